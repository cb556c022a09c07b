"""Seeding every RNG a training script touches."""

from __future__ import annotations

import os
import random


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy (if installed) and torch (CPU and CUDA) alike.

    `device_specific` adds the process index so each rank draws differently; `deterministic` asks torch
    for deterministic algorithms.
    """
    import torch

    from accel.core.probes import is_cuda_available  # NVML: asking does not initialise CUDA

    if device_specific:
        seed += int(os.environ.get("RANK", 0))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if is_cuda_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


RNG_TYPES = ("torch", "cuda", "generator")


def synchronize_rng_state(rng_type: str | None = None, generator=None) -> None:
    """Give every process the main process's state of one RNG (`torch`, `cuda`, or `generator`: the given
    `torch.Generator`), as Accelerate's prepared data loaders do at each epoch. None: nothing (Accelerate's)."""
    import torch
    import torch.distributed as dist

    from accel.core.probes import is_cuda_available  # NVML: asking does not initialise CUDA

    if rng_type is None:
        return

    if rng_type not in RNG_TYPES:
        raise ValueError(f"synchronize_rng_states: rng type {rng_type!r}; allowed: {', '.join(RNG_TYPES)}")
    if rng_type == "cuda" and not is_cuda_available():
        return
    if rng_type == "generator" and generator is None:
        raise ValueError("synchronize_rng_states(['generator']) needs generator=<the torch.Generator>")
    state = {"torch": torch.get_rng_state, "cuda": torch.cuda.get_rng_state,
             "generator": lambda: generator.get_state()}[rng_type]()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on_cuda = dist.get_backend() == "nccl"
        moved = state.to("cuda") if on_cuda else state
        dist.broadcast(moved, src=0)  # every rng state of a kind has the same size
        state = moved.cpu()
    {"torch": torch.set_rng_state, "cuda": torch.cuda.set_rng_state,
     "generator": lambda s: generator.set_state(s)}[rng_type](state)


def synchronize_rng_states(rng_types: list[str], generator=None) -> None:
    """`synchronize_rng_state` for each of `rng_types`."""
    for rng_type in rng_types:
        synchronize_rng_state(str(getattr(rng_type, "value", rng_type)), generator=generator)
