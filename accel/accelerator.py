"""The facade: `Accelerator` (Accelerate's names and semantics). Each method delegates in a few lines.

It resolves the config once, owns the process state, the precision policy, the gradient-accumulation
state and one backend chosen from the parallelism config. It never asks which backend it has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, cast

import torch

from accel.runtime import ops
from accel.runtime.accumulation import GradientState
from accel.backends.base import select_backend
from accel.transforms.compilation import compile_options
from accel.checkpoint.async_save import AsyncCheckpointer
from accel.compat.accelerator_members import AccelerateMembers, refuse_quantized_placement
from accel.compat.other import strip_data_parallel
from accel.core.probes import is_bitsandbytes_multi_backend_available, is_xpu_available
from accel.config import AccelConfig, ParallelismConfig, worker_config, worker_layers
from accel.config.kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ThroughputMonitorKwargs,
    find_handler,
)
from accel.optimizer import AcceleratedOptimizer
from accel.runtime.precision import PrecisionPolicy
from accel.runtime.replaced_parameters import ReplacedParameters, layout_name
from accel.scheduler import AcceleratedScheduler, retarget_scheduler
from accel.runtime.state import AcceleratorState, DistributedType, check_device_matches
from accel.runtime.throughput import ThroughputMonitor, monitor_for
from accel.runtime.topology import Topology

_NOT_YET = "is not available yet in accel"


_SAFETENSORS_ONLY_WARNED: list[bool] = []  # save_state(safe_serialization=False) warns once per process


def _warn_safetensors_only() -> None:
    """Accelerate's pickle checkpoints are never written: the files stay safetensors + JSON, which load_state (and
    Accelerate's loader, for the model files) reads the same way; say so once."""
    if not _SAFETENSORS_ONLY_WARNED:
        _SAFETENSORS_ONLY_WARNED.append(True)
        warnings.warn("save_state(safe_serialization=False): accel never writes pickle checkpoints; saving "
                      "safetensors + JSON as always (load_state reads them the same way)", UserWarning, stacklevel=3)


class Accelerator(AccelerateMembers):
    """Make a plain PyTorch training loop run on one CPU, many processes, GPUs or machines.

    Examples:
        >>> accelerator = Accelerator()
        >>> model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        >>> accelerator.backward(loss)   # instead of loss.backward()
    """

    _trigger: torch.Tensor | None  # set_trigger's flag (absent before the first call)

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

    def _tracker_names(self, log_with: Any) -> list:
        from accel.tracking import filter_trackers, logging_root

        trackers = filter_trackers(log_with, logging_root(self.project_configuration))
        if not trackers and log_with is not None:
            warnings.warn(f"`log_with={log_with}` was passed but no supported trackers are currently installed.",
                          stacklevel=3)
        return trackers

    # ------------------------------------------------------------------------------------------------------
    # identity
    # ------------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def mixed_precision(self) -> str:
        return self.precision.mode

    @property
    def scaler(self):
        return self.precision.scaler

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = value

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def step(self) -> int:
        """Micro-steps counted by `accumulate` (saved and restored by save_state/load_state)."""
        return self.gradient_state.step

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        """As in Accelerate: written to the dataloader config, so data loaders prepared after it follow it (those
        prepared before keep theirs; `join_uneven_inputs(even_batches=...)` changes them for a while)."""
        self.dataloader_config.even_batches = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 found inf/nan gradients)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

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

    def prepare_data_loader(self, data_loader, device_placement: bool | None = None, slice_fn_for_dispatch=None):
        from accel.data.loading import prepare_data_loader

        placement = self.device_placement if device_placement is None else device_placement
        prepared = prepare_data_loader(
            data_loader,
            device=self.device,
            num_processes=self.backend.data_parallel_size,
            process_index=self.backend.data_parallel_rank,
            split_batches=self.split_batches,
            put_on_device=placement,
            even_batches=self.even_batches,
            data_seed=self._shared_data_seed() if self._seedable_shuffle() else None,
            gradient_state=self.gradient_state,
            non_blocking=self.dataloader_config.non_blocking,
            use_seedable_sampler=self.dataloader_config.use_seedable_sampler,
            dispatch_batches=self.dataloader_config.dispatch_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_stateful_dataloader=self.dataloader_config.use_stateful_dataloader,
        )
        prepared.batch_transform = self.backend.batch_transform
        if self.throughput is not None:  # count each batch's samples and tokens (shapes only)
            prepared.batch_transform = self.throughput.counting(self.backend.batch_transform)
        prepared.exact_resume = self._exact_resume()
        self._dataloaders.append(prepared)
        expected = self.config.parallelism.micro_batch_size  # from a DeepSpeed JSON's train_micro_batch_size_per_gpu
        if expected and prepared.batch_size not in (None, expected):
            warnings.warn(f"config: micro_batch_size (train_micro_batch_size_per_gpu) is {expected} but this data "
                          f"loader gives each process batches of {prepared.batch_size}; the loader's size is used",
                          stacklevel=2)
        return prepared

    def _exact_resume(self) -> bool:
        """DataLoaderConfiguration.exact_resume; unset: Accelerate's resume where the script imported Accelerate (the
        shim: the drop-in gives Accelerate's numbers), accel's exact resume otherwise."""
        chosen = getattr(self.dataloader_config, "exact_resume", None)
        if chosen is None:
            given = os.environ.get("ACCEL_EXACT_RESUME", "").strip().lower()
            if given:  # for an unchanged Accelerate script that wants accel's exact resume
                if given not in ("1", "true", "0", "false"):
                    raise ValueError(f"ACCEL_EXACT_RESUME={given!r}; allowed: 1/true (accel's exact resume), 0/false "
                                     "(Accelerate's), or unset (Accelerate's under the shim, exact otherwise)")
                return given in ("1", "true")
            from accel.core.shim_version import shim_active

            return not shim_active()
        return bool(chosen)

    def _seedable_shuffle(self) -> bool:
        """Whether shuffles are a function of (seed, epoch): asked for, or a `data_seed` given (else Accelerate's
        draws from the global RNG, see accel.data.loading)."""
        return self.dataloader_config.use_seedable_sampler or self.dataloader_config.data_seed is not None

    def _shared_data_seed(self) -> int:
        """One shuffling seed for every rank: `data_seed`, else rank 0's torch seed (set by `set_seed`)."""
        if self._data_seed is None:
            seed = self.dataloader_config.data_seed
            if seed is None:
                seed = torch.initial_seed() % (2**63)  # reading it consumes no random numbers
                seed = int(ops.broadcast(torch.tensor([seed], dtype=torch.int64, device=self.device))[0])
            self._data_seed = int(seed)
        return self._data_seed

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """A loader over the rest of the current epoch, without loading the skipped batches."""
        from accel.data.loading import skip_first_batches

        return skip_first_batches(dataloader, num_batches)

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

    def unscale_gradients(self, optimizer=None) -> None:
        """Divide fp16 gradients by the loss scale (once per step; a no-op otherwise)."""
        targets = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer else self._optimizers
        for opt in targets:
            self.precision.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0,
                        foreach: bool | None = None) -> torch.Tensor:
        """Unscale, clip the gradients' global norm to `max_norm`, and return the norm before clipping. `foreach`
        is torch's clip_grad_norm_'s (None: the foreach kernels where the device has them)."""
        self.unscale_gradients()
        return self.backend.clip_grad_norm_(list(parameters), max_norm, norm_type, foreach)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        """The precision policy's autocast context, for code outside the prepared model's forward."""
        return self.precision.autocast(**(autocast_handler.to_kwargs() if autocast_handler else {}))

    @property
    def profile_handler(self) -> ProfileKwargs | None:
        """The `ProfileKwargs` given in kwargs_handlers, if any (Accelerate's attribute)."""
        return find_handler(self.kwargs_handlers, ProfileKwargs)

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None):
        """Profile the block with `torch.profiler` (yields the profiler: `prof.step()`, `prof.key_averages()`).
        With `output_trace_dir`, each process then writes its Chrome trace there as `profile_<process_index>.json`
        (Accelerate's name), and the processes wait for each other. `profile_handler` overrides the Accelerator's."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json"))
        self.wait_for_everyone()

    # ------------------------------------------------------------------------------------------------------
    # collectives
    # ------------------------------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather over the data-parallel processes, then drop the duplicates that padded the last batch, so
        each sample counts once. Processes that share a data shard (tensor- or pipeline-parallel ranks of one
        replica) hold the same samples: they are gathered once (use `gather` for every process's value)."""
        leaves: list = []
        ops.recursively_apply(leaves.append, input_data, test_type=lambda x: not isinstance(x, (list, tuple, dict)))
        all_tensors = all(isinstance(x, torch.Tensor) for x in leaves) and not isinstance(input_data, (str, int, float))
        replicas = self.backend.data_parallel_size
        group = self.topology.group("dp", self.device.type) if replicas < self.num_processes else None
        data: Any
        if use_gather_object or not all_tensors:
            items = input_data if isinstance(input_data, list) else [input_data]
            data = list(items) if replicas == 1 else ops.gather_object(items, group=group)
        else:  # with one replica, every process already holds all of it
            data = ops.gathered_alone(input_data) if replicas == 1 else ops.gather(input_data, group=group)
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder > 0:
            if isinstance(data, list):
                return data[:remainder]
            return ops.recursively_apply(lambda t: t[:remainder], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return ops.reduce(tensor, reduction, scale)

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of a causal LM's loss computed from its logits: `labels` ([batch, sequence], e.g. the
        input_ids) shifted one token left, the last one -100. Under sequence or context parallelism (sp_size,
        cp_size), `labels` is this process's slice and the shift runs over the WHOLE sequence (the slices are
        gathered over the group), so each token of the slice gets the next token of the sequence; accel's padding is
        -100. With reduce_sequence_loss, the loss is one process's (docs/long_sequences.md)."""
        return self.backend.shift_labels(labels)

    def reduce_sequence_loss(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor | int) -> torch.Tensor:
        """The mean loss over the tokens, from this process's summed token losses (e.g. cross_entropy(...,
        reduction="sum")) and its number of counted tokens. Under sequence or context parallelism it is the whole
        sequence's mean on every process (counts summed over the group), with gradients that equal one process's;
        else `loss_sum / num_tokens` (0 tokens: 0)."""
        return self.backend.reduce_token_loss(loss_sum, num_tokens)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return ops.pad_across_processes(tensor, dim, pad_index, pad_first)

    def wait_for_everyone(self) -> None:
        self.state.wait_for_everyone()

    def print(self, *args, **kwargs) -> None:
        self.state.print(*args, **kwargs)

    def main_process_first(self):
        return self.state.main_process_first()

    def local_main_process_first(self):
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False):
        return self.state.split_between_processes(inputs, apply_padding)

    def on_main_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable) -> Callable:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        return self.state.on_process(function, process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        return self.state.on_local_process(function, local_process_index)

    def trigger_sync_in_backward(self, model: torch.nn.Module):
        """Inside `no_sync`, make the next backward reduce the gradients (the model ran several forwards)."""
        return self.backend.sync_in_backward(model)

    def set_trigger(self) -> None:
        """Raise this process's flag; the next `check_trigger()` on every process sees it (e.g. to stop together)."""
        self._trigger = torch.ones((), device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called `set_trigger()` since the last check (all processes take part); the flags are
        cleared."""
        flag = getattr(self, "_trigger", None)
        flag = torch.zeros((), device=self.device) if flag is None else flag
        raised = bool(ops.reduce(flag, "sum").item() >= 1)
        self._trigger = None
        return raised

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None):
        """Train on data loaders whose processes get different numbers of batches (`even_batches=False`): torch's
        `Join` lets the processes that ran out shadow the others' gradient all-reduces, for DDP models on GPUs and,
        unlike Accelerate, on CPU processes (gloo) too. `even_batches` overrides the prepared map-style loaders'
        setting inside the block."""
        from accel.data.loading import BatchSamplerShard

        restore = []
        if even_batches is not None:
            samplers = [getattr(d, "batch_sampler", None) for d in self._dataloaders]
            if any(not isinstance(s, BatchSamplerShard) for s in samplers):
                warnings.warn("join_uneven_inputs(even_batches=...): overriding even_batches is only supported for "
                              "map-style datasets; iterable data loaders keep their setting", stacklevel=3)
            for sampler in samplers:
                if isinstance(sampler, BatchSamplerShard):
                    restore.append((sampler, sampler.even_batches))
                    sampler.even_batches = even_batches
        try:
            with self.backend.join(joinables):
                yield
        finally:
            for sampler, value in restore:
                sampler.even_batches = value

    # -- Accelerate's read-only views ------------------------------------------------------------------------
    @property
    def parallelism_config(self) -> ParallelismConfig:
        return self.config.parallelism

    @property
    def torch_device_mesh(self):
        """The DeviceMesh of the parallel dimensions (pp, dp, tp; dp_replicate and dp_shard when Accelerate's
        ParallelismConfig fields ask for them), or None on one process."""
        return self.state.device_mesh

    @property
    def is_fsdp2(self) -> bool:
        """Accelerate's test for its FSDP2 path: true when `state.fsdp_plugin` is set (a plugin was given, or the
        config's ZeRO 2/3 shards with FSDP2; `distributed_type` is then FSDP)."""
        return self.state.is_fsdp2

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def fp8_backend(self):
        """FP8BackendType.AO when training in fp8 (torchao), else NO."""
        from accel.compat.dataclasses import FP8BackendType

        return FP8BackendType.AO if self.config.mixed_precision == "fp8" else FP8BackendType.NO

    @property
    def should_save_model(self) -> bool:
        return True  # every rank takes part in saving (the checkpoint writer decides who writes), as in Accelerate

    @property
    def data_parallel_shard_rank(self) -> int:
        """This rank's position on the dp_shard dimension (0 when nothing is sharded)."""
        return self.topology.coordinates(self.process_index)["dp_shard"]

    @property
    def context_parallel_rank(self) -> int:
        """This rank's slice of every sequence on the cp (or sp) dimension (0 without one)."""
        return self.topology.seq_rank(self.process_index)

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """Accelerate's context manager that shards `buffers` along the sequence for context parallelism. accel's
        prepared DataLoader already hands each rank its slice (and the attention runs over the whole sequence while
        the model runs), so the block runs as it is."""
        yield

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def data_parallel_rank(self) -> int:
        return self.backend.data_parallel_rank

    @property
    def tensor_parallel_rank(self) -> int:
        return self.topology.coordinates(self.process_index)["tp"]

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.topology.coordinates(self.process_index)["pp"]

    @property
    def multi_device(self) -> bool:
        """Several accelerator devices (Accelerate's: MULTI_GPU and the like; not several CPU processes)."""
        return self.use_distributed and self.device.type != "cpu"

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def dispatch_batches(self):
        return self.dataloader_config.dispatch_batches

    # ------------------------------------------------------------------------------------------------------
    # models and lifetime
    # ------------------------------------------------------------------------------------------------------
    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's own module, without the backend's wrapper or torch's DDP/DataParallel (and optionally the
        autocast wrapper). A `torch.compile` wrapper is kept with `keep_torch_compile` (as Accelerate does): the same
        one when it holds the module directly, else a new wrapper of the module with the same compile settings (the
        prepared model's own wrapper is left as it is, still around its DDP)."""
        compiled = model if hasattr(model, "_orig_mod") else None
        inner = self.backend.unwrap_model(cast(torch.nn.Module, model._orig_mod) if compiled is not None else model)
        inner = strip_data_parallel(inner)  # torch's DDP/DataParallel a script wrapped itself, as Accelerate unwraps
        if not keep_fp32_wrapper:
            PrecisionPolicy.unwrap_forward(inner)
        if compiled is None or not keep_torch_compile:
            return inner
        if inner is model._orig_mod:
            return model
        context = getattr(model, "dynamo_ctx", None)
        return cast(torch.nn.Module, type(model)(inner, context) if context is not None else torch.compile(inner))

    @staticmethod
    def verify_device_map(model: torch.nn.Module) -> bool:
        """Whether `model` (or a submodule) was dispatched by a `device_map` with more than one entry (Accelerate's
        test: `hf_device_map` of length > 1); such a model is not moved by `prepare`, nor trained on several
        processes."""
        return any(len(getattr(m, "hf_device_map", None) or ()) > 1 for m in model.modules())

    def free_memory(self, *objects: Any) -> list:
        """Forget every prepared object (and empty the CUDA cache); returns `None` for each argument."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._replaced_optimizers.clear()
        self._replaced.clear()
        self.backend.forget()
        self.gradient_state.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None for _ in objects]

    clear = free_memory

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

    @property
    def preemption_requested(self) -> bool:
        """True once the job was asked to stop (SIGTERM or `preemption_signal` to `accel launch`), on every process at
        the same step. Read it once per step on every rank (it is a tiny all_reduce): `if
        accelerator.preemption_requested: accelerator.save_state(); break`. See accel/runtime/preemption.py."""
        from accel.runtime import preemption

        return preemption.requested(self.state)

    # ------------------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------------------
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Also save/restore these objects (anything with `state_dict` and `load_state_dict`) in save_state."""
        invalid = [f"Item at index {i} ({type(o).__name__}: {' '.join(str(o).split())[:80]})"
                   for i, o in enumerate(objects) if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if invalid:  # Accelerate's words for each ("Item at index N"), in one line
            raise ValueError("register_for_checkpointing: these objects lack state_dict/load_state_dict: "
                             + ", ".join(invalid))
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> torch.utils.hooks.RemovableHandle:
        """Run `hook(models, weights, output_dir)` in `save_state` before anything is written (Accelerate's). `weights`
        are the models' state dicts about to be saved: removing one skips saving that model's weights (e.g. the
        hook saved it its own way into `output_dir`, the checkpoint folder being built); changing one changes
        what is saved. Returns a handle whose `remove()` unregisters the hook."""
        handle = torch.utils.hooks.RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> torch.utils.hooks.RemovableHandle:
        """Run `hook(models, input_dir)` in `load_state` before anything is loaded (Accelerate's): models the hook
        removes from `models` (it loaded them itself) are not loaded from the checkpoint. Returns a handle whose
        `remove()` unregisters the hook."""
        handle = torch.utils.hooks.RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def _training_objects(self):
        from accel.checkpoint.training_state import TrainingObjects
        from accel.tracking import tracker_record

        return TrainingObjects(self.backend, self._models, self._optimizers, self._schedulers, self._dataloaders,
                               self._custom_objects, self.scaler, self.gradient_state.step,
                               save_hooks=list(self._save_model_state_pre_hook.values()),
                               load_hooks=list(self._load_model_state_pre_hook.values()),
                               trackers=tracker_record(self.trackers),
                               hook_view=lambda m: self.unwrap_model(m, keep_torch_compile=False),
                               exact_resume=self._exact_resume(), throughput=self.throughput,
                               set_step=self._set_step)

    def _set_step(self, step: int) -> None:
        self.gradient_state.step = step

    def _replicated(self) -> bool:
        """Every process holds the whole training state (DDP): the main process may save it alone."""
        return bool(getattr(self.backend, "replicated_state", False))

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   async_save: bool | None = None, **_: Any) -> str:
        """Save everything needed to continue (models, optimizers, schedulers, scaler, loaders, RNG, registered
        objects) atomically; with automatic naming, to `project_dir/checkpoints/checkpoint_<i>`.

        `async_save=True` (or the config's `checkpoint_async: thread | process`) returns once the tensors are
        copied off the live ones and writes them in the background; the folder appears, complete, when the write
        is done (`wait_for_checkpoint()` waits for it; so do the next save, load_state and end_training)."""
        from accel.checkpoint import layout
        from accel.checkpoint.training_state import save_training_state

        if not safe_serialization:
            _warn_safetensors_only()
        mode = self.config.checkpoint_async
        if async_save is not None:
            mode = ("thread" if mode == "no" else mode) if async_save else "no"
        self.wait_for_checkpoint()
        project = self.project_configuration
        target: str | os.PathLike
        if project.automatic_checkpoint_naming:
            if output_dir is not None:
                raise ValueError("save_state: output_dir is chosen by automatic_checkpoint_naming; pass no path")
            target = automatic = project.checkpoints_dir() / f"checkpoint_{project.iteration}"
            # where the main process saves alone (replicated state), it may have published this folder already
            alone = self.num_processes > 1 and self._replicated()
            if automatic.exists() and (self.is_main_process or not alone):
                raise ValueError(f"save_state: {automatic} already exists; set ProjectConfiguration(iteration=...) "
                                 "past the existing checkpoints")
        elif output_dir is None:
            raise ValueError("save_state: give output_dir, or Accelerator(project_config=ProjectConfiguration("
                             "project_dir=..., automatic_checkpoint_naming=True))")
        else:
            target = output_dir
        rotate = None
        if project.automatic_checkpoint_naming:
            folder, limit = project.checkpoints_dir(), project.total_limit
            rotate = lambda: layout.rotate(folder, limit)  # noqa: E731 (run by the main process once published)
        path = save_training_state(target, self._training_objects(), mode, self._checkpointer, rotate)
        if project.automatic_checkpoint_naming:
            project.iteration += 1
        return str(path)

    def wait_for_checkpoint(self) -> str | None:
        """Wait for an asynchronous `save_state` in flight (every process calls this); returns the folder it
        published, None when none was pending. A failure in the background is raised here, the same one-line
        CheckpointError on every process (the previous checkpoint stays the latest)."""
        from accel.checkpoint.training_state import wait_for_save

        published = wait_for_save(self._checkpointer)
        return None if published is None else str(published)

    def load_state(self, input_dir: str | None = None, **_: Any) -> None:
        """Restore what save_state wrote (RNG states last). With no path, the latest complete automatic checkpoint
        (half-written ones are never complete); when there is none yet, a FileNotFoundError (`NoCheckpointError`),
        so a script restarted by `accel launch --max_restarts N` catches it to start fresh on its first attempt."""
        from pathlib import Path

        from accel.checkpoint import layout
        from accel.checkpoint.training_state import load_training_state

        self.wait_for_checkpoint()
        project = self.project_configuration
        source: str | os.PathLike
        if input_dir is None:
            if not project.automatic_checkpoint_naming:
                raise ValueError("load_state: give input_dir, or use automatic_checkpoint_naming to load the latest")
            source = layout.latest_checkpoint(project.checkpoints_dir())
        else:
            source = input_dir
        manifest = load_training_state(source, self._training_objects())
        self._resume_trackers(manifest.get("trackers"))
        name = Path(source).name
        if project.automatic_checkpoint_naming and name.startswith("checkpoint_") and name[11:].isdigit():
            project.iteration = int(name[11:]) + 1

    def save(self, obj: Any, f, safe_serialization: bool = False) -> None:
        """Accelerate's `save`: write `obj` once, from the main process, atomically. With
        `safe_serialization`, `obj` must be a dict of tensors (safetensors); otherwise `torch.save` is used,
        as in Accelerate (load such files with `torch.load(weights_only=True)`)."""
        from pathlib import Path

        from accel.checkpoint.layout import fsync_dir, fsync_file

        from accel.checkpoint.main_save import main_process_writes

        path = Path(f)

        def write() -> None:
            tmp = path.with_name(f".{path.name}.tmp")
            if safe_serialization:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in obj.items()}, str(tmp), metadata={"format": "pt"})
            else:
                torch.save(obj, tmp)
            fsync_file(tmp)
            tmp.replace(path)
            fsync_dir(path.parent)

        main_process_writes("save", path, write, self.is_main_process, self._replicated())

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The full (unsharded) state dict, on CPU, with the user's parameter names; tied weights are one tensor
        under each of their names (as `model.state_dict()` gives them)."""
        from accel.checkpoint.ties import share_tied

        if not unwrap:
            return model.state_dict()
        return share_tied(self.backend.full_state_dict(model), self.backend.tied_groups(model))

    def save_model(self, model: torch.nn.Module, save_directory: str, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Save the full weights in Hugging Face's layout (sharded safetensors + index) from the main process;
        tied weights once, with the record that restores the tie. A transformers model's `config.json` is written
        beside them, so `from_pretrained(save_directory)` loads the trained model. Every file gets a checksum that
        `load_checkpoint_in_model` verifies; the folder's model (config.json included) is replaced in one step, its
        other files kept (model_io.save_state_dict_sharded)."""
        from accel.checkpoint.model_io import save_state_dict_sharded

        from accel.big_model.modeling import get_state_dict_offloaded_model, has_offloaded_params
        from accel.checkpoint.main_save import main_process_writes

        if any(has_offloaded_params(module) for module in model.modules()):  # big-model hooks: each module's weights
            state = get_state_dict_offloaded_model(model)  # brought in from the CPU or disk, one at a time
        else:
            state = self.get_state_dict(model)

        def write() -> None:
            config = getattr(self.unwrap_model(model), "config", None)
            # a transformers model: from_pretrained(save_directory) works; config.json is published with the weights
            extra = ({"config.json": lambda path: config.to_json_file(str(path))}
                     if config is not None and hasattr(config, "to_json_file") else None)
            save_state_dict_sharded(state, save_directory, max_shard_size=max_shard_size,
                                    safe_serialization=safe_serialization, extra_files=extra)

        # under DDP it may be called on the main process alone, as Accelerate allows
        main_process_writes("save_model", save_directory, write, self.is_main_process, self._replicated())

    # -- experiment trackers (accel/tracking.py): started, fed and finished on the main process only ----------
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the `log_with` trackers for a new run in `<logging_dir>/<project_name>/` (accel's jsonl/csv: in its
        own `run-<NNN>/` there; the checkpoint's run when load_state came first); `config`: its hyperparameters;
        `init_kwargs`: per tracker name, keyword arguments for its constructor (e.g. `{"wandb": {"tags": [...]}}`)."""
        from accel.tracking import logging_root, start_trackers

        if self.is_main_process:
            start_trackers(self.trackers, self.log_with, project_name, logging_root(self.project_configuration),
                           config, init_kwargs, resume=self._tracker_resume)
        self._tracker_resume = None

    def _resume_trackers(self, record: dict | None) -> None:
        """After load_state: the file trackers continue the checkpoint's run (accel/tracking.py says how), now if
        they are started, else at init_trackers."""
        from accel.tracking import resume_trackers

        if self.is_main_process and self.trackers:
            resume_trackers(self.trackers, record)
        else:
            self._tracker_resume = record

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called `name` (its library's own object with `unwrap=True`); a blank one off the main process."""
        from accel.tracking import get_tracker

        return get_tracker(self.trackers, name, unwrap)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send `values` (names to numbers or strings) at `step` to every tracker, from the main process only;
        `log_kwargs`: per tracker name, extra keyword arguments for its `log`."""
        if self.is_main_process:
            for tracker in self.trackers:
                tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

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
                     "AORecipeKwargs"), "accel.config.kwargs"),
    **dict.fromkeys(("PartialState", "AcceleratorState", "DistributedType"), "accel.runtime.state"),
}


def __getattr__(name: str):
    """Names Accelerate's `accelerate.accelerator` module also provides (scripts import them from there)."""
    import importlib

    if name in _ALSO_HERE:
        return getattr(importlib.import_module(_ALSO_HERE[name]), name)
    raise AttributeError(f"module 'accel.accelerator' has no attribute {name!r}")
