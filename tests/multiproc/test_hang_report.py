"""A hung collective on 2 gloo processes: the job stops soon after collective_timeout and names the stuck rank last.

One launch (rank 1 sleeps, rank 0 waits in an all_reduce; scripts/hang_worker.py) serves every check."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).resolve().parent / "scripts" / "hang_worker.py"
TIMEOUT_S = 3


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    """(the finished launch, seconds from rank 0 entering the all_reduce to the launcher's exit)."""
    from conftest import make_isolated_env

    tmp = tmp_path_factory.mktemp("hang")
    env = {**make_isolated_env(tmp), "TMPDIR": str(tmp)}  # the run folder the report names lands here
    proc = subprocess.run([sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2",
                           "--collective_timeout", str(TIMEOUT_S), str(WORKER), "--sleep", "60"],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=55)
    ended = time.time()
    entered = re.search(r"rank 0: entering the all_reduce at ([\d.]+)", proc.stdout)
    assert entered, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, ended - float(entered.group(1))


def report(proc) -> list[str]:
    """The lines from the hang report's headline to the end of stderr."""
    lines = proc.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("accel launch: hang:"))
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
