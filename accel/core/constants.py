"""Accelerate's constants (`accelerate.utils.constants`): checkpoint file names, launcher parameter names and the
torch versions some features need. Plain values, nothing imported, so reading one costs nothing."""

from __future__ import annotations

# -- file names of a saved training state and of saved weights ------------------------------------------------------
SCALER_NAME = "scaler.pt"
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
RNG_STATE_NAME = "random_states"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"
WEIGHTS_NAME = MODEL_NAME + ".bin"
WEIGHTS_PATTERN_NAME = MODEL_NAME + "{suffix}.bin"
WEIGHTS_INDEX_NAME = WEIGHTS_NAME + ".index.json"
SAFE_WEIGHTS_NAME = SAFE_MODEL_NAME + ".safetensors"
SAFE_WEIGHTS_PATTERN_NAME = SAFE_MODEL_NAME + "{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = SAFE_WEIGHTS_NAME + ".index.json"
FSDP_MODEL_NAME = "pytorch_model_fsdp"

# -- FSDP option values (what transformers' TrainingArguments checks `fsdp_config` against) ---------------------------
# accel maps the sharding strategies onto ZeRO stages (accel.config.plugins); the others are accepted and recorded.
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]

# -- torch versions from which a feature exists ----------------------------------------------------------------------
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"
FSDP2_PYTORCH_VERSION = "2.6.0"
DTENSOR_PYTORCH_VERSION = "2.5.0"
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"  # Accelerate's: transformers' tp_plan
BETA_SP_AVAILABLE_DEEPSPEED_VERSION = "0.18.2"  # Accelerate's: DeepSpeed's sequence parallelism (not in accel)

TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]

# -- launcher --------------------------------------------------------------------------------------------------------
# torch.distributed.run's own arguments (what a launcher passes to torchrun rather than to the script)
TORCH_LAUNCH_PARAMS = [
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone",
    "max_restarts", "monitor_interval", "start_method", "role", "module", "m", "no_python", "run_path", "log_dir",
    "r", "redirects", "t", "tee", "node_rank", "master_addr", "master_port",
]

# the distributed types (DistributedType values) whose collectives go through torch.distributed
CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
TORCH_DISTRIBUTED_OPERATION_TYPES = [
    *CUDA_DISTRIBUTED_TYPES, "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_CPU",
    "MULTI_HPU", "MULTI_NEURON",
]


def __getattr__(name: str):
    """`SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING`: layer classes (so it needs torch), made on first use."""
    if name == "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING":
        from torch import nn

        return (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear)
    raise AttributeError(f"module 'accel.core.constants' has no attribute {name!r}")
