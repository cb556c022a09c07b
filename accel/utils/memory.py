"""Accelerate's memory helpers (`accelerate.utils.memory`): retry with a smaller batch after running out of memory,
and drop references before emptying the allocator's cache."""

from __future__ import annotations

import functools
import gc
import inspect

import torch


def release_memory(*objects):
    """Set each object to None for the caller (`a, b = release_memory(a, b)`), collect garbage and empty the CUDA
    cache."""
    objects = [None] * len(objects)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return objects


def should_reduce_batch_size(exception: Exception) -> bool:
    """Whether `exception` is an out-of-memory error (CUDA, or the CPU allocator's)."""
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        marker in text for marker in ("CUDA out of memory.", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                                      "DefaultCPUAllocator: can't allocate memory"))


def find_executable_batch_size(function=None, starting_batch_size: int = 128, reduce_batch_size_fn=None):
    """Decorator: call `function(batch_size, ...)` with `starting_batch_size`, halving it (or `reduce_batch_size_fn`)
    after each out-of-memory error until it runs; the first argument is supplied by the decorator."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    reduce = reduce_batch_size_fn or (lambda size: size // 2)

    @functools.wraps(function)
    def run(*args, **kwargs):
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            raise TypeError(f"find_executable_batch_size: {function.__name__} takes the batch size as its first "
                            f"argument, which the decorator passes; call it without it (got {len(args)} arguments)")
        batch_size = starting_batch_size
        while True:
            if batch_size == 0:
                raise RuntimeError("find_executable_batch_size: no executable batch size found, reached zero")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 (only out-of-memory errors are retried)
                if not should_reduce_batch_size(exc):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = reduce(batch_size)

    return run


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Empty the accelerator's allocator cache (CUDA here), after a garbage collection if asked."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
