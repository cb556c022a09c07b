"""DDP under `accel launch` on real CPU processes (gloo), checked against plain PyTorch on one process.

Tolerance: float32 weights and losses within atol 1e-5 (only the summation order differs: DDP averages
per-rank gradients, the reference takes one mean over the large batch).
"""

import json
import os
import subprocess
from pathlib import Path

import _launch
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
ATOL = 1e-5


def accel_launch(num_processes: int, script: Path, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ACCEL_CONFIG_FILE"}
    return _launch.accel_launch(env, "--cpu", "--num_processes", num_processes, script, *args, timeout=timeout)


def load_problem():
    return _launch.worker_module("ddp_train").make_problem


def reference_run(num_processes: int, batch_size: int, accum: int, epochs: int):
    """Plain PyTorch, one process: one step on the num_processes*accum*batch_size samples that the ranks'
    micro-batches together cover, in the documented shuffling order randperm(seed + epoch) with seed 0.
    The scheduler steps num_processes times per optimizer step (Accelerate's semantics)."""
    x, y, model = load_problem()()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    per_step = num_processes * batch_size * accum
    step_losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0 + epoch))
        for start in range(0, len(x), per_step):
            idx = order[start:start + per_step]
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            for _ in range(num_processes):
                scheduler.step()
            optimizer.zero_grad()
            step_losses.append(loss.item())
    return model.state_dict(), step_losses, scheduler.get_last_lr()[0]


@pytest.mark.parametrize("num_processes,accum", [(1, 1), (2, 1), (2, 2)])
def test_ddp_matches_single_process_reference(tmp_path, num_processes, accum):
    batch_size, epochs = 4, 2
    accel_launch(num_processes, SCRIPTS / "ddp_train.py", "--out", str(tmp_path), "--batch-size", str(batch_size),
                 "--accum", str(accum), "--epochs", str(epochs))
    record = json.loads((tmp_path / "record.json").read_text())
    weights = load_file(str(tmp_path / "weights.safetensors"))
    ref_weights, ref_losses, ref_lr = reference_run(num_processes, batch_size, accum, epochs)

    assert record["num_processes"] == num_processes
    assert record["distributed_type"] == ("NO" if num_processes == 1 else "MULTI_CPU")
    assert record["batches_per_epoch"] == 64 // (batch_size * num_processes)
    if num_processes > 1:  # DistributedDataParallelKwargs reached the DDP wrapper
        assert record["ddp_bucket_bytes_cap"] == 1024 * 1024 and record["ddp_gradient_as_bucket_view"] is True
    else:  # one process: nothing to wrap
        assert record["ddp_bucket_bytes_cap"] is None
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        assert torch.allclose(weights[name], ref, atol=ATOL, rtol=0), f"{name}: max diff {(weights[name] - ref).abs().max()}"
    # each optimizer step's loss is the mean of the ranks' micro-batch losses in its window
    micro = torch.tensor(record["losses"])  # [micro_steps, num_processes]
    step_losses = micro.reshape(-1, accum * num_processes).mean(dim=1)
    assert torch.allclose(step_losses, torch.tensor(ref_losses), atol=ATOL, rtol=0)
    assert record["lrs"][-1] == pytest.approx(ref_lr, abs=1e-12)

    # inside an accumulation window gradients stay local: ranks' gradients differ; on sync steps they agree
    sync = record["grads_equal_when"]
    assert sync["sync"] and all(sync["sync"])
    if accum > 1 and num_processes > 1:
        assert sync["nosync"] and not any(sync["nosync"])
    if accum == 1:
        assert sync["nosync"] == []

    # gather_for_metrics drops the padding of the last uneven batch: exactly the dataset, in order
    assert record["metrics"] == [float(i) for i in range(13)]
    assert record["metric_objects"] == [f"item{i}" for i in range(13)]


def test_finished_job_exits_zero_every_time():
    """Teardown is reliable: a 2-process DDP job that never calls end_training exits 0, twice in a row (the
    order that makes it so, reducers released before the group is destroyed, is checked directly in
    tests/unit/runtime/test_release_at_destroy.py; the repetition that measures how reliable it is, 20 jobs or more, is
    benchmarks/bench_teardown.py's: each job here costs a launch, about 11 s of CPU)."""
    for attempt in range(2):
        proc = accel_launch(2, SCRIPTS / "minimal_ddp.py", timeout=120)
        assert "done" in proc.stdout, f"attempt {attempt}: {proc.stdout}\n{proc.stderr}"
