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


# name -> module that defines it, imported on first use so `import accel.utils` stays light
_LAZY = {
    **dict.fromkeys(("DataLoaderConfiguration", "skip_first_batches"), "accel.data"),
    "ProjectConfiguration": "accel.checkpoint",
    **dict.fromkeys(("DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "DynamoBackend",
                     "TorchTensorParallelPlugin"), "accel.plugins"),
    "ProfileKwargs": "accel.kwargs",
    "GradientAccumulationPlugin": "accel.accumulation",
    **dict.fromkeys((  # big-model inference helpers
        "check_device_map", "clean_device_map", "compute_module_sizes", "find_tied_parameters", "get_balanced_memory",
        "get_max_layer_size", "get_max_memory", "infer_auto_device_map", "load_checkpoint_in_model",
        "named_module_tensors", "set_module_tensor_to_device"), "accel.utils.modeling"),
    **dict.fromkeys(("OffloadedWeightsLoader", "PrefixedDataset", "load_offloaded_weight", "offload_state_dict",
                     "offload_weight", "save_offload_index"), "accel.utils.offload"),
    **dict.fromkeys(("compare_versions", "str_to_bool", "check_cuda_fp8_capability", "parse_flag_from_env"),
                    "accel.utils.imports"),
    **dict.fromkeys(("extract_model_from_parallel", "is_compiled_module"), "accel.utils.other"),
    **dict.fromkeys(("find_executable_batch_size", "release_memory", "should_reduce_batch_size",
                     "clear_device_cache"), "accel.utils.memory"),
    **dict.fromkeys(("patch_environment", "clear_environment", "get_int_from_env", "write_basic_config"),
                    "accel.utils.environment"),
    **dict.fromkeys(("copy_tensor_to_devices", "TensorInformation", "find_batch_size", "get_data_structure",
                     "initialize_tensors", "slice_tensors"), "accel.ops"),
    "tqdm": "accel.utils.progress",
    **dict.fromkeys(("DummyOptim", "DummyScheduler"), "accel.utils.deepspeed"),
}


def __getattr__(name: str):
    import importlib

    module = _LAZY.get(name) or ("accel.utils.imports" if name.startswith("is_") else None)  # the probes
    found = getattr(importlib.import_module(module), name, None) if module else None
    if found is None:
        raise AttributeError(f"module 'accel.utils' has no attribute {name!r}")
    return found


__all__ = [
    "AORecipeKwargs", "AutocastKwargs", "DDPCommunicationHookType", "DistributedDataParallelKwargs", "DistributedType",
    "GradScalerKwargs", "InitProcessGroupKwargs", "KwargsHandler", "ParallelismConfig", "broadcast",
    "broadcast_object_list", "concatenate", "gather", "gather_object", "pad_across_processes", "recursively_apply",
    "reduce", "send_to_device", "set_seed", "synchronize_rng_state", "synchronize_rng_states", *_LAZY,
]
