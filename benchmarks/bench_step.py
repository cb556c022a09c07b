"""Per-step training time: accel's prepared loop against the same raw PyTorch DDP loop (2 gloo processes, CPU).

    python benchmarks/bench_step.py             # launches itself: accel launch --cpu --num_processes 2 ... --worker
    python benchmarks/bench_step.py --quick     # smoke run (4 rounds per size): checks it works, figures are noise
    python benchmarks/bench_step.py --control   # A/A run: a second raw loop in accel's place (the noise floor)

Both loops live in the SAME launched job and run alternately, in blocks of steps (raw, accel | accel, raw | ...),
so machine noise hits both alike. Each loop trains its own copy of the same MLP (same initial weights) on the
same in-memory synthetic tensors, with the same per-process batch size and plain SGD:

* raw:   torch.distributed.init_process_group("gloo"), DistributedDataParallel(model),
         DataLoader(dataset, sampler=DistributedSampler(dataset)), loss.backward()
* accel: Accelerator() (it finds the group already initialised and uses it),
         accelerator.prepare(model, optimizer, DataLoader(dataset, shuffle=True)), accelerator.backward(loss)

Each size runs in two halves with the loops built in either order (in some A/A runs the loop built second
was a few percent faster), and the halves are pooled. A step is timed from fetching the batch to the end of
optimizer.step(); warm-up blocks are dropped. Rank 0 prints the median per-step milliseconds of each loop and
their ratio (target: accel/raw <= 1.02), the median of the per-round ratios (accel block / raw block of the
same round) with its quartiles, and the ratio within each half. Launched with OMP_NUM_THREADS=1, so the two
processes get one core each. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from _common import accel_command

TARGET_RATIO = 1.02
# name -> (input features, hidden widths, classes); parameter counts are printed exactly at run time
SIZES = {
    "1M": (768, [768, 512], 10),
    "10M": (768, [2048, 2048, 2048], 10),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run the measurement (set when already launched)")
    parser.add_argument("--sizes", default="1M,10M", help=f"comma-separated, from {', '.join(SIZES)}")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--block", type=int, default=10, help="steps per block before switching loops")
    parser.add_argument("--warmup-blocks", type=int, default=2, help="blocks of each loop dropped at the start")
    parser.add_argument("--rounds", default="60,12", help="measured rounds per size (one block of each loop per "
                        "round), comma-separated in --sizes order")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds per size")
    parser.add_argument("--control", action="store_true", help="A/A calibration: the 'accel' column runs a second "
                        "raw DDP loop instead, so its ratio shows the noise floor of this machine")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------------------
# launcher side
# ------------------------------------------------------------------------------------------------------------

def launch(argv: list[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # two processes on two cores: one thread each
    cmd = [*accel_command(), "launch", "--cpu", "--num_processes", "2", "--mixed_precision", "no",
           "--gradient_accumulation_steps", "1", str(Path(__file__).resolve()), "--worker", *argv]
    print("$ OMP_NUM_THREADS=1 " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


# ------------------------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------------------------

def make_mlp(features: int, hidden: list[int], classes: int):
    import torch

    layers, width = [], features
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def endless(loader, sampler=None):
    """Batches forever, epoch after epoch (set_epoch on a DistributedSampler as a raw loop must)."""
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return quantile(values, 0.5)


def worker(args: argparse.Namespace) -> int:
    import copy
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from accel import Accelerator

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")  # the raw loop's own init; accel reuses this default group
    accelerator = Accelerator()
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    rounds = [4] * len(sizes) if args.quick else [int(r) for r in args.rounds.split(",")]
    rounds += [rounds[-1]] * (len(sizes) - len(rounds))
    b = args.batch_size
    clock = time.perf_counter
    lr = 1e-3

    if rank == 0:
        print(f"torch {torch.__version__}, {world} processes (gloo, CPU), {torch.get_num_threads()} thread(s) each, "
              f"batch {b} per process, SGD, blocks of {args.block} steps, {args.warmup_blocks} warm-up block(s) "
              f"per loop and half dropped; accel: {accelerator.distributed_type}, "
              f"mixed_precision={accelerator.mixed_precision}"
              + ("\nCONTROL RUN: the 'accel' column is a second raw DDP loop (A/A noise floor)"
                 if args.control else ""),
              flush=True)

    # Each builder returns (step function, the prepared model); the step closes over everything it needs.
    def build_raw(base, dataset):
        model = DDP(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        batches = endless(DataLoader(dataset, batch_size=b, sampler=sampler), sampler)

        def step():
            inputs, targets = next(batches)
            opt.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            opt.step()

        return step, model

    def build_accel(base, dataset):
        model = copy.deepcopy(base)
        model, opt, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr),
                                                 DataLoader(dataset, batch_size=b, shuffle=True))
        batches = endless(loader)

        def step():
            inputs, targets = next(batches)
            opt.zero_grad()
            loss = F.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            opt.step()

        return step, model

    build_other = build_raw if args.control else build_accel

    def block(step) -> list[float]:
        times = []
        for _ in range(args.block):
            start = clock()
            step()
            times.append(clock() - start)
        return times

    rows = []
    for size, n_rounds in zip(sizes, rounds):
        features, hidden, classes = SIZES[size]
        torch.manual_seed(0)
        n = 2 * world * b * 32  # 64 steps per epoch per process: epoch boundaries are part of the loop
        dataset = TensorDataset(torch.randn(n, features), torch.randint(0, classes, (n,)))
        base = make_mlp(features, hidden, classes)
        n_params = sum(p.numel() for p in base.parameters())
        raw_times: list[float] = []
        acc_times: list[float] = []
        round_ratios: list[float] = []
        same_group = True
        halves: list[float] = []
        # Two halves, the loops built in either order: in some A/A runs the loop built second was a few percent
        # faster (allocator state?), so neither loop gets that edge for the whole run.
        for half in range(2):
            if half == 0:
                raw_step, _ = build_raw(base, dataset)
                acc_step, acc_model = build_other(base, dataset)
            else:
                acc_step, acc_model = build_other(base, dataset)
                raw_step, _ = build_raw(base, dataset)
            group = getattr(acc_model, "process_group", None)
            same_group &= group is None or group is dist.distributed_c10d._get_default_group()
            first = len(raw_times)
            for r in range(args.warmup_blocks + (n_rounds + 1 - half) // 2):
                if r % 2 == 0:  # raw, accel | accel, raw | ...: neither loop always goes first
                    raw_block, acc_block = block(raw_step), block(acc_step)
                else:
                    acc_block = block(acc_step)
                    raw_block = block(raw_step)
                if r >= args.warmup_blocks:
                    raw_times += raw_block
                    acc_times += acc_block
                    round_ratios.append(median(acc_block) / median(raw_block))
            halves.append(median(acc_times[first:]) / median(raw_times[first:]))
            dist.barrier()
            del raw_step, acc_step, acc_model, _
            accelerator.free_memory()
        rows.append(dict(size=size, params=n_params, steps=len(raw_times), raw=median(raw_times) * 1e3,
                         accel=median(acc_times) * 1e3, ratio=median(acc_times) / median(raw_times),
                         r_med=median(round_ratios), r_q1=quantile(round_ratios, 0.25),
                         r_q3=quantile(round_ratios, 0.75), halves=halves, same_group=same_group))
        if rank == 0:
            print(f"  {size}: done ({len(raw_times)} measured steps per loop)", flush=True)

    if rank == 0:
        print()
        header = (f"{'model':<6} {'params':>11} {'steps':>6} {'raw ms':>9} {'accel ms':>9} {'accel/raw':>10} "
                  f"{'per-round ratio [q1, q3]':>26} {'raw 1st / accel 1st':>20}  target")
        print(header)
        print("-" * len(header))
        for row in rows:
            verdict = "ok" if row["ratio"] <= TARGET_RATIO else "OVER"
            print(f"{row['size']:<6} {row['params']:>11,} {row['steps']:>6} {row['raw']:>9.2f} {row['accel']:>9.2f} "
                  f"{row['ratio']:>10.3f} {row['r_med']:>10.3f} [{row['r_q1']:.3f}, {row['r_q3']:.3f}] "
                  f"{row['halves'][0]:>10.3f} / {row['halves'][1]:.3f}  <= {TARGET_RATIO} {verdict}")
        print("\nper-step median on rank 0 (batch fetch + zero_grad + forward + backward/all-reduce + SGD step), "
              "both halves pooled;\nraw 1st / accel 1st: accel/raw within the half where that loop was built first; "
              f"accel's DDP on the default group: {all(r['same_group'] for r in rows)}", flush=True)
    accelerator.end_training()  # barrier, drops accel's DDP reducers; the group is ours (raw init) to destroy
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
