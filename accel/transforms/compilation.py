"""torch.compile, two steps of the recipe: each repeated block before data parallelism wraps the model (regional
compilation), or the whole wrapped model after it (as Accelerate compiles the DDP/FSDP model). Both compile in
place (`nn.Module.compile`), so parameter names, state dicts and the prepared model's type stay the user's."""

from __future__ import annotations

import torch

from accel.transforms.blocks import repeated_blocks
from accel.config import ConfigError


def compile_options(cfg, options: dict | None = None) -> dict | None:
    """torch.compile's keyword arguments (plus `regional`) from the config's dynamo keys; None when
    `dynamo_backend` is `no`. A backend this torch does not have is a one-line error naming those it has."""
    if cfg.dynamo_backend == "no":
        return None
    import torch._dynamo

    if cfg.dynamo_backend not in torch._dynamo.list_backends(exclude_tags=()):  # debug ones too, not offered
        raise ConfigError(f"dynamo_backend: {cfg.dynamo_backend!r} is not a torch.compile backend of this torch "
                          f"{torch.__version__}; allowed: no, {', '.join(sorted(torch._dynamo.list_backends()))}")
    out = {"backend": cfg.dynamo_backend, "fullgraph": cfg.dynamo_use_fullgraph, "dynamic": cfg.dynamo_use_dynamic,
           "regional": cfg.dynamo_use_regional_compilation}
    if options:
        out["options"] = dict(options)
    elif cfg.dynamo_mode != "default":
        out["mode"] = cfg.dynamo_mode  # torch.compile takes a mode or options, not both
    return out


def compile_blocks(model: torch.nn.Module, parallelism, options: dict) -> None:
    """Regional compilation (Accelerate's `compile_regions`): `torch.compile` each repeated block in place, the
    outermost ones only. FSDP's per-block hooks stay outside the graphs, and since torch inlines modules (their
    parameters are graph inputs), blocks of one class reuse one compiled graph instead of compiling each."""
    covered: set[int] = set()
    for block in repeated_blocks(model, parallelism):
        if id(block) in covered or next(block.parameters(), None) is None:
            continue  # inside a compiled block, or a stand-in for a block another pipeline stage holds
        block.compile(**options)
        covered.update(id(m) for m in block.modules())
