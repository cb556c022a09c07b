"""ZeRO on PyTorch's own sharding: stage 1 with `ZeroRedundancyOptimizer` (+ DDP for gradients), stages 2
and 3 with FSDP2 (`fully_shard`, `reshard_after_forward` False/True), applied per block, then to the root.

What each rank keeps (fp32 AdamW, N ranks): stage 1 shards the optimizer state, stage 2 also the gradients
(and, with FSDP2, the parameters between steps), stage 3 also the parameters during forward/backward.
Offload (`offload_params`/`offload_optimizer`) keeps parameters, gradients and the optimizer step on the CPU
(FSDP2's `CPUOffloadPolicy`).
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from accel.backends.base import Backend, ParameterReplacements, refuse_stepped_optimizer, register_backend
from accel.backends.ddp import DDPBackend
from accel.config import ConfigError

DEFAULT_MIN_PARAMS = 100_000_000  # submodules this large get their own shard group when nothing repeats


def wrap_targets(model: torch.nn.Module, class_names: Iterable[str] | None = None,
                 min_params: int = DEFAULT_MIN_PARAMS) -> list[torch.nn.Module]:
    """The submodules to shard one by one, outermost first: named classes if given, else the members of
    every `nn.ModuleList` (repeated blocks), else submodules with at least `min_params` parameters."""
    names = set(class_names or ())
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


@register_backend("zero")
class ZeroBackend(Backend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        par = self.parallelism
        self.stage = par.zero_stage
        self.offload = par.offload_params or par.offload_optimizer
        if self.offload and self.stage < 2:
            raise ConfigError(f"parallelism: offload_optimizer/offload_params need zero_stage 2 or 3 (FSDP2's CPU "
                              f"offload), got zero_stage={self.stage}; allowed: zero_stage 2 or 3 with offload")
        if self.stage >= 2 and self.sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.precision.use_scaler_class(ShardedGradScaler)  # each rank sees only its shard of the gradients
        self.replacements = ParameterReplacements()
        self._ddp = DDPBackend(*args, **kwargs) if self.stage == 1 else None  # stage 1 wraps the model in DDP

    @property
    def sharded(self) -> bool:
        """Whether parameters are really sharded (one process has nothing to shard with)."""
        return self.data_parallel_size > 1

    # -- model ------------------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        on_meta = any(p.is_meta for p in model.parameters())
        if device_placement and not on_meta and not self.offload:
            model = model.to(self.state.device)
        if not self.sharded:
            if on_meta:
                _materialize(model, self.state.device)
            return model
        if self.stage == 1:  # parameters stay whole: materialize, then plain DDP all-reduce for the gradients
            if on_meta:
                _materialize(model, self.state.device)
            return self._ddp.prepare_model(model, device_placement=False)
        return self._fully_shard(model, on_meta)

    def _fully_shard(self, model: torch.nn.Module, on_meta: bool) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        originals = self.replacements.snapshot(model)
        options = {
            "mesh": self.topology.mesh(self.state.device.type)["dp"] if self.topology.degrees["dp"] > 1 else None,
            "reshard_after_forward": self.stage == 3,
        }
        if self.precision.dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.precision.dtype, reduce_dtype=torch.float32)
        if self.offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.state.device.type == "cuda")
        classes = [c.strip() for c in (self.parallelism.zero_wrap_classes or "").split(",") if c.strip()]
        min_params = self.parallelism.zero_min_params or DEFAULT_MIN_PARAMS
        for block in reversed(wrap_targets(model, classes, min_params)):  # inner blocks before their parents
            fully_shard(block, **options)
        fully_shard(model, **options)
        if on_meta:
            _materialize(model, "cpu" if self.offload else self.state.device)
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
            return _fsdp_no_sync(model)
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


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _materialize(model: torch.nn.Module, device) -> None:
    """Allocate a meta-device model's (local shards of) parameters and initialise them with each
    submodule's `reset_parameters()`: a model larger than one process can be created this way."""
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
