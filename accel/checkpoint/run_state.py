"""What a run carries (the Accelerator's prepared objects, `TrainingObjects`) and its state as one tree.

The one list of a run's parts: `_collect` gives the state a save writes and a heal sends, `_hand_over` gives one back to
the objects after a load or a heal, so a save, a load and a heal never disagree on what a run holds.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from accel.checkpoint.backend_view import CheckpointBackend
from accel.checkpoint.layout import CheckpointError
from accel.checkpoint.rank_agreement import first_cause


@dataclass
class TrainingObjects:
    """What a checkpoint holds, as the Accelerator knows it."""

    backend: CheckpointBackend  # what checkpoint code calls on the backend (accel.checkpoint.backend_view)
    models: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)  # AcceleratedOptimizer
    schedulers: list = field(default_factory=list)
    dataloaders: list = field(default_factory=list)
    custom: list = field(default_factory=list)
    scaler: Any = None
    step: int = 0
    # Accelerate's register_save_state_pre_hook / register_load_state_pre_hook: hook(models, weights, folder) and
    # hook(models, folder); what they remove from `weights` / `models` is not saved / loaded
    save_hooks: list = field(default_factory=list)
    load_hooks: list = field(default_factory=list)
    trackers: dict | None = None  # the main process's file-tracker run (accel.tracking.tracker_record), resumed
    # what the hooks see of a prepared model: the user's module (Accelerate hands them its `_models`: the module
    # before the DDP wrapper and torch.compile)
    hook_view: Callable[[Any], Any] | None = None
    # load_state restores plain loaders' place (epoch, shuffle) too: accel's exact resume (DataLoaderConfiguration's
    # exact_resume); False: as Accelerate, only stateful loaders
    exact_resume: bool = True
    throughput: Any = None  # the throughput monitor: its step count goes on after a load
    set_step: Callable[[int], None] | None = None  # where a load puts the saved `step` (the Accelerator's counter)

    def hook_models(self) -> list:
        return [self.hook_view(m) if self.hook_view is not None else m for m in self.models]


def _owner(objects: TrainingObjects, optimizer) -> int | None:
    """Index of the model whose parameters the optimizer updates; None for an optimizer of tensors no prepared model
    holds (Accelerate saves those too: their state is then kept by position, as torch's state_dict keeps it)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for i, model in enumerate(objects.models):
        if any(id(p) in params for p in model.parameters()):
            return i
    return None


def _owned_optimizer_state(objects: TrainingObjects, optimizer) -> dict:
    owner = _owner(objects, optimizer)
    if owner is None:  # tensors of no prepared model: torch's own (index-keyed) state dict
        state = {**optimizer.state_dict(), "accel_by_position": True}
    else:
        state = _optimizer_state(objects.backend, objects.models[owner], optimizer)
    return {**state, "accel_type": _optimizer_type(optimizer)}


def _optimizer_type(optimizer) -> str:
    """The optimizer class the user prepared: ZeRO-1's `ZeroRedundancyOptimizer` names the one it wraps, so a
    checkpoint saved on 2 processes under ZeRO-1 loads on 1 (plain AdamW) and the other way round."""
    cls = getattr(optimizer, "_optim_constructor", None) or type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _optimizer_state(backend: CheckpointBackend, model, optimizer) -> dict:
    """The optimizer's checkpoint state dict. torch's DCP helpers first give an optimizer without state one (a
    zero-gradient step at lr 0: Adam's step count becomes 1), which would change the training that follows a
    save before the first step; a fresh optimizer is therefore left fresh, and its checkpoint says so
    (`accel_fresh`), so loading it leaves the optimizer fresh too, as Accelerate's state_dict round trip does."""
    fresh = isinstance(getattr(optimizer, "state", None), dict) and not optimizer.state
    state = backend.checkpoint_optimizer_state(model, optimizer)
    if fresh:
        optimizer.state.clear()
    return {**state, "accel_fresh": fresh}


def _collect(objects: TrainingObjects, model_states: list) -> dict:
    """The whole state tree (tensors and plain values) of everything in the checkpoint but the RNG; the models'
    part is `model_states` (after the pre-hooks)."""
    return {
        "models": model_states,
        "optimizers": [_owned_optimizer_state(objects, o.optimizer) for o in objects.optimizers],
        "schedulers": [s.state_dict() for s in objects.schedulers],
        "dataloaders": [loader_state(d) for d in objects.dataloaders if hasattr(d, "state_dict")],
        "custom": [obj.state_dict() for obj in objects.custom],
        "scaler": objects.scaler.state_dict() if objects.scaler is not None else None,
        "step": objects.step,
        "throughput": objects.throughput.state_dict() if objects.throughput is not None else None,
    }


def loader_state(loader) -> dict:
    """A prepared loader's whole state for a checkpoint: a stateful loader's `state_dict()` is torchdata's position
    alone (as Accelerate's), its epoch state is kept beside it (accel.data.stateful)."""
    return getattr(loader, "_accel_state_dict", loader.state_dict)()


def _copied_if_changed_before_the_step(tensors: dict, models: list) -> dict:
    """`tensors` with those that may change before the next optimizer step copied now (the rest is staged in the
    background, and the step waits for that copy): the models' buffers (batch norm's running statistics change in
    the forward; DDP broadcasts them there) and every tensor outside the models' and optimizers' state (registered
    objects, schedulers, loaders, scaler). The parameters and the optimizer state change only in the step."""
    buffers = set()
    for model in models:
        for buffer in model.buffers() if isinstance(model, torch.nn.Module) else ():
            local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
            if local.device.type != "meta" and local.numel():
                buffers.add(local.untyped_storage().data_ptr())

    def changes(key: str, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if not key.startswith(("/models/", "/optimizers/")):
            return True
        local = t.to_local() if hasattr(t, "to_local") else t
        return (key.startswith("/models/") and local.device.type != "meta" and local.numel() > 0
                and local.untyped_storage().data_ptr() in buffers)

    return {k: (t.detach().clone() if changes(k, t) else t) for k, t in tensors.items()}


def _hand_over(state: dict, models: list, objects: TrainingObjects, source: str,
               in_flight: tuple = ()) -> None:
    """Hand a state tree (read from a checkpoint, or received from a live replica) to the objects: the small ones
    first, their previous state kept to undo them should a later one refuse its state, then models and optimizers
    (whose names and shapes were checked), then the step counter. Loaders in `in_flight` are being iterated: their
    place is moved otherwise (a heal's fast-forward)."""
    small = [(f"registered object {i} ({type(o).__name__})", o, sd) for i, (o, sd) in
             enumerate(zip(objects.custom, state["custom"], strict=False))]
    small += [(f"data loader {i}", d, sd) for i, (d, sd) in
              enumerate(zip([d for d in objects.dataloaders if hasattr(d, "state_dict")], state["dataloaders"],
                             strict=False))
              # Accelerate restores only stateful loaders (torchdata's position); accel's exact resume all of them
              if (objects.exact_resume or getattr(d, "use_stateful_dataloader", False))
              and not any(d is loader for loader in in_flight)]
    if objects.scaler is not None and state["scaler"] is not None:
        small.append(("the gradient scaler", objects.scaler, state["scaler"]))
    small += [(f"scheduler {i} ({type(s).__name__})", s, sd) for i, (s, sd) in
              enumerate(zip(objects.schedulers, state["schedulers"], strict=False))]
    if objects.throughput is not None and state.get("throughput") is not None:  # (older checkpoints have none)
        small.append(("the throughput monitor", objects.throughput, state["throughput"]))
    backend, undo, what, partly = objects.backend, [], "", ""
    try:
        for what, obj, sd in small:  # noqa: B007 (`what` names the object in the error below)
            before = _cpu_copy(loader_state(obj))
            obj.load_state_dict(sd)
            undo.append((obj, before))
        partly = "; the models/optimizers before it hold the checkpoint's values: load again"
        for i, (model, sd) in enumerate(zip(models, state["models"], strict=False)):
            what = f"model {i}"
            backend.load_checkpoint_model_state(model, sd)
        for i, (opt, sd) in enumerate(zip(objects.optimizers, state["optimizers"], strict=False)):
            what = f"optimizer {i}"
            sd = dict(sd)
            sd.pop("accel_type", None)
            fresh = sd.pop("accel_fresh", False)
            owner = None if sd.pop("accel_by_position", False) else _owner(objects, opt.optimizer)
            if owner is None:
                opt.optimizer.load_state_dict(sd)
            else:
                backend.load_checkpoint_optimizer_state(objects.models[owner], opt.optimizer, sd)
            if fresh:  # saved before its first step: no state, as it was
                opt.optimizer.state.clear()
    except Exception as exc:
        for obj, before in reversed(undo):
            with contextlib.suppress(Exception):
                obj.load_state_dict(before)
        raise CheckpointError(f"{source}: {what} refused its saved state ({first_cause(exc)}){partly}") from None
    if objects.set_step is not None:
        objects.set_step(int(state.get("step") or 0))


def _cpu_copy(value: Any) -> Any:
    """A copy of a state dict to undo a load with, its tensors on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_cpu_copy(v) for v in value)
    return copy.deepcopy(value)
