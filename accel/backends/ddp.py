"""Data parallelism with `torch.nn.parallel.DistributedDataParallel` (gloo on CPU, NCCL on CUDA).

One process: the model is only moved to the device; nothing to wrap.
"""

from __future__ import annotations

import weakref

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from accel.backends.base import Backend, register_backend
from accel.backends.recipe import apply_activation_checkpointing
from accel.kwargs import DistributedDataParallelKwargs, find_handler


@register_backend("ddp")
class DDPBackend(Backend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._wrapped: list[weakref.ref] = []
        self.state.add_release_callback(self.release)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        if device_placement:
            model = model.to(self.state.device)
        if not isinstance(model, DDP):
            apply_activation_checkpointing(model, self.parallelism)
        if self.data_parallel_size == 1 or isinstance(model, DDP):
            return model
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (e.g. a frozen evaluation model); DDP would refuse it
        handler = find_handler(self.kwargs_handlers, DistributedDataParallelKwargs) or DistributedDataParallelKwargs()
        options = handler.to_kwargs()
        comm_hook, comm_state = options.pop("comm_hook", None), options.pop("comm_state", None)
        device_ids = [self.state.device.index] if self.state.device.type == "cuda" else None
        wrapped = DDP(model, device_ids=device_ids, process_group=self.topology.group("dp", self.state.device.type),
                      **options)
        if comm_hook is not None:
            wrapped.register_comm_hook(comm_state, comm_hook)
        self._wrapped.append(weakref.ref(wrapped))
        return wrapped

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DDP) else model

    def no_sync(self, model: torch.nn.Module):
        return model.no_sync() if isinstance(model, DDP) else super().no_sync(model)

    def release(self) -> None:
        release_ddp([ref() for ref in self._wrapped])
        self._wrapped.clear()


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
