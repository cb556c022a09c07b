"""A hung collective on 2 gloo processes: the job stops soon after collective_timeout and names the stuck rank last.

One launch (rank 1 sleeps, rank 0 waits in an all_reduce; scripts/hang_worker.py) serves the stuck-rank checks; one
launch per case serves the checks of a rank that left (rank 1 exits 0 or 3 while rank 0 waits, or exits 0 before rank
0 enters). The last tests build the report of a rank that left from a run folder written by hand (NCCL's timeout)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import warm_python

from accel.cli import hang_report
from accel.core import diagnostics as diag

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "hang_worker.py"
TIMEOUT_S = 3


def launch(tmp_path_factory, *worker_args: str) -> subprocess.CompletedProcess:
    from conftest import make_isolated_env

    tmp = tmp_path_factory.mktemp("hang")
    env = {**make_isolated_env(tmp), "TMPDIR": str(tmp)}  # the run folder the report names lands here
    return warm_python.run([sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2",
                            "--collective_timeout", str(TIMEOUT_S), str(WORKER), *worker_args],
                           cwd=tmp, env=env, timeout=55)


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    """(the finished launch, seconds from rank 0 entering the all_reduce to the launcher's exit)."""
    proc = launch(tmp_path_factory, "--sleep", "60")
    ended = time.time()
    entered = re.search(r"rank 0: entering the all_reduce at ([\d.]+)", proc.stdout)
    assert entered, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, ended - float(entered.group(1))


def report(proc, headline: str = "accel launch: hang:") -> list[str]:
    """The lines from the hang report's headline to the end of stderr."""
    lines = proc.stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(headline)), None)
    assert start is not None, f"rc {proc.returncode}\n{proc.stderr}"
    return lines[start:]


def test_the_job_stops_soon_after_the_timeout_with_the_stuck_ranks_exit_code(hung_job):
    proc, waited = hung_job
    assert waited < TIMEOUT_S + 10, f"stopped {waited:.1f}s after rank 0 began waiting\n{proc.stderr}"
    assert proc.returncode == 128 + 15, proc.stderr  # the stuck rank's: it was stopped with SIGTERM
    assert "past the all_reduce" not in proc.stdout


def test_the_last_lines_name_the_stuck_rank_first_with_its_stack(hung_job):
    proc, _ = hung_job
    lines = report(proc)
    assert lines[0].startswith(f"accel launch: hang: rank 1 never reached the collective that rank 0 waited in "
                               f"(all_reduce) for collective_timeout={TIMEOUT_S}s"), lines
    stuck = lines[1]
    assert stuck.startswith("accel launch: rank 1 (local rank 1, pid ") and "is stuck outside the collective" in stuck
    assert "first failure" in stuck and sum("first failure" in line for line in lines) == 1
    rank0 = next(i for i, line in enumerate(lines) if line.startswith("accel launch: rank 0 "))
    assert "time.sleep(args.sleep)  # the stuck rank" in "\n".join(lines[2:rank0])  # rank 1's stack: the sleep line
    assert "waited in all_reduce and timed out (exit code 1)" in lines[rank0]
    rank0_stack = "\n".join(lines[rank0 + 1:])
    assert "dist.all_reduce(total, group=group)  # rank 0 waits here" in rank0_stack
    assert "distributed_c10d.py" in rank0_stack and "in all_reduce" in rank0_stack
    assert lines[-1].startswith("accel launch: if rank 1 was busy on purpose") and "collective_timeout" in lines[-1]
    # torchrun's own summary, which named rank 0 the first failure, is not shown
    assert not any("(first failure)" in line and "rank 0" in line for line in proc.stderr.splitlines())


def test_the_run_folder_keeps_every_threads_stack(hung_job):
    proc, _ = hung_job
    folder = Path(re.search(r"every thread's stack: (\S+)", proc.stderr).group(1))
    dump = (folder / "stack_rank1.txt").read_text()
    assert dump.startswith(("Current thread 0x", "Thread 0x")) and "in main" in dump
    assert (folder / "collective_rank0.json").is_file()


# ----------------------------------------------------------------------------------------------------------
# a rank that left: it exited (0 or a code) while rank 0 waited in the all_reduce, or before rank 0 entered it
# ----------------------------------------------------------------------------------------------------------

LEFT = {  # case: (worker arguments, the headline's start, rank 1's exit code)
    "exit 0 while waiting": (("--exit", "0", "--sleep", "1"), "accel launch: hang: rank 1 exited (exit code 0) while "
                             "rank 0 waited in all_reduce", 0),
    "exit 3 while waiting": (("--exit", "3", "--sleep", "1"), "accel launch: rank 1 exited (exit code 3) while rank 0 "
                             "waited in all_reduce", 3),
    "exit 0 before it": (("--exit", "0", "--sleep", "0", "--late"), "accel launch: hang: rank 1 exited (exit code 0) "
                         "before rank 0 reached all_reduce, which then", 0),
}


@pytest.fixture(scope="module", params=list(LEFT))
def left_job(request, tmp_path_factory):
    """(the case, its finished launch): one launch per case, shared by the tests below."""
    args, _, _ = LEFT[request.param]
    return request.param, launch(tmp_path_factory, *args)


def test_the_headline_names_the_rank_that_left_with_its_exit_code(left_job):
    case, proc = left_job
    _, headline, code = LEFT[case]
    lines = report(proc, headline)
    assert lines[0].endswith("; the job was stopped"), lines
    assert proc.returncode == (code or 1), proc.stderr  # rank 1's code when non-zero, else rank 0's failure's (1)
    assert "past the all_reduce" not in proc.stdout
    left = lines[1]
    assert left.startswith("accel launch: rank 1 (local rank 1, pid ") and f"exited with code {code} (first failure) " \
        "outside any collective" in left, lines
    assert sum("first failure" in line for line in proc.stderr.splitlines()) == 1  # torchrun's summary is not shown
    rank0 = next(i for i, line in enumerate(lines) if line.startswith("accel launch: rank 0 "))
    # rank 0 waited (its collective failed as gloo saw rank 1's connection close, or it was stopped while waiting)
    assert re.search(r"waited in all_reduce and (failed without rank 1|was still waiting) \(", lines[rank0]), lines
    assert "dist.all_reduce(total, group=group)  # rank 0 waits here" in "\n".join(lines[rank0:])
    assert not any("stuck" in line or "never reached" in line or "timed out" in line for line in lines)
    if code == 0:  # a hang: each rank's stack, and what to change
        assert lines[-1].startswith("accel launch: rank 1 ended without reaching the collective that rank 0 waited in")
    else:  # a failure rank 0 only waited for: one line, where it waited (no stack), and nothing after it
        assert lines[rank0] == lines[-1] and "hang_worker.py:" in lines[rank0], lines
        assert not any(line.startswith("    File ") or "every thread's stack" in line for line in lines), lines


# ----------------------------------------------------------------------------------------------------------
# the same report from a run folder written by hand: NCCL, where the waiting rank times out (no connection to lose)
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def watch(tmp_path, monkeypatch):
    monkeypatch.setattr(hang_report.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    watch = hang_report.HangWatch(600)
    watch.folder = diag.attempt_folder(watch.run_dir, 0)
    watch.folder.mkdir()
    return watch


def timed_out_record(folder: Path, rank: int, started: float) -> None:
    record = {"kind": "timeout", "op": "all_reduce", "in_backward": False, "started_ns": int(started * 1e9),
              "message": "Watchdog caught collective operation timeout", "timeout_s": 5.0,
              "frames": [["/job/train.py", 12, "<module>"]]}
    diag.record_path(folder, rank).write_text(json.dumps(record))


def ended(watch, rank: int, exitcode: int, at: float, stopped: bool = False) -> None:
    watch.ends.setdefault(watch.folder, {})[rank] = hang_report.WorkerEnd(rank, 1000 + rank, exitcode, at, stopped)


def failure(rank: int, exitcode: int) -> SimpleNamespace:
    return SimpleNamespace(local_rank=rank, pid=1000 + rank, exitcode=exitcode)


def test_a_rank_that_exited_0_while_the_other_timed_out(watch):
    timed_out_record(watch.folder, 0, started=100.0)
    ended(watch, 1, 0, at=101.0)
    ended(watch, 0, -6, at=106.0)  # NCCL's watchdog aborts it
    report = watch.report({0: failure(0, -6)})
    assert report.lines[0] == ("accel launch: hang: rank 1 exited (exit code 0) while rank 0 waited in all_reduce for "
                               "collective_timeout=5s; the job was stopped")
    assert report.first_rank == 1 and report.exitcode == -6  # the job's code: rank 0's failure (134)
    assert report.lines[1] == ("accel launch: rank 1 (local rank 1, pid 1001) exited with code 0 (first failure) "
                               "outside any collective: its script returned or called sys.exit(0)")
    assert "rank 0 (local rank 0, pid 1000) waited in all_reduce and timed out (ended by signal 6 (SIGABRT))" \
        in report.lines[2]


def test_a_rank_that_left_before_the_collective_and_one_stopped_elsewhere(watch):
    timed_out_record(watch.folder, 0, started=103.0)
    diag.ended_path(watch.folder, 1).write_text(str(int(102.0 * 1e9)))  # the script's end, as the worker wrote it
    ended(watch, 1, 7, at=102.5)
    ended(watch, 0, 1, at=108.0)
    ended(watch, 2, -15, at=108.1, stopped=True)
    diag.stack_path(watch.folder, 2).write_text('Current thread 0x1 (most recent call first):\n'
                                                '  File "/job/train.py", line 30 in load_batch\n')
    watch.stopped = {2: 0}
    report = watch.report({0: failure(0, 1), 1: failure(1, 7), 2: failure(2, -15)})
    assert report.lines[0] == ("accel launch: rank 1 exited (exit code 7) before rank 0 reached all_reduce, which then "
                               "waited for collective_timeout=5s; the job was stopped")
    assert report.first_rank == 1 and report.exitcode == 7
    assert any(line.startswith("accel launch: rank 2 (local rank 2, pid 1002) was stopped outside any collective")
               for line in report.lines)
    assert not any("stuck" in line for line in report.lines)


def test_without_a_waiting_rank_a_rank_that_exited_is_an_ordinary_failure(watch):
    ended(watch, 1, 3, at=101.0)
    ended(watch, 0, -15, at=101.2, stopped=True)
    diag.stack_path(watch.folder, 0).write_text('Current thread 0x1 (most recent call first):\n'
                                                '  File "/job/train.py", line 30 in load_batch\n')
    watch.stopped = {0: 0}
    assert watch.report({0: failure(0, -15), 1: failure(1, 3)}) is None  # torchrun's summary, as before
