"""Data parallelism with `torch.nn.parallel.DistributedDataParallel`, the recipe's last step when parameters stay
whole (zero_stage 0 or 1): gradients are all-reduced in buckets during backward (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from accel.kwargs import DistributedDataParallelKwargs


def apply_ddp(model: torch.nn.Module, group, device: torch.device,
              handler: DistributedDataParallelKwargs | None = None) -> torch.nn.Module:
    """`model` in DDP over `group` with the options of the user's `DistributedDataParallelKwargs` (and its
    communication hook); a model with nothing to train (e.g. a frozen evaluation model) is returned as is, since
    DDP refuses it."""
    if not any(p.requires_grad for p in model.parameters()):
        return model
    options = (handler or DistributedDataParallelKwargs()).to_kwargs()
    comm_hook, comm_state = options.pop("comm_hook", None), options.pop("comm_state", None)
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DDP(model, device_ids=device_ids, process_group=group, **options)
    if comm_hook is not None:
        wrapped.register_comm_hook(comm_state, comm_hook)
    return wrapped


@contextlib.contextmanager
def ddp_pipeline_stages(stages: list, skip_sync: bool):
    """How pipeline stages (`PipelineStage`) whose module is in DDP run a training step.

    With `skip_sync` (inside `accumulate`): on the modules inside their DDP wrappers, so there is no gradient
    reduction and gradients accumulate locally (DDP's `no_sync`; PipelineStage would otherwise reduce after the
    last micro-batch). The next step that goes through DDP reduces the accumulated gradients.

    Otherwise: inside DDP's `no_sync`, where only the last micro-batch's backward reduces, as PipelineStage
    arranges it. Its shape-inference forward on the first step then does not arm DDP's reducer either (armed,
    the reducer counted that pass and the real one as one backward and failed its bucket rebuild with
    "rebuilt parameter indices size is not same as original model parameters size" when
    pp_microbatches == pp_size)."""
    ddp = [(stage, stage.submod) for stage in stages if isinstance(stage.submod, DDP)]
    with contextlib.ExitStack() as stack:
        for stage, module in ddp:
            if skip_sync:
                stage.submod = module.module
            else:
                stack.enter_context(module.no_sync())
        try:
            yield
        finally:
            for stage, module in ddp:
                stage.submod = module


def release_ddp(modules: list) -> None:
    """Drop each live DDP module's reducer and logger (C++ objects that hold the process group).

    The user's script still holds the DDP module at interpreter exit; its reducer must go before the
    group does, or a rank can abort ("terminate called without an active exception").
    """
    for module in modules:
        if module is not None:
            for attr in ("logger", "reducer"):
                if attr in module.__dict__:
                    module.__dict__[attr] = None
