"""Accelerate's environment helpers (`accelerate.utils.environment` / `.other`)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def patch_environment(**kwargs):
    """Set environment variables (upper-cased names, values as strings) inside the block; restore them after."""
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment():
    """Run the block with an empty environment; the old one comes back after."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def get_int_from_env(env_keys, default: int) -> int:
    """The first non-negative integer among the environment variables `env_keys`, else `default`."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None) -> str | bool:
    """Write a config for this machine (all GPUs, or one CPU process) without questions, as `accel config` would;
    False when one exists already at that place (Accelerate's behaviour)."""
    import torch

    from accel.config import AccelConfig, config_save_path

    path = config_save_path(save_location)
    if path.exists():
        return False
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cfg = AccelConfig(mixed_precision=mixed_precision, num_processes=max(gpus, 1), use_cpu=gpus == 0)
    return str(cfg.save(path))
