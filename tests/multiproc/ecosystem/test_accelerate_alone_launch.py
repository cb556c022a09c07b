"""With accel installed and Accelerate not (tests/hide_accelerate.py hides the one the test extras install), a script
written for Accelerate runs under a plain `accel launch` through the shim, and `accelerate launch` (the program
`eval "$(accel shim)"` puts at the end of PATH) trains examples/quickstart.py on 2 CPU processes; each start line says
the shim is used. The decisions, and that nothing changes with a real Accelerate: tests/unit/
test_accelerate_commands_alone.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python
from conftest import REPO_ROOT
from hide_accelerate import SHIM, without_accelerate

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accelerate_import_train.py"
NOTE = "; accelerate: accel's shim (Accelerate is not installed)"


def test_an_accelerate_script_runs_through_the_shim_under_plain_accel_launch(isolated_env, tmp_path):
    env = {**without_accelerate(isolated_env, tmp_path / "hide"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    out.mkdir()
    proc = warm_python.run([sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2",
                           str(SCRIPT), "--out", str(out)], env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0].startswith("accel launch: 2 processes (MULTI_CPU, gloo), DDP")
    assert proc.stderr.splitlines()[0].endswith(NOTE), proc.stderr
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for record in ranks:
        assert record["accelerate"] == str(Path(SHIM, "accelerate", "__init__.py"))
        assert record["distribution"] == "1.15.0" and record["num_processes"] == 2
    losses = ranks[0]["losses"]
    assert ranks[1]["losses"] == losses and losses[-1] < losses[0] / 4, losses


def test_accelerate_launch_after_eval_accel_shim_trains_the_quickstart(isolated_env, tmp_path):
    env = {**without_accelerate(isolated_env, tmp_path / "hide"), "OMP_NUM_THREADS": "1",
           "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "CUDA_VISIBLE_DEVICES": ""}  # as typed, without --cpu: on a machine with GPUs it would take two
    shell = (f'eval "$({sys.executable} -m accel.cli.main shim)"\n'
             f"accelerate launch --num_processes 2 {REPO_ROOT / 'examples' / 'quickstart.py'} --epochs 2")
    proc = subprocess.run(["bash", "-c", shell], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("accel launch: 2 processes (MULTI_CPU, gloo), DDP") and first.endswith(NOTE), proc.stderr
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in epochs] == ["0:", "1:"] and all(
        line.endswith("on 2 process(es)") for line in epochs), proc.stdout
    assert float(epochs[1].split()[3]) < float(epochs[0].split()[3])
    assert len(list((tmp_path / "runs" / "quickstart").glob("run-*/metrics.jsonl"))) == 1
