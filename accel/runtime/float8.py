"""float8 training, one step of the recipe (mixed_precision fp8): torchao's `convert_to_float8_training` swaps the
selected `nn.Linear` layers for `Float8Linear`, whose matmuls run in float8 with dynamic (tensor-wise) scales; the
rest of the model runs under bf16 autocast. Before tensor parallelism (which splits the Float8Linear weights like
any Linear's) and before FSDP2 (which then all-gathers them in float8 under ZeRO 2/3).

Which layers: every `nn.Linear` whose in and out features are multiples of 16 (float8 matmul kernels need that),
except the model's first and last Linear layers (the input projection and the output head are the most sensitive
to the precision loss), as torchao and Accelerate advise; transformers' `Conv1D` (GPT-2) is not an `nn.Linear` and
stays in bf16. Without a GPU with float8 matmuls (compute capability 8.9+), torchao's emulation runs the same
casts and scales with a higher-precision matmul, so CPU runs follow the same numerics path.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch


INSTALL = "pip install 'accel-train[fp8]' (torchao)"


@dataclasses.dataclass
class Float8Settings:
    """What the precision policy decided for fp8: torchao's config (None: its defaults) and the layer filter."""

    config: Any = None  # torchao.float8.Float8LinearConfig
    module_filter: Callable[[torch.nn.Module, str], bool] | None = None
    emulate: bool = False  # no float8 matmul on this device: torchao's emulation


def default_filter(model: torch.nn.Module) -> Callable[[torch.nn.Module, str], bool]:
    """Linear layers with both dimensions multiples of 16, except the first and the last one."""
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    edges = {linears[0], linears[-1]} if linears else set()

    def keep(module: torch.nn.Module, name: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and name not in edges
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    return keep


def float8_layers(model: torch.nn.Module, settings: Float8Settings) -> set[str]:
    """The names of the Linear layers to convert, chosen on the whole model (a pipeline stage converts its part of
    this one choice: its own first and last Linear layers are not the model's)."""
    keep = settings.module_filter or default_filter(model)
    chosen = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and keep(m, name)}
    if not chosen:
        warnings.warn(f"mixed_precision fp8: no layer of {type(model).__name__} qualifies for float8 (an nn.Linear "
                      "with dimensions multiples of 16, not the first or the last one); it trains in bf16",
                      stacklevel=3)
    return chosen


def convert_to_float8(model: torch.nn.Module, settings: Float8Settings, fsdp: bool,
                      layers: set[str] | None = None) -> list[str]:
    """Swap the chosen Linear layers of `model` (`layers`, else chosen on `model`) for torchao's Float8Linear in
    place; return their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = settings.config or Float8LinearConfig()
    overrides = {}
    if settings.emulate and not config.emulate:
        overrides["emulate"] = True
    if fsdp and not config.enable_fsdp_float8_all_gather and settings.config is None:
        overrides["enable_fsdp_float8_all_gather"] = True  # ZeRO 2/3 gathers the weights in float8
    if overrides:
        config = dataclasses.replace(config, **overrides)
    chosen = float8_layers(model, settings) if layers is None else layers
    convert_to_float8_training(model, module_filter_fn=lambda _module, name: name in chosen, config=config)
    return sorted(name for name, m in model.named_modules() if name in chosen and is_float8(m))


def warn_without_compile(compiled: bool) -> None:
    """One warning at prepare when fp8 runs eagerly: torchao's casts and scales around each float8 matmul are fused
    only by torch.compile, so without it a step is slower than bf16's."""
    if compiled:
        return
    warnings.warn("mixed_precision fp8 without torch.compile runs slower than bf16 (torchao's float8 casts and "
                  "scales are fused only by the compiler); set dynamo_backend: inductor (accel launch "
                  "--dynamo_backend inductor), or compile the prepared model yourself", stacklevel=4)


def is_float8(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"
