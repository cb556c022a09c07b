"""accel: an ordinary PyTorch training loop on one CPU, many processes, GPUs or machines.

The public names match Hugging Face Accelerate's. Attributes load lazily so `import accel` stays cheap.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"


def _export_restart_count() -> None:
    """Set ACCEL_RESTART_COUNT: which attempt this is under `accel launch --max_restarts N` (0 = the first), from
    torchrun's TORCHELASTIC_RESTART_COUNT. Done on import, so a script can read it before making an Accelerator;
    outside torchrun a value the user set is kept (to rehearse a restart), else 0."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("ACCEL_RESTART_COUNT") or "0"
    os.environ["ACCEL_RESTART_COUNT"] = count


_export_restart_count()

from accel.rank_warnings import warn_once_per_job  # noqa: E402

warn_once_per_job()  # ranks other than 0 leave the warnings every rank repeats to rank 0

_LAZY = {
    "Accelerator": "accel.accelerator",
    "PartialState": "accel.state",
    "AcceleratorState": "accel.state",
    "DistributedType": "accel.state",
    "ParallelismConfig": "accel.config",
    "AccelConfig": "accel.config",
    "ConfigError": "accel.config",
    "DataLoaderConfiguration": "accel.data",
    "skip_first_batches": "accel.data",
    "DistributedDataParallelKwargs": "accel.kwargs",
    "GradScalerKwargs": "accel.kwargs",
    "InitProcessGroupKwargs": "accel.kwargs",
    "AutocastKwargs": "accel.kwargs",
    "AORecipeKwargs": "accel.kwargs",
    "ProfileKwargs": "accel.kwargs",
    "DDPCommunicationHookType": "accel.kwargs",
    "notebook_launcher": "accel.launchers",
    "find_executable_batch_size": "accel.utils.memory",
    "synchronize_rng_states": "accel.utils.random",
    "debug_launcher": "accel.launchers",
    "GradientAccumulationPlugin": "accel.accumulation",
    "DeepSpeedPlugin": "accel.plugins", "FullyShardedDataParallelPlugin": "accel.plugins",
    "set_seed": "accel.utils.random",
    "ProjectConfiguration": "accel.checkpoint.layout",
    "CheckpointError": "accel.checkpoint.layout",
    "load_checkpoint_in_model": "accel.utils.modeling",  # the device_map-aware one
    "init_empty_weights": "accel.big_modeling", "init_on_device": "accel.big_modeling",
    "cpu_offload": "accel.big_modeling", "disk_offload": "accel.big_modeling",
    "cpu_offload_with_hook": "accel.big_modeling",
    "dispatch_model": "accel.big_modeling", "load_checkpoint_and_dispatch": "accel.big_modeling",
    "infer_auto_device_map": "accel.utils.modeling",
    "is_rich_available": "accel.utils.imports",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
