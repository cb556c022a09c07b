"""Big-model inference cost on CPU: forward latency in memory vs cpu_offload vs disk offload, and the peak memory
of load_checkpoint_and_dispatch's streaming load against the model's size.

    python benchmarks/bench_big_model.py            # ~201M-parameter model (806 MB fp32), ~20-40 s
    python benchmarks/bench_big_model.py --quick    # smoke run (4.2M parameters): its figures are noise
    python benchmarks/bench_big_model.py --threads 1   # steadier figures on a small shared machine

The model is a stack of 12 blocks [Linear(2048, 4096), GELU, Linear(4096, 2048)] (seed 0, 201,400,320 parameters).
The driver saves it with accel's `save_state_dict_sharded` (max_shard_size 100MB: one block per shard) and keeps
its output on a fixed batch (8 x 2048). Each mode then runs in a fresh interpreter (a worker: this file with
--worker), which gets the model ready, runs one warm-up forward and --runs timed ones under torch.no_grad(), and
checks every output against the driver's with torch.equal:

* in memory:   the plain model, built in the worker with the same seed (no hooks);
* cpu_offload: the same model after `cpu_offload(model)`: on a CPU-only machine weights stay where they are and
               only the hooks run, so this is the hooks' overhead;
* auto 25%:    `init_empty_weights` + `load_checkpoint_and_dispatch(device_map="auto", max_memory={"cpu": 25% of
               the model}, no_split_module_classes=["Block"])`: the first blocks resident, the rest read from disk;
* disk:        the same with device_map={"": "disk"}: every weight read from disk (memory-mapped safetensors, here
               the checkpoint's own shards, from the page cache) at every forward.

Memory: "load peak" is VmHWM (reset through /proc/self/clear_refs just before) minus VmRSS before the load: every
resident page, including file pages of the checkpoint that safetensors maps. safetensors maps tensors lazily, so
a resident weight is only paged in when first used; "run peak" (same reset, measured over the load and all the
forwards) therefore is the figure to hold against the model's size. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

MB = 1e6
MARKER = "BENCH_BIG_MODEL_RESULT "
SIZES = {"full": (12, 2048, 4096), "quick": (4, 512, 1024)}  # blocks, width, hidden
MODES = ["memory", "cpu_offload", "auto25", "disk"]
LABELS = {"memory": "in memory (plain)", "cpu_offload": "cpu_offload (hooks only)",
          "auto25": "auto, cpu cap 25% (rest disk)", "disk": "disk ({'': 'disk'})"}
BATCH = 8


def build(size: str, empty: bool = False):
    import torch
    from torch import nn

    from accel import init_empty_weights

    blocks, width, hidden = SIZES[size]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.act, self.down = nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)

        def forward(self, x):
            return x + self.down(self.act(self.up(x)))

    torch.manual_seed(0)
    if empty:
        with init_empty_weights():
            return nn.Sequential(*[Block() for _ in range(blocks)])
    return nn.Sequential(*[Block() for _ in range(blocks)])


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    return _status_kb("VmRSS")


def worker(mode: str, folder: Path, size: str, runs: int, threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)

    from accel import cpu_offload, load_checkpoint_and_dispatch

    reference = torch.load(folder / "reference.pt", weights_only=True)
    x = reference["input"]
    before = _reset_peak()
    t0 = time.perf_counter()
    if mode in ("memory", "cpu_offload"):
        model = build(size)
        if mode == "cpu_offload":
            model = cpu_offload(model)
    else:
        model_bytes = reference["model_bytes"]
        device_map = {"": "disk"} if mode == "disk" else "auto"
        model = load_checkpoint_and_dispatch(build(size, empty=True), folder / "ckpt", device_map=device_map,
                                             max_memory={"cpu": model_bytes // 4}, no_split_module_classes=["Block"],
                                             offload_folder=folder / f"offload-{mode}")
    load_s = time.perf_counter() - t0
    load_peak_kb = _status_kb("VmHWM") - before
    times, equal = [], True
    with torch.no_grad():
        for i in range(runs + 1):
            t0 = time.perf_counter()
            out = model(x)
            if i:
                times.append(time.perf_counter() - t0)
            equal = equal and torch.equal(out, reference["output"])
    run_peak_kb = _status_kb("VmHWM") - before
    device_map = getattr(model, "hf_device_map", {"": "cpu"})
    print(MARKER + json.dumps({"mode": mode, "load_s": load_s, "times": times, "equal": equal,
                               "load_peak_mb": load_peak_kb * 1024 / MB, "run_peak_mb": run_peak_kb * 1024 / MB,
                               "on_disk": sum(1 for v in device_map.values() if v == "disk"),
                               "entries": len(device_map)}), flush=True)


def run_worker(mode: str, folder: Path, size: str, runs: int, threads: int | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--path", str(folder), "--size", size,
           "--runs", str(runs)] + (["--threads", str(threads)] if threads else [])
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"worker {mode} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len(MARKER):])


def main(args: argparse.Namespace) -> None:
    import torch

    from accel.checkpoint.model_io import save_state_dict_sharded

    size = "quick" if args.quick else "full"
    runs = 2 if args.quick else args.runs
    start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="accel-bench-big-model-"))
    try:
        model = build(size)
        params = sum(p.numel() for p in model.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        files = save_state_dict_sharded(model.state_dict(), root / "ckpt", max_shard_size="100MB")
        shards = sum(1 for f in files if f.suffix == ".safetensors")
        x = torch.randn(BATCH, SIZES[size][1], generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.save({"input": x, "output": model(x), "model_bytes": model_bytes}, root / "reference.pt")
        del model
        results = {}
        for mode in MODES:
            results[mode] = run_worker(mode, root, size, runs, args.threads)
            print(f"  {LABELS[mode]:<32} forward median {median(results[mode]['times']) * 1e3:8.1f} ms", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    blocks, width, hidden = SIZES[size]
    print()
    threads = args.threads or torch.get_num_threads()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {threads} thread(s) per worker; temp folder on "
          f"{tempfile.gettempdir()} (the checkpoint is read from the page cache)")
    print(f"model: {blocks} x [Linear({width}, {hidden}), GELU, Linear({hidden}, {width})], {params:,} parameters, "
          f"{model_bytes / MB:.1f} MB fp32, {shards} safetensors shard(s); batch {BATCH} x {width}; "
          f"{runs} timed forwards per mode after 1 warm-up, torch.no_grad(); MB = 10**6 bytes")
    print()
    header = (f"{'mode':<32}{'fwd med ms':>11}{'min ms':>8}{'x memory':>9}{'load s':>8}{'load peak MB':>13}"
              f"{'run peak MB':>12}{'/ model':>8}{'disk entries':>13}{'equal':>6}")
    print(header)
    print("-" * len(header))
    base = median(results["memory"]["times"])
    for mode in MODES:
        r = results[mode]
        med = median(r["times"])
        disk = f"{r['on_disk']}/{r['entries']}"
        print(f"{LABELS[mode]:<32}{med * 1e3:>11.1f}{min(r['times']) * 1e3:>8.1f}{med / base:>9.2f}{r['load_s']:>8.2f}"
              f"{r['load_peak_mb']:>13.0f}{r['run_peak_mb']:>12.0f}{r['run_peak_mb'] * MB / model_bytes:>8.2f}"
              f"{disk:>13}{'yes' if r['equal'] else 'NO':>6}")
    print()
    print("x memory: forward median / in-memory forward median; / model: run peak / model size. 'in memory' and "
          "'cpu_offload' build the model in the worker (load s = construction with random init).")
    print(f"total {time.perf_counter() - start:.0f} s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed forwards per mode (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4.2M parameters, 2 forwards")
    parser.add_argument("--threads", type=int, help="torch threads in each worker (default: torch's default)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", choices=sorted(SIZES), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments.worker, Path(arguments.path), arguments.size, arguments.runs, arguments.threads)
    else:
        main(arguments)
