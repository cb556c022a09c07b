"""Pipeline parallelism on `torch.distributed.pipelining`: the model is cut into consecutive stages (see
`pipeline_split.py`), each process holds one (or, for interleaved/looped/V schedules, several), and a batch is
cut into micro-batches that PyTorch's schedule (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`, ...)
runs through the stages with `PipelineStage` over the `pp` sub-mesh.

The loop changes in one line: the loss function is given to `prepare(..., loss_fn=...)` and
`loss = model(x, target=y)` runs the whole forward/backward schedule and returns the batch loss on every rank;
`accelerator.backward(loss)` is then a no-op. Without a target the model runs forward only and returns the
outputs on every rank (evaluation).

Combinations compose here, in one place: after cutting, each stage model is wrapped by the backend of the
remaining degrees (DDP, ZeRO or TP x FSDP2 over `dp`), which PipelineStage drives.

The V schedules (ZBVZeroBubble, DualPipeV) place two stages per process in V order (`stage_placement`), so the
first and last stages, and a weight tied between them, share rank 0; their evaluation runs a forward-only copy of
the schedule (`_strip_backward`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from accel.backends import SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, check_split_backward
from accel.backends.base import (
    Backend,
    ParameterReplacements,
    clip_grads_with_norm,
    loss_input,
    refuse_stepped_optimizer,
    register_backend,
    select_backend,
    total_norm,
)
from accel.backends.pipeline_split import StagePlan, balanced_split_points, check_split_points, run_stage, stage_model
from accel.backends.recipe import materialize
from accel.config import ConfigError
from accel.parallel.part import norm_claims, norm_shares, with_shares


class PipelineError(ValueError):
    """Misuse of a pipeline model (bad batch size, missing loss function...), as one line."""


def stage_placement(pp_size: int, num_stages: int, schedule: str = "1F1B") -> dict[int, int]:
    """stage index -> pp rank, as torch's schedules place them: looped ones stage s on rank s mod pp_size; the V
    ones (ZBVZeroBubble, DualPipeV: 2 stages per rank) go down the ranks and back up, so rank r holds stages r and
    2p-1-r (the first and the last stage, e.g. a tied embedding and head, are both on rank 0)."""
    if schedule in V_SCHEDULES:
        return {stage: stage if stage < pp_size else num_stages - 1 - stage for stage in range(num_stages)}
    return {stage: stage % pp_size for stage in range(num_stages)}


@register_backend("pipeline")
class PipelineBackend(Backend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        par = self.parallelism
        self.schedule = par.pp_schedule
        per_rank = par.pp_stages_per_rank or (1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2)
        self.pp_size = self.topology.pp_size
        check_split_backward(par, self.topology.dp_size)  # Accelerator() checked the config without the world size
        self.num_stages = self.pp_size * per_rank
        # unset: one per process (DualPipeV: one per stage, the fewest it runs with)
        self.microbatches = par.pp_microbatches or (self.num_stages if self.schedule == "DualPipeV" else self.pp_size)
        self.placement = stage_placement(self.pp_size, self.num_stages, self.schedule)
        self.pp_rank = self.topology.coordinates(self.state.process_index)["pp"]
        self.local_stages = [s for s in range(self.num_stages) if self.placement[s] == self.pp_rank]
        inner_config = copy.copy(self.config)  # each stage is prepared as a whole model of the other degrees
        inner_config.parallelism = dataclasses.replace(par, pp_size=1)
        self.inner = select_backend(inner_config)(self.state, self.topology, self.precision, inner_config,
                                                  self.kwargs_handlers, gradient_state=self.gradient_state,
                                                  compile_options=self.compile_options)
        self._models: list[PipelineModel] = []
        self.backward_ran = False  # set by a training call of a pipeline model, cleared by backward()
        self.materialized = ParameterReplacements()  # a meta-device model's parameters, once allocated

    partial_gradients = True  # each stage holds its own: one inf on any stage skips the step everywhere

    @property
    def parts(self):  # Backend's class attribute: here the inner step owner's
        """The parallel dimensions of each stage: the inner step owner's."""
        return self.inner.parts

    # -- model ------------------------------------------------------------------------------------------------
    def attach_loss(self, model: nn.Module) -> None:
        """Nothing to attach: the pipeline model computes the loss on its last stage, per micro-batch."""

    def prepare_model(self, model: nn.Module, device_placement: bool = True) -> nn.Module:
        if isinstance(model, PipelineModel):
            return model
        on_meta = any(p.is_meta for p in model.parameters())
        points = self.parallelism.pp_split_points
        points = (check_split_points(model, points, self.num_stages) if points
                  else balanced_split_points(model, self.num_stages))
        plan = StagePlan(model, points)
        if not on_meta:
            self._sync_initial_weights(model)
        self.inner.plan_whole_model(model)  # e.g. a split plan: checked on the whole model, applied per stage
        users = plan.stages_of_param(model)
        params = {id(p): p for p in model.parameters()}
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        tied = [TiedWeight(tuple(aliases[i]), tuple(params[i].shape), min(s)) for i, s in users.items() if len(s) > 1]
        view, _ = stage_model(model, plan, set(self.local_stages), hooks=False)
        before = self.materialized.snapshot(view)
        shells, originals = [], []
        for index in self.local_stages:
            shell, run = stage_model(model, plan, {index})
            originals += list(shell.parameters())  # what the user's optimizer holds (TP/FSDP replace them)
            if on_meta:  # each process allocates only its own stages
                materialize(shell, self.state.device)
            elif device_placement:
                shell.to(self.state.device)
            shells.append((index, shell, run))
        if on_meta:
            _retie(view, tied)
            self.materialized.record(before, view)
        stages = []
        for index, shell, run in shells:
            prepared = self.inner.prepare_model(shell, device_placement=False)
            # after the parts' install: the stage runs the model's forward through what they wrapped around it
            _install_stage_forward(shell, run, index, self.precision)
            stages.append((index, shell, prepared))
        wrapped = PipelineModel(self, view, stages, tied, originals)
        for part in self.parts:  # what each part recorded per stage, as one model's (checkpoints read it)
            part.adopt(wrapped, [shell for _, shell, _ in shells])
        if on_meta and tied:
            wrapped.broadcast_tied_weights()
        self._models.append(wrapped)
        return wrapped

    def _sync_initial_weights(self, model: nn.Module) -> None:
        """The first pipeline rank's weights are the model's (as DDP takes rank 0's): every stage starts from
        the weights of one model, also for weights tied across stages."""
        group = self.topology.group("pp", self.state.device.type)
        source = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                moved = tensor.data.to(self.state.device)
                dist.broadcast(moved, src=source, group=group)
                if moved is not tensor.data:
                    tensor.data.copy_(moved)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.local_view if isinstance(model, PipelineModel) else self.inner.unwrap_model(model)

    # -- optimizer --------------------------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> torch.optim.Optimizer:
        refuse_stepped_optimizer(optimizer, "pipeline parallelism")
        pipelines = [m for m in models if isinstance(m, PipelineModel)] or list(self._models)  # earlier prepare calls
        if not pipelines:
            raise PipelineError("prepare: with pipeline parallelism, prepare the model before (or with) its optimizer")
        keep = {id(p) for m in pipelines for p in m.original_parameters}
        for group in optimizer.param_groups:  # other stages' parameters are not this process's to update
            group["params"] = [p for p in group["params"] if id(p) in keep]
        self.materialized.repoint(optimizer)  # meta-device parameters -> the allocated ones
        prepared = self.inner.prepare_optimizer(optimizer, [shell for m in pipelines for shell in m.shells])
        def sum_tied_grads(*_) -> None:
            for model in pipelines:
                model.sum_tied_grads()

        prepared.register_step_pre_hook(sum_tied_grads)
        return prepared

    # -- the step ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Inside an accumulation window, data-parallel stages (DDP) do not reduce gradients. FSDP2 stages
        (ZeRO 2/3, TP x DP) still do: PipelineStage reduce-scatters after every step; the result is the same."""
        if not isinstance(model, PipelineModel):
            with self.inner.no_sync(model):
                yield
            return
        model.skip_gradient_sync = True
        try:
            yield
        finally:
            model.skip_gradient_sync = False

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """A no-op: `model(x, target=y)` has already run the backward of every micro-batch."""
        if not self.backward_ran:
            raise PipelineError("accelerator.backward: with pipeline parallelism the backward runs inside "
                                "`loss = model(inputs, target=targets)` (loss_fn given to prepare); a loss computed "
                                "outside the pipeline model cannot be back-propagated through it")
        self.backward_ran = False

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0, foreach: bool | None = None) -> torch.Tensor:
        """The global norm over all stages (each weight tied across stages counted once)."""
        parameters = list(parameters)
        if self.gradient_state is None or self.gradient_state.sync_gradients:
            for model in self._models:
                model.sum_tied_grads()
        skip = {id(p) for m in self._models for p in m.not_owned_parameters()} | norm_claims(self.parts)
        grads = [p.grad for p in parameters if p.grad is not None and id(p) not in skip]
        device = self.state.device
        local = total_norm(grads, norm_type, device, foreach)
        # this stage's share: the parts' gradients counted over their own groups
        powered = with_shares(local, norm_shares(self.parts, parameters, norm_type), norm_type, powered=True)
        group = self.topology.group("pp", device.type)
        if norm_type == float("inf"):
            dist.all_reduce(powered, op=dist.ReduceOp.MAX, group=group)
            total = powered
        else:
            dist.all_reduce(powered, group=group)
            total = powered ** (1.0 / norm_type)
        clip_grads_with_norm(parameters, max_norm, total, foreach)
        return total

    # -- checkpoints ------------------------------------------------------------------------------------------
    holds_part_of_model = True

    def checkpoint_model_state(self, model: nn.Module) -> dict:
        """Each name of a weight tied across stages saved as its own tensor, also where one process holds all of
        them (V placement: the embedding and the head both on rank 0), as where they are on different processes:
        a checkpoint's layout does not depend on the schedule, so any placement loads it."""
        state = super().checkpoint_model_state(model)
        for part in self.parts:  # each rank's tensors placed in the whole (as without stages)
            state = part.checkpoint_state(model, state)
        for weight in model.tied if isinstance(model, PipelineModel) else ():
            for name in [n for n in weight.names if n in state][1:]:
                state[name] = state[name].detach().clone()
        return state

    def load_checkpoint_model_state(self, model: nn.Module, state: dict) -> None:
        for part in self.parts:  # this rank's tensors of each part
            state = part.load_model_state(model, state)
        super().load_checkpoint_model_state(model, {k: v for k, v in state.items() if v is not None})

    def load_checkpoint_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """The checkpoint holds every stage's optimizer state: keep this process's parameters'."""
        if "state" in state and "param_groups" in state:
            local = {canonical: name for name, canonical in _tied_names(model).items()}
            mine = {name for name, _ in model.named_parameters()}
            state = _rename(state, local)
            state = {"state": {k: v for k, v in state["state"].items() if k in mine},
                     "param_groups": [{**g, "params": [p for p in g["params"] if p in mine]}
                                      for g in state["param_groups"]]}
        self.inner.load_checkpoint_optimizer_state(model, optimizer, state)

    def checkpoint_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Keyed by parameter name; a weight tied across stages under the name the whole model gives it."""
        return _rename(self.inner.checkpoint_optimizer_state(model, optimizer), _tied_names(model))

    def full_state_dict(self, model: nn.Module) -> dict:
        """Every stage's full weights, collected on rank 0 with the original names (other ranks: {})."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        mine: dict[str, Any] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        mine = {k: v.detach().to("cpu") for k, v in mine.items()}  # this stage's
        for part in self.parts:  # each part's tensors whole, in the model's names (every rank of its groups)
            mine = part.full_state(model, mine)
        coords = self.topology.coordinates(self.state.process_index)
        if any(position for dim, position in coords.items() if dim != "pp"):  # one writer per stage
            return {}
        return _collect_on_first(mine, self.topology.group("pp", self.state.device.type), self.state.device)

    def held_names(self, for_optimizer: bool = False) -> set[str] | None:
        """The names of this process's stages' parameters and buffers; for optimizer state, also the first name of
        each weight tied across stages that it holds (that state is saved under it)."""
        held: set[str] = set()
        for model in self._models:
            held.update(n for n, _ in model.named_parameters(remove_duplicate=False))
            held.update(n for n, _ in model.named_buffers())
            if for_optimizer:
                held.update(w.names[0] for w, p in zip(model.tied, model._tied_params(), strict=True) if p is not None)
        return held

    def tied_groups(self, model: nn.Module) -> list[tuple[str, ...]]:
        """Weights tied across stages (each stage holds a copy, kept bit-equal), and ties within this process's
        stages."""
        groups = [w.names for w in model.tied] if isinstance(model, PipelineModel) else []
        return groups + super().tied_groups(model)

    def forget(self) -> None:
        self._models.clear()
        self.materialized.clear()
        self.inner.forget()

    def release(self) -> None:
        self.inner.release()


@dataclasses.dataclass(frozen=True)
class TiedWeight:
    """A weight used by several stages (e.g. an embedding tied to the output head): its names, its shape, and the
    first stage that uses it (the process holding that stage counts it in the gradient norm)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    first_stage: int


class PipelineModel(nn.Module):
    """What `prepare` returns for a pipeline: this process's stages. Its parameters and state dict keep the
    original names; calling it runs the schedule over the micro-batches."""

    # set with object.__setattr__ in __init__ (not registered as submodules)
    local_view: nn.Module
    _backend: PipelineBackend

    def __init__(self, backend: PipelineBackend, view: nn.Module, stages: list, tied: list[TiedWeight],
                 original_parameters: list) -> None:
        super().__init__()
        for name, child in view.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "local_view", view)
        object.__setattr__(self, "_backend", backend)
        self.tied = tied
        self._stages = stages  # (stage index, stage model, the stage model as the inner backend wrapped it)
        self._originals = [weakref.ref(p) for p in original_parameters]
        self._schedules: dict = {}
        self.skip_gradient_sync = False  # inside accumulate(): DDP stages keep their gradients local
        self._tied_pending = False  # tied weights have stage-local gradients not yet summed
        self._training_step = False
        self._raw_losses: list = []

    def train(self, mode: bool = True) -> "PipelineModel":
        """Also the stage models' own copies of the containers (a forward may read `self.training`)."""
        super().train(mode)
        for module in [self.local_view, *self.shells]:
            module.train(mode)
        return self

    @property
    def shells(self) -> list[nn.Module]:
        return [shell for _, shell, _ in self._stages]

    @property
    def original_parameters(self) -> list[nn.Parameter]:
        """This process's parameters as the model had them before TP/FSDP replaced them (the optimizer's)."""
        return [p for p in (ref() for ref in self._originals) if p is not None]

    def _tied_params(self) -> list:
        params = dict(self.named_parameters(remove_duplicate=False))
        return [next((params[n] for n in weight.names if n in params), None) for weight in self.tied]

    def not_owned_parameters(self) -> list[torch.Tensor]:
        """Weights tied across stages that an earlier stage on another process counts (for the norm)."""
        local = self._backend.local_stages
        return [p for weight, p in zip(self.tied, self._tied_params(), strict=True)
                if p is not None and weight.first_stage not in local]

    # -- the schedule -----------------------------------------------------------------------------------------
    def _schedule(self, packed: dict, with_loss: bool, forward_only: bool = False):
        key = (with_loss, forward_only) + tuple(
            (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v))
            for k, v in sorted(packed.items()))
        if key not in self._schedules:
            self._schedules[key] = self._build_schedule(with_loss, forward_only)
        return self._schedules[key]  # (schedule, its PipelineStages)

    def _build_schedule(self, with_loss: bool, forward_only: bool = False):
        """PyTorch's schedule over fresh `PipelineStage`s (they learn the activation shapes on first use, so
        each input shape gets its own). `forward_only`: for evaluation of a V schedule (see `_strip_backward`)."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        backend = self._backend
        group = backend.topology.group("pp", backend.state.device.type)
        stages = [PipelineStage(prepared, index, backend.num_stages, backend.state.device, group=group)
                  for index, _, prepared in self._stages]
        cls = get_schedule_class(backend.schedule)
        options = {"loss_fn": self._loss if with_loss else None, "scale_grads": False}
        try:
            if issubclass(cls, PipelineScheduleSingle):
                return cls(stages[0], backend.microbatches, **options), stages
            schedule = cls(stages, backend.microbatches, **options)
        except ValueError as exc:  # e.g. 1F1B needs at least as many micro-batches as stages
            raise ConfigError(f"parallelism: pp_schedule {backend.schedule} with pp_microbatches="
                              f"{backend.microbatches} and {backend.num_stages} stages: {exc}") from None
        if forward_only:
            _strip_backward(schedule)
        return schedule, stages

    def _loss(self, output, target):
        """The user's loss on one micro-batch, as the parts reduce it (e.g. the whole sequence's when ranks hold
        slices of it), scaled so the summed micro-batch gradients equal the batch's (and divided by the
        accumulation steps, and scaled for fp16)."""
        backend = self._backend
        raw = backend.finish_loss(backend.loss_fn(output, target), target)
        self._raw_losses.append(raw.detach())
        if not self._training_step:
            return raw
        steps = backend.gradient_state.num_steps if backend.gradient_state is not None else 1
        return backend.precision.scale_loss(raw) / (backend.microbatches * steps)

    # -- calling it -------------------------------------------------------------------------------------------
    def forward(self, *args, target=None, **kwargs):
        backend = self._backend
        packed = {f"_accel_arg{i}": a for i, a in enumerate(args)} | {f"_accel_kw_{k}": v for k, v in kwargs.items()}
        batch = next((v.shape[0] for v in packed.values() if isinstance(v, torch.Tensor) and v.dim()), None)
        if batch is None:
            raise PipelineError("pipeline: the model's inputs hold no batched tensor to cut into micro-batches")
        if batch % backend.microbatches:
            raise PipelineError(f"pipeline: batch size {batch} is not divisible by pp_microbatches="
                                f"{backend.microbatches}; allowed: a batch size that is a multiple of it (for a "
                                "smaller last batch: DataLoader(..., drop_last=True))")
        device = backend.state.device
        packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
        if target is not None:
            target = target.to(device)
        if target is not None and backend.loss_fn is None:
            raise PipelineError("pipeline: model(..., target=...) needs the loss function; give it once: "
                                "accelerator.prepare(model, ..., loss_fn=torch.nn.functional.cross_entropy)")
        self._training_step = target is not None and self.training and torch.is_grad_enabled()
        forward_only = not self._training_step and backend.schedule in V_SCHEDULES
        schedule, stages = self._schedule(packed, with_loss=target is not None, forward_only=forward_only)
        self._raw_losses = []
        if self._training_step:
            with backend.inner.pipeline_stages_step(stages, self.skip_gradient_sync,
                                                    backend.schedule in SPLIT_BACKWARD_SCHEDULES):
                output = schedule.step(target=target, **packed)
            self._tied_pending = bool(self.tied)
            backend.backward_ran = True
        else:
            with torch.no_grad():
                output = schedule.eval(target=target, **packed) if target is not None else schedule.step(**packed)
        group = backend.topology.group("pp", device.type)
        last = dist.get_global_rank(group, backend.placement[backend.num_stages - 1])
        if target is not None:
            if dist.get_rank() == last:  # the micro-batches' losses (after any from PyTorch's shape inference)
                loss = torch.stack(self._raw_losses[-backend.microbatches:]).float().mean()
            else:
                loss = torch.zeros((), device=device)
            dist.broadcast(loss, src=last, group=group)
            return loss
        return _broadcast_output(output, last, group, device)

    # -- weights tied across stages ---------------------------------------------------------------------------
    def broadcast_tied_weights(self) -> None:
        """Give every copy of a tied weight the first stage's values (a meta-device model is initialised by
        each process on its own)."""
        backend = self._backend
        group = backend.topology.group("pp", backend.state.device.type)
        for weight, param in zip(self.tied, self._tied_params(), strict=True):
            source = dist.get_global_rank(group, backend.placement[weight.first_stage])
            buffer = torch.empty(weight.shape, device=backend.state.device) if param is None else _local(param.data)
            dist.broadcast(buffer, src=source, group=group)

    def sum_tied_grads(self) -> None:
        """Each stage's gradient of a tied weight is its own part (averaged over the data-parallel replicas by
        DDP/FSDP): before the norm or the optimizer step, every copy gets the sum over the stages. Once per
        optimizer step, so accumulation windows and skipped reductions stay right."""
        if not self._tied_pending:
            return
        self._tied_pending = False
        backend = self._backend
        group = backend.topology.group("pp", backend.state.device.type)
        for weight, param in zip(self.tied, self._tied_params(), strict=True):
            if param is not None and param.grad is None:
                param.grad = torch.zeros_like(param)
            if param is not None and getattr(param.grad, "placements", None) != getattr(param, "placements", None):
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)  # e.g. an embedding's
                # gradient comes back replicated: every stage's copy is summed shard by shard, in the same layout
            grad = torch.zeros(weight.shape, device=backend.state.device) if param is None else _local(param.grad)
            dist.all_reduce(grad, group=group)


def _strip_backward(schedule) -> None:
    """Make a V schedule (ZBVZeroBubble, DualPipeV) forward only. On torch 2.13 their `eval()` still runs the
    backward actions of their plan, and the hand-over of an input gradient between the two stages of one rank fails
    without a backward ("can't steal_bwd_input"). So evaluation uses a separate schedule object, over the same
    modules and the same V placement, whose per-rank plan (with its send/recv actions) keeps only the forward work:
    every rank runs its forwards and forward send/recvs in the training plan's order, so it cannot deadlock where
    the training plan does not (dropping actions only removes waits)."""
    from torch.distributed.pipelining.schedules import _ComputationType as Action

    backward = {Action.FULL_BACKWARD, Action.BACKWARD_INPUT, Action.BACKWARD_WEIGHT, Action.SEND_B, Action.RECV_B,
                Action.REDUCE_GRAD}
    plans = schedule.pipeline_order_with_comms
    for rank, actions in plans.items():
        kept = []
        for action in actions:
            parts = action.sub_actions if action.computation_type == Action.OVERLAP_F_B else (action,)
            kept += [a for a in parts if a.computation_type not in backward]
        plans[rank] = kept


def _tied_names(model) -> dict[str, str]:
    """This process's name of each weight tied across stages -> the name the whole model gives it."""
    if not isinstance(model, PipelineModel):
        return {}
    params = dict(model.named_parameters())
    renames = {}
    for weight in model.tied:
        local = next((n for n in weight.names if n in params), None)
        if local is not None and local != weight.names[0]:
            renames[local] = weight.names[0]
    return renames


def _rename(state: dict, names: dict[str, str]) -> dict:
    """An optimizer state dict (keyed by parameter name) with some parameters renamed."""
    if not names or "state" not in state:
        return state
    return {**state, "state": {names.get(k, k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [names.get(p, p) for p in g["params"]]} for g in state["param_groups"]]}


def _retie(view: nn.Module, tied: list[TiedWeight]) -> None:
    """Allocating a meta-device stage gives each of its modules new Parameters, so a weight tied between two
    stages of this process (V placement: the embedding on stage 0 and the head on the last stage, both on rank 0)
    would become two: point every local name of it back at one Parameter."""
    params = dict(view.named_parameters(remove_duplicate=False))
    for weight in tied:
        names = [n for n in weight.names if n in params]
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(view.get_submodule(owner), attr, params[names[0]])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _install_stage_forward(shell: nn.Module, run, index: int, precision) -> None:
    """Make the stage model callable the way PipelineStage calls it: received activations positionally, the
    model's own (micro-batched) inputs as keyword arguments. The model's forward runs through what the parts
    wrapped around it at their install (e.g. a sequence slice's positions and attention), on every stage."""
    wrapped = shell.__dict__.get("forward")  # a part's wrapper of the model's forward, if any

    def forward(*received, **packed):
        args = [packed[k] for k in sorted((k for k in packed if k.startswith("_accel_arg")), key=lambda k: int(k[10:]))]
        kwargs = {k[10:]: v for k, v in packed.items() if k.startswith("_accel_kw_")}
        with precision.autocast():
            out = run_stage(shell, run, index, received[0] if received else None, tuple(args), kwargs, wrapped)
        out = loss_input(out)  # a transformers ModelOutput (or dict): the pipeline carries its logits
        if index == run.plan.num_stages - 1 and precision.dtype is not None:
            out = precision.outputs_to_float32(out)
        if isinstance(out, torch.Tensor) or (isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)):
            return out
        raise PipelineError(f"pipeline: stage {index} returns {type(out).__name__}; allowed: a tensor, a tuple of "
                            "tensors, or a dict/ModelOutput with 'logits' (compute the loss with loss_fn)")

    shell.forward = forward


def _broadcast_output(output, src: int, group, device):
    """The last stage's outputs, on every process of the pipeline."""
    meta: list[Any] = [None]
    if dist.get_rank() == src:
        tensors = output if isinstance(output, tuple) else (output,)
        meta = [(isinstance(output, tuple), [(t.shape, t.dtype) for t in tensors])]
    dist.broadcast_object_list(meta, src=src, group=group)
    is_tuple, shapes = meta[0]
    results = []
    for i, (shape, dtype) in enumerate(shapes):
        tensor = (output if not is_tuple else output[i]).contiguous() if dist.get_rank() == src \
            else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=group)
        results.append(tensor)
    return tuple(results) if is_tuple else results[0]


def _collect_on_first(state: dict, group, device) -> dict:
    """Each pipeline rank's tensors, sent to the group's first rank (the others return {})."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [(k, v.shape, v.dtype) for k, v in state.items()], group=group)
    first = dist.get_global_rank(group, 0)
    me = dist.get_rank()
    full: dict = dict(state) if me == first else {}
    seen = {k for k, _, _ in gathered[0]}
    for rank_in_group, entries in enumerate(gathered[1:], start=1):
        sender = dist.get_global_rank(group, rank_in_group)
        for key, shape, dtype in entries:
            if key in seen:
                continue  # a weight tied across stages: the first holder's copy
            seen.add(key)
            if me == sender:
                dist.send(state[key].to(device).contiguous(), dst=first, group=group)
            elif me == first:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, src=sender, group=group)
                full[key] = buffer.to("cpu")
    return full
