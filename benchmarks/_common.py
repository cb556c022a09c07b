"""Shared by the benchmark scripts (run as `python benchmarks/bench_*.py`, so this folder is on sys.path)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def accel_command() -> list[str]:
    """The `accel` console script of this interpreter (not a pyenv shim), else the module."""
    beside = Path(sys.executable).parent / "accel"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("accel")
    return [found] if found else [sys.executable, "-m", "accel.cli.main"]


def layout_parser(doc: str, warmup: int, steps: int, quick: str):
    """The arguments every layout benchmark takes: the launcher/worker switch, warm-up and measured steps, --quick
    (`quick` says what it shrinks) and the time limit per launched job; a benchmark adds its own."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run one job (set by the launcher)")
    parser.add_argument("--out", help="worker: where to write the JSON record")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--steps", type=int, default=steps, help="measured steps after the warm-up")
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launched job")
    return parser


def run_job(cmd: list[str], out: Path, timeout: float, label: str = "") -> dict | None:
    """Run one benchmark job (one thread per process) that writes a JSON record to `out`: the record, or
    None when the job failed or timed out (both printed, prefixed with `label`)."""
    print("$ OMP_NUM_THREADS=1 " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    try:
        rc = subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0 or not out.exists():
        print(f"  {label}FAILED (exit {rc})", flush=True)
        return None
    print(f"  {label}done in {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(out.read_text())


def run_layouts(script: str, jobs: dict, passed: list[str], timeout: float, prefix: str) -> dict:
    """`accel launch --cpu FLAGS script --worker --out OUT PASSED` for each layout of `jobs` (key -> launch flags), in
    fp32: {key: the record each job wrote}, leaving out those that failed (run_job prints why)."""
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for key, flags in jobs.items():
            out = Path(tmp) / f"{str(key).replace(' ', '_')}.json"
            cmd = [*accel_command(), "launch", "--cpu", *flags, "--mixed_precision", "no",
                   str(Path(script).resolve()), "--worker", "--out", str(out), *passed]
            record = run_job(cmd, out, timeout, label=f"{key}: ")
            if record is not None:
                results[key] = record
    return results


def per_rank(value) -> list:
    """Every rank's `value`, in rank order (all_gather_object; [value] on one process)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
