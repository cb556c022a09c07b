"""Cost of `accelerator.log()` per call for the jsonl, csv and tensorboard trackers, against a tiny training step.

    python benchmarks/bench_logging.py                 # 2000 calls per tracker, one process
    python benchmarks/bench_logging.py --calls 5000 --values 8

Each call logs a scalar-tensor loss, a float lr and `--values - 2` more floats at an increasing step (what a training
loop logs). Timed per tracker: the median over 5 rounds of the mean µs per `log()` call; the reference is one step
of a tiny MLP (forward, backward, AdamW step) on CPU, so "relative" says how much logging every step adds to a step
that small (a real step is far slower, and logging far cheaper in relation). A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel import Accelerator  # noqa: E402
from accel.tracking import filter_trackers  # noqa: E402


def tiny_step_us(reps: int) -> float:
    """µs of one training step of a tiny MLP (batch 32, 8 -> 64 -> 1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def step():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    for _ in range(20):
        step()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - start) / reps * 1e6


def log_us(accelerator: Accelerator, calls: int, n_values: int, first_step: int) -> float:
    extra = {f"metric_{i}": 0.1 * i for i in range(max(0, n_values - 2))}
    loss = torch.tensor(0.5)
    start = time.perf_counter()
    for step in range(first_step, first_step + calls):
        accelerator.log({"loss": loss, "lr": 1e-3, **extra}, step=step)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--values", type=int, default=4, help="values per log() call (default 4)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    step = tiny_step_us(args.calls)
    print(f"tiny training step (MLP 8-64-1, batch 32, AdamW, CPU): {step:8.1f} µs")
    print(f"accelerator.log() with {args.values} values, median of {args.rounds} rounds x {args.calls} calls:")
    for name in ("none", "jsonl", "csv", "tensorboard"):
        if name == "tensorboard":
            try:
                filter_trackers(name, ".")
            except ImportError as error:
                print(f"  {name:12s} skipped: {error}")
                continue
        with tempfile.TemporaryDirectory() as folder:
            accelerator = Accelerator(cpu=True, log_with=None if name == "none" else name, project_dir=folder)
            accelerator.init_trackers("bench")
            log_us(accelerator, 50, args.values, 0)  # warm-up (files opened, writer thread started)
            per_call = statistics.median(log_us(accelerator, args.calls, args.values, 50 + r * args.calls)
                                         for r in range(args.rounds))
            accelerator.end_training()
        print(f"  {name:12s} {per_call:8.1f} µs per call = {per_call / step:6.1%} of the tiny step")


if __name__ == "__main__":
    main()
