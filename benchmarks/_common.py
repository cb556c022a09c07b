"""Shared by the benchmark scripts (run as `python benchmarks/bench_*.py`, so this folder is on sys.path)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def accel_command() -> list[str]:
    """The `accel` console script of this interpreter (not a pyenv shim), else the module."""
    beside = Path(sys.executable).parent / "accel"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("accel")
    return [found] if found else [sys.executable, "-m", "accel.cli.main"]
