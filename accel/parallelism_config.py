"""Accelerate's `accelerate.parallelism_config` module path: its `ParallelismConfig` is accel's one config class
(accel.config.schema), which takes Accelerate's fields too. The shim maps `accelerate.parallelism_config` here."""

from accel.config.schema import ParallelismConfig

__all__ = ["ParallelismConfig"]
