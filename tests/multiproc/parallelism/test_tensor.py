"""Tensor parallelism (tp_size 2 on 2 CPU processes) against plain PyTorch on one process: losses, clipped
global norms and final weights within atol 1e-5 (fp32). Ranks of one TP group see the same batches.
The toy's runs share launches: 2 processes (both plans, then the checkpoint reloaded), 1 and 4 (tp_train.py --jobs)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from _launch import launch_jobs, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tp_train.py"
ATOL = 1e-5


def reference(dp: int = 1):
    tp_train = worker_module("tp_train")
    x, y, model = tp_train.make_problem()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for epoch in range(2):  # dp data-parallel ranks of batch 4 = one process with batch 4*dp, same order
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(x), 4 * dp):
            idx = order[start:start + 4 * dp]
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return model.state_dict(), losses, norms


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{processes: stdout of the launch}, and the folder of the jobs' folders."""
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("tp_jobs")
    env = make_isolated_env(out)
    runs = {2: [("automatic-plan", ["--tp_size", 2]), ("user-plan", ["--tp_size", 2, "--user_plan"]),
                ("automatic-plan", ["--tp_size", 2, "--load"])],  # the sharded checkpoint, reloaded with tp_size 2
            1: [("automatic-plan", ["--tp_size", 1, "--load"])],  # ... and with tp_size 1 on one process (resharded)
            4: [(f"zero{stage}", ["--tp_size", 2, "--zero_stage", stage]) for stage in (0, 3)]}
    logs = {}
    for processes in (2, 1, 4):
        logs[processes] = launch_jobs(out, env, processes, SCRIPT, runs[processes])
    return logs, out


@pytest.mark.parametrize("user_plan", [False, True], ids=["automatic-plan", "user-plan"])
def test_tp2_matches_single_process(jobs, user_plan):
    logs, out = jobs
    tmp_path = out / ("user-plan" if user_plan else "automatic-plan")
    source = "ParallelismConfig(tp_plan=...)" if user_plan else "accel's automatic plan"
    assert f"tensor parallel plan ({source}, tp_size=2): 0: colwise, 2: rowwise" in logs[2]
    records = json.loads((tmp_path / "record.json").read_text())
    ref_weights, ref_losses, ref_norms = reference()
    for rec in records:
        assert rec["local_weight_shape"] == [16, 6]  # the first layer is split by columns (output features)
        assert rec["batches"] == 16  # both ranks of the TP group see every batch
        assert rec["metric_rows"] == 4  # gather_for_metrics: the TP group's shared batch counted once
        losses = torch.tensor(rec["losses"])
        assert torch.equal(losses[:, 0], losses[:, 1])  # the loss is the same on every TP rank
        assert torch.allclose(losses[:, 0], torch.tensor(ref_losses), atol=ATOL, rtol=0)
        assert torch.allclose(torch.tensor(rec["norms"]), torch.tensor(ref_norms), atol=ATOL, rtol=0)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    assert weights.keys() == ref_weights.keys()
    for key, value in ref_weights.items():
        assert torch.allclose(weights[key], value, atol=ATOL, rtol=0), key

    if user_plan:
        return
    # the sharded checkpoint reloads with tp_size 2, and with tp_size 1 on one process (resharded)
    for tp in (2, 1):
        loaded = load_file(str(tmp_path / f"loaded_tp{tp}.safetensors"))
        assert all(torch.equal(loaded[k], weights[k]) for k in weights), tp


@pytest.mark.parametrize("zero_stage", [0, 3], ids=["dp2xtp2", "zero3xtp2"])
def test_2d_mesh_data_parallel_times_tensor_parallel(jobs, zero_stage):
    """4 processes: TP over pairs of ranks, then data parallelism (FSDP2 over dp) across the pairs."""
    tmp_path = jobs[1] / f"zero{zero_stage}"
    records = json.loads((tmp_path / "record.json").read_text())
    ref_weights, ref_losses, ref_norms = reference(dp=2)
    for rec in records:
        assert rec["batches"] == 8  # the data is sharded over the 2 data-parallel ranks only
        assert torch.allclose(torch.tensor(rec["norms"]), torch.tensor(ref_norms), atol=ATOL, rtol=0)
    losses = torch.tensor(records[0]["losses"])  # ranks 0,1 form one TP group, ranks 2,3 the other
    assert torch.equal(losses[:, 0], losses[:, 1]) and torch.equal(losses[:, 2], losses[:, 3])
    assert torch.allclose(losses[:, [0, 2]].mean(dim=1), torch.tensor(ref_losses), atol=ATOL, rtol=0)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    for key, value in ref_weights.items():
        assert torch.allclose(weights[key], value, atol=ATOL, rtol=0), key


@pytest.mark.parametrize("num_processes", [2, 4], ids=["tp2", "dp2xtp2"])
def test_tiny_llama_with_its_own_tp_plan(isolated_env, tmp_path, num_processes):
    """transformers' LlamaForCausalLM (from a LlamaConfig, no download): its published plan is applied, the
    attention reshapes by the local head count, and training matches one process (loss 1e-5, weights 1e-5)."""
    pytest.importorskip("transformers")
    script = SCRIPT.parent / "tp_llama.py"
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", str(num_processes),
           str(script), "--out", str(tmp_path)]  # every rank trains on the same batches: dp ranks agree
    proc = warm_python.run(cmd, cwd=ROOT, env={**isolated_env, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tensor parallel plan (the model's own tp plan, tp_size=2)" in proc.stdout
    assert "model.layers.1.self_attn.o_proj: rowwise" in proc.stdout and "lm_head: colwise_rep" in proc.stdout

    tp_llama = worker_module("tp_llama")
    model, tokens = tp_llama.make_problem()
    optimizer = torch.optim.AdamW(model.parameters(), lr=tp_llama.LR)
    ref_losses = []
    for batch in tokens:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(loss.item())
    losses = torch.tensor(json.loads((tmp_path / "losses.json").read_text()))
    assert all(torch.equal(losses[:, 0], losses[:, r]) for r in range(num_processes))
    assert torch.allclose(losses[:, 0], torch.tensor(ref_losses), atol=ATOL, rtol=0)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    assert weights.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.allclose(weights[key], value, atol=ATOL, rtol=0), (key, (weights[key] - value).abs().max())
