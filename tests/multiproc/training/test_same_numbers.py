"""The drop-in promise in numbers: a script written for Accelerate (dropout, a shuffled loader, accumulation, a
scheduler: tests/multiproc/scripts/same_numbers.py) gives the real Accelerate's losses and weights on accel, on 1
and 2 CPU processes, because accel's prepared loaders draw from the global RNG exactly as Accelerate's do (the
dropout masks are then the same); and, with ACCEL_EXACT_RESUME=1 (accel's exact resume for an unchanged Accelerate
script; under the shim the default is Accelerate's resume, whose numbers tests/consumers compares), a run resumed
mid-epoch from `save_state` equals the uninterrupted one."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python

pytestmark = pytest.mark.multiproc
if importlib.util.find_spec("accelerate") is None:
    pytest.skip("the real accelerate package (a test extra) is not installed", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "same_numbers.py"
ROOT = Path(__file__).resolve().parents[3]
ATOL = 1e-6  # the same operations in the same order on both: equal up to gloo's float reduction


def _run(env: dict, impl: str, procs: int, *args: str) -> dict:
    env = {**env, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    if impl == "accel":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [subprocess.check_output(
            [sys.executable, "-m", "accel.shim"], text=True).strip(), env.get("PYTHONPATH")]))
        launch = ["-m", "accel.cli.main", "launch", "--cpu", "--num_processes", str(procs)] if procs > 1 else []
    else:  # the real Accelerate; its --cpu runs one process, --multi_gpu without GPUs is its gloo launch
        launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs)] if procs > 1 else []
    proc = warm_python.run([sys.executable, *launch, str(SCRIPT), *args], cwd=ROOT, env=env, timeout=300)
    # The real Accelerate's end_training destroys the process group while the DDP module (and its C++ reducer,
    # which holds the group) lives on, so a rank can abort at interpreter exit after the run is complete: accel
    # drops the reducer first (accel.backends.ddp.release_ddp). The peer's numbers are still the reference.
    aborted_at_exit = impl == "accelerate" and "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or aborted_at_exit, \
        f"{impl} {procs}p: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0][len("RECORD "):])


def _close(a, b) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= ATOL for x, y in zip(a, b))


@pytest.mark.parametrize("procs", [1, 2])
def test_accelerate_scripts_give_accelerates_numbers_and_resume_exactly(isolated_env, tmp_path, procs):
    reference = _run(isolated_env, "accelerate", procs)
    state = tmp_path / "state"
    ours = _run(isolated_env, "accel", procs, "--save", str(state))
    assert ours["num_processes"] == reference["num_processes"] == procs
    assert len(ours["losses"]) == len(reference["losses"]) == 36 // procs
    for i, (a, b) in enumerate(zip(ours["losses"], reference["losses"])):
        assert _close(a, b), f"step {i}: accel {a} vs Accelerate {b}"
    assert _close(ours["weights"], reference["weights"])
    resumed = _run({**isolated_env, "ACCEL_EXACT_RESUME": "1"}, "accel", procs, "--load", str(state))
    assert resumed["losses"] == ours["losses"][ours["cut"]:]  # bit for bit
    assert resumed["weights"] == ours["weights"]
