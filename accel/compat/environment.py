"""Accelerate's environment helpers (`accelerate.utils.environment` / `.other`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import platform
import shutil
import subprocess
import sys

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def patch_environment(**kwargs):
    """Set environment variables (upper-cased names, values as strings) inside the block; restore them after."""
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment():
    """Run the block with an empty environment; the old one comes back after."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def get_int_from_env(env_keys, default: int) -> int:
    """The first non-negative integer among the environment variables `env_keys`, else `default`."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None) -> str | bool:
    """Write a config for this machine (all GPUs, or one CPU process) without questions, as `accel config` would;
    False when one exists already at that place (Accelerate's behaviour)."""
    import torch

    from accel.config import AccelConfig, config_save_path
    from accel.core.probes import is_cuda_available  # NVML: asking does not initialise CUDA

    path = config_save_path(save_location)
    if path.exists():
        return False
    gpus = torch.cuda.device_count() if is_cuda_available() else 0
    cfg = AccelConfig(mixed_precision=mixed_precision, num_processes=max(gpus, 1), use_cpu=gpus == 0)
    return str(cfg.save(path))


def _logger() -> logging.Logger:
    """This module's logger; under the shim Accelerate's name for it (`accelerate.utils.environment`, where scripts and
    Accelerate's tests listen)."""
    from accel.core.shim_version import shim_active

    return logging.getLogger("accelerate.utils.environment") if shim_active() else logger


def convert_dict_to_env_variables(current_env: dict) -> list[str]:
    """`KEY=value\n` lines for a launcher's environment file; an item with an empty key or value, or with one of
    `; \\n < >` or a space in it, is skipped with a warning."""
    lines = []
    for key, value in current_env.items():
        if not any(char in key + value for char in ";\n<> ") and len(key) >= 1 and len(value) >= 1:
            lines.append(f"{key}={value}\n")
        else:
            _logger().warning(f"WARNING: Skipping {key}={value} as it contains forbidden characters or missing "
                              "values.")
    return lines


def parse_choice_from_env(key: str, default="no") -> str:
    """The environment variable `key` as it is, or `str(default)`."""
    return os.environ.get(key, str(default))


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of `library_names` already imported in this process."""
    return [name for name in library_names if name in sys.modules]


@dataclasses.dataclass
class CPUInformation:
    """This process's place in a CPU job: rank, world size, local rank, processes on this machine."""

    rank: int = dataclasses.field(default=0, metadata={"help": "The rank of the current process."})
    world_size: int = dataclasses.field(default=1, metadata={"help": "The total number of processes in the world."})
    local_rank: int = dataclasses.field(default=0,
                                        metadata={"help": "The rank of the current process on the local node."})
    local_world_size: int = dataclasses.field(default=1,
                                              metadata={"help": "The total number of processes on the local node."})


def get_cpu_distributed_information() -> CPUInformation:
    """`CPUInformation` from torchrun's variables, or MPI's (Intel MPI/MPICH `PMI_*`, Open MPI, MVAPICH)."""
    return CPUInformation(
        rank=get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0),
        world_size=get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1),
        local_rank=get_int_from_env(
            ["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"], 0),
        local_world_size=get_int_from_env(
            ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"], 1),
    )


def get_current_device_type() -> tuple[str, str]:
    """(device type, distributed type) of this machine's accelerator without initialising it: `("xpu",
    "MULTI_XPU")` on Intel GPUs, else `("cuda", "MULTI_GPU")` (accel runs on no other accelerator)."""
    from accel.core import probes as imports

    for probe, answer in ((imports.is_mlu_available, ("mlu", "MULTI_MLU")),
                          (imports.is_sdaa_available, ("sdaa", "MULTI_SDAA")),
                          (imports.is_musa_available, ("musa", "MULTI_MUSA")),
                          (imports.is_npu_available, ("npu", "MULTI_NPU")),
                          (imports.is_hpu_available, ("hpu", "MULTI_HPU")),
                          (imports.is_xpu_available, ("xpu", "MULTI_XPU")),
                          (imports.is_neuron_available, ("neuron", "MULTI_NEURON"))):
        if probe():
            return answer
    return "cuda", "MULTI_GPU"


def _nvidia_smi() -> str:
    if platform.system() == "Windows":
        found = shutil.which("nvidia-smi")
        if found is None:
            return f"{os.environ['systemdrive']}\\Program Files\\NVIDIA Corporation\\NVSMI\\nvidia-smi.exe"
        return found
    return "nvidia-smi"


def _query_gpus(field: str) -> list[str]:
    output = subprocess.check_output([_nvidia_smi(), f"--query-gpu={field}", "--format=csv,noheader"],
                                     universal_newlines=True)
    return output.strip().split(os.linesep)


def get_gpu_info() -> tuple[list[str], int]:
    """(names, count) of the GPUs, asked of `nvidia-smi` so CUDA is not initialised (raises where there is no
    nvidia-smi, as Accelerate's does)."""
    gpus = _query_gpus("count,name")
    return [gpu.split(",")[1].strip() for gpu in gpus], len(gpus)


def get_driver_version() -> str:
    """The NVIDIA driver's version (of the first GPU), from `nvidia-smi`."""
    return _query_gpus("driver_version")[0]


def check_cuda_p2p_ib_support() -> bool:
    """False where several consumer GPUs of the RTX 40 series run a driver older than 550.40.07 (their P2P and
    InfiniBand transfers hang NCCL), True otherwise, also when nvidia-smi cannot be asked."""
    from accel.core.probes import compare_versions

    try:
        names, count = get_gpu_info()
        if count > 1 and any("RTX 40" in name for name in names):
            return not compare_versions(get_driver_version(), "<", "550.40.07")
    except Exception:
        pass
    return True


def purge_accelerate_environment(func_or_cls):
    """Decorator: the `ACCELERATE_*` environment variables are restored after the function (or each `test*` method
    of the class and of its subclasses) returns: ones it set are removed, ones it changed put back."""
    prefix = "ACCELERATE_"

    @contextlib.contextmanager
    def restored():
        before = {k: v for k, v in os.environ.items() if k.startswith(prefix)}
        try:
            yield
        finally:
            for key in [k for k in os.environ if k.startswith(prefix)]:
                if key in before:
                    os.environ[key] = before[key]
                else:
                    del os.environ[key]

    def wrap(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with restored():
                return func(*args, **kwargs)

        wrapper._accelerate_is_purged_environment_wrapped = True
        return wrapper

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)

    def wrap_tests(cls):
        for name in dir(cls):
            if name.startswith("test"):
                method = getattr(cls, name)
                if callable(method) and not hasattr(method, "_accelerate_is_purged_environment_wrapped"):
                    setattr(cls, name, wrap(method))
        return cls

    wrap_tests(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(lambda cls, **kwargs: wrap_tests(cls))
    return func_or_cls
