"""Tied weights (an embedding shared with the output head, an MLM decoder's bias...): one parameter under
several names. Every backend keeps them one parameter; here is how a state dict keeps them one tensor.

Sharded backends gather each name on its own (FSDP2's full state dict, a pipeline's stages), which would give
two equal copies that `save_model` then writes twice; `share_tied` makes them one object again, and refuses
copies that differ (a tie that was broken is a bug, never something to paper over)."""

from __future__ import annotations

import torch
from torch import nn


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of parameter names that refer to one parameter object, in `named_parameters` order."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def share_tied(state: dict, groups: list[tuple[str, ...]]) -> dict:
    """`state` with every present name of a tied group pointing at one tensor (the first name's)."""
    for names in groups:
        present = [n for n in names if n in state]
        if len(present) < 2:
            continue
        kept = state[present[0]]
        for name in present[1:]:
            other = state[name]
            if other is kept:
                continue
            if not _bit_equal(kept, other):
                raise RuntimeError(f"tied weights '{present[0]}' and '{name}' hold different values: the tie was "
                                   "broken during training (please report this as a bug in accel)")
            state[name] = kept
    return state


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu())
