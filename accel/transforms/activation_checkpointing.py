"""Activation checkpointing, one step of the recipe: each repeated block recomputes its forward in backward
instead of keeping its activations (torch's non-reentrant `checkpoint`)."""

from __future__ import annotations

from typing import Any

import torch

from accel.transforms.blocks import repeated_blocks


def apply_activation_checkpointing(model: torch.nn.Module, parallelism) -> None:
    """Recompute each repeated block (the blocks ZeRO shards one by one) in backward instead of keeping its
    activations: torch's non-reentrant `checkpoint` around the block's own forward, so names, hooks and state
    dicts are unchanged and it composes with DDP, FSDP2, TP and pipeline stages.

    `full` keeps only each block's input; `selective` also keeps the outputs of matmuls and attention (the costly
    ops) and recomputes the rest (norms, activations, elementwise ops). A transformers model's `use_cache` is
    turned off, as transformers' own gradient checkpointing does."""
    mode = parallelism.activation_checkpointing
    if mode == "no":
        return
    disable_kv_cache(model)  # as transformers' own gradient checkpointing does: the recomputation would update
    # the cache a second time
    for block in repeated_blocks(model, parallelism):
        if "_accel_checkpointed" in block.__dict__ or next(block.parameters(), None) is None:
            continue  # already wrapped, or a stand-in for a block another pipeline stage holds
        block._accel_checkpointed = block.forward  # type: ignore[assignment]  # a plain attribute: the original
        block.forward = _checkpointed(block.forward, mode)


_SAVED_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu")


def _checkpointed(forward, mode: str):
    import functools

    from torch.utils.checkpoint import checkpoint

    options: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        options["context_fn"] = _selective_contexts

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # evaluation: nothing to recompute
        return checkpoint(forward, *args, **options, **kwargs)

    return run


def _selective_contexts():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, name).default for name in _SAVED_OPS if hasattr(torch.ops.aten, name)}

    def policy(_ctx, op, *_args, **_kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def disable_kv_cache(model: torch.nn.Module) -> None:
    """Turn off a transformers model's `use_cache` default (generation still asks for a cache explicitly): a KV
    cache is state that training does not use, that a recomputed block would update twice, and whose per-layer
    state makes every compiled block recompile."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
