"""Accelerate's FSDP checkpoint functions and the members transformers' Trainer reads, on one process (the sharded
runs, against the real Accelerate, are tests/multiproc/ecosystem/test_trainer.py)."""

import random

import pytest
import torch

from accel import Accelerator
from accel.checkpoint.layout import CheckpointError
from accel.utils import (
    FSDP_AUTO_WRAP_POLICY,
    FSDP_SHARDING_STRATEGY,
    DistributedType,
    GradientAccumulationPlugin,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def trained(**kwargs):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, **kwargs)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(2, 3)).pow(2).sum())
    optimizer.step()
    return accelerator, model, optimizer


def test_model_and_optimizer_round_trip_in_accelerate_folders(tmp_path):
    accelerator, model, optimizer = trained()
    plugin = accelerator.state.fsdp_plugin
    save_fsdp_model(plugin, accelerator, model, tmp_path, adapter_only=True)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"pytorch_model_fsdp_0", "optimizer_0"}
    assert not [p for p in tmp_path.rglob("*") if p.suffix in (".bin", ".pt", ".pkl")]  # no pickle
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}

    _, fresh, fresh_optimizer = trained()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    random.seed(3)
    torch.manual_seed(3)
    before = (random.random(), torch.rand(1))
    random.seed(3)
    torch.manual_seed(3)
    result = load_fsdp_model(plugin, accelerator, fresh, tmp_path / "pytorch_model_fsdp_0")  # the folder itself too
    load_fsdp_optimizer(plugin, accelerator, fresh_optimizer, fresh, tmp_path)
    assert (random.random(), torch.rand(1)) == before  # loading weights leaves the RNG where it was
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items())
    assert all(torch.equal(fresh_optimizer.state_dict()["state"][0][k], v) for k, v in moments.items())


def test_bad_arguments_are_one_line_errors(tmp_path):
    accelerator, model, optimizer = trained()
    with pytest.raises(ValueError, match="save_fsdp_model: argument 'use_dcp': bad value False"):
        save_fsdp_model(None, accelerator, model, tmp_path, use_dcp=False)
    with pytest.raises(CheckpointError, match="load_fsdp_model: .*pytorch_model_fsdp_0 is not a folder"):
        load_fsdp_model(None, accelerator, model, tmp_path)
    with pytest.raises(TypeError, match="argument 'accelerator': expected an accel Accelerator, got object"):
        save_fsdp_optimizer(None, object(), optimizer, model, tmp_path)
    save_fsdp_model(None, accelerator, model, tmp_path)
    other = torch.nn.Linear(3, 1)
    with pytest.raises(CheckpointError, match="does not match the prepared model"):
        load_fsdp_model(None, accelerator, other, tmp_path)


def test_state_tells_trainer_whether_the_model_is_sharded():
    accelerator, _, _ = trained()
    assert accelerator.state.fsdp_plugin is None and accelerator.distributed_type == DistributedType.NO
    assert not accelerator.is_fsdp2
    from accel.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False,
                                            transformer_cls_names_to_wrap="Linear")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # one process: NO, not FSDP (the state is also PartialState, and transformers then expects a process group)
    assert accelerator.state.fsdp_plugin is plugin and accelerator.distributed_type == DistributedType.NO
    assert accelerator.is_fsdp2 and accelerator.config.parallelism.zero_stage == 2
    assert accelerator.config.parallelism.zero_wrap_classes == "Linear"


def test_tensor_parallelism_with_data_parallelism_is_fsdp_for_trainer():
    """TP with data parallelism is FSDP2 over dp (as in Accelerate): the state then has a plugin whose
    FULL_STATE_DICT makes transformers' Trainer gather the weights on every process before saving. TP alone, or
    DDP, has none."""
    from types import SimpleNamespace

    from accel.checkpoint.fsdp_compat import fsdp_state_members
    from accel.config import ParallelismConfig
    from accel.parallel.data_parallel import DataParallelPlan

    def members(kind, **fields):
        config = SimpleNamespace(parallelism=ParallelismConfig(**fields))
        backend = SimpleNamespace(data_parallel=None if kind is None else DataParallelPlan(kind=kind))
        return fsdp_state_members(None, config, backend)

    plugin = members("fsdp", tp_size=2)["fsdp_plugin"]
    assert plugin is not None and "FULL_STATE_DICT" in str(plugin.state_dict_type)
    assert members(None, tp_size=2)["fsdp_plugin"] is None
    assert members("ddp", ep_size=2)["fsdp_plugin"] is None
    assert members("fsdp", zero_stage=3)["is_fsdp2"]
    assert members("hsdp", zero_stage=3, dp_replicate_size=2, dp_shard_size=2)["is_fsdp2"]
    assert members("zero1", zero_stage=1)["fsdp_plugin"] is None


def test_gradient_state_as_trainer_drives_it():
    """Trainer passes GradientAccumulationPlugin(num_steps=1), then sets the sync flag itself each micro-step."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
    state = accelerator.gradient_state
    assert state.plugin_kwargs == {"num_steps": 1} and state.plugin_kwargs.get("sync_each_batch", False) is False
    state._set_sync_gradients(False)
    assert accelerator.sync_gradients is False
    state._set_sync_gradients(True)
    assert accelerator.sync_gradients is True
    each = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2,
                                                                                         sync_each_batch=True))
    assert each.gradient_state.plugin_kwargs == {"num_steps": 2, "sync_each_batch": True}


def test_constants_transformers_checks_fsdp_config_against():
    assert FSDP_AUTO_WRAP_POLICY[0] == "TRANSFORMER_BASED_WRAP" and "SHARD_GRAD_OP" in FSDP_SHARDING_STRATEGY
    from accel.utils.constants import FSDP2_STATE_DICT_TYPE

    assert FSDP2_STATE_DICT_TYPE == ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
