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

    if device_specific:
        seed += int(os.environ.get("RANK", 0))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
