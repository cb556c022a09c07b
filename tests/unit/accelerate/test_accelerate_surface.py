"""accel's public surface against the installed Hugging Face Accelerate (and 1.16 from a side folder when there is one):
every difference must be in tests/accelerate_compat/surface_allowed.txt; and the behaviours behind the differences
this audit closed (the even_batches setter, set_module_tensor_to_device's keywords, the FSDP plugin's setters,
clip_grad_norm_'s foreach)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accel
from accel.utils import FullyShardedDataParallelPlugin, set_module_tensor_to_device

SURFACE = Path(__file__).resolve().parents[2] / "accelerate_compat" / "surface.py"
ACC116 = os.environ.get("ACCEL_ACCELERATE116", "/tmp/acc116")


def _real_accelerate_installed() -> bool:
    spec = importlib.util.find_spec("accelerate")
    return spec is not None and spec.origin is not None and "accel/shim" not in spec.origin


@pytest.mark.skipif(not _real_accelerate_installed(), reason="Hugging Face Accelerate is not installed")
def test_surface_differences_are_all_allowed(tmp_path):
    out = subprocess.run([sys.executable, str(SURFACE), "audit", "--accelerate116", ACC116],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, f"differences not in surface_allowed.txt:\n{out.stdout}\n{out.stderr[-2000:]}"
    assert "0 not allowed" in out.stdout


def test_compare_reports_missing_keyword_setter_and_name():
    sys.path.insert(0, str(SURFACE.parent))
    try:
        import surface
    finally:
        sys.path.pop(0)
    ref = {"modules": {"m": {"names": {"f": {"kind": "function", "object": "m.f"},
                                       "C": {"kind": "class", "object": "m.C"},
                                       "gone": {"kind": "function", "object": "m.gone"}}}},
           "objects": {"m.f": {"kind": "function", "signature": {"params": [
               {"name": "x", "kind": "POSITIONAL_OR_KEYWORD"},
               {"name": "k", "kind": "KEYWORD_ONLY", "default": "1", "value": 1}]}},
               "m.C": {"kind": "class", "members": {"p": {"kind": "property", "setter": True}},
                       "instance_attrs": [], "fields": {}}}}
    ours = {"modules": {"m": {"names": {"f": {"kind": "function", "object": "m.f"},
                                        "C": {"kind": "class", "object": "m.C"},
                                        "gone": {"kind": "missing"}}}},
            "objects": {"m.f": {"kind": "function", "signature": {"params": [
                {"name": "x", "kind": "POSITIONAL_OR_KEYWORD"}]}},
                "m.C": {"kind": "class", "members": {"p": {"kind": "property", "setter": False}},
                        "instance_attrs": [], "fields": {}}}}
    keys = {key for key, _ in surface.compare(ref, ours)}
    assert keys == {"missing-name:m.gone", "missing-param:m.f(k)", "missing-setter:m.C.p"}
    assert surface.unallowed([("missing-param:m.f(k)", "")], ["missing-param:m.f(*)"]) == []


def test_even_batches_setter_applies_to_loaders_prepared_after():
    accelerator = accel.Accelerator(cpu=True)
    assert accelerator.even_batches is True
    before = accelerator.prepare(torch.utils.data.DataLoader(list(range(10)), batch_size=3))
    accelerator.even_batches = False
    assert accelerator.even_batches is False and accelerator.dataloader_config.even_batches is False
    after = accelerator.prepare(torch.utils.data.DataLoader(list(range(10)), batch_size=3))
    assert after.batch_sampler.even_batches is False
    assert before.batch_sampler.even_batches is True  # as in Accelerate: already-prepared loaders keep theirs


def test_set_module_tensor_to_device_accelerate_keywords():
    model = torch.nn.Linear(2, 2)
    value = torch.ones(2, 2)
    tied: dict = {value.data_ptr(): {}}
    stats = torch.full((2,), 3.0)
    set_module_tensor_to_device(model, "weight", "cpu", value=value, dtype=torch.float32, fp16_statistics=stats,
                                tied_params_map=tied, non_blocking=True, clear_cache=False)
    assert torch.equal(model.weight, value) and isinstance(model.weight, torch.nn.Parameter)
    assert torch.equal(model.weight.SCB, stats)
    assert tied[value.data_ptr()]["cpu"] is model.weight  # recorded for the next tensor tied to the same source
    other = torch.nn.Linear(2, 2)
    set_module_tensor_to_device(other, "weight", "cpu", value=value, tied_params_map=tied)
    assert other.weight is model.weight  # reused, not a second copy
    set_module_tensor_to_device(other, "bias", "cpu", value=torch.zeros(2), clear_cache=True)
    assert torch.equal(other.bias, torch.zeros(2))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)


class _Model(torch.nn.Module):
    _no_split_modules = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])


def test_fsdp_plugin_set_auto_wrap_policy():
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap")
    plugin.set_auto_wrap_policy(_Model())
    assert plugin.transformer_cls_names_to_wrap == ["_Block"]  # the model's _no_split_modules
    assert plugin.auto_wrap_policy.func is transformer_auto_wrap_policy
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {_Block}
    assert plugin.to_layer()["parallelism"]["zero_wrap_classes"] == "_Block"

    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=10)
    plugin.set_auto_wrap_policy(_Model())
    assert plugin.auto_wrap_policy.func is size_based_auto_wrap_policy
    assert plugin.to_layer()["parallelism"]["zero_min_params"] == 10

    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["NoSuchLayer"])
    with pytest.raises(ValueError, match="Could not find the transformer layer class NoSuchLayer"):
        plugin.set_auto_wrap_policy(_Model())


def test_fsdp_plugin_set_mixed_precision_and_state_dict_type_and_cpu_offload():
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FullStateDictConfig,
        MixedPrecisionPolicy,
        ShardedStateDictConfig,
        StateDictType,
    )

    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision("bf16")
    assert isinstance(plugin.mixed_precision_policy, MixedPrecisionPolicy)
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert plugin.to_layer()["mixed_precision"] == "bf16"
    plugin.validate_mixed_precision_policy()
    plugin.set_mixed_precision("fp16")  # a policy is there and override is False: kept
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    plugin.set_mixed_precision(torch.float16, override=True)
    assert plugin.mixed_precision_policy.param_dtype == torch.float16 and plugin.to_layer()["mixed_precision"] == "fp16"
    with pytest.raises(ValueError, match="Invalid mixed precision"):
        plugin.set_mixed_precision("int4")

    plugin = FullyShardedDataParallelPlugin()
    plugin.set_state_dict_type()
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT  # FSDP2's default
    assert isinstance(plugin.state_dict_config, ShardedStateDictConfig)
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_state_dict_type("FULL_STATE_DICT")
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    assert isinstance(plugin.state_dict_config, FullStateDictConfig)
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT"):
        FullyShardedDataParallelPlugin(fsdp_version=2).set_state_dict_type("LOCAL_STATE_DICT")

    plugin = FullyShardedDataParallelPlugin(cpu_offload=True)
    plugin.set_cpu_offload()
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    plugin.validate_cpu_offload()
    assert plugin.to_layer()["parallelism"]["offload_params"] is True


@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_norm_foreach(foreach):
    accelerator = accel.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5, foreach=foreach)
    torch.testing.assert_close(norm, expected)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)
