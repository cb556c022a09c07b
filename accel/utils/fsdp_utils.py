"""Accelerate's `accelerate.utils.fsdp_utils` path (TRL imports `get_parameters_from_modules` from it): the FSDP
checkpoint helpers are accel's (accel.checkpoint.fsdp_compat, which save and load through the backend of the
prepared model), and the small name/parameter helpers follow Accelerate's behaviour. Accelerate's internal
`fsdp2_prepare_model` / `fsdp2_apply_ac` / `fsdp2_prepare_auto_wrap_policy` are not here: accel's ZeRO backend
(`fully_shard`) does that work inside `prepare` (docs/accelerate_compat.md)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import torch

from accel.big_model.modeling import ensure_weights_retied
from accel.checkpoint.fsdp_compat import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
from accel.checkpoint.merge import merge_fsdp_weights

__all__ = ["disable_fsdp_ram_efficient_loading", "enable_fsdp_ram_efficient_loading", "ensure_weights_retied",
           "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict", "get_fsdp2_grad_scaler",
           "get_parameters_from_modules", "load_fsdp_model", "load_fsdp_optimizer", "merge_fsdp_weights",
           "save_fsdp_model", "save_fsdp_optimizer"]


def enable_fsdp_ram_efficient_loading() -> None:
    """Tell transformers' `from_pretrained` that FSDP is on and to load weights on rank 0 only (its env switches)."""
    os.environ.setdefault("ACCELERATE_USE_FSDP", "True")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def get_fsdp2_grad_scaler(**kwargs) -> torch.amp.GradScaler:
    """A plain `torch.amp.GradScaler` with the given arguments (FSDP2's gradients are DTensors it already handles)."""
    return torch.amp.GradScaler(**kwargs)


def fsdp2_canonicalize_names(named_params: dict) -> dict:
    """Parameter names without the wrappers' infixes (activation checkpointing's, torch.compile's `_orig_mod`)."""
    out = {}
    for name, value in named_params.items():
        name = name.replace("._checkpoint_wrapped_module", "")
        name = name[len("_orig_mod."):] if name.startswith("_orig_mod.") else name
        out[name.replace("._orig_mod", "")] = value
    return out


def get_parameters_from_modules(modules: Iterable[torch.nn.Module] | str | None, model: torch.nn.Module,
                                device) -> set[torch.nn.Parameter]:
    """The parameters of `modules`: modules themselves, or a regex that `model`'s module names fully match (those
    modules are moved to `device` first, as Accelerate does); None gives an empty set."""
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        matched = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
        for module in matched:
            module.to(device)
        modules = matched
    return {param for module in modules for param in module.parameters()}


def fsdp2_load_full_state_dict(accelerator, model: torch.nn.Module, full_sd: dict, cpu_offload: bool = False):
    """Load a whole (unsharded) state dict into a sharded model: rank 0's `full_sd` is broadcast and each process
    keeps its shards (torch.distributed.checkpoint's `set_model_state_dict`); on one process a plain load."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not (dist.is_available() and dist.is_initialized()):
        model.load_state_dict(full_sd)
        return model
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=cpu_offload)
    set_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, options=options)
    return model
