"""Nothing outlives an `accel launch` job, and forked workers behave like fresh interpreters.

* The job's end (exit 0, a failure, a restart of the worker group) ends every worker's process group: a `sleep`
  child a worker started is gone too (accel/cli/job_reaper.py).
* A SIGKILLed launcher takes its workers and their children with it (the launcher's sentinel): no worker trains or
  writes on for a requeued job to find.
* A forked worker's output equals a fresh interpreter's: a buffered log handler flushed at exit, multiprocessing, a
  `--checkpoint_async process` save, atexit output, and what it sees of its interpreter.
* SIGTERM to every process of the job at once (a cgroup / pod / SLURM step kill), or to the workers only, is the
  same preemption request: one grace save at the same step, exit 75; a second SIGTERM stops them at once (143).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_python
from _launch import ROOT, SCRIPTS

from accel.runtime.preemption import EXIT_CODE

pytestmark = pytest.mark.multiproc

PREEMPT = SCRIPTS / "preempt_train.py"
MARKER_STEP = 3


def alive(pid: int) -> bool:
    """Running: a zombie (ended, not yet waited for) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until none of `pids` runs; fails (after killing what is left) when some still run after `timeout`."""
    start = time.monotonic()
    while any(alive(pid) for pid in pids):
        if time.monotonic() - start > timeout:
            left = [pid for pid in pids if alive(pid)]
            _kill(left)
            pytest.fail(f"still running {timeout:g} s later: {left}")
        time.sleep(0.02)
    return time.monotonic() - start


def _kill(pids: list[int]) -> None:
    """Clean up after a failed check: only the pids this test recorded."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pids(folder: Path, pattern: str) -> list[int]:
    found = [pid for path in sorted(folder.glob(pattern)) for pid in json.loads(path.read_text())]
    assert found, f"no {pattern} in {folder}"
    return found


def launch(env: dict, out: Path, script: Path, *args: str, launch_args: tuple = (), fresh: bool = False
           ) -> tuple[warm_python.Popen, Path]:
    """`accel launch --cpu --num_processes 2 [LAUNCH_ARGS] SCRIPT --out OUT ARGS` in its own session, output in
    OUT.stdout / OUT.stderr."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2", *launch_args,
           str(script), "--out", str(out), *args]
    env = {**env, "OMP_NUM_THREADS": "1", "ACCEL_FRESH_WORKERS": "1" if fresh else "0"}
    with open(out.with_suffix(".stdout"), "w") as so, open(out.with_suffix(".stderr"), "w") as se:
        proc = warm_python.Popen(cmd, cwd=ROOT, env=env, stdout=so, stderr=se, start_new_session=True)
    return proc, out.with_suffix(".stderr")


def finish(proc: warm_python.Popen, err: Path, timeout: float = 120) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launch did not stop:\n{err.read_text()}")
    return proc.returncode, err.read_text()


def wait_for(what, proc: warm_python.Popen, err: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, f"the launch ended early (rc {proc.returncode}):\n{err.read_text()}"
        assert time.monotonic() < deadline, f"timed out waiting:\n{err.read_text()}"
        time.sleep(0.05)


# -- the job's end ends every worker's process group; forked workers = fresh interpreters ----------------------

@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """fork_parity.py launched forked and fresh: {kind: (out folder, stdout, stderr, seconds until its pids ended)}."""
    from conftest import make_isolated_env

    root = tmp_path_factory.mktemp("parity")
    env = make_isolated_env(root)
    runs = {}
    for kind in ("forked", "fresh"):
        out = root / kind
        proc, err = launch(env, out, SCRIPTS / "fork_parity.py", launch_args=("--checkpoint_async", "process"),
                           fresh=kind == "fresh")
        rc, stderr = finish(proc, err)
        assert rc == 0, stderr
        pids = _pids(out, "pids_rank*.json")
        runs[kind] = (out, out.with_suffix(".stdout").read_text(), stderr, wait_gone(pids, 5))
    return runs


@pytest.mark.parametrize("kind", ["forked", "fresh"])
def test_the_job_end_ends_the_workers_children(parity, kind):
    """The workers exited 0; the `sleep 1000` each started is gone within 5 s of the launcher's return (it is ended
    before the launcher returns)."""
    assert parity[kind][3] < 5


def _normalized(text: str) -> list[str]:
    lines = [re.sub(r"\d+\.\d+ ?s\b", "<secs>", line) for line in text.splitlines()]
    return sorted(re.sub(r"\b(pid|process) \d+", r"\1 <pid>", line) for line in lines)


def test_a_forked_worker_prints_and_logs_what_a_fresh_interpreter_does(parity):
    (forked, out_f, err_f, _), (fresh, out_n, err_n, _) = parity["forked"], parity["fresh"]
    for text in (out_f, err_f, out_n, err_n):
        assert "Traceback" not in text and "Error" not in text, text
    for rank in (0, 1):  # the MemoryHandler's records, flushed by logging.shutdown at exit
        assert f"log INFO rank {rank} started" in out_f and f"log INFO rank {rank} saved" in out_f, out_f
        assert f"rank {rank} atexit" in out_f and f"rank {rank} child process ran" in out_f
    assert _normalized(out_f) == _normalized(out_n)
    assert _normalized(err_f) == _normalized(err_n)
    for rank in (0, 1):
        seen_f = json.loads((forked / f"state_rank{rank}.json").read_text())
        seen_n = json.loads((fresh / f"state_rank{rank}.json").read_text())
        for seen in (seen_f, seen_n):
            for when in ("start", "end"):
                seen[when]["env_keys"].remove("ACCEL_FRESH_WORKERS")
            # a forked worker starts with torch._dynamo imported (its filters, exit handlers and inductor's cache
            # folder variable come with it), the same at the end, where a fresh one imported it too; threads: a
            # background save may still be running at the end
            del seen["start"]["warnings_filters"], seen["start"]["atexit_handlers"], seen["end"]["threads"]
            with contextlib.suppress(ValueError):
                seen["start"]["env_keys"].remove("TORCHINDUCTOR_CACHE_DIR")
        assert seen_f["start"] == seen_n["start"]
        assert seen_f["end"] == seen_n["end"]
        start = seen_f["start"]
        assert start["root_handlers"] == [] and start["root_level"] == 30 and start["threads"] == ["MainThread"]


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_failure_and_a_restart_end_the_old_workers_children(isolated_env, tmp_path, fresh):
    """Rank 1 exits 1 on both attempts (--max_restarts 1): the first attempt's workers and children are gone when the
    second starts, and the second's when the launcher returned (exit 1)."""
    out = tmp_path / "fail"
    proc, err = launch(isolated_env, out, SCRIPTS / "lifetime_train.py", "--mode", "fail",
                       launch_args=("--max_restarts", "1"), fresh=fresh)
    rc, stderr = finish(proc, err)
    try:
        assert rc == 1, stderr
        found = sorted(out.glob("survivors_rank*_attempt1.json"))
        assert len(found) == 2, stderr  # the second attempt ran
        assert [json.loads(path.read_text()) for path in found] == [[], []], stderr
    finally:
        wait_gone(_pids(out, "pids_rank*_attempt*.json"), 5)


# -- a SIGKILLed launcher takes its workers with it -------------------------------------------------------------

@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_sigkilled_launcher_takes_its_workers_and_their_children(isolated_env, tmp_path, fresh):
    out = tmp_path / "train"
    proc, err = launch(isolated_env, out, SCRIPTS / "lifetime_train.py", "--mode", "train", fresh=fresh)
    steps = [out / f"steps_rank{rank}" for rank in (0, 1)]
    wait_for(lambda: all(p.exists() and p.stat().st_size > 0 for p in steps)
             and len(list(out.glob("pids_rank*"))) == 2, proc, err)
    pids = _pids(out, "pids_rank*.json")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    took = wait_gone(pids, 5)
    print(f"launcher SIGKILLed: its workers and their children were gone {took:.2f} s later")
    sizes = [p.stat().st_size for p in steps]
    time.sleep(1)
    assert [p.stat().st_size for p in steps] == sizes  # nothing written after that


# -- SIGTERM to every process of the job at once, or to the workers only --------------------------------------

def _job_pids(out: Path) -> list[int]:
    return [int((out / f"marker_rank{rank}").read_text()) for rank in (0, 1)]


def _markers(out: Path):
    return lambda: all((out / f"marker_rank{rank}").exists() for rank in (0, 1))


def test_sigterm_to_every_process_at_once_is_one_preemption(isolated_env, tmp_path):
    """A cgroup / pod kill: the launcher and both workers get SIGTERM together. The workers save at the same step,
    the launcher exits 75, and the next launch loads the checkpoint and trains to the end."""
    out = tmp_path / "all"
    proc, err = launch(isolated_env, out, PREEMPT, "--marker_step", str(MARKER_STEP))
    wait_for(_markers(out), proc, err)
    for pid in [proc.pid, *_job_pids(out)]:
        os.kill(pid, signal.SIGTERM)
    rc, stderr = finish(proc, err)
    assert rc == EXIT_CODE, stderr
    seen = [json.loads((out / f"preempted_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] == seen[1] == {"step": MARKER_STEP, "epoch": 0}
    assert (out / "checkpoints" / "checkpoint_0").is_dir()
    for rank in (0, 1):
        (out / f"preempted_rank{rank}.json").unlink()
    proc, err = launch(isolated_env, out, PREEMPT)
    rc, stderr = finish(proc, err)
    assert rc == 0, stderr  # load_state of the grace save, then to the end
    assert (out / "final.safetensors").exists() and not (out / "preempted_rank0.json").exists()


def test_sigterm_to_the_workers_only_is_a_preemption(isolated_env, tmp_path):
    out = tmp_path / "workers"
    proc, err = launch(isolated_env, out, PREEMPT, "--marker_step", str(MARKER_STEP))
    wait_for(_markers(out), proc, err)
    os.kill(_job_pids(out)[1], signal.SIGTERM)  # one rank is enough: the all_reduce tells the other
    rc, stderr = finish(proc, err)
    assert rc == EXIT_CODE, stderr
    seen = [json.loads((out / f"preempted_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] == seen[1] == {"step": MARKER_STEP, "epoch": 0}
    assert (out / "checkpoints" / "checkpoint_0").is_dir()


def test_a_second_sigterm_to_every_process_stops_them_at_once(isolated_env, tmp_path):
    """The workers never save (--stubborn): the second SIGTERM to all of them ends the job at once, 143."""
    out = tmp_path / "twice"
    proc, err = launch(isolated_env, out, PREEMPT, "--marker_step", str(MARKER_STEP), "--stubborn")
    wait_for(_markers(out), proc, err)
    job = [proc.pid, *_job_pids(out)]
    for pid in job:
        os.kill(pid, signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None and all(alive(pid) for pid in job[1:]), err.read_text()  # a request, not a stop
    started = time.monotonic()
    for pid in job:
        with contextlib.suppress(ProcessLookupError):  # the launcher's second SIGTERM may have ended it already
            os.kill(pid, signal.SIGTERM)
    rc, stderr = finish(proc, err, timeout=20)
    assert rc == 128 + signal.SIGTERM, stderr
    assert time.monotonic() - started < 10, stderr
    wait_gone(job[1:], 5)
