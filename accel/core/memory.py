"""Accelerate's memory helpers (`accelerate.utils.memory`): retry with a smaller batch after running out of memory,
and drop references before emptying the allocator's cache."""

from __future__ import annotations

import functools
import gc
import inspect

import torch
from accel.core.probes import is_cuda_available  # NVML: asking does not initialise CUDA (forks stay usable)


def release_memory(*objects):
    """Set each object to None for the caller (`a, b = release_memory(a, b)`), collect garbage and empty the CUDA
    cache."""
    objects = [None] * len(objects)
    gc.collect()
    if is_cuda_available():
        torch.cuda.empty_cache()
    return objects


# what an out-of-memory error says: CUDA / HIP / XPU / the CPU's "... out of memory.", MPS, cuDNN's, the CPU allocator's
_OOM_MARKERS = (" out of memory.", "MPS backend out of memory", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                "DefaultCPUAllocator: can't allocate memory", "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed")


def should_reduce_batch_size(exception: Exception) -> bool:
    """Whether `exception` is an out-of-memory error (torch's OutOfMemoryError, or a RuntimeError whose one argument
    says so: CUDA, CPU, MPS, cuDNN)."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    return (isinstance(exception, RuntimeError) and len(exception.args) == 1 and isinstance(exception.args[0], str)
            and any(marker in exception.args[0] for marker in _OOM_MARKERS))


def find_executable_batch_size(function=None, starting_batch_size: int = 128, reduce_batch_size_fn=None):
    """Decorator: call `function(batch_size, ...)` with `starting_batch_size`, then after each out-of-memory error with
    90% of it (or what `reduce_batch_size_fn()` returns), until it runs; the first argument is supplied by the
    decorator. As in Accelerate, the size found is kept for later calls of the decorated function."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size
    if reduce_batch_size_fn is None:
        def reduce_batch_size_fn():
            return int(batch_size * 0.9)

    @functools.wraps(function)
    def run(*args, **kwargs):
        nonlocal batch_size
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{name}={value!r}" for name, value in zip(params[1:], args[1:], strict=False))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called; "
                            f"the decorator already passes it: call `{function.__name__}({given})`")
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 (only out-of-memory errors are retried)
                if not should_reduce_batch_size(exc):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = reduce_batch_size_fn()

    return run


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Empty the accelerator's allocator cache (CUDA here), after a garbage collection if asked."""
    if garbage_collection:
        gc.collect()
    if is_cuda_available():
        torch.cuda.empty_cache()
