"""`benchmarks/gpu_check.py --versus --cpu`: accel, torchtitan's Trainer and Accelerate with FSDP2 train the same
toy Llama on the CPU, each in its own process, and compute the same loss at step 1 (the same weights, data and
model function, so the GPU comparison measures the same work). A peer whose package is not installed here is
skipped with the script's reason (benchmarks/fetch_versus_wheels.sh brings torchtitan for the GPU machine)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
BF16_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("versus") / "versus.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "MASTER_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--versus", "--cpu", "--warmup", "0",
           "--steps", "1", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    data["output"] = run.stdout
    data["returncode"] = run.returncode
    return data


def test_accel_trains_and_the_table_is_printed(results):
    accel = results["results"]["bf16-eager"]["accel"]
    assert accel["status"] == "PASS", accel
    assert accel["setup"].startswith("Accelerator(zero_stage=3)"), accel["setup"]
    assert accel["tokens_per_s"] > 0 and len(accel["losses"]) == 1
    assert "tokens/s" in results["output"] and "x accel" in results["output"]
    assert results["returncode"] == 0, results["output"][-3000:]


@pytest.mark.parametrize("peer", ["torchtitan", "accelerate"])
def test_peer_computes_the_same_step_one_loss(results, peer):
    record = results["results"]["bf16-eager"][peer]
    if record["status"] == "SKIP":
        assert "not installed" in record["why"], record
        pytest.skip(record["why"])
    assert record["status"] == "PASS", record
    accel = results["results"]["bf16-eager"]["accel"]
    assert abs(record["loss1"] - accel["loss1"]) <= BF16_TOLERANCE, (record["loss1"], accel["loss1"])
