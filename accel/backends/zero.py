"""ZeRO on PyTorch's own sharding: stage 1 with `ZeroRedundancyOptimizer` (+ DDP for gradients), stages 2
and 3 with FSDP2 (`fully_shard`, `reshard_after_forward` False/True), applied per block, then to the root.

What each rank keeps (fp32 AdamW, N ranks): stage 1 shards the optimizer state, stage 2 also the gradients
(and, with FSDP2, the parameters between steps), stage 3 also the parameters during forward/backward.
Offload (`offload_params`/`offload_optimizer`) keeps parameters, gradients and the optimizer step on the CPU
(FSDP2's `CPUOffloadPolicy`).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from accel.backends.base import Backend, ParameterReplacements, refuse_stepped_optimizer, register_backend
from accel.backends.ddp import DDPBackend
from accel.backends.recipe import apply_activation_checkpointing, apply_fsdp, fsdp_no_sync, materialize


@register_backend("zero")
class ZeroBackend(Backend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        par = self.parallelism
        self.stage = par.zero_stage
        self.offload = par.offload_params or par.offload_optimizer
        self.replacements = ParameterReplacements()
        self._ddp = DDPBackend(*args, **kwargs) if self.stage == 1 else None  # stage 1 wraps the model in DDP

    @property
    def partial_gradients(self) -> bool:
        """Stages 2/3 shard the gradients: each rank sees only its shard."""
        return self.stage >= 2 and self.sharded

    @property
    def sharded(self) -> bool:
        """Whether parameters are really sharded (one process has nothing to shard with)."""
        return self.data_parallel_size > 1

    # -- model ------------------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        on_meta = any(p.is_meta for p in model.parameters())
        if device_placement and not on_meta and not self.offload:
            model = model.to(self.state.device)
        apply_activation_checkpointing(model, self.parallelism)
        if not self.sharded:
            if on_meta:
                materialize(model, self.state.device)
            return model
        if self.stage == 1:  # parameters stay whole: materialize, then plain DDP all-reduce for the gradients
            if on_meta:
                materialize(model, self.state.device)
            return self._ddp.prepare_model(model, device_placement=False)
        return self._fully_shard(model, on_meta)

    def _fully_shard(self, model: torch.nn.Module, on_meta: bool) -> torch.nn.Module:
        originals = self.replacements.snapshot(model)
        mesh = self.topology.mesh(self.state.device.type)["dp"] if self.topology.degrees["dp"] > 1 else None
        apply_fsdp(model, mesh, self.parallelism, self.precision, offload=self.offload,
                   pin_memory=self.state.device.type == "cuda")
        if on_meta:
            materialize(model, "cpu" if self.offload else self.state.device)
        self.replacements.record(originals, model)
        return model

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DDP) else model

    def forget(self) -> None:
        self.replacements.clear()

    # -- optimizer --------------------------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> torch.optim.Optimizer:
        refuse_stepped_optimizer(optimizer, "ZeRO")
        if not self.sharded:
            return optimizer
        if self.stage == 1:
            return self._zero_redundancy(optimizer)
        self.replacements.track(optimizer)
        return optimizer

    def _zero_redundancy(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        import inspect

        from torch.distributed.optim import ZeroRedundancyOptimizer

        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}  # e.g. AdamW lacks one of Adam's
        groups = [dict(group) for group in optimizer.param_groups]
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                       process_group=self.topology.group("dp", self.state.device.type), **defaults)

    # -- the step ---------------------------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module):
        if isinstance(model, DDP):
            return model.no_sync()
        if hasattr(model, "set_requires_gradient_sync"):
            return fsdp_no_sync(model)
        return super().no_sync(model)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            # Consolidated on the first data-parallel rank (of each pipeline stage), which writes it, keyed by
            # parameter name like every other backend's (so stages do not collide and other backends load it).
            optimizer.consolidate_state_dict(to=0)
            if self.data_parallel_rank:
                return {}
            return _keyed_by_name(optimizer.state_dict(), self._parameter_order(model, optimizer))
        return super().checkpoint_optimizer_state(model, optimizer)

    def load_checkpoint_optimizer_state(self, model, optimizer, state: dict) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.load_state_dict(_keyed_by_index(state, self._parameter_order(model, optimizer)))  # keeps
            return  # this rank's partition
        super().load_checkpoint_optimizer_state(model, optimizer, state)

    def _parameter_order(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """The names of the optimizer's parameters in its index order (ZeroRedundancyOptimizer's state keys)."""
        names = {id(p): n for n, p in self.unwrap_model(model).named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        if self.stage < 2 or not self.sharded:
            return super().full_state_dict(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # every rank takes part in the gathers; rank 0 receives the full tensors on the CPU
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _keyed_by_name(state: dict, order: list[str]) -> dict:
    return {"state": {order[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}


def _keyed_by_index(state: dict, order: list[str]) -> dict:
    """A name-keyed optimizer state (any backend's checkpoint) in ZeroRedundancyOptimizer's index keys."""
    index = {name: i for i, name in enumerate(order)}
    return {"state": {index[n]: v for n, v in state["state"].items() if n in index},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}
