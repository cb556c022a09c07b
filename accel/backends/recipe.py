"""Model transformations that several backends apply, as plain functions (the first steps toward one ordered
recipe: materialize -> tensor parallel -> FSDP/DDP over the data-parallel dims).

ZeRO 2/3 and TP x DP shard with the same FSDP2 loop, and ZeRO and pipelines allocate meta-device models the
same way; each is written once here, so no backend imports another's private names.
"""

from __future__ import annotations

import contextlib

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
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):  # as transformers' own gradient checkpointing does
        config.use_cache = False  # a KV cache is state that the recomputation would update a second time
    for block in repeated_blocks(model, parallelism):
        if "_accel_checkpointed" in block.__dict__ or next(block.parameters(), None) is None:
            continue  # already wrapped, or a stand-in for a block another pipeline stage holds
        block._accel_checkpointed = block.forward
        block.forward = _checkpointed(block.forward, mode)


_SAVED_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu")


def _checkpointed(forward, mode: str):
    import functools

    from torch.utils.checkpoint import checkpoint

    options = {"use_reentrant": False}
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


def apply_fsdp(model: torch.nn.Module, mesh, parallelism, precision, offload: bool = False,
               pin_memory: bool = False) -> None:
    """FSDP2 (`fully_shard`) over `mesh`: each repeated block (inner before outer), then the root. Parameters
    are resharded after forward with zero_stage 3; gradients are reduced in fp32 under mixed precision."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    options = {"mesh": mesh, "reshard_after_forward": parallelism.zero_stage == 3}
    mp_policy = precision.fsdp_policy()
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    for block in reversed(repeated_blocks(model, parallelism)):  # inner blocks before their parents
        fully_shard(block, **options)
    fully_shard(model, **options)


@contextlib.contextmanager
def fsdp_no_sync(model):
    """FSDP2's `no_sync`: gradients accumulate locally until the context ends."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def materialize(model: torch.nn.Module, device) -> None:
    """Allocate a meta-device model's (local shards of) parameters and initialise them with each
    submodule's `reset_parameters()`: a model larger than one process can be created this way."""
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
