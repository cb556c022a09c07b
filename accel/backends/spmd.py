"""The step owner of every layout in which each process runs the whole model (data parallelism, ZeRO, and the
parallel dimensions composed with them): it builds the recipe from the data-parallel plan and the run's parts,
`recipe.parallelize` applies it, and every moment of the step calls the parts in order. ZeRO-1's optimizer is the
only behaviour a subclass adds (zero.py)."""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from accel.backends.base import Backend, ParameterReplacements, refuse_stepped_optimizer, register_backend
from accel.backends.ddp import apply_ddp, ddp_pipeline_stages, release_ddp
from accel.backends.recipe import Recipe, fsdp_no_sync, parallelize
from accel.config.errors import ConfigError
from accel.config.kwargs import DistributedDataParallelKwargs, find_handler
from accel.parallel.data_parallel import DataParallelPlan
from accel.parallel.gradients import clip_grads_with_norm, quiet_logger, total_norm
from accel.parallel.part import around_backward, norm_claims, norm_shares, with_shares
from accel.parallel.parts import build_parts


def guard_save_pretrained(model: torch.nn.Module, why: str) -> None:
    """A transformers model accel split holds only this process's part: its `save_pretrained` without a state_dict
    would write that part as the model (a checkpoint that does not load) or fail deep in safetensors (DTensors).
    It is refused in one line that says what to pass instead."""
    original = getattr(model, "save_pretrained", None)
    if original is None or "save_pretrained" in model.__dict__:
        return

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        if state_dict is None:
            raise ConfigError(f"{type(model).__name__}.save_pretrained: this process holds only its part of the "
                              f"model ({why}); allowed: state_dict=accelerator.get_state_dict(model), called on "
                              "every process, or accelerator.save_model(model, directory); with transformers' "
                              "Trainer, zero_stage 2 or 3 (it then gathers the weights itself)")
        return original(save_directory, *args, state_dict=state_dict, **kwargs)

    setattr(model, "save_pretrained", save_pretrained)  # noqa: B010 (an instance attribute: mypy sees a Module)


def _release_wrapped(wrapped: list[weakref.ref]) -> None:
    """Drop the reducers of the DDP wrappers in `wrapped` that are still alive, then forget them."""
    release_ddp([ref() for ref in wrapped])
    wrapped.clear()


@register_backend("spmd")
class SpmdBackend(Backend):
    """Each process runs the whole model: DDP, FSDP2/HSDP or one data-parallel rank (the data-parallel plan), with
    the run's parallel dimensions as parts, called in order at every moment of the step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.data_parallel = DataParallelPlan.decide(self.parallelism, self.topology, self.config.fault_tolerance,
                                                     self.precision)
        self.parts = build_parts(self.topology, self.state, self.parallelism, self.data_parallel)
        self.fixed_float8_layers: set[str] | None = None  # plan_whole_model's, for a pipeline's stages
        self.replacements = ParameterReplacements()
        self._wrapped: list[weakref.ref] = []
        # DDP reducers go before the process group does; the state holds only the list of weak references, so an
        # Accelerator that is dropped is freed with its backend (and its gradient state)
        self.state.add_release_callback(functools.partial(_release_wrapped, self._wrapped))
        self._no_sync_depth = 0  # inside no_sync: gradients the parts reduce themselves accumulate unreduced too

    def __getstate__(self) -> dict:
        """A pickled copy (Accelerate's scripts pickle the Accelerator) owns no DDP wrappers to release, nor process
        groups (each part drops its own)."""
        return {**self.__dict__, "_wrapped": []}

    @property
    def holds_part_of_model(self) -> bool:  # type: ignore[override]  # Backend's class attribute, computed here
        """Whether a part leaves some of the model's tensors on some ranks only: checkpoints then merge the ranks'
        tensors as for pipeline stages."""
        return any(part.held_names() is not None for part in self.parts)

    def held_names(self, for_optimizer: bool = False) -> set[str] | None:
        held = [names for names in (part.held_names() for part in self.parts) if names is not None]
        return set().union(*held) if held else None

    @property
    def replicated_state(self) -> bool:  # type: ignore[override]  # Backend's class attribute, computed here
        """DDP (or one process) without ZeRO, and no part that splits the state over ranks."""
        return self.data_parallel.replicated and not any(part.splits_state for part in self.parts)

    @property
    def partial_gradients(self) -> bool:  # type: ignore[override]  # Backend's class attribute, computed here
        """FSDP2 shards the gradients: each rank sees only its shard."""
        return self.data_parallel.fsdp

    @property
    def splits_parameters(self) -> bool:
        """Whether prepare replaces the model's parameters (sharded or split): the optimizer must not have stepped."""
        return self.data_parallel.shards_parameters or any(part.replaces_parameters for part in self.parts)

    # -- model ------------------------------------------------------------------------------------------------
    def plan_whole_model(self, model: torch.nn.Module) -> None:
        """What the parts decide on the whole model (e.g. a split plan, checked and printed once) and the float8
        layers are chosen before a pipeline cuts it, then applied stage by stage."""
        for part in self.parts:
            part.plan_whole_model(model)
        if self.precision.float8 is not None:
            from accel.runtime.float8 import float8_layers

            self.fixed_float8_layers = float8_layers(model, self.precision.float8)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        if isinstance(model, DDP) or "_accel_parallelized" in model.__dict__:
            return model  # prepared before
        mesh = self.data_parallel.fsdp_mesh(self.topology, self.state) if self.data_parallel.fsdp else None
        recipe = Recipe(self.parallelism, self.precision, self.state.device, device_placement=device_placement,
                        data_parallel=self.data_parallel, compile=self.compile_options, dp_mesh=mesh,
                        wrap_ddp=self._wrap_ddp, float8_layers=self.fixed_float8_layers, parts=self.parts)
        originals = self.replacements.snapshot(model)
        for part in self.parts:
            part.prepare(model, recipe)
        prepared = parallelize(model, recipe)
        inner = self.unwrap_model(prepared)
        for part in self.parts:
            part.install(inner)
        if self.data_parallel.fsdp or any(part.replaces_parameters for part in self.parts):
            # sharded or split: once only (a DDP model is wrapped again)
            inner._accel_parallelized = True  # type: ignore[assignment]  # a plain attribute
        self.replacements.record(originals, inner)  # FSDP2 and the parts give the model new (DTensor) parameters
        notes = ["sharded by ZeRO 2/3"] if self.data_parallel.fsdp else []
        notes += [part.save_pretrained_note for part in self.parts if part.save_pretrained_note]
        if notes:
            guard_save_pretrained(inner, ", ".join(notes))
        return prepared

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Each part may reduce gradients it owns after a synced backward, as DDP reduces the others (outside
        no_sync: see `no_sync`)."""
        if not self.parts:
            return super().backward(loss, **kwargs)
        with around_backward(self.parts, sync=not self._no_sync_depth):
            loss.backward(**kwargs)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0,
                        foreach: bool | None = None) -> torch.Tensor:
        """The norm of the gradients no part claims, combined with each part's share (its gradients over every
        rank holding them)."""
        claimed = norm_claims(self.parts)
        if not claimed:
            return super().clip_grad_norm_(parameters, max_norm, norm_type, foreach)
        parameters = list(parameters)
        others = total_norm([p.grad for p in parameters if p.grad is not None and id(p) not in claimed], norm_type,
                            self.state.device, foreach)
        total = with_shares(others, norm_shares(self.parts, parameters, norm_type), norm_type)
        clip_grads_with_norm(parameters, max_norm, total, foreach)
        return total

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
            splits = [part.title for part in self.parts if part.replaces_parameters]
            refuse_stepped_optimizer(optimizer, " or ".join(["ZeRO", *splits]))
        self.replacements.track(optimizer)
        return optimizer

    # -- the step ---------------------------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module):
        if self.parts:
            return self._counting_no_sync(model)
        return self._no_sync(model)

    @contextlib.contextmanager
    def _counting_no_sync(self, model: torch.nn.Module):
        self._no_sync_depth += 1
        try:
            with self._no_sync(model):
                yield
        finally:
            self._no_sync_depth -= 1

    def _no_sync(self, model: torch.nn.Module):
        if isinstance(model, DDP):
            return model.no_sync()
        if hasattr(model, "set_requires_gradient_sync"):
            return fsdp_no_sync(model)
        return super().no_sync(model)

    def join(self, joinables: list):
        """torch's `Join`: ranks that ran out of batches shadow the others' DDP all-reduces (also on gloo)."""
        if self.data_parallel.ddp and joinables and all(isinstance(j, DDP) for j in joinables):
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

    @contextlib.contextmanager
    def pipeline_stages_step(self, stages: list, skip_sync: bool, split_backward: bool = False):
        """A pipeline step (the step's backward runs inside the schedule): the parts reduce what they own after it,
        as `backward` does without stages (the schedule divides the loss by the micro-batches)."""
        with around_backward(self.parts, sync=not skip_sync), ddp_pipeline_stages(stages, skip_sync, split_backward):
            yield

    # -- checkpoints ------------------------------------------------------------------------------------------
    # Each part gives its rank's tensors their place in the whole (DTensors, so DCP writes each once) and takes its
    # rank's back at loading.
    def _with_parts(self, model: torch.nn.Module, state: dict) -> dict:
        inner = self.unwrap_model(model)
        for part in self.parts:
            state = part.checkpoint_state(inner, state)
        return state

    def checkpoint_model_state(self, model: torch.nn.Module) -> dict:
        return self._with_parts(model, super().checkpoint_model_state(model))

    def checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return self._with_parts(model, super().checkpoint_optimizer_state(model, optimizer))

    def load_checkpoint_model_state(self, model: torch.nn.Module, state: dict) -> None:
        inner = self.unwrap_model(model)
        for part in self.parts:
            state = part.load_model_state(inner, state)
        super().load_checkpoint_model_state(model, state)

    def load_checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                        state: dict) -> None:
        inner = self.unwrap_model(model)
        for part in self.parts:
            state = part.load_optimizer_state(inner, state)
        super().load_checkpoint_optimizer_state(model, optimizer, state)

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        if not self.data_parallel.fsdp and not any(part.replaces_parameters for part in self.parts):
            state = super().full_state_dict(model)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # every rank takes part in the gathers; rank 0 receives the full tensors on the CPU. torch notes, once
            # per 2-D shard, that it gathers in two steps: right for a one-off save, so not shown
            with quiet_logger("torch.distributed.tensor._redistribute"):
                state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        inner = self.unwrap_model(model)
        for part in self.parts:  # each part's tensors whole, in the model's own names and layout (every rank)
            state = part.full_state(inner, state)
        return state

    # -- lifetime ---------------------------------------------------------------------------------------------
    def forget(self) -> None:
        self.replacements.clear()
        for part in self.parts:
            part.forget()

    def release(self) -> None:
        _release_wrapped(self._wrapped)
