"""Parallelism backends. `base.py` has the interface; this module knows, without importing torch, which
backend a parallelism config asks for and whether this version of accel has it (so `accel launch` can
refuse a config before starting any process)."""

from __future__ import annotations

from accel.config import ConfigError, ParallelismConfig

# backend name -> module that implements (and registers) it
BACKEND_MODULES = {"ddp": "accel.backends.ddp", "zero": "accel.backends.zero", "tensor": "accel.backends.tensor",
                   "pipeline": "accel.backends.pipeline"}


class BackendNotAvailable(ConfigError):
    """The config asks for a parallelism this version of accel does not implement yet."""


def backend_name_for(parallelism: ParallelismConfig) -> str:
    """Which backend a parallelism config asks for (combinations compose in the backend of the outermost)."""
    if parallelism.pp_size > 1:
        return "pipeline"
    if parallelism.tp_size > 1:
        return "tensor"
    if parallelism.zero_stage > 0 or parallelism.offload_optimizer or parallelism.offload_params:
        return "zero"
    return "ddp"


def check_available(parallelism: ParallelismConfig, num_processes: int | None = None) -> str:
    """The backend's name, or a clear error when it is not available (never a silent fallback to DDP)."""
    name = backend_name_for(parallelism)
    if name == "pipeline" and (parallelism.offload_optimizer or parallelism.offload_params):
        raise BackendNotAvailable(
            f"parallelism: pipeline parallelism (pp_size={parallelism.pp_size}) with CPU offload is not available yet "
            "in accel; allowed: offload_optimizer and offload_params false")
    if parallelism.tp_size > 1 and (parallelism.zero_stage == 1 or parallelism.offload_optimizer or parallelism.offload_params):
        raise BackendNotAvailable(
            f"parallelism: tensor parallelism (tp_size={parallelism.tp_size}) with ZeRO stage 1 or CPU offload is not "
            "available yet in accel; allowed: zero_stage 0, 2 or 3 without offload")
    if name not in BACKEND_MODULES:
        wanted = " and ".join(parallelism.requested_features())
        raise BackendNotAvailable(
            f"parallelism: {wanted} is not available yet in accel; this version runs data parallelism (DDP), "
            "ZeRO stages 1-3 and tensor parallelism (alone, with DDP or ZeRO 2/3) only: set pp_size 1"
        )
    return name
