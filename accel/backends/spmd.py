"""The backend of every layout in which each process runs the whole model (data parallelism, ZeRO, tensor
parallelism and their combinations): it decides the recipe once from the config and the topology, and
`recipe.parallelize` applies it. ZeRO-1's optimizer is the only behaviour a subclass adds (zero.py)."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from accel.backends import backend_name_for
from accel.backends.base import Backend, ParameterReplacements, refuse_stepped_optimizer, register_backend
from accel.backends.ddp import apply_ddp, ddp_pipeline_stages, release_ddp
from accel.backends.recipe import Recipe, fsdp_no_sync, parallelize
from accel.config.kwargs import DistributedDataParallelKwargs, find_handler


def _release_wrapped(wrapped: list[weakref.ref]) -> None:
    """Drop the reducers of the DDP wrappers in `wrapped` that are still alive, then forget them."""
    release_ddp([ref() for ref in wrapped])
    wrapped.clear()


def data_parallel_kind(parallelism, topology) -> str | None:
    """How the data-parallel ranks are run: FSDP2 when gradients (ZeRO 2/3) or split DTensor parameters (TP) are
    sharded, since DDP does not take DTensors, over the topology's dp_shard (x dp_replicate: HSDP) ranks; DDP
    when parameters stay whole (zero_stage 0/1, dp_shard_size 1); None alone."""
    if topology.dp_size * topology.seq_size <= 1:  # the sequence ranks reduce gradients like data-parallel ones
        return None
    sharded = topology.dp_shard_size > 1 or parallelism.zero_stage >= 2 or parallelism.tp_size > 1
    return "fsdp" if sharded else "ddp"


@register_backend("ddp")
@register_backend("tensor")
class SpmdBackend(Backend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        par = self.parallelism
        self.name = backend_name_for(par)
        self.data_parallel = data_parallel_kind(par, self.topology)
        self.offload = bool(par.offload_params or par.offload_optimizer) and self.data_parallel == "fsdp"
        self.fixed_plan: dict[str, str] | None = None  # plan_whole_model's, for a pipeline's stages
        self.fixed_float8_layers: set[str] | None = None  # likewise
        self.applied_plans: list[dict[str, str]] = []
        self.replacements = ParameterReplacements()
        self._wrapped: list[weakref.ref] = []
        # DDP reducers go before the process group does; the state holds only the list of weak references, so an
        # Accelerator that is dropped is freed with its backend (and its gradient state)
        self.state.add_release_callback(functools.partial(_release_wrapped, self._wrapped))
        self._sequence = None  # the sequence group (sequence_parallel), built on first use by every rank

    @property
    def sequence_parallel(self):
        """The sp/cp group's attention, batch cut and loss (None without a sequence degree)."""
        if self._sequence is None and self.topology.seq_size > 1:
            from accel.backends.sequence import SequenceParallel

            self._sequence = SequenceParallel(self.topology, self.state, self.parallelism)
        return self._sequence

    @property
    def batch_transform(self):
        sequence = self.sequence_parallel
        return None if sequence is None else sequence.cut_batch

    def finish_loss(self, loss: torch.Tensor, target) -> torch.Tensor:
        sequence = self.sequence_parallel
        if sequence is None:
            return loss
        from accel.backends.sequence_layout import IGNORE_INDEX

        counted = isinstance(target, torch.Tensor) and not target.is_floating_point()
        return sequence.reduce_loss(loss, (target != IGNORE_INDEX).sum() if counted else None)

    def __getstate__(self) -> dict:
        """A pickled copy (Accelerate's scripts pickle the Accelerator) owns no DDP wrappers to release, nor process
        groups."""
        return {**self.__dict__, "_wrapped": [], "_sequence": None}

    @property
    def partial_gradients(self) -> bool:  # type: ignore[override]  # Backend's class attribute, computed here
        """FSDP2 shards the gradients: each rank sees only its shard."""
        return self.data_parallel == "fsdp"

    @property
    def splits_parameters(self) -> bool:
        """Whether prepare replaces the model's parameters (sharded or split): the optimizer must not have stepped."""
        return self.parallelism.zero_stage > 0 or self.parallelism.tp_size > 1

    # -- model ------------------------------------------------------------------------------------------------
    def plan_whole_model(self, model: torch.nn.Module) -> None:
        """TP's plan (checked for ties and divisibility, and printed) and the float8 layers are chosen on the whole
        model, then applied stage by stage."""
        if self.parallelism.tp_size > 1:
            self.fixed_plan = self._plan(model)
        if self.precision.float8 is not None:
            from accel.runtime.float8 import float8_layers

            self.fixed_float8_layers = float8_layers(model, self.precision.float8)

    def _plan(self, model: torch.nn.Module) -> dict[str, str]:
        from accel.backends.tensor import plan_for

        return plan_for(model, self.parallelism, self.topology.tp_size, self.state.is_main_process)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        if isinstance(model, DDP) or "_accel_parallelized" in model.__dict__:
            return model  # prepared before
        device_type = self.state.device.type
        recipe = Recipe(self.parallelism, self.precision, self.state.device, device_placement=device_placement,
                        offload=self.offload, data_parallel=self.data_parallel, compile=self.compile_options,
                        dp_mesh=self.topology.fsdp_mesh(device_type) if self.data_parallel == "fsdp" else None,
                        wrap_ddp=self._wrap_ddp, float8_layers=self.fixed_float8_layers)
        if self.parallelism.tp_size > 1:
            from accel.backends.tensor import held_part

            recipe.tp_mesh = self.topology.submesh("tp", device_type)
            recipe.tp_plan = self._plan(model) if self.fixed_plan is None else held_part(self.fixed_plan, model)
            self.applied_plans.append(recipe.tp_plan)
        originals = self.replacements.snapshot(model)
        prepared = parallelize(model, recipe)
        inner = self.unwrap_model(prepared)
        if self.sequence_parallel is not None:
            self.sequence_parallel.install(inner)
        if self.data_parallel == "fsdp" or self.parallelism.tp_size > 1:
            # sharded or split: once only (a DDP model is wrapped again)
            inner._accel_parallelized = True  # type: ignore[assignment]  # a plain attribute
        self.replacements.record(originals, inner)  # FSDP2 and TP give the model new (DTensor) parameters
        return prepared

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        handler = find_handler(self.kwargs_handlers, DistributedDataParallelKwargs)
        wrapped = apply_ddp(model, self.topology.group(self.topology.gradient_dim, self.state.device.type),
                            self.state.device, handler)
        if wrapped is not model:
            self._wrapped.append(weakref.ref(wrapped))
        return wrapped

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DDP) else model

    # -- optimizer --------------------------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> torch.optim.Optimizer:
        if self.splits_parameters:
            refuse_stepped_optimizer(optimizer, "ZeRO or tensor parallelism")
        self.replacements.track(optimizer)
        return optimizer

    # -- the step ---------------------------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module):
        if isinstance(model, DDP):
            return model.no_sync()
        if hasattr(model, "set_requires_gradient_sync"):
            return fsdp_no_sync(model)
        return super().no_sync(model)

    def join(self, joinables: list):
        """torch's `Join`: ranks that ran out of batches shadow the others' DDP all-reduces (also on gloo)."""
        if self.data_parallel == "ddp" and joinables and all(isinstance(j, DDP) for j in joinables):
            from torch.distributed.algorithms.join import Join

            return Join(joinables)
        return super().join(joinables)

    @contextlib.contextmanager
    def sync_in_backward(self, model: torch.nn.Module):
        if isinstance(model, DDP):
            saved = model.require_backward_grad_sync, model.require_forward_param_sync
            model.require_backward_grad_sync = model.require_forward_param_sync = True
            model.reducer.prepare_for_backward([])  # arm the reducer as a synced forward would have
            try:
                yield
            finally:
                model.require_backward_grad_sync, model.require_forward_param_sync = saved
        elif hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(True)  # type: ignore[operator]  # FSDP2's method (hasattr above)
            yield
        else:
            yield

    def pipeline_stages_step(self, stages: list, skip_sync: bool):
        return ddp_pipeline_stages(stages, skip_sync)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def full_state_dict(self, model: torch.nn.Module) -> dict:
        if self.data_parallel != "fsdp" and self.parallelism.tp_size == 1:
            return super().full_state_dict(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from accel.backends import fused

        # every rank takes part in the gathers; rank 0 receives the full tensors on the CPU
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return fused.to_model_order(state, model)

    # -- lifetime ---------------------------------------------------------------------------------------------
    def forget(self) -> None:
        self.replacements.clear()

    def release(self) -> None:
        _release_wrapped(self._wrapped)
