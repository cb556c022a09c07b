"""How bf16/fp16 runs under ZeRO 2/3 (`parallelism.zero_mixed_precision`), decided once by the data-parallel plan:
FSDP2's MixedPrecisionPolicy (bf16 parameters in forward and backward, fp32 master shards, fp32 reduction) or fp32
parameters under autocast; `auto` takes the policy where Accelerate's FSDP2 does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from accel.config import ConfigError, ParallelismConfig
from accel.config.resolve import config_from_dict
from accel.parallel.data_parallel import DataParallelPlan
from accel.runtime.topology import Topology


def _precision(mode: str, device_type: str = "cpu"):
    dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    return SimpleNamespace(dtype=dtype, device_type=device_type)


@pytest.mark.parametrize("world,stage,choice,mode,device,kind,policy", [
    (2, 3, "auto", "bf16", "cpu", "fsdp", True),  # several ranks: the policy, as before
    (2, 3, "autocast", "bf16", "cpu", "fsdp", False),  # fp32 parameters, FSDP2 without a policy
    (2, 3, "auto", "no", "cpu", "fsdp", False),
    (1, 3, "auto", "bf16", "cpu", "none", False),  # one CPU process: autocast, as Accelerate (no FSDP there)
    (1, 3, "auto", "bf16", "cuda", "fsdp", True),  # one GPU process: FSDP2 on one rank, as Accelerate
    (1, 2, "auto", "fp16", "cuda", "fsdp", True),
    (1, 3, "autocast", "bf16", "cuda", "none", False),
    (1, 3, "fsdp_policy", "bf16", "cpu", "fsdp", True),
    (1, 3, "fsdp_policy", "no", "cpu", "none", False),  # nothing to cast: no FSDP2 on one rank
    (1, 1, "fsdp_policy", "bf16", "cuda", "none", False),  # ZeRO-1 does not shard parameters
    (1, 0, "auto", "bf16", "cuda", "none", False),
])
def test_the_plan_decides_the_policy_once(world, stage, choice, mode, device, kind, policy):
    par = ParallelismConfig(zero_stage=stage, zero_mixed_precision=choice)
    plan = DataParallelPlan.decide(par, Topology.for_config(world, par), None, _precision(mode, device))
    assert (plan.kind, plan.low_precision_params) == (kind, policy)


def test_without_a_precision_the_plan_keeps_fp32_parameters():
    par = ParallelismConfig(zero_stage=3)
    assert DataParallelPlan.decide(par, Topology.for_config(2, par)).low_precision_params is False


def test_a_bad_value_is_one_line_naming_the_key_the_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"parallelism": {"zero_mixed_precision": "bf16"}})
    message = str(caught.value)
    assert "\n" not in message and "zero_mixed_precision" in message and "'bf16'" in message
    assert "allowed: one of auto, fsdp_policy, autocast" in message


SCRIPT = """
import json, sys, torch
from torch.distributed.fsdp import FSDPModule
from accel import Accelerator
from accel.config import ParallelismConfig
from accel.runtime.state import PartialState

def train(choice):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16",
                              parallelism_config=ParallelismConfig(zero_stage=3, zero_mixed_precision=choice))
    model, optimizer = accelerator.prepare(model, optimizer)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    policy = model._get_fsdp_state()._mp_policy if isinstance(model, FSDPModule) else None
    result = {"losses": losses, "fsdp": isinstance(model, FSDPModule),
              "param_dtype": str(policy.param_dtype) if policy else None,
              "reduce_dtype": str(policy.reduce_dtype) if policy else None,
              "optimizer_dtypes": sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]})}
    PartialState._reset_for_tests()
    return result

print(json.dumps({choice: train(choice) for choice in ("autocast", "auto", "fsdp_policy")}))
"""


def test_one_cpu_process_under_zero3_runs_the_policy_when_asked_and_autocast_by_default(isolated_env, tmp_path):
    """One process, ZeRO-3, bf16 on the CPU: `fsdp_policy` wraps the model in FSDP2 on a one-rank mesh with the
    policy (bf16 parameters, fp32 reduction) while the optimizer steps fp32 shards; its losses stay within 1% of
    the autocast run's (bf16 rounding of every parameter, the LayerNorm's included, in forward). The default leaves
    the autocast run's numbers exactly as they were."""
    import json

    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240,
                          env=isolated_env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    autocast, auto, policy = runs["autocast"], runs["auto"], runs["fsdp_policy"]
    assert not autocast["fsdp"] and not auto["fsdp"]
    assert auto["losses"] == autocast["losses"]  # the default on one CPU process: today's numbers, bit for bit
    assert policy["fsdp"] and policy["param_dtype"] == "torch.bfloat16" and policy["reduce_dtype"] == "torch.float32"
    assert policy["optimizer_dtypes"] == ["torch.float32"]
    assert policy["losses"] == pytest.approx(autocast["losses"], rel=1e-2)  # within bf16's rounding of the weights


def test_the_key_is_documented_on_the_precision_and_zero_pages():
    docs = Path(__file__).resolve().parents[3] / "docs"
    for page in ("mixed_precision.md", "zero.md"):
        assert "zero_mixed_precision" in (docs / page).read_text(), page
