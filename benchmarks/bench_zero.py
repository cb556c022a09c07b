"""ZeRO memory and speed: per-rank bytes and step time of DDP and ZeRO stages 1, 2, 3, 3 + offload (2 gloo processes).

    python benchmarks/bench_zero.py             # ~52M-parameter model, AdamW fp32, 2 x 5 launched jobs (~4 minutes)
    python benchmarks/bench_zero.py --quick     # smoke run (~1M parameters, 2 measured steps): figures are noise
    python benchmarks/bench_zero.py --configs ddp,zero1 --ddp-bucket-view   # DDP gradients as bucket views

One job per configuration, each `accel launch --cpu --num_processes 2 --mixed_precision no
--gradient_accumulation_steps 1 --zero_stage S benchmarks/bench_zero.py --worker --stage S [--offload]` with
OMP_NUM_THREADS=1 (one core per process); the worker also passes `ParallelismConfig(zero_stage=S,
offload_optimizer=offload, offload_params=offload)` to `Accelerator`. Configurations: DDP (zero_stage 0),
ZeRO-1 (ZeroRedundancyOptimizer + DDP), ZeRO-2 and ZeRO-3 (FSDP2 `fully_shard` per block, then the root,
`reshard_after_forward` False / True), ZeRO-3 + offload (FSDP2 `CPUOffloadPolicy`).

Every job builds the same model (seed 0): Linear(W, W), then B blocks `LayerNorm(W) - Linear(W, H) - GELU -
Linear(H, W)` with a residual, held in an `nn.ModuleList` (so accel's ZeRO shards block by block), then
Linear(W, W); W=1024, H=4096, B=6: 52,473,856 parameters. AdamW (lr 1e-4, fp32), MSE loss on fixed synthetic
tensors (a different batch per rank), batch 16 per process. A step is `zero_grad(); loss = mse(model(x), y);
accelerator.backward(loss); optimizer.step()`, timed on each rank with perf_counter around each part.

Per-rank bytes are counted from tensors (local shards of DTensors via `.to_local()`):

* parameters and optimizer state (every tensor in the state: exp_avg, exp_avg_sq and the 0-d `step`) between
  steps, after `optimizer.step()` and before `zero_grad()`; for ZeRO-1 the state of the
  ZeroRedundancyOptimizer's local optimizer (`.optim`), which only holds this rank's partition;
* gradients right after `accelerator.backward(loss)` (DDP/ZeRO-1: the full `.grad` tensors; FSDP2: the local
  shards of the DTensor gradients).

They are printed beside the DeepSpeed-style theory per parameter for fp32 AdamW on N ranks (params 4, grads 4,
Adam moments 8 bytes): DDP 16, stage 1 8 + 8/N, stage 2 4 + 12/N, stage 3 16/N; offload: 16/N, on the CPU.
The peak during forward/backward (all-gathered blocks, activations, communication buffers) is not visible as
tensors the script can enumerate, so the worker also reports process memory from /proc/self/status: VmRSS
between steps and VmHWM (peak resident) over the measured steps, after resetting it (/proc/self/clear_refs).
Those include the interpreter, torch and gloo, allocator slack and buffers that tensor counts miss (e.g. DDP's
gradient buckets).

The configurations run one after the other, in `--repeats` passes (default 2; every other pass in reverse order,
so slow phases of a shared machine do not all land on one configuration); step times are pooled over the passes
(rank 0's), bytes and process memory come from the first pass (the byte counts do not change between runs).
Each worker writes one JSON file (both ranks' records) into a temporary folder; the launcher prints the tables.
A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from _common import accel_command, run_job

# name -> (zero_stage, offload)
CONFIGS = {
    "ddp": (0, False),
    "zero1": (1, False),
    "zero2": (2, False),
    "zero3": (3, False),
    "zero3_offload": (3, True),
}
LABELS = {
    "ddp": "DDP (stage 0)",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "zero3_offload": "ZeRO-3 + offload",
}
# (blocks, width, hidden)
SIZES = {"full": (6, 1024, 4096), "quick": (2, 256, 1024)}
MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run one configuration (set by the launcher)")
    parser.add_argument("--stage", type=int, default=0, help="worker: zero_stage")
    parser.add_argument("--offload", action="store_true", help="worker: offload_optimizer and offload_params")
    parser.add_argument("--out", help="worker: where to write the JSON record")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped at the start")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--quick", action="store_true", help="smoke run: small model, 1 warm-up and 2 measured steps")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the configurations (every other pass "
                        "in reverse order); step times are pooled over the passes")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launched job")
    parser.add_argument("--ddp-bucket-view", action="store_true", help="pass DistributedDataParallelKwargs("
                        "gradient_as_bucket_view=True) (DDP and ZeRO-1: gradients become views of DDP's buckets)")
    return parser.parse_args(argv)


def theory(stage: int, n: int) -> dict[str, float]:
    """Bytes per parameter on one rank (fp32 AdamW), DeepSpeed's ZeRO accounting."""
    params = 4.0 if stage < 3 else 4.0 / n
    grads = 4.0 if stage < 2 else 4.0 / n
    optim = 8.0 if stage < 1 else 8.0 / n
    return {"params": params, "grads": grads, "optim": optim, "total": params + grads + optim}


# ------------------------------------------------------------------------------------------------------------
# launcher side
# ------------------------------------------------------------------------------------------------------------

def run_all(args: argparse.Namespace) -> int:
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        print(f"unknown configs {unknown}; allowed: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    passed = ["--batch-size", str(args.batch_size), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.quick:
        passed.append("--quick")
    if args.ddp_bucket_view:
        passed.append("--ddp-bucket-view")
    repeats = 1 if args.quick else max(1, args.repeats)
    results: dict[str, list[dict]] = {name: [] for name in names}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="bench_zero_") as tmp:
        for n_pass, name in [(p, name) for p in range(repeats) for name in (names if p % 2 == 0 else names[::-1])]:
            stage, offload = CONFIGS[name]
            out = Path(tmp) / f"{name}_{n_pass}.json"
            cmd = [*accel_command(), "launch", "--cpu", "--num_processes", "2", "--mixed_precision", "no",
                   "--gradient_accumulation_steps", "1", "--zero_stage", str(stage), str(Path(__file__).resolve()),
                   "--worker", "--stage", str(stage), *(["--offload"] if offload else []), "--out", str(out), *passed]
            record = run_job(cmd, out, args.timeout, label=f"{name} (pass {n_pass + 1}/{repeats}): ")
            if record is None:
                failed += 1  # left out of the tables
                continue
            results[name].append(record)
    results = {name: runs for name, runs in results.items() if runs}
    if results:
        print_tables(results)
    return 1 if failed else 0


def print_tables(runs: dict[str, list[dict]]) -> None:
    """Bytes and process memory from each configuration's first run; step times pooled over its runs."""
    results = {name: runs_of[0] for name, runs_of in runs.items()}
    first = next(iter(results.values()))
    n, n_params = first["world"], first["n_params"]
    print(f"\ntorch {first['torch']}, {n} processes (gloo, CPU), {first['threads']} thread(s) each; model "
          f"{n_params:,} parameters ({first['n_blocks']} blocks), AdamW fp32, batch {first['batch_size']} per process, "
          f"{first['warmup']} warm-up + {first['steps']} measured steps per run, "
          f"{max(len(r) for r in runs.values())} run(s) per configuration"
          + ("; DDP gradient_as_bucket_view=True" if first.get("ddp_bucket_view") else ""))

    # 1. bytes per rank, measured vs theory
    print("\nper-rank bytes counted from tensors (max over ranks), MB = 1e6 bytes; B/p = bytes per parameter")
    header = (f"{'config':<17} {'params MB':>9} {'grads MB':>9} {'optim MB':>9} {'total MB':>9} {'B/p':>6} "
              f"{'theory B/p':>10} {'meas/theory':>11}  where")
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        ranks = res["ranks"]
        stage = res["stage"]
        th = theory(stage, n)
        part = {k: max(r["bytes"][k] for r in ranks) for k in ("params", "grads", "optim")}
        total = max(sum(r["bytes"][k] for k in ("params", "grads", "optim")) for r in ranks)
        devices = sorted({d for r in ranks for d in r["devices"]})
        where = ("offloaded (" + "/".join(devices) + ")") if res["offload"] else "/".join(devices)
        print(f"{LABELS[name]:<17} {part['params'] / MB:>9.1f} {part['grads'] / MB:>9.1f} {part['optim'] / MB:>9.1f} "
              f"{total / MB:>9.1f} {total / n_params:>6.2f} {th['total']:>10.2f} "
              f"{total / n_params / th['total']:>11.3f}"
              f"  {where}")

    # 2. per component
    print("\nper component, bytes per parameter on one rank: measured / theory (max over ranks)")
    header = f"{'config':<17} {'params':>13} {'grads':>13} {'optim':>13}  ranks' totals MB"
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        th = theory(res["stage"], n)
        cells = []
        for k in ("params", "grads", "optim"):
            meas = max(r["bytes"][k] for r in res["ranks"]) / n_params
            cells.append(f"{meas:5.2f} / {th[k]:5.2f}")
        totals = " / ".join(f"{sum(r['bytes'].values()) / MB:.1f}" for r in res["ranks"])
        print(f"{LABELS[name]:<17} {cells[0]:>13} {cells[1]:>13} {cells[2]:>13}  {totals}")

    # 3. time
    def pooled(name: str, key: str) -> list[float]:
        return [t * 1e3 for run in runs[name] for t in run["ranks"][0][key]]

    base_ms = median(pooled("ddp", "step")) if "ddp" in runs else None
    print("\nstep time, rank 0, median of the measured steps of all runs (ms); parts: zero_grad / forward / "
          "backward / optimizer.step")
    header = (f"{'config':<17} {'step ms':>8} {'vs DDP':>7} {'min':>7} {'max':>7} {'zero_grad':>9} {'forward':>8} "
              f"{'backward':>8} {'opt.step':>8}  per-run medians")
    print(header)
    print("-" * len(header))
    for name in runs:
        step = pooled(name, "step")
        med = median(step)
        ratio = f"{med / base_ms:7.2f}" if base_ms else f"{'-':>7}"
        parts = [median(pooled(name, k)) for k in ("zero_grad", "forward", "backward", "opt_step")]
        per_run = " / ".join(f"{median([t * 1e3 for t in run['ranks'][0]['step']]):.0f}" for run in runs[name])
        print(f"{LABELS[name]:<17} {med:>8.1f} {ratio} {min(step):>7.1f} {max(step):>7.1f} {parts[0]:>9.1f} "
              f"{parts[1]:>8.1f} {parts[2]:>8.1f} {parts[3]:>8.1f}  {per_run}")

    # 4. process memory
    print("\nprocess memory per rank (MB, from /proc/self/status; rank 0 / rank 1): before the model was built, "
          "between steps, peak over the measured steps")
    header = f"{'config':<17} {'RSS before model':>17} {'RSS between steps':>18} {'peak RSS (steps)':>17}"
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        cols = []
        for key in ("rss_base", "rss_between", "hwm_steps"):
            vals = [r["proc"].get(key) for r in res["ranks"]]
            cols.append(" / ".join("?" if v is None else f"{v / MB:.0f}" for v in vals))
        print(f"{LABELS[name]:<17} {cols[0]:>17} {cols[1]:>18} {cols[2]:>17}")
    if not first["ranks"][0]["proc"].get("hwm_reset", False):
        print("(peak RSS could not be reset before the measured steps: it includes model construction)")
    print(f"\ntheory (fp32 AdamW, N={n}): DDP 16, stage 1 8 + 8/N, stage 2 4 + 12/N, stage 3 and offload 16/N bytes "
          f"per parameter; FSDP2 keeps parameters sharded between steps at stages 2 and 3 (4/N, not stage 2's 4)",
          flush=True)


# ------------------------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------------------------

def make_model(blocks: int, width: int, hidden: int):
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.up = torch.nn.Linear(width, hidden)
            self.down = torch.nn.Linear(hidden, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(width, width)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
            self.out = torch.nn.Linear(width, width)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    return Net()


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def count_bytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def optimizer_state_tensors(optimizer) -> list:
    """Every tensor in the optimizer state; ZeroRedundancyOptimizer keeps this rank's partition in `.optim`."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accel's AcceleratedOptimizer -> the prepared optimizer
    inner = getattr(inner, "optim", inner)
    return [v for st in inner.state.values() for v in st.values() if hasattr(v, "numel")]


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes (Linux)."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from accel import Accelerator, ParallelismConfig

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    parallelism = ParallelismConfig(zero_stage=args.stage, offload_optimizer=args.offload, offload_params=args.offload)
    handlers = []
    if args.ddp_bucket_view:
        from accel.config.kwargs import DistributedDataParallelKwargs

        handlers.append(DistributedDataParallelKwargs(gradient_as_bucket_view=True))
    accelerator = Accelerator(parallelism_config=parallelism, kwargs_handlers=handlers)
    rank, world = accelerator.process_index, accelerator.num_processes
    blocks, width, hidden = SIZES["quick" if args.quick else "full"]
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    clock = time.perf_counter
    proc: dict = {"rss_base": proc_status().get("VmRSS")}

    torch.manual_seed(0)
    model = make_model(blocks, width, hidden)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch_size, width, generator=g).to(accelerator.device)
    y = torch.randn(args.batch_size, width, generator=g).to(accelerator.device)

    times: dict[str, list[float]] = {"zero_grad": [], "forward": [], "backward": [], "opt_step": [], "step": []}
    grads_bytes = 0
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            proc["hwm_reset"] = reset_peak()
        t0 = clock()
        optimizer.zero_grad()
        t1 = clock()
        loss = torch.nn.functional.mse_loss(model(x), y)
        t2 = clock()
        accelerator.backward(loss)
        t3 = clock()
        if i == warmup + steps - 1:  # gradients right after backward (outside the timed parts)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grads_bytes = count_bytes(grads)
            grad_devices = {str(local(gr).device) for gr in grads}
        t3b = clock()
        optimizer.step()
        t4 = clock()
        if i >= warmup:
            for key, value in (("zero_grad", t1 - t0), ("forward", t2 - t1), ("backward", t3 - t2),
                               ("opt_step", t4 - t3b), ("step", (t4 - t0) - (t3b - t3))):
                times[key].append(value)

    # between steps: after optimizer.step(), before zero_grad()
    params = list(model.parameters())
    state = optimizer_state_tensors(optimizer)
    record = {
        "rank": rank,
        "bytes": {"params": count_bytes(params), "grads": grads_bytes, "optim": count_bytes(state)},
        "grads_between": count_bytes([p.grad for p in params if p.grad is not None]),
        "devices": sorted({str(local(t).device) for t in params + state} | grad_devices),
        "dtensor_params": sum(hasattr(p, "to_local") for p in params),
        "n_param_tensors": len(params),
        "n_state_tensors": len(state),
        "proc": proc,
        **times,
    }
    status = proc_status()
    proc["rss_between"], proc["hwm_steps"] = status.get("VmRSS"), status.get("VmHWM")
    ranks: list = [None] * world
    dist.all_gather_object(ranks, record)
    if rank == 0:
        out = {"stage": args.stage, "offload": args.offload, "world": world, "n_params": n_params, "n_blocks": blocks,
               "batch_size": args.batch_size, "warmup": warmup, "steps": steps, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "ddp_bucket_view": args.ddp_bucket_view,
               "distributed_type": str(accelerator.distributed_type),
               "model_type": type(model).__name__, "optimizer_type": type(optimizer.optimizer).__name__,
               "ranks": ranks}
        Path(args.out).write_text(json.dumps(out))
    accelerator.end_training()
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
