"""Fused projections under tensor parallelism (GPT-2's `c_attn`: q, k and v in one [in, 3*out] matrix; a MoE
layer's stacked experts' `gate_up_proj`: gate and up in one [E, 2*I, H] tensor).

Megatron's split gives each tensor-parallel rank whole heads of q, of k and of v. A contiguous shard of the
fused matrix would not (rank 0 would get all of q and half of k), so before sharding the output features are
reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: then the plain `Shard` of that order is rank r's q_r, k_r, v_r,
which the module's own forward splits into its local heads.

The reordering is an internal layout: full state dicts (`save_model`, `get_state_dict`) put the features back
in the model's order, and a `save_state` checkpoint records the layout so that it is only resumed into the
same one (never silently into another tensor-parallel degree).
"""

from __future__ import annotations

import torch
from torch import nn

_MARK = "_accel_fused"  # on a fused module: (parts, tp_size, {parameter name: the dim of its fused features})


def permutation(features: int, parts: int, tp_size: int) -> torch.Tensor:
    """Indices that reorder `parts` equal parts of `features` so each of `tp_size` chunks holds a slice of each."""
    width = features // parts
    chunk = width // tp_size
    return torch.cat([torch.arange(j * width + r * chunk, j * width + (r + 1) * chunk)
                      for r in range(tp_size) for j in range(parts)])


def mark(module: nn.Module, parts: int, tp_size: int, dims: dict[str, int]) -> None:
    setattr(module, _MARK, (parts, tp_size, dims))


def _marked(model: nn.Module):
    for name, module in model.named_modules():
        info = getattr(module, _MARK, None)
        if info is not None:
            yield name, info


def layouts(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the non-default layout it is held in (for the checkpoint manifest)."""
    found = {}
    for name, (parts, tp_size, dims) in _marked(model):
        for leaf in dims:
            found[f"{name}.{leaf}" if name else leaf] = f"fused {parts} parts, reordered for tp_size={tp_size}"
    return found


def to_model_order(state: dict, model: nn.Module) -> dict:
    """A full state dict (gathered tensors) with fused features put back in the model's own order."""
    for name, (parts, tp_size, dims) in _marked(model):
        for leaf, dim in dims.items():
            key = f"{name}.{leaf}" if name else leaf
            value = state.get(key)
            if isinstance(value, torch.Tensor):
                inverse = torch.argsort(permutation(value.shape[dim], parts, tp_size))
                state[key] = value.index_select(dim, inverse)
    return state
