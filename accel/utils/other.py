"""Accelerate's `accelerate.utils.other` helpers that scripts and transformers import."""

from __future__ import annotations

import torch


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True, recursive: bool = False) -> torch.nn.Module:
    """The user's module inside DDP (`.module`) and, unless `keep_torch_compile`, a `torch.compile` wrapper; with
    `keep_fp32_wrapper=False`, without accel's autocast forward."""
    from accel.precision import PrecisionPolicy

    compiled = getattr(model, "_orig_mod", None)
    inner = compiled if compiled is not None else model
    while isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        inner = inner.module
    if not keep_fp32_wrapper:
        PrecisionPolicy.unwrap_forward(inner)
    if compiled is not None and keep_torch_compile:
        model._orig_mod = inner
        return model
    return inner


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether `module` is a `torch.compile` wrapper (OptimizedModule)."""
    return hasattr(module, "_orig_mod") and hasattr(module, "_compiled_call_impl")
