"""Dtypes and mixed precision as Accelerate's `utils.modeling` names them: bytes per element (quantized ones
included), the gradient scaler and the autocast context of a precision.
"""

from __future__ import annotations

import contextlib
import os

import torch


_CUSTOM_DTYPE_BYTES = {"int2": 1 / 4, "int4": 1 / 2, "fp8": 1}


def dtype_byte_size(dtype: torch.dtype) -> int | float:
    """Bytes one element of ``dtype`` takes: ``1/8`` for bool, fractions for ``CustomDtype.INT2``/``INT4``, else
    torch's ``itemsize`` (Accelerate 1.16's rule: packed 4-bit dtypes such as ``uint4`` count 1 byte, not 0)."""
    import enum

    if dtype == torch.bool:
        return 1 / 8
    if isinstance(dtype, enum.Enum) and type(dtype).__name__ == "CustomDtype":
        return _CUSTOM_DTYPE_BYTES[dtype.value]
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"`dtype` is not a valid dtype: {dtype}.")
    return dtype.itemsize


def get_grad_scaler(distributed_type=None, **kwargs):
    """A new GradScaler for fp16: torch's ShardedGradScaler for ``DistributedType.FSDP``, else ``torch.amp``'s for
    this machine's accelerator (XPU, MPS, else CUDA: as in Accelerate, a CUDA scaler is disabled where there is no
    GPU). ``kwargs`` go to the scaler."""
    from accel.core.probes import is_mps_available, is_torch_version, is_xpu_available

    if distributed_type == "FSDP":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)
    if is_xpu_available():
        return torch.amp.GradScaler("xpu", **kwargs)
    if is_mps_available():
        if not is_torch_version(">=", "2.8.0"):
            raise ValueError("Grad Scaler with MPS device requires a Pytorch >= 2.8.0")
        return torch.amp.GradScaler("mps", **kwargs)
    return torch.amp.GradScaler("cuda", **kwargs)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs=None):
    """The autocast context for the run's ``mixed_precision`` (the Accelerator's, else $ACCELERATE_MIXED_PRECISION)
    on its device: float16 for fp16, bfloat16 for bf16 and fp8, the device's default otherwise; a no-op context
    unless ``native_amp``. ``autocast_kwargs`` (an ``AutocastKwargs``) adds torch.autocast's arguments."""
    from accel.runtime.state import AcceleratorState

    if not native_amp:
        return contextlib.nullcontext()
    state = AcceleratorState()
    kwargs = {} if autocast_kwargs is None else autocast_kwargs.to_kwargs()
    mixed_precision = state.__dict__.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    mixed_precision = str(getattr(mixed_precision, "value", mixed_precision)).lower()
    device_type = state.device.type
    if mixed_precision == "fp16":
        return torch.autocast(device_type=device_type, dtype=torch.float16, **kwargs)
    if mixed_precision in ("bf16", "fp8"):  # every distributed type accel runs is one Accelerate autocasts in bf16
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16, **kwargs)
    return torch.autocast(device_type=device_type, **kwargs)
