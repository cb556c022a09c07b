"""Preemption end to end on 2 CPU processes: SIGTERM to `accel launch` mid-epoch asks the workers to save and stop (the
same step on both ranks, exit code 75), the next launch resumes bit-exactly; a second signal stops them at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_python
from safetensors.torch import load_file

from accel.runtime.preemption import EXIT_CODE

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "preempt_train.py"
MARKER_STEP = 3  # 5 batches per rank and epoch: the request comes in the middle of the first epoch


def start(env: dict, out: Path, *args: str, launch_args: tuple[str, ...] = ()) -> tuple[warm_python.Popen, Path]:
    """`accel launch --cpu --num_processes 2 preempt_train.py --out OUT ARGS`, its stderr in OUT.stderr."""
    err = out.with_suffix(".stderr")
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2", *launch_args,
           str(SCRIPT), "--out", str(out), *args]
    with open(err, "w") as fh:
        proc = warm_python.Popen(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                 stderr=fh)
    return proc, err


def wait_for(what, proc: warm_python.Popen, err: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, f"the launch ended early (rc {proc.returncode}):\n{err.read_text()}"
        assert time.monotonic() < deadline, f"timed out waiting:\n{err.read_text()}"
        time.sleep(0.05)


def finish(proc: warm_python.Popen, err: Path, timeout: float = 120) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the launch did not stop:\n{err.read_text()}")
    return proc.returncode, err.read_text()


def markers(out: Path) -> bool:
    return all((out / f"marker_rank{rank}").exists() for rank in (0, 1))


def run_to_end(env: dict, out: Path, launch_args: tuple[str, ...] = ()) -> str:
    proc, err = start(env, out, launch_args=launch_args)
    rc, stderr = finish(proc, err)
    assert rc == 0, stderr
    return stderr


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", [(), ("--zero_stage", "3")], ids=["ddp", "zero3"])
def test_sigterm_mid_epoch_saves_and_the_next_launch_resumes_bit_exactly(isolated_env, tmp_path, backend):
    run_to_end(isolated_env, tmp_path / "full", backend)

    out = tmp_path / "preempted"
    proc, err = start(isolated_env, out, "--marker_step", str(MARKER_STEP), launch_args=backend)
    wait_for(lambda: markers(out), proc, err)
    proc.send_signal(signal.SIGTERM)
    rc, stderr = finish(proc, err)
    assert rc == EXIT_CODE, stderr
    assert "accel launch: got SIGTERM: asked the workers to save and stop" in stderr
    assert f"the workers stopped at the preemption request; exit code {EXIT_CODE}" in stderr
    seen = [json.loads((out / f"preempted_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] == seen[1] == {"step": MARKER_STEP, "epoch": 0}  # the same step on both ranks, mid-epoch
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint_0"]
    assert not (out / "final.safetensors").exists()

    for rank in (0, 1):
        (out / f"preempted_rank{rank}.json").unlink()
    run_to_end(isolated_env, out, backend)  # load_state of the grace save, skip_first_batches, to the end
    assert not (out / "preempted_rank0.json").exists()
    full, resumed = load_file(str(tmp_path / "full" / "final.safetensors")), load_file(str(out / "final.safetensors"))
    assert full.keys() == resumed.keys()
    for key in full:
        assert (full[key] - resumed[key]).abs().max().item() == 0.0, key


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.multiproc
def test_a_second_signal_stops_the_workers(isolated_env, tmp_path):
    """The workers never reach their check again (a save that hangs): the request (here --preemption_signal SIGUSR1)
    does not stop them, a second signal does, as before: 128 + 15, no worker left. (The grace period's end takes the
    same path: tests/unit/cli/test_preemption_launcher.py.)"""
    out = tmp_path / "stubborn"
    proc, err = start(isolated_env, out, "--marker_step", str(MARKER_STEP), "--stubborn",
                      launch_args=("--preemption_signal", "SIGUSR1"))
    wait_for(lambda: markers(out), proc, err)
    proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: "got SIGUSR1: asked the workers to save and stop" in err.read_text(), proc, err)
    time.sleep(0.5)
    assert proc.poll() is None  # a request, not a stop
    proc.send_signal(signal.SIGTERM)
    rc, stderr = finish(proc, err, timeout=60)
    assert rc == 128 + signal.SIGTERM, stderr
    assert "accel launch: stopped by a second signal (SIGTERM); the workers were stopped" in stderr
    pids = [int((out / f"marker_rank{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"workers {pids} still running"
        time.sleep(0.1)


def _agree_worker(rank: int, store_path: str, results: str) -> None:
    """Only rank 1 was signalled: both ranks' first read is True (the all_reduce); the second needs no collective."""
    import torch
    import torch.distributed as dist

    from accel.runtime import preemption

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    state = type("State", (), {"process_index": rank, "num_processes": 2, "device": torch.device("cpu")})()
    if rank == 1:
        preemption._local["signal"] = signal.SIGTERM
    first = preemption.requested(state)
    second = preemption.requested(state)  # rank 0 would hang here if this were a collective rank 1 skips
    Path(results, f"rank{rank}").write_text(json.dumps([first, second]))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_one_rank_signalled_is_agreed_by_every_rank(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.delenv("ACCEL_PREEMPTION_DIR", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # under an agent: no handlers of its own
    mp.start_processes(_agree_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    assert [json.loads((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1)] == [[True, True], [True, True]]


@pytest.mark.multiproc
def test_one_process_the_script_itself_takes_sigterm(isolated_env, tmp_path):
    """One process: `accel launch` becomes the script (exec), which turns SIGTERM into the request itself."""
    out = tmp_path / "one"
    err = tmp_path / "one.stderr"
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", str(SCRIPT), "--out", str(out),
           "--marker_step", str(MARKER_STEP)]
    with open(err, "w") as fh:
        proc = warm_python.Popen(cmd, cwd=ROOT, env={**isolated_env, "OMP_NUM_THREADS": "1"},
                                 stdout=subprocess.DEVNULL, stderr=fh)
    wait_for(lambda: (out / "marker_rank0").exists(), proc, err)
    proc.send_signal(signal.SIGTERM)
    rc, stderr = finish(proc, err)
    assert rc == 0, stderr  # the script's own exit code
    assert "accel: got SIGTERM: preemption_requested turns true at the next step" in stderr
    assert json.loads((out / "preempted_rank0.json").read_text()) == {"step": MARKER_STEP, "epoch": 0}
    assert (out / "checkpoints" / "checkpoint_0").is_dir()
