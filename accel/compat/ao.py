"""Accelerate's torchao helpers (`accelerate.utils.ao`), for scripts that convert a model to float8 themselves.

accel's own fp8 path (`mixed_precision: fp8`) chooses layers in `accel.runtime.float8`; these keep Accelerate's
exact rules (e.g. a non-Linear module passes `filter_linear_layers`), since scripts pass them to torchao directly.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from accel.runtime.float8 import is_float8
from accel.core.probes import torchao_required

__all__ = ["convert_model_to_fp8_ao", "filter_first_and_last_linear_layers", "filter_linear_layers",
           "find_first_last_linear_layers", "has_ao_layers"]


def find_first_last_linear_layers(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The names of the first and the last `nn.Linear` in `model` (None when there is none)."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def filter_linear_layers(module: torch.nn.Module, fqn: str, layers_to_filter: list) -> bool:
    """False for a Linear whose dimensions are not multiples of 16 (float8 kernels need them) and for the names in
    `layers_to_filter`; True otherwise."""
    if isinstance(module, torch.nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return False
    return fqn not in layers_to_filter


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """`filter_linear_layers` leaving out the first and last Linear of `module` (Accelerate's rule, as it is)."""
    return filter_linear_layers(module, fqn, layers_to_filter=list(find_first_last_linear_layers(module)))


@torchao_required
def has_ao_layers(model: torch.nn.Module) -> bool:
    return any(is_float8(module) for module in model.modules())


@torchao_required
def convert_model_to_fp8_ao(model: torch.nn.Module, config: Any = None,
                            module_filter_func: Callable | None = None) -> None:
    """Swap `model`'s Linear layers, but its first and last, for torchao's Float8Linear in place."""
    from torchao.float8 import convert_to_float8_training

    if module_filter_func is None:
        module_filter_func = partial(filter_linear_layers, layers_to_filter=list(find_first_last_linear_layers(model)))
    convert_to_float8_training(model, module_filter_fn=module_filter_func, config=config)
