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
from accel.backends.base import (
    Backend,
    ParameterReplacements,
    quiet_logger,
    refuse_stepped_optimizer,
    register_backend,
)
from accel.backends.ddp import apply_ddp, ddp_pipeline_stages, release_ddp
from accel.backends.recipe import Recipe, fsdp_no_sync, parallelize
from accel.config.kwargs import DistributedDataParallelKwargs, find_handler
from accel.config.errors import ConfigError


def guard_save_pretrained(model: torch.nn.Module, why: str) -> None:
    """A transformers model accel split holds only this process's part: its `save_pretrained` without a state_dict
    would write that part as the model (ep's local experts: a checkpoint that does not load) or fail deep in
    safetensors (DTensors). It is refused in one line that says what to pass instead."""
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
        self.experts: list = []  # expert parallelism: one ExpertLayout per prepared MoE model (expert.py)
        self._expert_no_sync = 0  # inside no_sync: expert gradients accumulate unreduced too

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
        return {**self.__dict__, "_wrapped": [], "_sequence": None, "experts": []}

    @property
    def holds_part_of_model(self) -> bool:  # type: ignore[override]  # Backend's class attribute, computed here
        """A MoE layer's ModuleList experts exist only on the ep rank holding them: checkpoints merge the ranks'
        tensors as for pipeline stages (stacked experts are DTensors: every rank has every name)."""
        return any(layout.listed for layout in self.experts)

    def held_names(self, for_optimizer: bool = False) -> set[str] | None:
        if not self.holds_part_of_model:
            return None
        return {name for layout in self.experts for name in layout.held}

    @property
    def replicated_state(self) -> bool:  # type: ignore[override]  # Backend's class attribute, computed here
        """DDP (or one process) without ZeRO-1's sharded optimizer, TP, or experts split over ranks."""
        par = self.parallelism
        return (self.data_parallel != "fsdp" and par.zero_stage == 0 and par.tp_size == 1
                and not self.experts)

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
        if self.topology.ep_size > 1:
            self._shard_experts(model, recipe)
        prepared = parallelize(model, recipe)
        inner = self.unwrap_model(prepared)
        if self.sequence_parallel is not None:
            self.sequence_parallel.install(inner)
        if self.data_parallel == "fsdp" or self.parallelism.tp_size > 1:
            # sharded or split: once only (a DDP model is wrapped again)
            inner._accel_parallelized = True  # type: ignore[assignment]  # a plain attribute
        self.replacements.record(originals, inner)  # FSDP2 and TP give the model new (DTensor) parameters
        parts = [what for what, on in (("sharded by ZeRO 2/3", self.data_parallel == "fsdp"),
                                       ("split by tensor parallelism", self.parallelism.tp_size > 1),
                                       ("its experts divided among processes", self.topology.ep_size > 1)) if on]
        if parts:
            guard_save_pretrained(inner, ", ".join(parts))
        return prepared

    def _shard_experts(self, model: torch.nn.Module, recipe: Recipe) -> None:
        """Divide the MoE layers' experts among the ep ranks (expert.py). DDP leaves them alone (their gradients are
        reduced over the expert's replicas in `backward`); with FSDP2 they (stacked ones, each expert of a ModuleList)
        are sharded again over those replicas (`shard_over_replicas`)."""
        from accel.backends.expert import expert_names, shard_experts, shard_over_replicas

        device_type = self.state.device.type
        rank = self.topology.coordinates(self.state.process_index)["ep"]
        layout = shard_experts(model, self.topology.ep_size, rank, self.topology.group("ep", device_type))
        self.topology.group("edp", device_type)  # every rank builds the expert mesh's groups now, together
        layout.held = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
            {n for n, _ in model.named_buffers()}
        self.experts.append(layout)
        model._accel_experts = layout  # type: ignore[assignment]  # a plain attribute: the model's own layout
        if recipe.tp_plan is not None and layout.lists:  # ModuleList experts stay whole on every tp rank
            recipe.tp_plan = {name: style for name, style in recipe.tp_plan.items()
                              if not any(name == owner or name.startswith(f"{owner}.") for owner in layout.lists)}
        if self.data_parallel == "fsdp":  # experts (stacked, or each of a ModuleList) sharded over their replicas
            recipe.fsdp_first = functools.partial(shard_over_replicas, layout, self.topology.expert_mesh(device_type),
                                                  self.topology.expert_divisor, device=self.state.device)
        elif self.data_parallel == "ddp":
            DDP._set_params_and_buffers_to_ignore_for_model(model, sorted(expert_names(layout)))

    def _expert_layout(self, model: torch.nn.Module):
        return getattr(self.unwrap_model(model), "_accel_experts", None)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """With experts: their gradients are reduced after a synced backward, as DDP reduces the others. Only what
        is not reduced yet is: gradients a previous synced backward of this step reduced are set aside meanwhile
        (two backward calls per step, as DDP allows), those accumulated under no_sync are reduced with the new."""
        if not self.experts:
            return super().backward(loss, **kwargs)
        with self._reducing_experts(sync=not self._expert_no_sync):
            loss.backward(**kwargs)

    @contextlib.contextmanager
    def _reducing_experts(self, sync: bool):
        """Around a backward: the expert gradients are reduced after it (when `sync`), over the edp group with the
        divisor of every other gradient; those a previous synced backward reduced are set aside meanwhile."""
        from accel.backends.expert import reduce_expert_gradients, set_aside

        aside = [set_aside(layout) for layout in self.experts if layout.reduced] if sync else []
        yield
        for layout in self.experts:
            layout.reduced = sync
        if sync:
            edp = self.topology.group("edp", self.state.device.type)
            for layout in self.experts:
                reduce_expert_gradients(layout, edp, self.topology.expert_divisor)
            for restore in aside:
                restore()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0,
                        foreach: bool | None = None) -> torch.Tensor:
        """With experts, each held by one ep rank: the norm of the others plus theirs summed over the ep group."""
        if not self.experts:
            return super().clip_grad_norm_(parameters, max_norm, norm_type, foreach)
        from accel.backends.base import clip_grads_with_norm, total_norm
        from accel.backends.expert import ExpertLayout, expert_norm_power

        parameters = list(parameters)
        expert_ids = {id(p) for layout in self.experts for p in (*layout.params.values(), *layout.listed.values())}
        held = [p for p in parameters if id(p) in expert_ids]
        others = total_norm([p.grad for p in parameters if p.grad is not None and id(p) not in expert_ids], norm_type,
                            self.state.device, foreach)
        mine = ExpertLayout(params={str(i): p for i, p in enumerate(held)})
        experts = expert_norm_power(mine, norm_type, self.topology.group("ep", self.state.device.type),
                                 self.state.device)
        experts = experts.to(others.device)
        if norm_type == float("inf"):
            total = torch.maximum(others, experts)
        else:
            total = (others ** norm_type + experts) ** (1.0 / norm_type)
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
            refuse_stepped_optimizer(optimizer, "ZeRO or tensor parallelism")
        self.replacements.track(optimizer)
        return optimizer

    # -- the step ---------------------------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module):
        if self.experts:
            return self._experts_no_sync(model)
        return self._no_sync(model)

    @contextlib.contextmanager
    def _experts_no_sync(self, model: torch.nn.Module):
        self._expert_no_sync += 1
        try:
            with self._no_sync(model):
                yield
        finally:
            self._expert_no_sync -= 1

    def _no_sync(self, model: torch.nn.Module):
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

    def pipeline_stages_step(self, stages: list, skip_sync: bool, split_backward: bool = False):
        if self.experts:
            return self._expert_pipeline_step(stages, skip_sync, split_backward)
        return ddp_pipeline_stages(stages, skip_sync, split_backward)

    @contextlib.contextmanager
    def _expert_pipeline_step(self, stages: list, skip_sync: bool, split_backward: bool):
        """A pipeline step whose stages hold experts (pp x ep): the step's backward runs inside the schedule, so the
        expert gradients FSDP2 leaves alone (all under DDP) are reduced here after it, over the stage's edp group,
        as `backward` does without stages (the schedule divides the loss by the micro-batches)."""
        with self._reducing_experts(sync=not skip_sync), ddp_pipeline_stages(stages, skip_sync, split_backward):
            yield

    # -- checkpoints ------------------------------------------------------------------------------------------
    # With experts, each ep rank holds different rows of a stacked expert parameter under the same name: the
    # training checkpoint gives them as DTensors sharded over ep (replicated over edp), so DCP writes each row once
    # with its place in the whole tensor; loading takes the local rows back.
    def _expert_dtensors(self, model: torch.nn.Module, state: dict) -> dict:
        layout = self._expert_layout(model)
        if not layout or not layout.params:
            return state
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = self.topology.expert_mesh(self.state.device.type)[("edp", "ep")]

        def wrap(value):
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                return DTensor.from_local(value, mesh, [Replicate(), Shard(0)], run_check=False)
            return value

        for key in layout.params:
            if key in state.get("state", state):
                holder = state["state"] if "state" in state else state
                entry = holder[key]
                holder[key] = {k: wrap(v) for k, v in entry.items()} if isinstance(entry, dict) else wrap(entry)
        return state

    @staticmethod
    def _local_experts(state: dict) -> dict:
        from torch.distributed.tensor import DTensor

        def unwrap(value):
            if isinstance(value, DTensor):
                return value.to_local()
            if isinstance(value, dict):
                return {k: unwrap(v) for k, v in value.items()}
            return value

        return unwrap(state)

    def checkpoint_model_state(self, model: torch.nn.Module) -> dict:
        return self._expert_dtensors(model, super().checkpoint_model_state(model))

    def checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return self._expert_dtensors(model, super().checkpoint_optimizer_state(model, optimizer))

    def load_checkpoint_model_state(self, model: torch.nn.Module, state: dict) -> None:
        layout = self._expert_layout(model)
        if layout:  # this rank's rows of stacked experts; only the ModuleList experts it holds
            state = {k: self._local_experts(v) if k in layout.params else v for k, v in state.items()
                     if not layout.listed or k in layout.held}
        super().load_checkpoint_model_state(model, state)

    def load_checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                        state: dict) -> None:
        layout = self._expert_layout(model)
        if layout and isinstance(state.get("state"), dict):
            mine = layout.held if layout.listed else None
            state = {**state, "state": {k: self._local_experts(v) if k in layout.params else v
                                        for k, v in state["state"].items() if mine is None or k in mine}}
            if mine is not None and isinstance(state.get("param_groups"), list):
                state["param_groups"] = [{**g, "params": [p for p in g["params"] if p in mine]}
                                         for g in state["param_groups"]]
        super().load_checkpoint_optimizer_state(model, optimizer, state)

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        layout = self._expert_layout(model)
        if self.data_parallel != "fsdp" and self.parallelism.tp_size == 1:
            state = super().full_state_dict(model)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            from accel.backends import fused

            # every rank takes part in the gathers; rank 0 receives the full tensors on the CPU. torch notes, once
            # per 2-D (FSDP x TP or ep) shard, that it gathers in two steps: right for a one-off save, so not shown
            with quiet_logger("torch.distributed.tensor._redistribute"):
                state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            state = fused.to_model_order(state, model)
        if layout:  # the experts whole, in the model's own names and layout (every rank gathers)
            from accel.backends.expert import gather_full

            state = gather_full(layout, state, self.topology.group("ep", self.state.device.type),
                                self.topology.ep_size)
        return state

    # -- lifetime ---------------------------------------------------------------------------------------------
    def forget(self) -> None:
        self.replacements.clear()
        self.experts.clear()

    def release(self) -> None:
        _release_wrapped(self._wrapped)
