"""Gradient arithmetic every step owner and dimension shares: the global norm over gradients on several meshes,
clipping by it, and one flat all-reduce of a list of gradients."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


@contextlib.contextmanager
def quiet_logger(name: str):
    """Raise one logger's level to ERROR for the duration."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def total_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device,
               foreach: bool | None = None) -> torch.Tensor:
    """The norm of all `grads` as one vector. Sharded (DTensor) gradients are reduced over their mesh; those on
    different meshes (e.g. TP x FSDP layers and FSDP-only norms) are reduced one mesh at a time, then combined.
    `foreach` as torch's get_total_norm takes it (None: the foreach kernels where the device has them; True where it
    has none: torch's RuntimeError)."""
    from accel.core import collective_check

    collective_check.expect_reduction("clip_grad_norm_ (the sharded gradients' norm)", grads)
    by_mesh: dict = {}
    for grad in grads:
        by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(grad)
    norms = []
    for group in by_mesh.values():
        # on a 2-D mesh (FSDP x TP, ep) torch logs its one all-reduce per mesh dimension (of a scalar) as suboptimal
        with quiet_logger("torch.distributed.tensor._redistribute"):
            norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, foreach=foreach)
            whole = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        norms.append(whole.to(device=device, dtype=torch.float32))
    if not norms:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grads_with_norm(parameters: list[torch.Tensor], max_norm: float, total: torch.Tensor,
                         foreach: bool | None = None) -> None:
    """Scale the gradients by max_norm / total when that is below 1 (each shard in place, whatever its mesh).
    `foreach`: one foreach kernel per device and dtype (None: where the device has it; True where it has none:
    the RuntimeError torch's clip_grads_with_norm_ raises); False: one multiplication per gradient."""
    from torch.utils._foreach_utils import _device_has_foreach_support

    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    with torch.no_grad():
        for (device, dtype), grads in groups.items():
            scale = coefficient.to(device, dtype)
            if foreach is not False and _device_has_foreach_support(device):
                torch._foreach_mul_(grads, scale)
            elif foreach:
                raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
            else:
                for grad in grads:
                    grad.mul_(scale)


def sum_gradients(grads: list[torch.Tensor], group, divide_by: int = 1) -> None:
    """Sum `grads` over `group` (None: this rank alone) in one flat all-reduce, then divide by `divide_by`."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.div_(divide_by)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
