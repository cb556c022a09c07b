"""accel: an ordinary PyTorch training loop on one CPU, many processes, GPUs or machines.

The public names match Hugging Face Accelerate's. Attributes load lazily so `import accel` stays cheap.
"""

from __future__ import annotations

import importlib

from accel.core.version import __version__

from accel.core.restarts import export_restart_count

# these two read the process's environment; a worker forked by `accel launch` calls them again with its own
# (accel/cli/forked_workers.py), since it loaded accel in the launcher
export_restart_count()

from accel.core.rank_warnings import warn_once_per_job  # noqa: E402

warn_once_per_job()  # ranks other than 0 leave the warnings every rank repeats to rank 0

from accel.core.uncaught import install as _install_excepthook  # noqa: E402

# an uncaught one-line error of accel's is that line alone; a worker of `accel launch` leaves its exception to the
# launcher, which prints it once (accel/core/uncaught.py)
_install_excepthook()

_LAZY = {
    "Accelerator": "accel.accelerator",
    "PartialState": "accel.runtime.state",
    "AcceleratorState": "accel.runtime.state",
    "DistributedType": "accel.runtime.state",
    "ParallelismConfig": "accel.config",
    "AccelConfig": "accel.config",
    "ConfigError": "accel.config",
    "DataLoaderConfiguration": "accel.data.loading",
    "skip_first_batches": "accel.data.loading",
    "DistributedDataParallelKwargs": "accel.config.kwargs",
    "GradScalerKwargs": "accel.config.kwargs",
    "InitProcessGroupKwargs": "accel.config.kwargs",
    "AutocastKwargs": "accel.config.kwargs",
    "AORecipeKwargs": "accel.config.kwargs",
    "ProfileKwargs": "accel.config.kwargs",
    "ThroughputMonitorKwargs": "accel.config.kwargs",
    "DDPCommunicationHookType": "accel.config.kwargs",
    "notebook_launcher": "accel.launchers",
    "find_executable_batch_size": "accel.core.memory",
    "synchronize_rng_states": "accel.core.seeding",
    "debug_launcher": "accel.launchers",
    "GradientAccumulationPlugin": "accel.runtime.accumulation",
    "DeepSpeedPlugin": "accel.config.plugins", "FullyShardedDataParallelPlugin": "accel.config.plugins",
    "set_seed": "accel.core.seeding",
    "ProjectConfiguration": "accel.checkpoint.layout",
    "CheckpointError": "accel.checkpoint.layout",
    "load_checkpoint_in_model": "accel.big_model.modeling",  # the device_map-aware one
    "init_empty_weights": "accel.big_model.dispatch", "init_on_device": "accel.big_model.dispatch",
    "cpu_offload": "accel.big_model.dispatch", "disk_offload": "accel.big_model.dispatch",
    "cpu_offload_with_hook": "accel.big_model.dispatch",
    "dispatch_model": "accel.big_model.dispatch", "load_checkpoint_and_dispatch": "accel.big_model.dispatch",
    "infer_auto_device_map": "accel.big_model.modeling",
    "is_rich_available": "accel.core.probes",
}

__all__ = sorted(_LAZY) + ["__version__"]  # noqa: PLE0605 (the lazy names: strings)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
