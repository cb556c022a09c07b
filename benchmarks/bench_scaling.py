"""How step time and memory per rank grow with the process count: DDP and ZeRO-3, accel against raw PyTorch.

    python benchmarks/bench_scaling.py                      # 1, 2, 4, 8 processes; DDP and ZeRO-3 (~15 minutes)
    python benchmarks/bench_scaling.py --procs 1,2 --quick  # smoke run: small model, 2 measured steps

Weak scaling: every process trains on the same per-rank batch (16 samples of width 576) whatever the count, so
with enough cores the step time would stay flat and the gap to flat is what the collectives cost. Every job is
`accel launch --cpu --num_processes N --mixed_precision no --zero_stage S benchmarks/bench_scaling.py --worker ...`
with OMP_NUM_THREADS=1. The raw loop is `_step_loops.py`'s (DistributedDataParallel; `fully_shard` of each block
then the root, reshard_after_forward: ZeRO-3; one process: the plain loop, no wrapper, as accel runs it), accel's
is `Accelerator()` and `prepare` with the layout from the launch's flags, over the same model (seed 0:
`ResidualMLP(576, 4)`, 10,628,352 parameters, SGD) and data.

Time: one job per (layout, count) builds both loops and alternates them in blocks of 5 steps (in turn first; the
first round is a warm-up), each step timed on every rank after a barrier; a step's time is the slowest rank's, the
table shows the medians and their ratio. Memory: one job per loop, VmHWM (peak resident set) over the warm-up and
measured steps, reset (/proc/self/clear_refs) once the loop is built; the table shows the largest rank's. With
fewer cores than processes the step time grows with the processes per core (8 processes on 2 cores: each core runs
4 ranks' compute in turn), so the figure to read is accel's time over raw PyTorch's at the same count. A
benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import sys
import time
from pathlib import Path
from statistics import median

from _common import accel_command, layout_parser, run_job

LAYOUTS = {"ddp": 0, "zero3": 3}  # layout -> --zero_stage
LABELS = {"ddp": "DDP", "zero3": "ZeRO-3"}
SIZES = {"full": "10M", "quick": "1M"}  # _step_loops.SIZES
BATCH = 16  # per process


def parse_args(argv=None):
    parser = layout_parser(__doc__, warmup=3, steps=10, quick="smoke run: 1M parameters, 1 warm-up, 2 measured steps")
    parser.add_argument("--procs", default="1,2,4,8", help="process counts, comma-separated")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"from {', '.join(LAYOUTS)}")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help="worker: the layout")
    parser.add_argument("--loop", choices=["raw", "accel", "both"], help="worker: whose loop (both: alternating)")
    return parser.parse_args(argv)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from _common import per_rank
    from _step_loops import SIZES as MODEL_SIZES
    from _step_loops import LR, AccelLoop, ResidualMLP, endless, raw_loop, sgd_step

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    size = SIZES["quick" if args.quick else "full"]
    world = int(os.environ.get("WORLD_SIZE", "1"))  # `accel launch` runs one process as plain python
    if world > 1 and args.loop != "accel":
        dist.init_process_group("gloo")  # the raw loop's own init; accel's Accelerator finds it and uses it
    peer = AccelLoop(args.layout) if args.loop != "raw" else None
    width, blocks = MODEL_SIZES[size]
    torch.manual_seed(0)
    n = 2 * world * BATCH * 32
    dataset = TensorDataset(torch.randn(n, width), torch.randn(n, width))
    base = ResidualMLP(width, blocks)

    def raw_step():
        if world > 1:
            return raw_loop(args.layout, base, dataset, BATCH)
        model = copy.deepcopy(base)  # one process: the plain loop, no wrapper (what accel runs there too)
        return sgd_step(model, torch.optim.SGD(model.parameters(), lr=LR),
                        endless(DataLoader(dataset, batch_size=BATCH, shuffle=True)), lambda loss: loss.backward())

    def timed(step, count: int) -> list[float]:
        times = []
        for _ in range(count):
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return times

    record: dict = {"rank": dist.get_rank() if dist.is_initialized() else 0, "torch": torch.__version__,
                    "params": sum(p.numel() for p in base.parameters())}
    if args.loop == "both":  # time: raw and accel alternate in blocks, in turn first, the first round dropped
        steps = {"raw": raw_step(), "accel": peer.build(base, dataset, BATCH)}
        record.update(raw=[], accel=[])
        block, rounds = (2, 2) if args.quick else (5, 1 + -(-args.steps // 5))
        for r in range(rounds):
            for name in (("raw", "accel") if r % 2 == 0 else ("accel", "raw")):
                times = timed(steps[name], block)
                if r:
                    record[name] += times
    else:  # memory: one loop per process
        step = peer.build(base, dataset, BATCH) if peer is not None else raw_step()
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM from here: the steps' peak
        except OSError:
            pass
        warmup, count = (1, 2) if args.quick else (args.warmup, args.steps)
        record["times"] = timed(step, warmup + count)[warmup:]
        record.update(peak_mb=_status_kb("VmHWM") / 1024, rss_mb=_status_kb("VmRSS") / 1024)
    everyone = per_rank(record)
    if record["rank"] == 0:
        Path(args.out).write_text(json.dumps(everyone))
    if peer is not None:
        peer.close()
    if dist.is_initialized():
        # every rank past the gather before the group goes (without it, raw DDP jobs of 2 and 8 processes sometimes
        # never ended)
        dist.barrier()
        dist.destroy_process_group()


def launch(args) -> int:
    import tempfile

    procs = [int(p) for p in args.procs.split(",") if p.strip()]
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    passed = ["--warmup", str(args.warmup), "--steps", str(args.steps), *(["--quick"] if args.quick else [])]
    results: dict[tuple[str, int, str], list[dict]] = {}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        for i, (layout, n) in enumerate((layout, n) for layout in layouts for n in procs):
            for loop in ("both", *(("raw", "accel") if i % 2 == 0 else ("accel", "raw"))):
                out = Path(tmp) / f"{layout}-{n}-{loop}.json"
                cmd = [*accel_command(), "launch", "--cpu", "--num_processes", str(n), "--mixed_precision", "no",
                       "--zero_stage", str(LAYOUTS[layout]), str(Path(__file__).resolve()), "--worker", "--layout",
                       layout, "--loop", loop, "--out", str(out), *passed]
                record = run_job(cmd, out, args.timeout, label=f"{layout} x {n} {loop}: ")
                if record is not None:
                    results[(layout, n, loop)] = record
    load_end = os.getloadavg()
    if results:
        report(results, layouts, procs)
    print(f"load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end, on {os.cpu_count()} CPUs "
          "(other work slows every figure)")
    return 0 if len(results) == 3 * len(layouts) * len(procs) else 1


def _step_ms(ranks: list[dict], key: str = "times") -> float:
    """The median over measured steps of the slowest rank's time for that step."""
    return median(max(r[key][i] for r in ranks) for i in range(len(ranks[0][key]))) * 1e3


def report(results: dict, layouts: list[str], procs: list[int]) -> None:
    first = next(iter(results.values()))[0]
    print(f"\ntorch {first['torch']}, {os.cpu_count()} CPUs, gloo, 1 thread per process; ResidualMLP "
          f"{first['params']:,} parameters, SGD, batch {BATCH} per process (weak scaling); step: median of the "
          "slowest rank's, raw and accel alternating in one job; memory: peak RSS of the largest rank, one loop per "
          "job (MB = 2**20 bytes)")
    header = (f"{'layout':<8}{'procs':>6}{'per core':>9}{'raw ms':>9}{'accel ms':>10}{'accel/raw':>10}"
              f"{'raw peak MB':>12}{'accel peak MB':>14}{'accel/raw':>10}{'raw ms / 1 proc':>16}")
    print(header)
    print("-" * len(header))
    cores = os.cpu_count() or 1
    for layout in layouts:
        one = results.get((layout, procs[0], "both"))
        for n in procs:
            both = results.get((layout, n, "both"))
            raw, acc = results.get((layout, n, "raw")), results.get((layout, n, "accel"))
            cells = f"{LABELS[layout]:<8}{n:>6}{n / cores:>9.1f}"
            if both is not None:
                raw_ms, acc_ms = _step_ms(both, "raw"), _step_ms(both, "accel")
                cells += f"{raw_ms:>9.1f}{acc_ms:>10.1f}{acc_ms / raw_ms:>10.3f}"
            else:
                cells += f"{'(failed)':>29}"
            if raw is not None and acc is not None:
                raw_mb, acc_mb = max(r["peak_mb"] for r in raw), max(r["peak_mb"] for r in acc)
                cells += f"{raw_mb:>12.0f}{acc_mb:>14.0f}{acc_mb / raw_mb:>10.3f}"
            else:
                cells += f"{'(failed)':>36}"
            if both is not None and one is not None:
                cells += f"{_step_ms(both, 'raw') / _step_ms(one, 'raw'):>16.2f}"
            print(cells)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        sys.exit(launch(arguments))
