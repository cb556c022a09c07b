"""ZeRO on PyTorch's own sharding: stage 1 with `ZeroRedundancyOptimizer` (+ DDP for gradients), stages 2
and 3 with FSDP2 (`fully_shard`, `reshard_after_forward` False/True), applied per block, then to the root.

What each rank keeps (fp32 AdamW, N ranks): stage 1 shards the optimizer state, stage 2 also the gradients
(and, with FSDP2, the parameters between steps), stage 3 also the parameters during forward/backward.
Offload (`offload_params`/`offload_optimizer`) keeps parameters, gradients and the optimizer step on the CPU
(FSDP2's `CPUOffloadPolicy`).

The model's side is the recipe's (spmd.py, recipe.py); what this backend adds is ZeRO-1's optimizer and its
checkpoints. Which stage runs is the data-parallel plan's (accel/parallel/data_parallel.py).
"""

from __future__ import annotations

import torch

from accel.backends.base import refuse_stepped_optimizer, register_backend
from accel.backends.spmd import SpmdBackend


@register_backend("zero")
class ZeroBackend(SpmdBackend):
    @property
    def replica_dim(self) -> str | None:
        """The ranks holding the same copy of a part's parameters, when a part has fewer of them than the gradient
        ranks (they step those parameters alike)."""
        return next((part.replica_dim for part in self.parts if part.replica_dim), None)

    @property
    def optimizer_dim(self) -> str:
        """The ranks ZeRO-1's optimizer shards its state over: the gradient ranks (dp, or dp_cp), or a part's
        replicas (`replica_dim`: the other parameters' state is then sharded over them too, not over all of dp)."""
        return self.replica_dim or self.topology.gradient_dim

    @property
    def sharded(self) -> bool:
        """Whether there is anything to shard with (one process keeps everything)."""
        return self.topology.sizes[self.optimizer_dim] > 1

    # -- optimizer --------------------------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> torch.optim.Optimizer:
        refuse_stepped_optimizer(optimizer, "ZeRO")
        if self.data_parallel.kind == "zero1" and self.sharded:
            return self._zero_redundancy(optimizer)
        return super().prepare_optimizer(optimizer, models)

    def _zero_redundancy(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        import inspect

        from torch.distributed.optim import ZeroRedundancyOptimizer

        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # e.g. AdamW lacks one of Adam's
        self.replacements.repoint(optimizer)  # a meta-device model's parameters -> the allocated ones
        groups = [dict(group) for group in optimizer.param_groups]
        group = self.topology.group(self.optimizer_dim, self.state.device.type)
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=group, **defaults)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if _is_zero_redundancy(optimizer):
            # Consolidated on the first data-parallel rank (of each pipeline stage), which writes it, keyed by
            # parameter name like every other backend's (so stages do not collide and other backends load it).
            # With a part's replicas: on the first rank of each (the parts place its tensors in the whole, as under
            # DDP, so each is written once).
            if hasattr(optimizer, "_default_device"):  # torch's device for the consolidation's broadcasts: its
                optimizer._default_device = self.state.device  # parameters' at construction, the CPU when the
                # optimizer was prepared before the model (NCCL would refuse the CPU tensors)
            optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # (_is_zero_redundancy)
            replicas = self.replica_dim
            if self.topology.coordinates(self.state.process_index)[replicas] if replicas else self.data_parallel_rank:
                return {}
            state = _keyed_by_name(optimizer.state_dict(), self._parameter_order(model, optimizer))
            return self._with_parts(model, state)
        return super().checkpoint_optimizer_state(model, optimizer)

    def load_checkpoint_optimizer_state(self, model, optimizer, state: dict) -> None:
        if _is_zero_redundancy(optimizer):
            inner = self.unwrap_model(model)
            for part in self.parts:
                state = part.load_consolidated_optimizer_state(inner, optimizer, state)
            optimizer.load_state_dict(_keyed_by_index(state, self._parameter_order(model, optimizer)))  # keeps
            return  # this rank's partition
        super().load_checkpoint_optimizer_state(model, optimizer, state)

    def _parameter_order(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """The names of the optimizer's parameters in its index order (ZeroRedundancyOptimizer's state keys)."""
        names = {id(p): n for n, p in self.unwrap_model(model).named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _keyed_by_name(state: dict, order: list[str]) -> dict:
    return {"state": {order[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}


def _keyed_by_index(state: dict, order: list[str]) -> dict:
    """A name-keyed optimizer state (any backend's checkpoint) in ZeroRedundancyOptimizer's index keys."""
    index = {name: i for i, name in enumerate(order)}
    return {"state": {index[n]: v for n, v in state["state"].items() if n in index},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def _is_zero_redundancy(optimizer) -> bool:
    """Whether `optimizer` is torch's ZeroRedundancyOptimizer, without importing torch.distributed.optim (0.2-0.6 s
    at the first save of every ZeRO-2/3 run, measured by bench_checkpoint.py): an instance exists only once the module
    is loaded."""
    import sys

    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)
