"""Helpers Accelerate users import from `accelerate.utils`, under the same names."""

from __future__ import annotations

from accel.config import ParallelismConfig
from accel.kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from accel.ops import (
    broadcast,
    broadcast_object_list,
    concatenate,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
)
from accel.state import DistributedType
from accel.utils.random import set_seed, synchronize_rng_state, synchronize_rng_states


# big-model inference helpers, imported on first use
_MODELING = (
    "check_device_map", "clean_device_map", "compute_module_sizes", "find_tied_parameters", "get_balanced_memory",
    "get_max_layer_size", "get_max_memory", "infer_auto_device_map", "load_checkpoint_in_model",
    "named_module_tensors", "set_module_tensor_to_device",
)
_OFFLOAD = (
    "OffloadedWeightsLoader", "PrefixedDataset", "load_offloaded_weight", "offload_state_dict", "offload_weight",
    "save_offload_index",
)


def __getattr__(name: str):
    # data-loading names live in accel.data; imported lazily so `import accel.utils` stays light
    if name in ("DataLoaderConfiguration", "skip_first_batches"):
        import accel.data

        return getattr(accel.data, name)
    if name == "ProjectConfiguration":
        import accel.checkpoint

        return getattr(accel.checkpoint, name)
    if name in ("DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "DynamoBackend"):
        import accel.plugins

        return getattr(accel.plugins, name)
    if name in _MODELING:
        import accel.utils.modeling

        return getattr(accel.utils.modeling, name)
    if name in _OFFLOAD:
        import accel.utils.offload

        return getattr(accel.utils.offload, name)
    if name.startswith("is_") or name in ("compare_versions", "str_to_bool", "check_cuda_fp8_capability",
                                          "parse_flag_from_env"):
        import accel.utils.imports

        if hasattr(accel.utils.imports, name):
            return getattr(accel.utils.imports, name)
    if name in ("extract_model_from_parallel", "is_compiled_module"):
        import accel.utils.other

        return getattr(accel.utils.other, name)
    if name in ("find_executable_batch_size", "release_memory", "should_reduce_batch_size", "clear_device_cache"):
        import accel.utils.memory

        return getattr(accel.utils.memory, name)
    if name in ("patch_environment", "clear_environment", "get_int_from_env", "write_basic_config"):
        import accel.utils.environment

        return getattr(accel.utils.environment, name)
    if name == "copy_tensor_to_devices":
        from accel.ops import copy_tensor_to_devices

        return copy_tensor_to_devices
    if name == "tqdm":
        from accel.utils.progress import tqdm

        return tqdm
    if name == "GradientAccumulationPlugin":
        from accel.accumulation import GradientAccumulationPlugin

        return GradientAccumulationPlugin
    raise AttributeError(f"module 'accel.utils' has no attribute {name!r}")


__all__ = [
    "AORecipeKwargs", "AutocastKwargs", "DDPCommunicationHookType", "DistributedDataParallelKwargs", "DistributedType", "GradScalerKwargs", "InitProcessGroupKwargs",
    "KwargsHandler", "ParallelismConfig", "synchronize_rng_state", "synchronize_rng_states", "broadcast", "broadcast_object_list", "concatenate", "gather", "gather_object",
    "pad_across_processes", "recursively_apply", "reduce", "send_to_device", "set_seed", "DataLoaderConfiguration",
    "skip_first_batches", "GradientAccumulationPlugin", "TorchDynamoPlugin", "DynamoBackend", "ProjectConfiguration", "load_checkpoint_in_model",
    *_MODELING, *_OFFLOAD,
]
