"""DummyOptim / DummyScheduler under ZeRO stage 2 and 3 on 2 CPU processes, against plain PyTorch on one process.

The DeepSpeed JSON names AdamW ("auto" params filled from the DummyOptim) and WarmupDecayLR ("auto" filled from the
DummyScheduler as Accelerate fills them). The reference is torch.optim.AdamW with the same arguments, the lr set by
hand each step from DeepSpeed's WarmupDecayLR formula, on the global batch. Final weights and every step's lr agree
within atol 1e-5 (fp32). Two launches (about 7 s each): the JSON given as DeepSpeedPlugin(hf_ds_config=...), and
named by `accel launch --deepspeed_config_file` (Accelerate's automatic plugin; `--zero_stage 3` beats its stage 2).
"""

import json
import math
from pathlib import Path

import pytest
import torch
from _launch import accel_launch, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ds_dummy_train.py"
ATOL = 1e-5
N = 2
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}


def deepspeed_warmup_decay(it: int, max_lr: float, warmup: int, total: int) -> float:
    """DeepSpeed's WarmupDecayLR (warmup_min_lr 0, "log" warmup) at its iteration `it` (-1 before the first step)."""
    if it < 0:
        return 0.0
    warmup = max(2, warmup)
    if it < warmup:
        return max_lr * math.log(it + 1) / math.log(warmup)
    return max_lr * max(0.0, (total - it) / max(1.0, total - warmup))


def reference():
    """One process, batch N*4 in loader order (no shuffling: step k reads rows 8k..8k+7), lr set before each step."""
    script = worker_module("ds_dummy_train")
    x, y, model = script.make_problem()
    optimizer = torch.optim.AdamW(model.parameters(), **script.OPTIM)
    per_step = N * script.BATCH
    total = math.ceil(script.EPOCHS * (len(x) // script.BATCH) / N)  # Accelerate divides it by num_processes
    lrs = []
    for epoch in range(script.EPOCHS):
        for start in range(0, len(x), per_step):
            step = epoch * (len(x) // per_step) + start // per_step
            lr = deepspeed_warmup_decay(step - 1, script.OPTIM["lr"], script.WARMUP, total)
            for group in optimizer.param_groups:
                group["lr"] = lr
            lrs.append(lr)
            torch.nn.functional.mse_loss(model(x[start:start + per_step]), y[start:start + per_step]).backward()
            optimizer.step()
            optimizer.zero_grad()
    last = deepspeed_warmup_decay(len(lrs) - 1, script.OPTIM["lr"], script.WARMUP, total)
    return model.state_dict(), lrs, last


def check_against_plain_pytorch(out, zero_stage: int) -> None:
    records = json.loads((out / "record.json").read_text())
    ref_weights, ref_lrs, ref_last = reference()

    assert len(records) == N
    for rec in records:
        assert (rec["optimizer"], rec["scheduler"], rec["zero_stage"]) == ("AdamW", "WarmupDecayLR", zero_stage)
        assert rec["json_sections"] == sorted(DS_CONFIG)  # state.deepspeed_plugin.deepspeed_config is the JSON
        assert rec["unwrapped"] in ("Net", "FSDPNet")  # ZeRO 2/3 shard with FSDP2, which renames the class
        assert rec["defaults"] == {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.98], "eps": 1e-7}
        assert torch.allclose(torch.tensor(rec["lrs"]), torch.tensor(ref_lrs), atol=ATOL, rtol=0), rec["lrs"]
        assert rec["last_lr"] == pytest.approx(ref_last, abs=ATOL)
    assert max(ref_lrs) == pytest.approx(1e-2) and ref_lrs[:2] == [0.0, 0.0]  # warmed up, then decayed
    weights = load_file(str(out / "weights.safetensors"))
    assert weights.keys() == ref_weights.keys()
    for key, value in ref_weights.items():
        assert torch.allclose(weights[key], value, atol=ATOL, rtol=0), f"{key}: {(weights[key] - value).abs().max()}"


def test_dummy_optim_and_scheduler_under_zero2_match_plain_pytorch(isolated_env, tmp_path):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps(DS_CONFIG))
    accel_launch(isolated_env, "--cpu", "--num_processes", N, SCRIPT, "--out", tmp_path, "--ds_config", ds_json)
    check_against_plain_pytorch(tmp_path, zero_stage=2)


def test_launch_deepspeed_config_file_carries_the_sections_and_the_flags_win(isolated_env, tmp_path):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps(DS_CONFIG))
    proc = accel_launch(isolated_env, "--cpu", "--num_processes", N, "--deepspeed_config_file", ds_json,
                        "--zero_stage", 3, SCRIPT, "--out", tmp_path)
    assert "DeepSpeed keys accel does not use" not in proc.stderr  # optimizer/scheduler are used now
    check_against_plain_pytorch(tmp_path, zero_stage=3)
