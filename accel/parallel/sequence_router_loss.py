"""A MoE model's router auxiliary (load-balancing) loss under sequence/context parallelism, over the whole sequence.

transformers' MoE causal LMs add `router_aux_loss_coef x load_balancing_loss_func(router_logits, ..., attention_mask)`
to their loss: a product of two means over every token (the share of tokens routed to each expert, the mean router
probability of each). On a rank's slice those means would be the slice's. While such a model's forward runs, its
modeling module's `load_balancing_loss_func` is called on the router logits and the mask gathered over the sequence
group (an all-gather whose backward sums every rank's gradient of this rank's slice), so every rank computes the
whole sequence's term, as one process does. The term is then the same on every rank of the group: `excess` says how
much of it a slice's loss must give back when the slices' losses are summed (transformers' num_items_in_batch).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from accel.parallel.sequence_layout import gather_slices

LOSS_FUNCTION = "load_balancing_loss_func"  # the name every transformers MoE modeling file gives it


def computes_router_loss(model: torch.nn.Module) -> bool:
    """Whether `model`'s modeling module has transformers' router loss function (which `whole_sequence` replaces)."""
    return _modeling_module(model) is not None


def _modeling_module(model: torch.nn.Module):
    """The module that defines `model`'s class and its router loss function (FSDP2 and others subclass the model's
    class elsewhere: its bases are looked at too); None when there is none."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if callable(getattr(module, LOSS_FUNCTION, None)):
            return module
    return None


@contextlib.contextmanager
def whole_sequence(model: torch.nn.Module, group, batch: int) -> Iterator[None]:
    """Within: `model`'s router loss is the whole sequence's, from this rank's [batch x slice, experts] router logits
    of each layer and its [batch, slice] attention mask, gathered over `group` (the order of the gathered tokens does
    not matter: the loss sums over tokens, and logits and mask are gathered alike)."""
    module = _modeling_module(model)
    if module is None:
        yield
        return
    original = getattr(module, LOSS_FUNCTION)

    def loss_over_the_sequence(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if not isinstance(gate_logits, tuple) or not gate_logits:
            return original(gate_logits, num_experts, top_k, attention_mask)
        gathered = tuple(_gather_rows(layer, batch, group) for layer in gate_logits)
        mask = None if attention_mask is None else _gather_columns(attention_mask, group)
        return original(gathered, num_experts, top_k, mask)

    setattr(module, LOSS_FUNCTION, loss_over_the_sequence)
    try:
        yield
    finally:
        setattr(module, LOSS_FUNCTION, original)


def excess(model: torch.nn.Module, outputs, degree: int) -> torch.Tensor | None:
    """The share of the router term a slice's loss gives back when the group's losses are summed: coef x aux x
    (1 - 1/degree), so that the sum counts the whole sequence's term once (None: the model added none)."""
    aux = outputs.get("aux_loss") if hasattr(outputs, "get") else getattr(outputs, "aux_loss", None)
    config = getattr(model, "config", None)
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0))
    if not isinstance(aux, torch.Tensor) or not coef:
        return None
    return coef * aux * (1 - 1 / degree)


def _gather_rows(logits: torch.Tensor, batch: int, group) -> torch.Tensor:
    """[batch x slice, experts] on each rank -> [batch x sequence, experts], differentiable."""
    experts = logits.shape[-1]
    return gather_slices(logits.reshape(batch, -1, experts), group, dim=1).reshape(-1, experts)


def _gather_columns(mask: torch.Tensor, group) -> torch.Tensor:
    """[batch, slice] on each rank -> [batch, sequence] (the slices side by side, as `_gather_rows` puts them)."""
    parts = [torch.empty_like(mask) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mask.contiguous(), group=group)
    return torch.cat(parts, dim=1)
