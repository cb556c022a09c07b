"""Accelerate's module name for its configuration classes (`from accelerate.utils.dataclasses import ...`)."""

from accel.accumulation import GradientAccumulationPlugin  # noqa: F401
from accel.checkpoint.layout import ProjectConfiguration  # noqa: F401
from accel.config import ParallelismConfig  # noqa: F401
from accel.data import DataLoaderConfiguration  # noqa: F401
from accel.kwargs import (  # noqa: F401
    AORecipeKwargs,
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from accel.plugins import (  # noqa: F401
    DeepSpeedPlugin,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    TorchDynamoPlugin,
    TorchTensorParallelPlugin,
)
from accel.state import DistributedType  # noqa: F401
