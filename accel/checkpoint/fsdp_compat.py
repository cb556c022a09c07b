"""Accelerate's FSDP checkpoint functions (`save_fsdp_model`, `load_fsdp_model`, `save_fsdp_optimizer`,
`load_fsdp_optimizer`) on accel's own checkpoints, and the `AcceleratorState.fsdp_plugin` that tells code written
for Accelerate (transformers' `Trainer`) that the model is sharded.

Each function writes, or reads, one accel checkpoint folder (`save_state`'s format: safetensors through
torch.distributed.checkpoint, every rank its shards, JSON for the rest; no pickle), named as Accelerate's sharded
checkpoints are, so transformers' `Trainer` recognises a checkpoint folder holding them:

    <output_dir>/pytorch_model_fsdp_<model_index>/    the model's tensors
    <output_dir>/optimizer_<optimizer_index>/         the optimizer's state, keyed by parameter name

They work under every backend (DDP, ZeRO 1/2/3, TP), load on another number of processes, and are written the
same way whatever `fsdp_plugin.state_dict_type` says: Accelerate's FULL_STATE_DICT would be a pickle file, and
the full weights are what `Accelerator.save_model` / `get_state_dict` give.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from accel.checkpoint.backend_view import CheckpointBackend
from accel.checkpoint.layout import CheckpointError
from accel.core.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME


def _model_folder(directory: str | os.PathLike, model_index: int) -> Path:
    return Path(directory) / f"{FSDP_MODEL_NAME}_{model_index}"


def _optimizer_folder(directory: str | os.PathLike, optimizer_index: int) -> Path:
    return Path(directory) / f"{OPTIMIZER_NAME}_{optimizer_index}"


def _input_folder(input_dir: str | os.PathLike, name: str) -> Path:
    """Accelerate's loaders take the checkpoint folder or the folder itself."""
    folder = Path(input_dir)
    return folder if folder.name == name else folder / name


def _backend(accelerator: Any, function: str) -> CheckpointBackend:
    backend = getattr(accelerator, "backend", None)
    if backend is None or not hasattr(backend, "checkpoint_model_state"):
        raise TypeError(f"{function}: argument 'accelerator': expected an accel Accelerator, got "
                        f"{type(accelerator).__name__}")
    return backend


def _check_dcp(use_dcp: bool, function: str) -> None:
    if not use_dcp:
        raise ValueError(f"{function}: argument 'use_dcp': bad value False (per-rank pickle files); allowed: True "
                         "(accel writes torch.distributed.checkpoint folders of safetensors)")


class _Wrapped:
    """What the training-state writer takes for an optimizer: an object with `.optimizer` (accel's
    AcceleratedOptimizer has one; a plain torch optimizer is wrapped here)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def _as_prepared(optimizer: Any) -> Any:
    prepared = isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)
    return optimizer if prepared else _Wrapped(optimizer)


def _rng_snapshot() -> dict:
    """This process's RNG states: loading weights must not rewind them (a checkpoint folder records the RNG of its
    save, and `load_state` restores it; these functions load weights only)."""
    try:
        import numpy as np

        numpy = np.random.get_state()
    except ImportError:
        numpy = None
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state(), "cuda": cuda}


def _drop_models(models: list, *rest) -> None:
    """A save/load pre-hook that leaves the models out: an optimizer folder holds the optimizer only."""
    if rest and isinstance(rest[0], list):
        rest[0].clear()  # save: the weights to write
    else:
        models.clear()  # load: the models to read into


# -- the four functions ---------------------------------------------------------------------------------------

def save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index: int = 0, adapter_only: bool = False,
                    use_dcp: bool = True) -> None:
    """Write `model`'s state (each rank its shards) to `<output_dir>/pytorch_model_fsdp_<model_index>`; every
    process calls it.

    `adapter_only` is accepted (transformers always passes it) and every tensor is written, frozen ones included,
    so the folder loads strictly into the same model."""
    from accel.checkpoint.training_state import TrainingObjects, save_training_state

    _check_dcp(use_dcp, "save_fsdp_model")
    backend = _backend(accelerator, "save_fsdp_model")
    save_training_state(_model_folder(output_dir, model_index), TrainingObjects(backend, models=[model]))


def load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, model_index: int = 0, adapter_only: bool = False,
                    use_dcp: bool = True):
    """Read what `save_fsdp_model` wrote into `model` (sharded or not, on any number of processes); every process
    calls it. Names and shapes are checked before anything changes. Returns torch's `_IncompatibleKeys` (empty:
    the load is strict)."""
    from torch.nn.modules.module import _IncompatibleKeys

    from accel.checkpoint.rng_states import _apply_rng
    from accel.checkpoint.training_state import TrainingObjects, load_training_state

    _check_dcp(use_dcp, "load_fsdp_model")
    backend = _backend(accelerator, "load_fsdp_model")
    folder = _input_folder(input_dir, f"{FSDP_MODEL_NAME}_{model_index}")
    _require_folder(folder, "load_fsdp_model", "save_fsdp_model")
    rng = _rng_snapshot()
    load_training_state(folder, TrainingObjects(backend, models=[model]))
    _apply_rng(rng)
    return _IncompatibleKeys([], [])


def save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index: int = 0,
                        use_dcp: bool = True) -> None:
    """Write `optimizer`'s state (keyed by `model`'s parameter names; sharded state stays sharded) to
    `<output_dir>/optimizer_<optimizer_index>`; every process calls it."""
    from accel.checkpoint.training_state import TrainingObjects, save_training_state

    _check_dcp(use_dcp, "save_fsdp_optimizer")
    backend = _backend(accelerator, "save_fsdp_optimizer")
    objects = TrainingObjects(backend, models=[model], optimizers=[_as_prepared(optimizer)], save_hooks=[_drop_models])
    save_training_state(_optimizer_folder(output_dir, optimizer_index), objects)


def load_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index: int = 0,
                        adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Read what `save_fsdp_optimizer` wrote into `optimizer` (whose parameters are `model`'s); every process
    calls it."""
    from accel.checkpoint.rng_states import _apply_rng
    from accel.checkpoint.training_state import TrainingObjects, load_training_state

    _check_dcp(use_dcp, "load_fsdp_optimizer")
    backend = _backend(accelerator, "load_fsdp_optimizer")
    folder = _input_folder(input_dir, f"{OPTIMIZER_NAME}_{optimizer_index}")
    _require_folder(folder, "load_fsdp_optimizer", "save_fsdp_optimizer")
    rng = _rng_snapshot()
    load_training_state(folder, TrainingObjects(backend, models=[model], optimizers=[_as_prepared(optimizer)],
                                                load_hooks=[_drop_models]))
    _apply_rng(rng)


def _require_folder(folder: Path, function: str, writer: str) -> None:
    if not folder.is_dir():
        raise CheckpointError(f"{function}: {folder} is not a folder; allowed: a folder written by {writer} "
                              "(or the folder holding it)")


# -- AcceleratorState.fsdp_plugin ----------------------------------------------------------------------------

def fsdp_state_members(given: Any, config: Any, backend: Any) -> dict:
    """Accelerate's `AcceleratorState.fsdp_plugin` for this run: the plugin given to the Accelerator, else, when the
    backend shards the model with FSDP2 (ZeRO 2/3 from the config or launch, or tensor parallelism with data
    parallelism, which accel runs as FSDP2 over dp as Accelerate does), one describing that layout; None
    otherwise. The state's `distributed_type` is then FSDP and `is_fsdp2` true, as in Accelerate, so code that
    branches on them (transformers' Trainer) saves and loads through every process."""
    plugin = given
    plan = getattr(backend, "data_parallel", None)  # a DataParallelPlan (none on a pipeline backend)
    if plugin is None and plan is not None and plan.fsdp:
        plugin = derived_plugin(config.parallelism, plan.reshard_after_forward)
    return {"fsdp_plugin": plugin, "is_fsdp2": plugin is not None}


def derived_plugin(parallelism: Any, reshard_after_forward: bool):
    """The FullyShardedDataParallelPlugin that describes accel's ZeRO 2/3 settings. Its `state_dict_type` is
    FULL_STATE_DICT, so Trainer's `save_model` writes the gathered weights (accel's `save_model` always does)."""
    from accel.config.plugins import FullyShardedDataParallelPlugin

    offload = bool(parallelism.offload_params or parallelism.offload_optimizer)
    return FullyShardedDataParallelPlugin(
        reshard_after_forward=reshard_after_forward, fsdp_version=2, state_dict_type="FULL_STATE_DICT",
        cpu_offload=offload, activation_checkpointing=parallelism.activation_checkpointing != "no",
        auto_wrap_policy="TRANSFORMER_BASED_WRAP")
