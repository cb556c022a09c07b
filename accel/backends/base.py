"""The Backend interface and the registry that maps a parallelism config to a backend class.

The Accelerator only talks to this interface; it never asks which backend it has. A new ability is a
new method here (with a default), not a branch in the facade.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from accel.backends import BACKEND_MODULES, check_available
from accel.parallel.gradients import clip_grads_with_norm, quiet_logger, total_norm

__all__ = ["Backend", "ParameterReplacements", "clip_grads_with_norm", "loss_input", "quiet_logger",
           "refuse_stepped_optimizer", "register_backend", "select_backend", "total_norm"]

if TYPE_CHECKING:
    from accel.config.schema import AccelConfig
    from accel.parallel.part import Part
    from accel.runtime.precision import PrecisionPolicy
    from accel.runtime.state import PartialState
    from accel.runtime.topology import Topology


def loss_input(outputs):
    """What `loss_fn` receives: a transformers ModelOutput's (or a dict's) logits, as a pipeline's last stage
    carries them, so one loss_fn serves every backend; any other output as it is."""
    if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    return outputs


class Backend:
    """Wraps models/optimizers for one kind of parallelism and owns what depends on it."""

    name = "base"
    holds_part_of_model = False  # True: each process has only some of the model's tensors (pipeline stages)
    # True: every process holds the whole training state (model, optimizer), so the main process can save a
    # checkpoint on its own (save_state called there alone, as Accelerate allows under DDP)
    replicated_state = False
    partial_gradients = False  # True: a rank holds only part of the gradients (the precision policy's scaler)
    # the Accelerator's prepared objects, as save_state takes them (accel.checkpoint.training_state.TrainingObjects):
    # a backend that moves training state between processes itself (a replica that heals) takes this whole set
    training_objects: Callable[[], Any] | None = None
    # the run's parallel dimensions beyond data parallelism (accel/parallel/part.py), called in this order
    parts: "list[Part]" = []

    def __init__(self, state: "PartialState", topology: "Topology", precision: "PrecisionPolicy",
                 config: "AccelConfig", kwargs_handlers: list | None = None, gradient_state=None,
                 compile_options: dict | None = None) -> None:
        self.state = state
        self.topology = topology
        self.precision = precision
        self.config = config  # the whole resolved config: each backend reads the sections it needs
        self.parallelism = config.parallelism
        self.kwargs_handlers = list(kwargs_handlers or [])
        self.gradient_state = gradient_state  # accumulation steps, for backends that own the backward
        self.compile_options = compile_options  # torch.compile's (compilation.compile_options), None: eager

    # -- data ------------------------------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """How many distinct data shards there are (ranks sharing a shard get the same batches)."""
        return self.topology.dp_size

    @property
    def data_parallel_rank(self) -> int:
        return self.topology.dp_rank(self.state.process_index)

    # -- model and optimizer ---------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        raise NotImplementedError

    def plan_whole_model(self, model: torch.nn.Module) -> None:
        """Decide what depends on the whole model (TP's plan) before a pipeline cuts it; each stage's
        `prepare_model` then applies its part of that one decision."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          models: list[torch.nn.Module]) -> torch.optim.Optimizer:
        """Return the optimizer to wrap (re-pointed at sharded parameters where a backend shards them)."""
        return optimizer

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    loss_fn = None

    def set_loss_fn(self, loss_fn) -> None:
        """The loss function given to `prepare(..., loss_fn=...)`, so `model(x, target=y)` returns the loss."""
        self.loss_fn = loss_fn
        for part in self.parts:
            part.note_loss_fn(loss_fn)

    def attach_loss(self, model: torch.nn.Module) -> None:
        """Let the prepared model take `target=`: then it returns `loss_fn(outputs, target)`, so a loop written
        for pipeline parallelism runs unchanged on every backend. Backends that run the loss themselves
        (pipelines) override this."""
        if self.loss_fn is None or "_accel_loss_forward" in model.__dict__:
            return
        inner, loss_fn = model.forward, self.loss_fn

        def forward(*args, target=None, **kwargs):
            outputs = inner(*args, **kwargs)
            return outputs if target is None else self.finish_loss(loss_fn(loss_input(outputs), target), target)

        model.forward = forward
        model._accel_loss_forward = inner  # type: ignore[assignment]  # a plain attribute: the model's own forward

    def finish_loss(self, loss: torch.Tensor, target) -> torch.Tensor:
        """The loss `loss_fn` computed on this rank's part of the data, as the step needs it (each part reduces it in
        turn, e.g. to the loss of the whole sequence when ranks hold slices of it)."""
        for part in self.parts:
            loss = part.reduce_loss(loss, target)
        return loss

    @property
    def batch_transform(self):
        """A function the prepared DataLoaders apply to each batch last (None: batches as they are)."""
        cutters = [part.cut_batch for part in self.parts if part.cuts_batches]
        if len(cutters) <= 1:
            return cutters[0] if cutters else None

        def cut(batch):
            for cutter in cutters:
                batch = cutter(batch)
            return batch

        return cut

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """A causal LM's labels shifted one token left, the last one -100 (Accelerator.shift_labels): a part whose
        ranks hold slices of each sequence shifts over the whole sequence."""
        for part in self.parts:
            shifted = part.shift_labels(labels)
            if shifted is not None:
                return shifted
        from accel.parallel.sequence_layout import real_length, shift_labels

        return shift_labels(labels, real_length(labels))

    def reduce_token_loss(self, loss_sum: torch.Tensor, num_tokens) -> torch.Tensor:
        """The mean loss over the tokens from this rank's summed token losses and counted tokens
        (Accelerator.reduce_sequence_loss); without a part that reduces it, `loss_sum / num_tokens` (0 tokens: 0)."""
        for part in self.parts:
            reduced = part.reduce_token_loss(loss_sum, num_tokens)
            if reduced is not None:
                return reduced
        count = torch.as_tensor(num_tokens, device=loss_sum.device).to(loss_sum.dtype)
        return loss_sum / count.clamp(min=1)

    # -- the step --------------------------------------------------------------------------------------------
    def no_sync(self, model: torch.nn.Module):
        """Context in which backward accumulates locally without communicating."""
        return contextlib.nullcontext()

    def join(self, joinables: list):
        """Context for data-parallel ranks with different numbers of batches (Accelerate's `join_uneven_inputs`)."""
        import warnings

        warnings.warn("join_uneven_inputs is only supported for multi-GPU (and, in accel, multi-CPU) training of DDP "
                      f"models; with {self.name} it has no effect", stacklevel=4)
        return contextlib.nullcontext()

    def sync_in_backward(self, model: torch.nn.Module):
        """Context in which the next backward reduces gradients even inside `no_sync` (Accelerate's
        `trigger_sync_in_backward`, for a model run several times before one backward)."""
        return contextlib.nullcontext()

    def pipeline_stages_step(self, stages: list, skip_sync: bool, split_backward: bool = False):
        """Context in which a pipeline's `PipelineStage`s (whose modules this backend prepared) run one training
        step; `skip_sync`: inside `accumulate`, without reducing gradients; `split_backward`: the schedule computes
        weight gradients past autograd's hooks (the zero-bubble ones)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        loss.backward(**kwargs)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0, foreach: bool | None = None) -> torch.Tensor:
        """Clip to the global norm over all gradients; for sharded (DTensor) gradients the norm is reduced
        over the shards, so it equals the single-process norm. `foreach` is torch's (clip_grad_norm_'s)."""
        parameters = list(parameters)
        total = total_norm([p.grad for p in parameters if p.grad is not None], norm_type, self.state.device, foreach)
        clip_grads_with_norm(parameters, max_norm, total, foreach)
        return total

    # -- checkpoint hooks ------------------------------------------------------------------------------------
    # Training state goes through torch.distributed.checkpoint: these return the (possibly sharded) state
    # dicts keyed by the user's parameter names. PyTorch's helpers handle DDP, FSDP2 and DTensor alike.
    def checkpoint_model_state(self, model: torch.nn.Module) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)

    def checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer)

    def load_checkpoint_model_state(self, model: torch.nn.Module, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state)

    def load_checkpoint_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                        state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state)

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        """The whole, unsharded state dict on CPU (sharded backends gather it here), user's key names."""
        from accel.checkpoint.model_io import get_full_state_dict

        return get_full_state_dict(self.unwrap_model(model))

    def held_names(self, for_optimizer: bool = False) -> set[str] | None:
        """The parameter (and buffer) names whose model tensors, or optimizer state, this process loads from a
        `save_state` checkpoint; None: all of them (only pipelines hold a part of the model)."""
        return None

    def checkpoint_layouts(self, model: torch.nn.Module) -> dict[str, str]:
        """Parameters held in a layout of accel's own (TP's reordered fused q/k/v), recorded by `save_state` so a
        checkpoint is never resumed into another layout."""
        from accel.parallel import fused

        return fused.layouts(self.unwrap_model(model))

    def tied_groups(self, model: torch.nn.Module) -> list[tuple[str, ...]]:
        """Names that are one (tied) parameter of the user's model, so a full state dict stores it once."""
        from accel.checkpoint.ties import tied_names

        return tied_names(self.unwrap_model(model))

    # -- lifetime --------------------------------------------------------------------------------------------
    def end_training(self) -> None:
        """The loop is over (Accelerator.end_training), the prepared objects still held: a last check of them."""

    def forget(self) -> None:
        """Drop references to prepared objects (Accelerator.free_memory)."""

    def release(self) -> None:
        """Drop references to communication objects before the process group is destroyed."""


class ParameterReplacements:
    """Sharding (FSDP2, DTensor) replaces a module's Parameters with new objects; optimizers built from the
    originals must be re-pointed at them, whichever of the two was prepared first."""

    def __init__(self) -> None:
        self._new: dict[int, tuple] = {}  # id(original) -> (weakref to it: ids can be reused, replacement)
        self._optimizers: list = []

    def __getstate__(self) -> dict:
        return {"_new": {}, "_optimizers": []}  # identities (what weakrefs and ids record) do not survive pickling

    @staticmethod
    def snapshot(model: torch.nn.Module) -> dict:
        return dict(model.named_parameters(remove_duplicate=False))

    def record(self, before: dict, model: torch.nn.Module) -> None:
        """Map the parameters of `before` (a snapshot) to the model's current ones, and re-point optimizers."""
        import weakref

        after = dict(model.named_parameters(remove_duplicate=False))
        for name, old in before.items():  # gone (an expert another ep rank holds): dropped from optimizers
            self._new[id(old)] = (weakref.ref(old), after.get(name))
        for optimizer in self._optimizers:
            self.repoint(optimizer)

    def track(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-point now, and again whenever a model is sharded later."""
        self.repoint(optimizer)
        self._optimizers.append(optimizer)

    def repoint(self, optimizer: torch.optim.Optimizer) -> None:
        def replacement(param):
            ref, new = self._new.get(id(param), (None, None))
            return new if ref is not None and ref() is param else param

        for group in optimizer.param_groups:
            group["params"] = [new for new in map(replacement, group["params"]) if new is not None]

    def clear(self) -> None:
        self._new.clear()
        self._optimizers.clear()


def refuse_stepped_optimizer(optimizer: torch.optim.Optimizer, what: str) -> None:
    if any(optimizer.state.values()):
        raise RuntimeError(f"prepare: the optimizer already has state (it has stepped); with {what}, call "
                           "accelerator.prepare(model, optimizer) before the first optimizer.step()")


_REGISTRY: dict[str, type[Backend]] = {}


def register_backend(name: str):
    def decorator(cls: type[Backend]) -> type[Backend]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def select_backend(config: "AccelConfig") -> type[Backend]:
    """The backend class for this config, or a clear error when it is not available. An enabled `fault_tolerance`
    section (accel.config.schema.FaultToleranceConfig, checked with the rest of the config) selects the
    fault-tolerant data parallelism of accel/fault_tolerance/, which reads its settings from the config."""
    import importlib

    parallelism = config.parallelism
    if config.fault_tolerance is not None and config.fault_tolerance.enabled:
        importlib.import_module(BACKEND_MODULES["fault_tolerant"])
        return _REGISTRY["fault_tolerant"]
    name = check_available(parallelism)
    if parallelism.tp_plan:  # a plan given in the script (ParallelismConfig(tp_plan=...)): refused here, on every
        from accel.parallel.tensor_plan import check_plan_styles  # rank alike, not at prepare() with the model

        check_plan_styles(parallelism.tp_plan)
    importlib.import_module(BACKEND_MODULES[name])  # registers itself
    return _REGISTRY[name]
