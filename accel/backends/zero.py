"""ZeRO on PyTorch's own sharding: stage 1 with `ZeroRedundancyOptimizer` (+ DDP for gradients), stages 2
and 3 with FSDP2 (`fully_shard`, `reshard_after_forward` False/True), applied per block, then to the root.

What each rank keeps (fp32 AdamW, N ranks): stage 1 shards the optimizer state, stage 2 also the gradients
(and, with FSDP2, the parameters between steps), stage 3 also the parameters during forward/backward.
Offload (`offload_params`/`offload_optimizer`) keeps parameters, gradients and the optimizer step on the CPU
(FSDP2's `CPUOffloadPolicy`).

The model's side is the recipe's (spmd.py, recipe.py); what this backend adds is ZeRO-1's optimizer and its
checkpoints.
"""

from __future__ import annotations

import torch

from accel.backends.base import refuse_stepped_optimizer, register_backend
from accel.backends.spmd import SpmdBackend


@register_backend("zero")
class ZeroBackend(SpmdBackend):
    @property
    def optimizer_dim(self) -> str:
        """The ranks ZeRO-1's optimizer shards its state over: the gradient ranks (dp, or dp_cp), or with expert
        parallelism the expert's replicas (edp: the ranks holding the same experts, which step them alike; the
        other parameters' state is then sharded over them too, not over all of dp)."""
        return "edp" if self.topology.ep_size > 1 else self.topology.gradient_dim

    @property
    def sharded(self) -> bool:
        """Whether there is anything to shard with (one process keeps everything)."""
        return self.topology.sizes[self.optimizer_dim] > 1

    # -- optimizer --------------------------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> torch.optim.Optimizer:
        refuse_stepped_optimizer(optimizer, "ZeRO")
        if self.parallelism.zero_stage == 1 and self.sharded:
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
            # With experts: on the first rank of each expert's replicas (one per ep rank), its stacked experts'
            # state given as DTensors over (edp, ep), as under DDP, so each ep rank's rows are written once.
            if hasattr(optimizer, "_default_device"):  # torch's device for the consolidation's broadcasts: its
                optimizer._default_device = self.state.device  # parameters' at construction, the CPU when the
                # optimizer was prepared before the model (NCCL would refuse the CPU tensors)
            optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]  # (_is_zero_redundancy)
            experts = self.topology.ep_size > 1
            if self.topology.coordinates(self.state.process_index)["edp"] if experts else self.data_parallel_rank:
                return {}
            state = _keyed_by_name(optimizer.state_dict(), self._parameter_order(model, optimizer))
            return self._expert_dtensors(model, state) if experts else state
        return super().checkpoint_optimizer_state(model, optimizer)

    def load_checkpoint_optimizer_state(self, model, optimizer, state: dict) -> None:
        if _is_zero_redundancy(optimizer):
            if self.topology.ep_size > 1:
                state = self._held_experts(model, optimizer, self._expert_rows(model, state))
            optimizer.load_state_dict(_keyed_by_index(state, self._parameter_order(model, optimizer)))  # keeps
            return  # this rank's partition
        super().load_checkpoint_optimizer_state(model, optimizer, state)

    def _held_experts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """A ModuleList's experts exist on the ep rank holding them: only their state is this rank's, and each
        parameter group lists this rank's parameters (the saved groups may be another ep rank's)."""
        layout = self._expert_layout(model)
        if not layout or not layout.listed or not isinstance(state.get("param_groups"), list):
            return state
        names = {id(p): n for n, p in self.unwrap_model(model).named_parameters()}
        live = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        return {**state, "state": {k: v for k, v in state["state"].items() if k in layout.held},
                "param_groups": [{**g, "params": mine} for g, mine in zip(state["param_groups"], live, strict=True)]}

    def _expert_rows(self, model: torch.nn.Module, state: dict) -> dict:
        """This ep rank's rows of each stacked expert's optimizer state: read into a DTensor (the rank that wrote
        it) or whole [E, ...] (the expert's other replicas, which wrote nothing)."""
        layout = self._expert_layout(model)
        if not layout or not isinstance(state.get("state"), dict):
            return state
        ep, rank = self.topology.ep_size, self.topology.coordinates(self.state.process_index)["ep"]

        def rows(key: str, value):
            if hasattr(value, "to_local"):
                return value.to_local()
            local = layout.params[key].shape[0]
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == local * ep:
                return value[rank * local:(rank + 1) * local]
            return value

        return {**state, "state": {k: {n: rows(k, v) for n, v in entry.items()} if k in layout.params else entry
                                   for k, entry in state["state"].items()}}

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
