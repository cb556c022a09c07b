"""The user's module inside its wrappers (DDP, torch.compile) and its whole state dict, as model weights files hold
it: a sharded tensor gathered, tied weights kept as one tensor under each name.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DistributedDataParallel / DataParallel and torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


def _strip_compile_prefix(name: str) -> str:
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _view_key(tensor: torch.Tensor) -> tuple | None:
    """Identifies a tensor view exactly (storage, offset, shape, stride, dtype); None when it cannot be shared."""
    if tensor.device.type == "meta" or tensor.numel() == 0 or tensor.layout != torch.strided:
        return None
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return None
    if ptr == 0:
        return None
    return (tensor.device, ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def get_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every tensor detached and on CPU, keys without ``_orig_mod.``.

    Accepts a model wrapped in DistributedDataParallel/DataParallel (``.module`` is used) or compiled
    with ``torch.compile``. Tensors sharing the same view of the same storage (tied weights) come back as
    the same tensor object, so :func:`save_state_dict_sharded` writes them once. DTensor values are
    gathered with ``full_tensor()`` (a collective: call this on every rank). Non-tensor entries (extra
    state) are passed through unchanged.
    """
    model = unwrap_model(model)
    try:  # optional: only present in distributed-enabled builds
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        DTensor = None  # type: ignore[misc, assignment]  # noqa: N806

    result: dict[str, torch.Tensor] = {}
    converted: dict[tuple, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        key = _strip_compile_prefix(name)
        if key in result:
            raise ValueError(f"Two state-dict entries map to {key!r} once '_orig_mod.' is removed.")
        if not isinstance(value, torch.Tensor):
            result[key] = value
            continue
        if DTensor is not None and isinstance(value, DTensor):
            value = value.full_tensor()
        if value.device.type == "meta":
            raise ValueError(f"State-dict entry {name!r} is on the meta device and holds no data.")
        view = _view_key(value)
        if view is not None and view in converted:
            result[key] = converted[view]
            continue
        cpu_value = value.detach().to("cpu")
        if view is not None:
            converted[view] = cpu_value
        result[key] = cpu_value
    return result
