"""Collectives over nested structures of tensors: gather, reduce, broadcast, pad, send_to_device.

All of them work on (nested) lists, tuples, dicts and tensors, and are no-ops on one process.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch



class DistributedOperationException(Exception):
    """A collective called with inputs that do not match across processes (Accelerate's name)."""


class CannotPadNestedTensorWarning(UserWarning):
    """pad_across_processes met a nested tensor: it is left as it is (Accelerate's warning)."""


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


is_tensor_like = is_torch_tensor  # accel's earlier name


def recursively_apply(func: Callable, data: Any, *args, test_type: Callable = is_torch_tensor,
                      error_on_other_type: bool = False, **kwargs) -> Any:
    """Apply `func` to every leaf of `data` that passes `test_type`, keeping the container types. Other leaves are
    kept as they are, or refused with `error_on_other_type` (Accelerate's argument)."""
    rest = dict(test_type=test_type, error_on_other_type=error_on_other_type, **kwargs)
    if isinstance(data, (tuple, list)):
        mapped = [recursively_apply(func, o, *args, **rest) for o in data]
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
            return type(data)(*mapped)
        return type(data)(mapped)
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(func, v, *args, **rest) for k, v in data.items()})  # type: ignore[call-arg]  # the mapping's own class
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
                        "list/tuple/dicts of objects that are valid for "
                        f"`{getattr(test_type, '__name__', test_type)}` should be passed.")  # Accelerate's words
    return data


@dataclass(frozen=True)
class TensorInformation:
    """A tensor's shape and dtype: what a process needs to receive it (Accelerate's name)."""

    shape: torch.Size
    dtype: torch.dtype


def get_data_structure(data: Any) -> Any:
    """`data` with each tensor replaced by its TensorInformation (sent ahead so receivers can allocate)."""
    return recursively_apply(lambda t: TensorInformation(t.shape, t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors in the structure `get_data_structure` described."""
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure,
                             test_type=lambda o: isinstance(o, TensorInformation))


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor in a nested batch."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"Cannot find the batch size from empty {type(data).__name__}.")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"Can only find the batch size of tensors but got {type(data).__name__}.")
    return data.shape[0]


def slice_tensors(data: Any, tensor_slice: slice, process_index: int | None = None,
                  num_processes: int | None = None) -> Any:
    """Every tensor of a nested batch sliced along dim 0 (the process arguments are Accelerate's, unused)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def send_to_device(tensor: Any, device, non_blocking: bool = False, skip_keys=None) -> Any:
    """Move every tensor (or object with `.to`) in `tensor` to `device`."""
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    skip_keys = skip_keys or []
    if isinstance(tensor, torch.Tensor) or (
            hasattr(tensor, "to") and not isinstance(tensor, (Mapping, list, tuple, type))):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:
            return tensor.to(device)
    if isinstance(tensor, (tuple, list)):
        mapped = [send_to_device(o, device, non_blocking) for o in tensor]
        if isinstance(tensor, tuple) and hasattr(tensor, "_fields"):
            return type(tensor)(*mapped)
        return type(tensor)(mapped)
    if isinstance(tensor, Mapping):
        return type(tensor)(  # type: ignore[call-arg]  # the mapping's own class
            {k: v if k in skip_keys else send_to_device(v, device, non_blocking) for k, v in tensor.items()}
        )
    return tensor


# ---------------------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------------------

def _world(group=None) -> int:
    """The number of processes (of `group`, default all)."""
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _debug_mode() -> bool:
    from accel.runtime.state import PartialState

    state = PartialState._instance
    return bool(state is not None and state.__dict__.get("debug"))


def _shapes(data: Any):
    if isinstance(data, torch.Tensor):
        return list(data.shape)
    if isinstance(data, Mapping):
        return {k: _shapes(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_shapes(v) for v in data]
    return None


def verify_operation(operation: str, data: Any, group=None) -> None:
    """Debug mode (`ACCELERATE_DEBUG_MODE=1`, or `PartialState().debug = True`): before a collective, every process
    compares the shapes it was given; a mismatch raises `DistributedOperationException` on every process, naming
    each one's shapes, where gloo or NCCL would otherwise hang or abort."""
    if _world(group) == 1 or not _debug_mode():
        return
    shapes = [None] * _world(group)
    import torch.distributed as dist

    dist.all_gather_object(shapes, _shapes(data), group=group)
    if any(shape != shapes[0] for shape in shapes):
        listed = "; ".join(f"process {i}: {shape}" for i, shape in enumerate(shapes))
        raise DistributedOperationException(f"{operation}: the processes' tensors have different shapes ({listed}); "
                                            "every process must pass tensors of the same shapes")


def _job_device() -> torch.device | None:
    """The device the job's process group works on (PartialState's; None before there is one)."""
    from accel.runtime.state import PartialState

    return PartialState._shared_state.get("device")


def _to_job_device(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` where the group can take it: a CPU tensor on a GPU job goes to the GPU (NCCL refuses CPU tensors;
    Accelerate's operations fail there); the result is brought back to the caller's device."""
    device = _job_device()
    return tensor if device is None or tensor.device == device else tensor.to(device)


def _gather_one(tensor: torch.Tensor, group=None) -> torch.Tensor:
    import torch.distributed as dist

    if tensor.ndim == 0:
        tensor = tensor[None]
    origin = tensor.device
    tensor = _to_job_device(tensor.contiguous())
    if tensor.device != origin:
        return _gather_one(tensor, group).to(origin)
    size = _world(group)
    if dist.get_backend(group) == "nccl":
        out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, tensor, group=group)
        return out
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=0)


def gather(tensor: Any, group=None) -> Any:
    """Concatenate each tensor from all processes (of `group`) along dim 0 (scalars become 1-D); same shape
    everywhere."""
    if _world(group) == 1:
        return gathered_alone(tensor)
    verify_operation("gather", tensor, group)
    return recursively_apply(lambda t: _gather_one(t, group), tensor)


def gathered_alone(tensor: Any) -> Any:
    """What `gather` returns with a single process: the tensors themselves, scalars made 1-D."""
    return recursively_apply(lambda t: t[None] if t.ndim == 0 else t, tensor)


def gather_object(object: list, group=None) -> list:  # Accelerate's keyword name
    """All processes' (of `group`) lists, concatenated in rank order (Accelerate's `gather_object`)."""
    import torch.distributed as dist

    if _world(group) == 1:
        return list(object)
    out: list = [None] * _world(group)
    dist.all_gather_object(out, object, group=group)
    return [item for part in out for item in part]


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every tensor takes the value it has on `from_process` (in place; also returned)."""
    import torch.distributed as dist

    if _world() == 1:
        return tensor
    verify_operation("broadcast", tensor)

    def _one(t: torch.Tensor) -> torch.Tensor:
        moved = _to_job_device(t)
        dist.broadcast(moved, src=from_process)
        if moved is not t:
            t.copy_(moved)
        return t

    return recursively_apply(_one, tensor)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    import torch.distributed as dist

    if _world() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


_REDUCE_OPS = ("sum", "mean", "max", "min", "none")


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Sum, mean, max or min of each tensor over all processes (Accelerate's `reduce`); returns new tensors, inputs
    are left alone."""
    import torch.distributed as dist

    if reduction not in _REDUCE_OPS:
        raise ValueError(f"reduce: bad reduction {reduction!r}; allowed: {', '.join(_REDUCE_OPS)}")
    op = {"max": "MAX", "min": "MIN"}.get(reduction, "SUM")
    verify_operation("reduce", tensor)

    def _one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if reduction == "none":
            return out
        if _world() > 1:
            moved = _to_job_device(out)
            dist.all_reduce(moved, op=getattr(dist.ReduceOp, op))
            out = moved if moved is out else moved.to(t.device)
        if reduction == "mean":
            out = out / _world()
        return out * scale if scale != 1.0 else out

    return recursively_apply(_one, tensor)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor that exactly one process has (the others pass None), on every process; unlike `broadcast`, the
    others need not know its shape or which process has it."""
    from accel.runtime.state import PartialState

    state = PartialState()
    described = gather_object([None if tensor is None else (tuple(tensor.shape), tensor.dtype)])
    shape, dtype = next(d for d in described if d is not None)
    if tensor is None:
        tensor = torch.zeros(shape, dtype=dtype, device=state.device)
    return reduce(tensor, reduction="sum")


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along `dim` to the largest size any process has, so it can be gathered."""
    if _debug_mode():  # only the padded dimension may differ: the number of dimensions must agree
        verify_operation("pad_across_processes", recursively_apply(lambda t: t.new_empty((0,) * t.ndim), tensor))

    def _one(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "is_nested", False):
            warnings.warn("Cannot pad nested tensors without more information. Leaving unprocessed.",
                          CannotPadNestedTensorWarning, stacklevel=1)
            return t
        if _world() == 1 or t.ndim == 0 or dim >= t.ndim:
            return t
        size = torch.tensor(t.shape, device=t.device)[None]
        max_size = int(gather(size)[:, dim].max())
        if max_size == t.shape[dim]:
            return t
        new_shape = list(t.shape)
        new_shape[dim] = max_size
        out = t.new_full(new_shape, pad_index)
        index = [slice(None)] * t.ndim
        index[dim] = slice(max_size - t.shape[dim], max_size) if pad_first else slice(0, t.shape[dim])
        out[tuple(index)] = t
        return out

    return recursively_apply(_one, tensor)


def concatenate(data: list, dim: int = 0) -> Any:
    """Join a list of same-structured nested batches along `dim`; a single leaf comes back as it is (even when it
    is not a tensor), as in Accelerate."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        return type(first)(concatenate([d[i] for d in data], dim) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim) for k in first})  # type: ignore[call-arg]  # the mapping's own class
    if len(data) == 1:
        return first
    return torch.cat(data, dim=dim)
