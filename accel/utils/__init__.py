"""Helpers Accelerate users import from `accelerate.utils`, under the same names."""

from __future__ import annotations

from accel.config import ParallelismConfig
from accel.config.kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
)
from accel.runtime.ops import (
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
from accel.runtime.state import DistributedType
from accel.core.seeding import set_seed, synchronize_rng_state, synchronize_rng_states


# name -> module that defines it, imported on first use so `import accel.utils` stays light
_LAZY = {
    **dict.fromkeys(("DataLoaderConfiguration", "skip_first_batches"), "accel.data.loading"),
    "ProjectConfiguration": "accel.checkpoint",
    **dict.fromkeys(("DeepSpeedPlugin", "FullyShardedDataParallelPlugin", "TorchDynamoPlugin", "DynamoBackend",
                     "TorchTensorParallelPlugin"), "accel.config.plugins"),
    **dict.fromkeys(("ProfileKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs"), "accel.config.kwargs"),
    "ThroughputMonitorKwargs": "accel.config.kwargs",
    "GradientAccumulationPlugin": "accel.runtime.accumulation",
    **dict.fromkeys((  # big-model inference helpers
        "check_device_map", "clean_device_map", "compute_module_sizes", "find_tied_parameters", "get_balanced_memory",
        "get_max_layer_size", "get_max_memory", "infer_auto_device_map", "load_checkpoint_in_model",
        "named_module_tensors", "set_module_tensor_to_device"), "accel.big_model.modeling"),
    **dict.fromkeys(("OffloadedWeightsLoader", "PrefixedDataset", "load_offloaded_weight", "offload_state_dict",
                     "offload_weight", "save_offload_index"), "accel.big_model.offload"),
    **dict.fromkeys(("compare_versions", "str_to_bool", "check_cuda_fp8_capability", "parse_flag_from_env"),
                    "accel.core.probes"),
    **dict.fromkeys(("extract_model_from_parallel", "is_compiled_module"), "accel.compat.other"),
    **dict.fromkeys(("find_executable_batch_size", "release_memory", "should_reduce_batch_size",
                     "clear_device_cache"), "accel.core.memory"),
    **dict.fromkeys(("patch_environment", "clear_environment", "get_int_from_env", "write_basic_config"),
                    "accel.compat.environment"),
    **dict.fromkeys(("copy_tensor_to_devices", "TensorInformation", "find_batch_size", "get_data_structure",
                     "initialize_tensors", "slice_tensors"), "accel.runtime.ops"),
    "tqdm": "accel.runtime.progress",
    **dict.fromkeys(("convert_model_to_fp8_ao", "filter_first_and_last_linear_layers", "has_ao_layers"),
                    "accel.compat.ao"),
    **dict.fromkeys(("DummyOptim", "DummyScheduler", "DeepSpeedSchedulerWrapper", "HfDeepSpeedConfig"),
                    "accel.compat.deepspeed"),
    "get_module_class_from_name": "accel.compat.dataclasses",
    **dict.fromkeys(("DeepSpeedSequenceParallelConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig"),
                    "accel.config.parallel_handlers"),
    **dict.fromkeys(("disable_fsdp_ram_efficient_loading", "enable_fsdp_ram_efficient_loading",
                     "fsdp2_canonicalize_names", "fsdp2_load_full_state_dict", "get_fsdp2_grad_scaler"),
                    "accel.utils.fsdp_utils"),
    # Accelerate's small helpers, each in the module of Accelerate's name
    **dict.fromkeys((
        "MODEL_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME", "SCALER_NAME", "RNG_STATE_NAME",
        "SAFE_MODEL_NAME", "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "WEIGHTS_NAME",
        "WEIGHTS_INDEX_NAME", "WEIGHTS_PATTERN_NAME", "PROFILE_PATTERN_NAME", "TORCH_LAUNCH_PARAMS",
        "TORCH_DISTRIBUTED_OPERATION_TYPES", "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION",
        "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION", "FSDP_MODEL_NAME", "FSDP_SHARDING_STRATEGY", "FSDP_AUTO_WRAP_POLICY",
        "FSDP_BACKWARD_PREFETCH", "FSDP_STATE_DICT_TYPE", "FSDP2_STATE_DICT_TYPE"), "accel.core.constants"),
    **dict.fromkeys(("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer"),
                    "accel.checkpoint.fsdp_compat"),
    **dict.fromkeys(("ComputeEnvironment", "CustomDtype", "FP8BackendType", "LoggerType", "PrecisionType", "RNGType",
                     "SageMakerDistributedType"), "accel.compat.dataclasses"),
    **dict.fromkeys(("CannotPadNestedTensorWarning", "convert_outputs_to_fp32", "convert_to_fp32", "find_device",
                     "honor_type", "ignorant_find_batch_size", "is_namedtuple", "is_tensor_information",
                     "is_torch_tensor", "listify", "pad_input_tensors"), "accel.compat.operations"),
    **dict.fromkeys(("check_os_kernel", "clean_state_dict_for_safetensors", "compile_regions", "convert_bytes",
                     "get_module_children_bottom_up", "get_pretty_name", "has_compiled_regions", "is_port_in_use",
                     "load", "merge_dicts", "model_has_dtensor", "recursive_getattr", "save", "wait_for_everyone",
                     "get_model_tp_size", "has_transformer_engine_layers", "is_peft_model"),
                    "accel.compat.other"),
    **dict.fromkeys(("align_module_device", "calculate_maximum_sizes", "check_tied_parameters_in_config",
                     "check_tied_parameters_on_same_device", "convert_file_size_to_int", "dtype_byte_size",
                     "ensure_weights_retied", "get_grad_scaler", "get_mixed_precision_context_manager",
                     "has_offloaded_params", "id_tensor_storage", "load_offloaded_weights",
                     "load_state_dict", "retie_parameters"), "accel.big_model.modeling"),
    "extract_submodules_state_dict": "accel.big_model.offload",
    **dict.fromkeys(("are_libraries_initialized", "check_cuda_p2p_ib_support", "convert_dict_to_env_variables",
                     "get_cpu_distributed_information", "get_current_device_type", "get_gpu_info",
                     "parse_choice_from_env", "purge_accelerate_environment"), "accel.compat.environment"),
    **dict.fromkeys(("deepspeed_required", "torchao_required", "get_torch_accelerator_backend",
                     "get_distributed_backend"), "accel.core.probes"),
    **dict.fromkeys(("PrepareForLaunch", "prepare_multi_gpu_env", "prepare_simple_launcher_cmd_env"),
                    "accel.compat.launch"),
    "merge_fsdp_weights": "accel.checkpoint.merge",
}


def __getattr__(name: str):
    import importlib

    module = _LAZY.get(name) or ("accel.core.probes" if name.startswith("is_") else None)  # the probes
    found = getattr(importlib.import_module(module), name, None) if module else None
    if found is None:
        raise AttributeError(f"module 'accel.utils' has no attribute {name!r}")
    return found


__all__ = [  # noqa: PLE0604 (the lazy names: strings)
    "AORecipeKwargs", "AutocastKwargs", "DDPCommunicationHookType", "DistributedDataParallelKwargs", "DistributedType",
    "GradScalerKwargs", "InitProcessGroupKwargs", "KwargsHandler", "ParallelismConfig", "broadcast",
    "broadcast_object_list", "concatenate", "gather", "gather_object", "pad_across_processes", "recursively_apply",
    "reduce", "send_to_device", "set_seed", "synchronize_rng_state", "synchronize_rng_states", *_LAZY,
]
