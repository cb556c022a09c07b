"""The facade: `Accelerator` (Accelerate's names and semantics). Each method delegates in a few lines.

It resolves the config once, owns the process state, the precision policy, the gradient-accumulation
state and one backend chosen from the parallelism config. It never asks which backend it has. This module holds the
constructor, prepare and the loop's backward and accumulate; the other members live by concern in
accel/accelerator_mixins/ (process control, the training step, collectives, data loaders, the parallel layout,
models, checkpoints, experiment trackers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, cast

import torch

from accel.accelerator_mixins.checkpointing import Checkpointing
from accel.accelerator_mixins.collectives import Collectives
from accel.accelerator_mixins.data_loading import DataLoading
from accel.accelerator_mixins.experiment_tracking import Tracking
from accel.accelerator_mixins.models import ModelHandling
from accel.accelerator_mixins.parallel_layout import ParallelLayout
from accel.accelerator_mixins.process import ProcessControl
from accel.accelerator_mixins.training_step import TrainingStep
from accel.runtime.accumulation import GradientState
from accel.backends.base import select_backend
from accel.transforms.compilation import compile_options
from accel.checkpoint.async_save import AsyncCheckpointer
from accel.compat.accelerator_members import AccelerateMembers, refuse_quantized_placement
from accel.core.probes import is_bitsandbytes_multi_backend_available, is_xpu_available
from accel.config import AccelConfig, ParallelismConfig, worker_config, worker_layers
from accel.config.kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ThroughputMonitorKwargs,
    find_handler,
)
from accel.optimizer import AcceleratedOptimizer
from accel.runtime.precision import PrecisionPolicy
from accel.runtime.replaced_parameters import ReplacedParameters, layout_name
from accel.scheduler import AcceleratedScheduler, retarget_scheduler
from accel.runtime.state import AcceleratorState, check_device_matches
from accel.runtime.throughput import ThroughputMonitor, monitor_for
from accel.runtime.topology import Topology

_NOT_YET = "is not available yet in accel"


class Accelerator(Checkpointing, Tracking, DataLoading, TrainingStep, ModelHandling, Collectives,
                  ParallelLayout, ProcessControl, AccelerateMembers):
    """Make a plain PyTorch training loop run on one CPU, many processes, GPUs or machines.

    Examples:
        >>> accelerator = Accelerator()
        >>> model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        >>> accelerator.backward(loss)   # instead of loss.backward()
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config=None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list | None = None,
        log_with: Any = None,
        project_dir: str | None = None,
        project_config: Any = None,
        gradient_accumulation_plugin: Any = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: ParallelismConfig | None = None,
        even_batches: bool | None = None,
        throughput_monitor: bool | None = None,
        **unsupported: Any,
    ) -> None:
        if megatron_lm_plugin is not None:
            raise NotImplementedError(f"Accelerator(megatron_lm_plugin=...) {_NOT_YET}; use parallelism_config="
                                      "ParallelismConfig(...) or the config file's parallelism section")
        if unsupported:
            raise TypeError(f"Accelerator() got unexpected keyword arguments: {', '.join(sorted(unsupported))}")
        from accel.data.loading import DataLoaderConfiguration
        from accel.config.plugins import (
            active_deepspeed_plugin,
            apply_plugins,
            carried_deepspeed_plugin,
            deepspeed_state_members,
            dynamo_layer,
            tp_plugin_layer,
        )

        deepspeed_plugin, deepspeed_plugins = active_deepspeed_plugin(deepspeed_plugin, deepspeed_plugins)

        arguments = self._argument_layer(mixed_precision, gradient_accumulation_steps, cpu, parallelism_config,
                                         gradient_accumulation_plugin)
        arguments.update(dynamo_layer(dynamo_backend, dynamo_plugin))
        arguments = tp_plugin_layer(arguments, torch_tp_plugin)  # under parallelism_config=, as in Accelerate
        layers = worker_layers()  # read once: a plugin's default stage depends on them, then the arguments go on top
        arguments = apply_plugins(arguments, deepspeed_plugin, fsdp_plugin, layers[0])
        self.config: AccelConfig = worker_config(arguments, layers)  # built once, the plugin's layer included
        if deepspeed_plugin is None and fsdp_plugin is None:  # a config file's / launch's DeepSpeed JSON: Accelerate
            deepspeed_plugin = deepspeed_plugins = carried_deepspeed_plugin(self.config)  # builds it; not re-applied
        self.deepspeed_plugin, self.fsdp_plugin = deepspeed_plugin, fsdp_plugin
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches is not None:
            self.dataloader_config.split_batches = split_batches
        if even_batches is not None:
            self.dataloader_config.even_batches = even_batches
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        from accel.checkpoint.layout import ProjectConfiguration

        self.project_configuration = project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and project_config is not None:
            self.project_configuration.project_dir = project_dir
        self.rng_types = rng_types
        self.kwargs_handlers = list(kwargs_handlers or [])
        self._check_handlers()
        self.log_with = self._tracker_names(log_with)
        self.trackers: list[Any] = []  # GeneralTracker instances, from init_trackers
        self._tracker_resume: dict | None = None  # the tracker run of a checkpoint loaded before init_trackers

        backend_cls = select_backend(self.config)  # before any process group
        compiling = compile_options(self.config, getattr(dynamo_plugin, "options", None))  # refused before launch too
        init = find_handler(self.kwargs_handlers, InitProcessGroupKwargs)
        offload = bool(self.config.parallelism.offload_params or self.config.parallelism.offload_optimizer)
        self.state = AcceleratorState(cpu=self.config.use_cpu, cpu_collectives=offload,
                                      **(init.to_kwargs() if init else {}))
        self.state.check_cpu_collectives(offload)
        self._checkpointer = AsyncCheckpointer()  # an asynchronous save_state in flight: waited for before teardown
        self.state.add_release_callback(self._checkpointer.close)
        check_device_matches(self.config, self.state.device)
        self.topology = Topology.for_config(self.state.num_processes, self.config.parallelism)
        scaler = find_handler(self.kwargs_handlers, GradScalerKwargs)
        autocast = find_handler(self.kwargs_handlers, AutocastKwargs)
        from accel.core.shim_version import shim_active

        self.precision = PrecisionPolicy(self.config.mixed_precision, self.state.device,
                                         scaler.to_kwargs() if scaler else None,
                                         autocast.to_kwargs() if autocast else None,
                                         find_handler(self.kwargs_handlers, AORecipeKwargs),
                                         as_accelerate=shim_active())
        note = self.precision.cpu_fp16_note()
        if note is not None and self.state.is_main_process:
            warnings.warn(note, UserWarning, stacklevel=2)
        plugin = gradient_accumulation_plugin
        self.gradient_state = GradientState(
            num_steps=self.config.gradient_accumulation_steps,
            sync_with_dataloader=getattr(plugin, "sync_with_dataloader", True),
            adjust_scheduler=getattr(plugin, "adjust_scheduler", True),
            sync_each_batch=getattr(plugin, "sync_each_batch", False),
        )
        self.backend = backend_cls(self.state, self.topology, self.precision, self.config,
                                   self.kwargs_handlers, gradient_state=self.gradient_state,
                                   compile_options=compiling)
        self.precision.choose_scaler(self.backend.partial_gradients)
        # Accelerate's AcceleratorState members, on the one shared state (scripts read them from AcceleratorState())
        from accel.checkpoint.fsdp_compat import fsdp_state_members

        self.state.__dict__.update(mixed_precision=self.config.mixed_precision, deepspeed_plugin=deepspeed_plugin,
                                   parallelism_config=self.config.parallelism,
                                   topology=self.topology, torch_tp_plugin=torch_tp_plugin,
                                   dynamo_plugin=dynamo_plugin, megatron_lm_plugin=None, downcast_bfloat=False,
                                   **deepspeed_state_members(deepspeed_plugin, deepspeed_plugins),
                                   **fsdp_state_members(fsdp_plugin, self.config, self.backend))
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list = []
        self._custom_objects: list = []
        self._replaced_optimizers: dict[int, torch.optim.Optimizer] = {}
        # the parameters prepare replaced: an optimizer that still holds them is refused (replaced_parameters.py)
        self._replaced = ReplacedParameters(layout_name(self.config.parallelism, self.topology.sizes))
        self._data_seed: int | None = None
        self._save_model_state_pre_hook: OrderedDict = OrderedDict()  # Accelerate's names
        self._load_model_state_pre_hook: OrderedDict = OrderedDict()
        self.throughput = self._throughput_monitor(throughput_monitor)  # accel's own: tokens/s, MFU (None when off)
        # what a replica that heals receives (one truth); weakly, so the Accelerator is freed without gc as before
        self.backend.training_objects = _weakly(self._training_objects)

    # ------------------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------------------
    def _throughput_monitor(self, enabled: bool | None) -> ThroughputMonitor | None:
        """The throughput monitor when on, fed this run's degrees and device, the planner's FLOPs count and peak."""
        from accel.planning.peak_flops import device_peak

        return monitor_for(enabled, find_handler(self.kwargs_handlers, ThroughputMonitorKwargs), self.config,
                           data_parallel_size=self.backend.data_parallel_size, num_processes=self.num_processes,
                           device=self.device, is_main_process=self.is_main_process, log=self._log_throughput,
                           model_flops=self._flops_per_token_of,
                           device_peak=functools.partial(device_peak, self.device, self.mixed_precision))

    def _flops_per_token_of(self, model: torch.nn.Module) -> Callable[[float], float] | None:
        """The planner's FLOPs per token of a prepared model, by sequence length (None without a transformers
        config)."""
        from accel.planning.shape import module_shape, training_flops_per_token

        shape = module_shape(self.unwrap_model(model, keep_torch_compile=False))
        return None if shape is None else functools.partial(training_flops_per_token, shape)

    def _log_throughput(self, metrics: dict[str, float], step: int) -> None:
        self.log(metrics, step=step)

    @staticmethod
    def _argument_layer(mixed_precision, gradient_accumulation_steps, cpu, parallelism_config, plugin) -> dict:
        """The `Accelerator(...)` arguments that were given, as the highest-precedence config layer."""
        layer: dict[str, Any] = {}
        if mixed_precision is not None:
            layer["mixed_precision"] = str(getattr(mixed_precision, "value", mixed_precision))
        if plugin is not None and getattr(plugin, "num_steps", None):
            if gradient_accumulation_steps != 1:
                raise ValueError("Accelerator: give gradient_accumulation_steps or gradient_accumulation_plugin, "
                                 "not both")
            gradient_accumulation_steps = plugin.num_steps
        if gradient_accumulation_steps != 1:
            layer["gradient_accumulation_steps"] = gradient_accumulation_steps
        if cpu:
            layer["use_cpu"] = True
        if parallelism_config is not None:
            if not isinstance(parallelism_config, ParallelismConfig):
                raise TypeError("Accelerator(parallelism_config=...) expects accel.ParallelismConfig, got "
                                f"{type(parallelism_config).__name__}")
            layer["parallelism"] = dataclasses.asdict(parallelism_config)
        return layer

    def _check_handlers(self) -> None:
        from accel.config.kwargs import KwargsHandler

        for handler in self.kwargs_handlers:
            if not isinstance(handler, KwargsHandler):
                raise TypeError(f"kwargs_handlers: {handler!r} is not a kwargs handler; allowed: "
                                "DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, "
                                "AutocastKwargs, AORecipeKwargs, ProfileKwargs, ThroughputMonitorKwargs")
            find_handler(self.kwargs_handlers, type(handler))  # at most one of each kind

    # ------------------------------------------------------------------------------------------------------
    # prepare
    # ------------------------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None, loss_fn: Callable | None = None) -> Any:
        """Prepare models, optimizers, data loaders and schedulers, in any order; returned in the same order.

        Models are wrapped first, then optimizers (which may need the wrapped parameters), then schedulers.
        With `loss_fn(outputs, targets)`, `loss = model(inputs, target=targets)` returns the loss; under pipeline
        parallelism that call runs forward and backward over the micro-batches (so one loop fits every config).
        """
        if loss_fn is not None:
            self.backend.set_loss_fn(loss_fn)
        placement: list[bool | None] = [*device_placement] if device_placement else [None] * len(args)
        if len(placement) != len(args):
            raise ValueError(f"prepare: device_placement has {len(placement)} entries for {len(args)} objects")
        from accel.compat.deepspeed import replace_dummies  # DummyOptim/DummyScheduler -> what the DeepSpeed JSON names

        args = tuple(replace_dummies(args, self.deepspeed_plugin, self.backend.data_parallel_size, self.split_batches,
                               self.step_scheduler_with_optimizer))
        result = list(args)
        models = [i for i, obj in enumerate(args) if isinstance(obj, torch.nn.Module)]
        for i in models:
            result[i] = self.prepare_model(args[i], device_placement=placement[i])
        if loss_fn is not None:
            for model in self._models:
                self.backend.attach_loss(model)
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer):
                result[i] = self._prepare_optimizer(obj, [result[m] for m in models])
            elif isinstance(obj, torch.utils.data.DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=placement[i])
        for i, obj in enumerate(args):
            if _is_scheduler(obj):
                result[i] = self.prepare_scheduler(obj)
        for i, obj in enumerate(args):  # Accelerate's mark of what prepare handled (other objects pass through)
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader)) or \
                    _is_scheduler(obj):
                with contextlib.suppress(AttributeError, TypeError):
                    result[i]._is_accelerate_prepared = True
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        if any(model is prepared for prepared in self._models):  # prepared already: as it is, listed once
            return model
        placement = self.device_placement if device_placement is None else device_placement
        # a model transformers loaded in 8/4 bits with a device map (the probes are this module's names, which
        # Accelerate's tests patch)
        refuse_quantized_placement(model, self.device, self.use_distributed, is_bitsandbytes_multi_backend_available(),
                                   is_xpu_available())
        mapped = self.verify_device_map(model)  # dispatched by a device_map: it stays as the map placed it
        if mapped and self.use_distributed and os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP", "false") != "true":
            raise ValueError("prepare: You can't train a model that has been loaded with `device_map='auto'` in any "
                             f"distributed mode ({self.num_processes} processes); allowed: one process (`python "
                             "script.py` or --num_processes=1), or a model loaded without a device_map")
        self.precision.wrap_forward(model)
        kept = (evaluation_mode or mapped) and not self.use_distributed  # mapped: its offloaded weights stay on meta
        before = self._replaced.snapshot(self.unwrap_model(model, keep_torch_compile=False))
        prepared = model if kept else self.backend.prepare_model(model, placement and not mapped)
        self._replaced.record(before, self.unwrap_model(prepared, keep_torch_compile=False))
        if self.throughput is not None and not self._models:  # the first model's mode gates counting
            self.throughput.watch(prepared)
        self._models.append(prepared)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> AcceleratedOptimizer:
        return self._prepare_optimizer(optimizer, self._models)

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> AcceleratedOptimizer:
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        replacement = self.backend.prepare_optimizer(optimizer, models)
        self._replaced.check_prepared(replacement)
        if replacement is not optimizer:  # e.g. ZeRO-1 shards it; schedulers built on the original follow
            self._replaced_optimizers[id(optimizer)] = replacement
            for prepared in self._schedulers:  # a scheduler prepared in an earlier call
                if getattr(prepared.scheduler, "optimizer", None) is optimizer:
                    retarget_scheduler(prepared.scheduler, replacement)
        wrapped = AcceleratedOptimizer(replacement, self.precision, self.gradient_state)
        clip_to = self.config.parallelism.gradient_clipping
        if clip_to:  # DeepSpeed's `gradient_clipping`: clip at every real step, without a call in the script
            params = [p for group in replacement.param_groups for p in group["params"]]
            wrapped.before_step = lambda: self.clip_grad_norm_(params, clip_to)
        if self.throughput is not None and not self._optimizers:  # the first optimizer's steps are the steps
            wrapped._throughput = self.throughput
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler) -> AcceleratedScheduler:
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        target = getattr(scheduler, "optimizer", None)
        if id(target) in self._replaced_optimizers:
            target = self._replaced_optimizers[id(target)]
            retarget_scheduler(scheduler, target)
        optimizers = [opt for opt in self._optimizers if opt.optimizer is target or opt is target] or self._optimizers
        wrapped = AcceleratedScheduler(scheduler, optimizers, self.gradient_state, self.backend.data_parallel_size,
                                       self.step_scheduler_with_optimizer, self.split_batches)
        self._schedulers.append(wrapped)
        return wrapped

    # ------------------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()`, divided by the accumulation steps and scaled for fp16."""
        if self.gradient_state.num_steps > 1:
            loss = loss / self.gradient_state.num_steps
        if self._replaced.unchecked:  # the first backward since a model whose parameters prepare replaced
            self._replaced.check_backward()
        self.backend.backward(self.precision.scale_loss(loss), **kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module):
        """Count one micro-step; inside the window, backward runs without gradient communication."""
        sync = self.gradient_state.do_sync_step()
        with contextlib.ExitStack() as stack:
            if not sync and not self.gradient_state.sync_each_batch:  # sync_each_batch: reduce every micro-batch
                for model in models or self._models:
                    stack.enter_context(self.backend.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module):
        """Backward inside this block accumulates locally; gradients are not synchronised."""
        with self.backend.no_sync(model):
            yield

    # ------------------------------------------------------------------------------------------------------
    # the run's end
    # ------------------------------------------------------------------------------------------------------
    def end_training(self) -> None:
        """Finish: close the trackers, release the wrapped modules and destroy the process group (also done at
        exit)."""
        self.wait_for_checkpoint()
        self.backend.end_training()
        for tracker in self.trackers:
            tracker.finish()
        self.wait_for_everyone()
        self.free_memory()
        self.state.destroy()

    def __repr__(self) -> str:
        """The state's summary (Accelerate's fields, then accel's layout), then the accumulation steps."""
        return f"{self.state!r}Gradient accumulation steps: {self.gradient_accumulation_steps}\n"


class _weakly:
    """`method` (bound) called through a weak reference to its object: no reference cycle through the backend. A
    pickled copy (Accelerate's tests pickle the Accelerator) refers to the copy of that object, weakly again."""

    def __init__(self, method: Callable[[], Any]) -> None:
        self._ref = weakref.WeakMethod(cast(Any, method))

    def __call__(self) -> Any:
        bound = self._ref()
        if bound is None:
            raise RuntimeError("the Accelerator that prepared these objects is gone")
        return bound()

    def __getstate__(self) -> dict:
        bound = self._ref()  # the object itself: pickle writes it once (the copy being made), not a second copy
        return {"owner": getattr(bound, "__self__", None), "name": getattr(bound, "__name__", None)}

    def __setstate__(self, state: dict) -> None:
        owner, name = state["owner"], state["name"]
        self._ref = (weakref.WeakMethod(getattr(owner, name)) if owner is not None and name
                     else cast(Any, lambda: None))


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))


_ALSO_HERE = {  # names Accelerate's `accelerate.accelerator` module also provides -> the module defining them
    **dict.fromkeys(("DataLoaderConfiguration",), "accel.data.loading"),
    **dict.fromkeys(("GradientAccumulationPlugin", "GradientState"), "accel.runtime.accumulation"),
    "ProjectConfiguration": "accel.checkpoint.layout",
    **dict.fromkeys(("DeepSpeedPlugin", "FullyShardedDataParallelPlugin"), "accel.config.plugins"),
    **dict.fromkeys(("DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs",
                     "AORecipeKwargs", "ProfileKwargs"), "accel.config.kwargs"),
    **dict.fromkeys(("PartialState", "AcceleratorState", "DistributedType"), "accel.runtime.state"),
}


def __getattr__(name: str):
    """Names Accelerate's `accelerate.accelerator` module also provides (scripts import them from there)."""
    import importlib

    if name in _ALSO_HERE:
        return getattr(importlib.import_module(_ALSO_HERE[name]), name)
    raise AttributeError(f"module 'accel.accelerator' has no attribute {name!r}")
