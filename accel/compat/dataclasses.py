"""Accelerate's module name for its configuration classes (`from accelerate.utils.dataclasses import ...`)."""

import enum

from accel.runtime.accumulation import GradientAccumulationPlugin  # noqa: F401
from accel.checkpoint.layout import ProjectConfiguration  # noqa: F401
from accel.config.parallel_handlers import (  # noqa: F401 (Accelerate's names in this module)
    DeepSpeedSequenceParallelConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from accel.config import ParallelismConfig  # noqa: F401
from accel.data.loading import DataLoaderConfiguration  # noqa: F401
from accel.config.kwargs import (  # noqa: F401
    AORecipeKwargs,
    AutocastKwargs,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from accel.config.plugins import (  # noqa: F401
    DeepSpeedPlugin,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    TorchDynamoPlugin,
    TorchTensorParallelPlugin,
)
from accel.runtime.state import DistributedType  # noqa: F401


# -- Accelerate's enums of names (defined here, as in Accelerate) ---------------------------------------------------


class EnumWithContains(enum.EnumMeta):
    """`"fp16" in PrecisionType`: whether a value names a member."""

    def __contains__(cls, item) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class BaseEnum(enum.Enum, metaclass=EnumWithContains):
    """An enum whose `str()` is its value, with `.list()` of all values."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [str(member) for member in cls]


class SageMakerDistributedType(str, enum.Enum):
    """SageMaker's kinds of run (accel does not launch on SageMaker; the names are for configs and scripts)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class ComputeEnvironment(str, enum.Enum):
    """Where a config runs: this machine (or a cluster of them), or Amazon SageMaker."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class LoggerType(BaseEnum):
    """The experiment trackers' names (`Accelerator(log_with=...)`); `all` means every one installed."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class FP8BackendType(str, BaseEnum):
    """Which library trains in fp8 (Accelerate's values); accel's fp8 is torchao's ("AO")."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


class PrecisionType(str, BaseEnum):
    """The values of `mixed_precision` (a `str`, so a member equals its value)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(BaseEnum):
    """The random number generators a prepared data loader can synchronize (`rng_types=`)."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class CustomDtype(enum.Enum):
    """Sizes below a byte (and fp8) for the device-map helpers (`dtype_byte_size`, `infer_auto_device_map`)."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


def get_module_class_from_name(module, name: str):
    """The class named `name` of `module` or of its first submodule (depth first) of that class; None if none is
    (Accelerate's helper, which PEFT imports)."""
    if type(module).__name__ == name:
        return type(module)
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None
