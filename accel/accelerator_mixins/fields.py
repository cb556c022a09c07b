"""What the Accelerator's constructor sets, declared once for the mix-ins that read it (nothing is set here)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accel.backends.base import Backend
    from accel.checkpoint.async_save import AsyncCheckpointer
    from accel.checkpoint.layout import ProjectConfiguration
    from accel.config import AccelConfig
    from accel.data.loading import DataLoaderConfiguration
    from accel.optimizer import AcceleratedOptimizer
    from accel.runtime.accumulation import GradientState
    from accel.runtime.precision import PrecisionPolicy
    from accel.runtime.replaced_parameters import ReplacedParameters
    from accel.runtime.state import AcceleratorState
    from accel.runtime.throughput import ThroughputMonitor
    from accel.runtime.topology import Topology
    from accel.scheduler import AcceleratedScheduler


class AcceleratorFields:
    """The base of the Accelerator's mix-ins: the attributes `Accelerator.__init__` sets, as type annotations."""

    config: AccelConfig  # the one resolved config
    state: AcceleratorState
    topology: Topology
    precision: PrecisionPolicy
    gradient_state: GradientState
    backend: Backend  # the step owner, asked through its interface only
    kwargs_handlers: list
    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    device_placement: bool
    step_scheduler_with_optimizer: bool
    deepspeed_plugin: Any
    log_with: list
    trackers: list[Any]
    throughput: ThroughputMonitor | None
    _tracker_resume: dict | None
    _checkpointer: AsyncCheckpointer
    _models: list[torch.nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list
    _custom_objects: list
    _replaced_optimizers: dict[int, torch.optim.Optimizer]
    _replaced: ReplacedParameters
    _data_seed: int | None
    _save_model_state_pre_hook: OrderedDict
    _load_model_state_pre_hook: OrderedDict
