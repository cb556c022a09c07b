"""The repeated blocks of a model: the unit that ZeRO shards, activation checkpointing recomputes and regional
compilation compiles, one at a time."""

from __future__ import annotations

import torch

from accel.config import ConfigError

DEFAULT_MIN_PARAMS = 100_000_000  # submodules this large get their own shard group when nothing repeats


def repeated_blocks(model: torch.nn.Module, parallelism) -> list[torch.nn.Module]:
    """The blocks that ZeRO shards and activation checkpointing recomputes one by one, outermost first: the
    classes named in `zero_wrap_classes` if given, else the members of every `nn.ModuleList` (repeated blocks),
    else submodules with at least `zero_min_params` parameters."""
    names = {c.strip() for c in (parallelism.zero_wrap_classes or "").split(",") if c.strip()}
    min_params = parallelism.zero_min_params or DEFAULT_MIN_PARAMS
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        known = {type(m).__name__ for m in model.modules()}
        unknown = names - known
        if unknown:
            raise ConfigError(f"parallelism.zero_wrap_classes: {sorted(unknown)} not found in the model; "
                              f"its classes are: {', '.join(sorted(known))}")
        return found
    blocks = [child for m in model.modules() if isinstance(m, torch.nn.ModuleList) for child in m]
    if blocks:
        return blocks
    targets: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if sum(p.numel() for p in child.parameters()) >= min_params:
                targets.append(child)
            visit(child)

    visit(model)
    return targets
