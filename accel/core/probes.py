"""Accelerate's `is_*_available` probes and version helpers (`accelerate.utils.imports` / `.versions` /
`.environment`): scripts and Accelerate's own test helpers branch on them. A package probe only looks for the
package (nothing is imported); a device probe asks torch."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import operator
import os

import torch

_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
               "<": operator.lt}


def _installed(*names: str) -> bool:
    """Whether every module can be found; a dotted name whose parent package is missing (find_spec raises
    ModuleNotFoundError for it) or a broken one is not found, never an error."""
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except (ImportError, ValueError, AttributeError):
            return False
    return True


def _version(text: str):
    return torch.torch_version.TorchVersion(text)


def compare_versions(library_or_version, operation: str, requirement_version: str) -> bool:
    """`library_or_version` (an installed package's name, or a version) compared with `requirement_version`."""
    if operation not in _OPERATIONS:
        raise ValueError(f"compare_versions: operation {operation!r}; allowed: {', '.join(_OPERATIONS)}")
    version = library_or_version
    if isinstance(version, str) and not version[:1].isdigit():
        version = importlib.metadata.version(version)
    return _OPERATIONS[operation](_version(str(version)), str(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    return compare_versions(torch.__version__, operation, version)


def str_to_bool(value, to_bool: bool = False):
    """Accelerate's reading of a boolean environment value: 1/0 (or True/False with `to_bool`)."""
    value = str(value).lower()
    if value in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if value in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}")


# -- devices --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def nvml_cuda_check():
    """While inside, torch answers `torch.cuda.is_available()` through NVML, without initialising the CUDA runtime
    (which would make every process forked afterwards fail with "Cannot re-initialize CUDA in forked subprocess")."""
    old = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = old


def is_cuda_available() -> bool:
    """Whether a GPU is there, asked through NVML (as Accelerate's probe does), so a process that asks can still fork
    workers that use CUDA (`notebook_launcher`)."""
    with nvml_cuda_check():
        return torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    return is_torch_version(">=", min_version) and torch.backends.mps.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def _no_device(*_args, **_kwargs) -> bool:
    return False


# accelerators accel has no code path for (it runs on CPU and CUDA): always False
is_mlu_available = is_musa_available = is_npu_available = is_sdaa_available = is_hpu_available = _no_device
is_neuron_available = is_habana_gaudi1 = is_torch_xla_available = is_xccl_available = _no_device
is_rocm_available = is_bitsandbytes_multi_backend_available = is_import_timer_available = _no_device


def is_torch_distributed_available() -> bool:
    return torch.distributed.is_available()


_DISTRIBUTED_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}  # of Accelerate 1.16's table, the devices torch here may have


def get_torch_accelerator_backend(check_available: bool = True):
    """(device type, its torch module) of the accelerator torch sees, or (None, None) on a CPU-only machine
    (Accelerate 1.16's; its test helpers call it). `check_available=False`: without probing the device."""
    try:
        device = torch.accelerator.current_accelerator()
    except RuntimeError:  # torch 2.6 on a CPU-only build
        device = None
    if device is None:
        return None, None
    if check_available and not torch.accelerator.is_available():
        return None, None
    if device.type in ("cuda", "mps", "xpu"):
        return device.type, torch.get_device_module(device.type)
    return device.type, torch.accelerator


def get_distributed_backend(device_type: str | None) -> str | None:
    """The default torch.distributed backend of a device type (nccl for cuda), None where there is none."""
    return _DISTRIBUTED_BACKENDS.get(device_type) if device_type is not None else None


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()


def is_fp16_available() -> bool:
    return True


def check_cuda_fp8_capability() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def is_fp8_available() -> bool:
    """accel's fp8 is torchao's float8 training (emulated on the CPU)."""
    return _installed("torchao")


def is_weights_only_available() -> bool:
    return True


# -- packages -------------------------------------------------------------------------------------------------
def _package_probe(*modules: str):
    def probe(*_args, **_kwargs) -> bool:
        return _installed(*modules)

    probe.__doc__ = f"Whether {', '.join(modules)} can be imported here."
    return probe


is_torchao_available = _package_probe("torchao")
is_deepspeed_available = _package_probe("deepspeed")
is_transformers_available = _package_probe("transformers")
is_datasets_available = _package_probe("datasets")
is_peft_available = _package_probe("peft")
is_timm_available = _package_probe("timm")
is_triton_available = _package_probe("triton")
is_aim_available = _package_probe("aim")
is_tensorboard_available = _package_probe("tensorboard")
is_wandb_available = _package_probe("wandb")
is_comet_ml_available = _package_probe("comet_ml")
is_swanlab_available = _package_probe("swanlab")
is_trackio_available = _package_probe("trackio")
is_clearml_available = _package_probe("clearml")
is_mlflow_available = _package_probe("mlflow")
is_dvclive_available = _package_probe("dvclive")
is_pandas_available = _package_probe("pandas")
is_matplotlib_available = _package_probe("matplotlib")
is_boto3_available = _package_probe("boto3")
is_sagemaker_available = _package_probe("sagemaker")
is_tqdm_available = _package_probe("tqdm")
is_pytest_available = _package_probe("pytest")
is_schedulefree_available = _package_probe("schedulefree")
is_lomo_available = _package_probe("lomo_optim")
is_msamp_available = _package_probe("msamp")
is_transformer_engine_available = _package_probe("transformer_engine")
is_transformer_engine_mxfp8_available = _no_device
is_megatron_lm_available = _package_probe("megatron")
is_pippy_available = is_torch_distributed_available  # torch.distributed.pipelining
is_torchvision_available = _package_probe("torchvision")
is_torchdata_available = _package_probe("torchdata")
is_torchdata_stateful_dataloader_available = _package_probe("torchdata.stateful_dataloader")
is_pynvml_available = _package_probe("pynvml")
is_amdsmi_available = _package_probe("amdsmi")


def _at_least(package: str, min_version: str | None) -> bool:
    """Whether `package` is installed (and, with `min_version`, at least that version); False when it or its
    metadata is missing."""
    if not _installed(package):
        return False
    try:
        return min_version is None or compare_versions(package, ">=", min_version)
    except importlib.metadata.PackageNotFoundError:
        return False


def is_bnb_available(min_version: str | None = None) -> bool:
    return _at_least("bitsandbytes", min_version)


is_4bit_bnb_available = is_8bit_bnb_available = is_bnb_available


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    return _at_least("numpy", min_version)


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    return str_to_bool(os.environ.get(key, str(default)), to_bool=True)


def is_rich_available() -> bool:
    """Whether rich is installed and asked for ($ACCELERATE_ENABLE_RICH, as in Accelerate: off by default)."""
    return _installed("rich") and parse_flag_from_env("ACCELERATE_ENABLE_RICH", False)


def torchao_required(func):
    """Decorator: calling `func` without torchao installed is an ImportError saying how to install it."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if not is_torchao_available():
            raise ImportError("`torchao` is not available, please install it before calling this function via "
                              "`pip install torchao`.")
        return func(*args, **kwargs)

    return wrapper


def deepspeed_required(func):
    """Decorator for functions that work on DeepSpeed's engine: accel has none (a DeepSpeed config runs on accel's
    ZeRO backend), so calling `func` is a one-line NotImplementedError."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        raise NotImplementedError(f"{func.__name__}: DeepSpeed's engine is not available yet in accel (a DeepSpeed "
                                  "config runs on accel's ZeRO backend); this function needs DeepSpeed itself")

    return wrapper


__all__ = [name for name in dir() if name.startswith(("is_", "compare_versions", "str_to_bool", "check_cuda"))]
