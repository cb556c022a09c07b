"""Accelerate's module name for the collective operations (`from accelerate.utils.operations import ...`), and its
small helpers on nested lists/tuples/dicts of tensors."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Mapping
from typing import Callable

import torch

from accel.runtime.ops import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    TensorInformation,
    concatenate,
    copy_tensor_to_devices,
    gather,
    find_batch_size,
    gather_object,
    get_data_structure,
    initialize_tensors,
    is_tensor_like,
    is_torch_tensor,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)


def is_tensor_information(tensor_info) -> bool:
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data) -> bool:
    """Whether `data` is a namedtuple (a tuple with `_asdict` and `_fields`)."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj, generator):
    """The items of `generator` in a container of `obj`'s type (list, tuple or namedtuple)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def ignorant_find_batch_size(data) -> int | None:
    """`find_batch_size`, or None where it cannot tell (no tensor first, or an empty container)."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data):
    """Every tensor in `data` as (nested) Python lists of numbers; bfloat16 goes through float32."""

    def to_list(tensor: torch.Tensor):
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:  # numpy, under tolist, has no bfloat16
            tensor = tensor.float()
        return tensor.tolist()

    return recursively_apply(to_list, data)


def find_device(data) -> torch.device | None:
    """The device of the first tensor found in `data` (depth first), None if there is none."""
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (tuple, list)):
        for item in data:
            device = find_device(item)
            if device is not None:
                return device
        return None
    if isinstance(data, torch.Tensor):
        return data.device
    return None


def _is_half(obj) -> bool:
    return (isinstance(obj, torch.Tensor) or hasattr(obj, "dtype")) and obj.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor):
    """Every float16/bfloat16 tensor in `tensor` (nested) as float32; everything else unchanged."""
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """A forward whose outputs come back as float32 (`convert_to_fp32`). Refuses pickling, as Accelerate's does:
    unwrap the model first."""

    def __init__(self, model_forward: Callable):
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args, **kwargs):
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self):
        raise pickle.PicklingError("Cannot pickle a prepared model with automatic mixed precision, please unwrap the "
                                   "model with `Accelerator.unwrap_model(model)` before pickling it.")


def convert_outputs_to_fp32(model_forward: Callable) -> Callable:
    """`model_forward` with float32 outputs, as a plain function whose `__wrapped__` is the converting wrapper (so
    `extract_model_from_parallel(keep_fp32_wrapper=False)` can peel it off)."""
    converting = ConvertOutputsToFp32(model_forward)

    def forward(*args, **kwargs):
        return converting(*args, **kwargs)

    forward.__wrapped__ = converting  # type: ignore[attr-defined]  # what unwrapping looks for
    return forward


def pad_input_tensors(tensor, batch_size: int, num_processes: int, dim: int = 0):
    """Each tensor of `tensor` (nested) grown with zeros along dim 0 so `num_processes` processes can share the
    batch, as Accelerate's `split_between_processes(apply_padding=True)` needs; same sizes as Accelerate's."""

    def pad(t: torch.Tensor, batch_size: int, num_processes: int, dim: int = 0) -> torch.Tensor:
        per_process = batch_size // num_processes
        leftover = batch_size - per_process * num_processes
        to_pad = num_processes - (per_process if per_process else batch_size)
        # Accelerate's rule as it runs (`a > b & b < 1` chains as `a > b and b < 1`)
        if leftover > to_pad and to_pad < 1:
            to_pad = leftover - to_pad
        shape = list(t.shape)
        shape[0] = batch_size + to_pad
        out = t.new_zeros(tuple(shape))
        out[tuple(slice(0, t.shape[dim]) if i == dim else slice(None) for i in range(len(shape)))] = t
        return out

    return recursively_apply(pad, tensor, error_on_other_type=True, batch_size=batch_size,
                             num_processes=num_processes, dim=dim)


__all__ = [
    "CannotPadNestedTensorWarning", "ConvertOutputsToFp32", "DistributedOperationException", "TensorInformation",
    "broadcast", "broadcast_object_list", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32",
    "copy_tensor_to_devices", "find_batch_size", "find_device", "gather", "gather_object", "get_data_structure",
    "honor_type", "ignorant_find_batch_size", "initialize_tensors", "is_namedtuple", "is_tensor_information",
    "is_tensor_like", "is_torch_tensor", "listify", "pad_across_processes", "pad_input_tensors", "recursively_apply",
    "reduce", "send_to_device", "slice_tensors",
]
