"""The one typed config tree, split by concept (see each module's docstring):

* `errors`, `degrees`: the error type and the values derived from the parallel degrees (below everything);
* `mesh_layout`: the degrees as named mesh dimensions (sizes, coordinates, shape; accel.runtime.topology builds it);
* `kwargs`, `plugins`: Accelerate's handler and plugin classes, mapped onto this config;
* `schema`: the dataclasses, field rules, cross-field rules and the values derived from them;
* `accelerate_import`: Accelerate's config sections and DeepSpeed JSON files, as accel layers;
* `resolve`: layers and precedence (files, `accel launch` flags, the launched config, `Accelerator` args).

Every name other modules use is re-exported here, so `from accel.config import X` keeps working.
"""

from accel.config.accelerate_import import (
    ACCELERATE_IGNORED_KEYS,
    ACCELERATE_SECTIONS,
    DEEPSPEED_FILE_KEY,
    KNOWN_TOP_KEYS,
    OFFLOAD_DEVICES,
    DeepSpeedConfigWarning,
    deepspeed_json_layer,
    read_deepspeed_config,
    read_deepspeed_json,
)
from accel.config.resolve import (
    LAUNCH_ENV,
    PACKAGED_DEFAULT,
    USER_CONFIG_ENV,
    build_config,
    config_from_dict,
    config_save_path,
    default_user_config_path,
    encode_for_workers,
    file_layers,
    launched_config,
    merge_layers,
    parse_layer,
    read_config_file,
    resolve_config,
    resolve_launch_config,
    user_config_path,
    worker_config,
    worker_layers,
)
from accel.config.schema import (
    ACTIVATION_CHECKPOINTING,
    DISTRIBUTED_TYPES,
    DYNAMO_BACKENDS,
    DYNAMO_MODES,
    MIXED_PRECISIONS,
    PARALLEL_FIELDS,
    PP_SCHEDULES,
    RDZV_BACKENDS,
    TOP_FIELDS,
    AccelConfig,
    ConfigError,
    ParallelismConfig,
    allowed_values,
    check_consistency,
    check_value,
    compact_gpu_ids,
    cuda_visible_devices,
    divides_world,
    model_parallel_size,
)

__all__ = [
    "ACCELERATE_IGNORED_KEYS", "ACCELERATE_SECTIONS", "ACTIVATION_CHECKPOINTING", "DEEPSPEED_FILE_KEY",
    "DYNAMO_BACKENDS", "DYNAMO_MODES", "DISTRIBUTED_TYPES", "KNOWN_TOP_KEYS", "OFFLOAD_DEVICES", "LAUNCH_ENV",
    "MIXED_PRECISIONS", "PACKAGED_DEFAULT", "PARALLEL_FIELDS",
    "PP_SCHEDULES", "RDZV_BACKENDS", "TOP_FIELDS", "USER_CONFIG_ENV", "AccelConfig", "ConfigError",
    "DeepSpeedConfigWarning", "ParallelismConfig", "allowed_values", "build_config", "check_consistency",
    "check_value", "compact_gpu_ids", "config_from_dict", "config_save_path", "cuda_visible_devices",
    "deepspeed_json_layer",
    "default_user_config_path", "divides_world", "encode_for_workers", "file_layers", "launched_config",
    "merge_layers", "model_parallel_size", "parse_layer", "read_config_file", "read_deepspeed_config",
    "read_deepspeed_json", "resolve_config", "resolve_launch_config", "user_config_path", "worker_config",
    "worker_layers",
]
