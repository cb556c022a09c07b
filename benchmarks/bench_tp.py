"""Tensor parallelism on CPU: per-rank parameter bytes and step time of tp 1 against tp 2 (gloo).

    python benchmarks/bench_tp.py            # ~21M-parameter MLP, 2 launched jobs (~1-2 minutes on 2 cores)
    python benchmarks/bench_tp.py --quick    # smoke run (small model, 1 warm-up + 2 measured steps)

Two jobs, each with OMP_NUM_THREADS=1 (one core per process):

* tp 1: `accel launch --cpu --num_processes 1 benchmarks/bench_tp.py --worker ...` (plain, one process);
* tp 2: `accel launch --cpu --num_processes 2 --tp_size 2 benchmarks/bench_tp.py --worker ...`.

The model (seed 0): B blocks `nn.Sequential(Linear(D, 4D), GELU(), Linear(4D, D))` in an `nn.ModuleList`, each
added to its input (residual). accel's automatic plan splits every Sequential's Linear pair: the first by
columns (weight and bias halved), the second by rows (weight halved, bias replicated); one all-reduce per block
in forward and one in backward. D=512, B=10: 20,997,120 parameters. AdamW (lr 1e-4, fp32), MSE on fixed
synthetic tensors; both TP ranks get the same batch (they are one model replica). A step is `zero_grad();
loss = mse(model(x), y); accelerator.backward(loss); optimizer.step()`, timed with perf_counter on rank 0.

Parameter bytes per rank are counted from tensors after `prepare` (DTensors by their `.to_local()` shard) and
printed beside the theory for tp N: split weights 1/N, replicated tensors (row-split biases) whole.
Each worker writes one JSON record into a temporary folder; the launcher prints the table. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

from _common import layout_parser, per_rank, run_layouts

SIZES = {"full": (10, 512), "quick": (2, 64)}  # (blocks, width); hidden = 4 * width
MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    parser = layout_parser(__doc__, 3, 10, "small model, 1 warm-up and 2 measured steps")
    parser.add_argument("--batch-size", type=int, default=8)
    return parser.parse_args(argv)


# launcher side -------------------------------------------------------------------------------------------

def run_all(args: argparse.Namespace) -> int:
    passed = ["--batch-size", str(args.batch_size), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.quick:
        passed.append("--quick")
    jobs = {1: ["--num_processes", "1"], 2: ["--num_processes", "2", "--tp_size", "2"]}
    results: dict[int, dict] = run_layouts(__file__, jobs, passed, args.timeout, "bench_tp_")
    if results:
        print_table(results)
    return 0 if len(results) == len(jobs) else 1


def print_table(results: dict[int, dict]) -> None:
    first = next(iter(results.values()))
    n_params = first["n_params"]
    print(f"\ntorch {first['torch']}, gloo on CPU, 1 thread per process; model {n_params:,} parameters "
          f"({first['blocks']} blocks, width {first['width']}), AdamW fp32, batch {first['batch_size']}, "
          f"{first['warmup']} warm-up + {first['steps']} measured steps")
    header = (f"{'config':<6} {'params MB/rank':>14} {'theory MB':>9} {'split MB':>8} {'theory split':>12} "
              f"{'replicated kB':>13} {'step ms':>8} {'min':>7} {'max':>7} {'vs tp1':>6}")
    print(header)
    print("-" * len(header))
    base = median([t * 1e3 for t in results[1]["step"]]) if 1 in results else None
    for tp, res in sorted(results.items()):
        b = res["bytes"]
        full_split = b["split_full"]
        theory = full_split / tp + b["replicated"]
        step = [t * 1e3 for t in res["step"]]
        med = median(step)
        ratio = f"{med / base:6.2f}" if base else f"{'-':>6}"
        print(f"tp {tp:<3} {max(b['per_rank']) / MB:>14.1f} {theory / MB:>9.1f} {b['split_local'] / MB:>8.1f} "
              f"{full_split / tp / MB:>12.1f} {b['replicated'] / 1e3:>13.1f} {med:>8.1f} {min(step):>7.1f} "
              f"{max(step):>7.1f} {ratio}")
    print("split = parameters of layers the plan splits (theory: 1/tp of their full size); replicated = the rest "
          "(row-split biases), whole on every rank", flush=True)


# worker side ---------------------------------------------------------------------------------------------

def make_model(blocks: int, width: int):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, width))
                for _ in range(blocks))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    return Net()


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from accel import Accelerator

    blocks, width = SIZES["quick" if args.quick else "full"]
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = make_model(blocks, width)
    n_params = sum(p.numel() for p in model.parameters())
    # parameters the tp plan splits (colwise: weight and bias, rowwise: weight), at full size, from the same
    # automatic plan accel applies with --tp_size 2; the rest (row-split biases) stays whole on every rank
    from accel.parallel.tensor import automatic_plan

    modules = dict(model.named_modules())
    split_full = sum(
        t.numel() * t.element_size()
        for name, style in automatic_plan(model).items()
        for t in ([modules[name].weight, modules[name].bias] if style == "colwise" else [modules[name].weight])
        if t is not None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)

    # measured: every parameter's local tensor (DTensor shards via .to_local()) after prepare
    mine = sum(t.numel() * t.element_size() for t in (p.to_local() if hasattr(p, "to_local") else p
                                                      for p in model.parameters()))
    tp = accelerator.state.num_processes if dist.is_initialized() else 1
    split_local = sum(t.numel() * t.element_size() for p in model.parameters() if hasattr(p, "to_local")
                      and any(pl.is_shard() for pl in p.placements) for t in [p.to_local()])
    if tp == 1:
        split_local = split_full
    replicated = mine - split_local

    gen = torch.Generator().manual_seed(1)  # the same batch on every TP rank
    x = torch.randn(args.batch_size, width, generator=gen)
    y = torch.randn(args.batch_size, width, generator=gen)
    times = []
    for i in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)

    ranks = per_rank(mine)
    if accelerator.is_main_process:
        record = {"torch": torch.__version__, "n_params": n_params, "blocks": blocks, "width": width,
                  "batch_size": args.batch_size, "warmup": warmup, "steps": steps, "step": times,
                  "bytes": {"per_rank": ranks, "split_local": split_local, "split_full": split_full,
                            "replicated": replicated}}
        Path(args.out).write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
