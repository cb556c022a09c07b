"""Sizes, memory budgets and device maps for big-model inference (the names of ``accelerate.utils.modeling``).

A device map sends each module (or tensor) name to a GPU index, ``"cpu"`` or ``"disk"``. It is computed from
parameter sizes only, so it works on a model built under ``init_empty_weights`` (meta tensors), and it is
used to load a checkpoint one tensor at a time straight to where each tensor will live, so that a model
larger than memory never has to be materialised whole.

The helpers live by theme, each module named for it: `module_tensors` (a module's tensors by name, ties, offloaded
parameters), `sizes`, `dtypes`, `device_map` (memory budgets and device maps) and `checkpoint_loading` (checkpoints
loaded into a model along a device map). This module is their one import path, and `accel.utils.modeling` is this
module object.
"""

from accel.big_model.module_tensors import (  # noqa: F401
    Device,
    align_module_device,
    check_tied_parameters_in_config,
    check_tied_parameters_on_same_device,
    ensure_weights_retied,
    find_tied_parameters,
    get_non_persistent_buffers,
    has_offloaded_params,
    id_tensor_storage,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)
from accel.big_model.sizes import (
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    get_max_layer_size,
    get_module_size_with_ties,
)
from accel.big_model.dtypes import (
    dtype_byte_size,
    get_grad_scaler,
    get_mixed_precision_context_manager,
)
from accel.big_model.device_map import (  # noqa: F401
    DEVICE_MAP_STRATEGIES,
    check_device_map,
    clean_device_map,
    fallback_allocate,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
)
from accel.big_model.checkpoint_loading import (
    get_state_dict_from_offload,
    get_state_dict_offloaded_model,
    load_checkpoint_in_model,
    load_checkpoint_with_device_map,
    load_offloaded_weights,
    load_state_dict,
)

__all__ = [
    "get_state_dict_from_offload",
    "named_module_tensors",
    "set_module_tensor_to_device",
    "find_tied_parameters",
    "compute_module_sizes",
    "get_max_layer_size",
    "get_max_memory",
    "get_balanced_memory",
    "infer_auto_device_map",
    "clean_device_map",
    "check_device_map",
    "load_checkpoint_with_device_map",
    "load_checkpoint_in_model",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "id_tensor_storage",
    "calculate_maximum_sizes",
    "has_offloaded_params",
    "align_module_device",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "retie_parameters",
    "get_grad_scaler",
    "get_mixed_precision_context_manager",
    "load_offloaded_weights",
    "load_state_dict",
    "ensure_weights_retied",
    "get_non_persistent_buffers",
    "compute_module_total_buffer_size",
    "get_module_size_with_ties",
    "get_state_dict_offloaded_model",
    "fallback_allocate",
]
