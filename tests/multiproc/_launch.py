"""`accel launch` in a subprocess for the multi-process tests (this folder is on sys.path under pytest)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def worker_module(name: str):
    """Import a worker script from scripts/ as a module (its model and data build the one-process reference)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def accel_launch(env: dict, *launch_args: str, timeout: int = 300, expect: int = 0) -> subprocess.CompletedProcess:
    """Run `accel launch LAUNCH_ARGS...` from the repository root, one thread per process; check the exit code."""
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", *map(str, launch_args)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == expect, f"{' '.join(cmd)}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc
