"""`accel plan --measure` and `--calibrate`: FlexFlow's / DeepSpeed autotuner's step. Run the best candidate
layouts for a few optimizer steps with the user's unmodified script (accel stops it: `StepMeter`), and measure
this machine's matmul rate and collective bandwidth for later plans.

Measured memory per rank: on CUDA `torch.cuda.max_memory_allocated`; on CPU the bytes of the tensors the rank
holds after `optimizer.step()` (parameters, gradients, optimizer state: the same quantity as the estimate's
model-state bytes, as benchmarks/bench_estimate.py counts them), plus the process's max RSS for reference.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STOP_ENV = "ACCEL_STOP_AFTER_STEPS"
MEASURE_BATCH_ENV = "ACCEL_MEASURE_BATCH_SIZE"  # read by accel.data.loading.prepare_data_loader
FILE_ENV = "ACCEL_MEASURE_FILE"
CAL_VERSION = 1


@dataclass(frozen=True)
class Effort:
    """How long `calibrate` measures the collectives: the sweep's sizes, the in-step runs (each: compute segments x
    3 collective sizes, `pairs` paired trials of `calls` calls), the backend-cost trials. FULL is the default;
    QUICK (a few seconds) checks the same figures with more noise (tests set it: `measure.EFFORT = QUICK`)."""

    sweep: tuple = (2 ** 14, 2 ** 16, 2 ** 18, 2 ** 20, 2 ** 22, 2 ** 24)
    in_situ_runs: int = 3
    segments: tuple = (0.002, 0.008)
    pairs: int = 9
    calls: int = 8
    backend_trials: int = 7


FULL = Effort()
QUICK = Effort(sweep=(2 ** 14, 2 ** 18, 2 ** 22), in_situ_runs=1, segments=(0.001, 0.004), pairs=3, calls=4,
               backend_trials=3)
EFFORT = FULL  # what `calibrate` runs


# -- inside the workers -------------------------------------------------------------------------------------
class StepMeter:
    """Counts real optimizer steps (AcceleratedOptimizer.step past the accumulation gate and not skipped for
    inf/nan), and after `stop` of them writes this rank's record and ends the job cleanly (exit 0)."""

    def __init__(self, stop: int, path: str):
        self.stop, self.path, self.times = stop, path, [time.perf_counter()]

    def tick(self, optimizer) -> None:
        if optimizer.step_was_skipped:
            return
        self.times.append(time.perf_counter())
        if len(self.times) - 1 >= self.stop:
            self.finish(optimizer)

    def record(self, optimizer) -> dict:
        import resource

        import torch

        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        ends = self.times[1:]
        return {"rank": int(os.environ.get("RANK", 0)), "steps": len(ends),
                "step_times_s": [b - a for a, b in itertools.pairwise(self.times)],
                "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else held_bytes(optimizer),
                "memory_kind": "cuda max_memory_allocated" if cuda else "tensors held after step",
                "held_bytes": held_bytes(optimizer),
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def finish(self, optimizer):
        import torch.distributed as dist

        rec = self.record(optimizer)
        Path(f"{self.path}.rank{rec['rank']}.json").write_text(json.dumps(rec))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        raise SystemExit(0)


def meter_from_env() -> StepMeter | None:
    """The meter when `accel plan --measure` launched this process (ACCEL_STOP_AFTER_STEPS set), else None."""
    stop = os.environ.get(STOP_ENV)
    if not stop:
        return None
    return StepMeter(int(stop), os.environ.get(FILE_ENV) or os.path.join(tempfile.gettempdir(), "accel_measure"))


def held_bytes(optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state tensors this rank holds (local shards)."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    tensors = [t for group in inner.param_groups for p in group["params"] for t in (p, p.grad)]
    local = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer: this rank's partition and its state
    tensors += [v for st in local.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]  # kept alive: ids
    seen, total = set(), 0
    for t in local:
        if t.device.type == "meta" or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


# -- the driver ----------------------------------------------------------------------------------------------
def summarize(records: list[dict], warmup: int) -> dict:
    """Step time: the slowest rank's median step after `warmup` steps; memory: the largest rank's."""
    times = [statistics.median(r["step_times_s"][warmup:] or r["step_times_s"]) for r in records]
    return {"measured_step_time_s": max(times), "measured_memory_per_rank_bytes": max(
        r["peak_memory_bytes"] for r in records), "memory_kind": records[0]["memory_kind"],
        "max_rss_bytes": max(r["max_rss_bytes"] for r in records), "ranks": len(records)}


def _reason(proc: subprocess.CompletedProcess) -> str:
    text = (proc.stderr or "") + (proc.stdout or "")
    if "out of memory" in text.lower():
        return "out of memory"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(" ")]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return ((errors or lines or [f"exit code {proc.returncode}"])[-1])[:200]


def measure_one(result: dict, index: int, script: str, script_args: list[str], steps: int, workdir: Path,
                timeout: float = 600, env: dict | None = None) -> dict:
    """Launch `script` under layout `index` of a plan for `steps` optimizer steps; its measured figures or
    {"measured_error": one line}."""
    from accel.planning.plan import write_config

    cfg = write_config({**result, "recommended": index}, workdir / f"layout{index}.yaml")
    out = workdir / f"layout{index}"
    row = result["layouts"][index]  # the script's prepared DataLoader gets the layout's batch per process
    batch = row["micro_batch_size"] if row["pp_size"] == 1 else row["per_process_batch"]
    run_env = {**(env or os.environ), STOP_ENV: str(steps), FILE_ENV: str(out), MEASURE_BATCH_ENV: str(batch)}
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--config_file", str(cfg), script, *script_args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"measured_error": f"did not finish {steps} steps in {timeout:.0f} s"}
    records = [json.loads(p.read_text()) for p in sorted(workdir.glob(f"layout{index}.rank*.json"))]
    if proc.returncode != 0 or not records:
        return {"measured_error": _reason(proc) if proc.returncode else
                f"the script ended before {steps} optimizer steps (no record written)"}
    return {**summarize(records, 2 if steps >= 5 else 1), "launch_s": time.perf_counter() - start}


def measure(result: dict, script: str, script_args: list[str], top: int = 3, steps: int = 5,
            timeout: float = 600, env: dict | None = None) -> dict:
    """Run the `top` best fitting layouts; `measured` lists them with their figures and `measured_best` indexes
    (into layouts) the fastest that ran, which becomes `recommended`."""
    fitting = [i for i, r in enumerate(result["layouts"]) if r["fits"]][:top]
    rows = []
    with tempfile.TemporaryDirectory(prefix="accel-measure-") as tmp:
        for i in fitting:
            rows.append({"index": i, **measure_one(result, i, script, script_args, steps, Path(tmp), timeout, env)})
    ran = [r for r in rows if "measured_step_time_s" in r]
    best = min(ran, key=lambda r: r["measured_step_time_s"])["index"] if ran else None
    return {**result, "measured": rows, "measured_steps": steps, "measured_best": best,
            "recommended": best if best is not None else result["recommended"]}


# -- calibration ---------------------------------------------------------------------------------------------
def default_calibration_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "accel" / "calibration.json"


def _best_seconds(call, reps: int, trials: int = 3, cuda: bool = False) -> float:
    """Seconds per call: the best of `trials` timings of `reps` calls (a shared machine's hiccups only slow)."""
    import torch

    call()
    best = float("inf")
    for _ in range(trials):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            call()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def matmul_tflops(device: str, dtype, n: int, reps: int) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _best_seconds(lambda: a @ b, reps, cuda=device == "cuda") / 1e12


def memory_bandwidth(device: str, dtype, nbytes: int = 2 ** 24) -> float:
    """Bytes/s (read + written) of the memory-bound work of a training step that accel.planning.plan adds to the
    matmuls, as a mix of its kinds on `nbytes` activations: residual add, gating mul, SiLU, a norm's mean of squares,
    and the loss's log_softmax with its backward (on a CPU, exp-heavy ops run at a fraction of a plain add's rate)."""
    import torch

    n = nbytes // torch.tensor([], dtype=dtype).element_size()
    x, y = (torch.randn(n // 4096, 4096, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty_like(x)
    grad = torch.empty_like(x)
    ops = [(lambda: torch.add(x, y, out=out), 3), (lambda: torch.mul(x, y, out=out), 3),
           (lambda: torch.nn.functional.silu(x), 2), (lambda: x.pow(2).mean(-1, keepdim=True), 2),
           (lambda: torch.log_softmax(x, -1), 2),
           (lambda: torch._log_softmax_backward_data(y, x, -1, dtype, out=grad), 3)]
    cuda = device == "cuda"
    seconds = sum(_best_seconds(op, 5 if device == "cpu" else 50, cuda=cuda) for op, _ in ops)
    return sum(passes for _, passes in ops) * nbytes / seconds


def op_overhead(device: str) -> float:
    """Seconds of framework time per eager op, forward + backward: a chain of 200 elementwise ops on a 64-element
    tensor that requires grad (the kernels are nothing; dispatch, autograd and Python are what is timed). On a
    GPU the launches run ahead of the kernels and hide behind any model worth planning: 0 there."""
    import torch

    if device != "cpu":
        return 0.0
    x = torch.ones(64, requires_grad=True)

    def chain():
        y = x
        for _ in range(200):
            y = y * 1.0001
        y.sum().backward()
    return _best_seconds(chain, 5) / 200


def half_rate_size(device: str, dtype, peak: float, sizes=(64, 256), width: bool = False) -> float:
    """The size at which a matmul runs at half the `peak` rate, fitting rate = peak * n / (n + half) to
    [n, 1024] @ [1024, 1024] (rows: a micro-batch's tokens) or [1024, n] @ [n, n] (`width`: hidden per TP rank),
    the median over `sizes`."""
    import torch

    fits = []
    for n in sizes:
        shape_a, shape_b = ((1024, n), (n, n)) if width else ((n, 1024), (1024, 1024))
        a = torch.randn(*shape_a, device=device, dtype=dtype)
        b = torch.randn(*shape_b, device=device, dtype=dtype)
        flops = 2 * shape_a[0] * shape_a[1] * shape_b[1]
        rate = flops / _best_seconds(lambda a=a, b=b: a @ b, max(4, int(2e9 / flops)), cuda=device == "cuda")
        fits.append(max(0.0, n * (peak / rate - 1)))
    return statistics.median(fits)


def _allreduce_worker(rank: int, world: int, port: int, backend: str, sizes: list[int], queue,
                      effort: Effort = FULL) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    times: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for size in sizes:
        full = torch.ones(size // 4, device=device)
        shard = torch.ones(size // 4 // world, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed them
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        calls = {"all_reduce": functools.partial(dist.all_reduce, full),
                 "all_gather": functools.partial(gather, full, shard),
                 "reduce_scatter": functools.partial(scatter, shard, full)}
        for name, call in calls.items():
            times[name].append((size, _median_call(call, backend, device)))
    situ = _median_fields([_in_situ(backend, device, times, effort) for _ in range(effort.in_situ_runs)])  # noisy
    situ.update(_backend_call_costs(backend, device, times, trials=effort.backend_trials))
    fits = {name: _affine(points) for name, points in times.items()}  # seconds = fixed + size * per_byte
    best: dict[str, Any] = {name: ((2 if name == "all_reduce" else 1) * (world - 1) / world) / max(per_byte, 1e-15)
            for name, (_, per_byte) in fits.items()}  # ring bus bandwidth
    fixed = fits["all_reduce"][0]
    if fixed <= 0:  # noise (a shared machine) tilted the line below 0: the smallest call's time bounds the fixed cost
        fixed = min(t for _, t in times["all_reduce"])
    latency = fixed / (2 * (world - 1))  # per ring hop, as accel.planning.plan counts it
    best["times"], best["in_situ"] = times, situ
    if rank == 0:
        queue.put((best, latency))
    dist.barrier()
    dist.destroy_process_group()


def _median_call(call, backend: str, device: str) -> float:
    """Median seconds of one call over ~0.2 s of calls (every rank runs as many): the typical call, not the
    mean a few scheduler hiccups of a shared CPU machine (10x a call, now and then) would set."""
    import torch
    import torch.distributed as dist

    def timed() -> float:
        start = time.perf_counter()
        call()
        if backend == "nccl":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed()
    reps = torch.tensor([min(50, max(7, int(0.2 / max(timed(), 1e-6))))], device=device)
    dist.all_reduce(reps, op=dist.ReduceOp.MAX)
    return statistics.median(timed() for _ in range(int(reps.item())))


def _compute_chain(device: str, seconds: float):
    """A call that runs about `seconds` of matmuls shaped like a small transformer's ([256, 256] @ [256, 688])."""
    import torch

    a = torch.randn(256, 256, device=device)
    b = torch.randn(256, 688, device=device)
    one = _best_seconds(lambda: a @ b, 20, cuda=device != "cpu")
    reps = max(1, round(seconds / max(one, 1e-7)))

    def run():
        for _ in range(reps):
            a @ b
    return run


def _in_situ(backend: str, device: str, iso: dict, effort: Effort = FULL) -> dict:
    """What a blocking collective costs inside a training step, beyond the isolated time `iso` measured: ranks
    that compute between collectives arrive at different times and wait for each other (on a CPU the OS
    scheduler and gloo's threads make that large; a GPU's kernels run alike). Segments of compute
    (`effort.segments`: 2 and 8 ms) each followed by an all_reduce (16 KiB, 1 MiB, 4 MiB: latency- to
    bandwidth-bound), against the compute alone
    in paired trials (medians: the typical step); the extra per call is fitted as `sync_fixed` + `sync_slowdown` x
    the time of the sweep's call (`iso`, what accel.planning.plan interpolates). Also `overlap`: the share
    of an asynchronous all_reduce of about the same duration that hides behind matmuls (DDP's and FSDP2's
    bucketed collectives run beside compute; a GPU runs them on their own stream, gloo's thread competes with
    the matmuls for the CPU's cores)."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    rows, calls = [], effort.calls
    for seg in effort.segments:
        chain = _compute_chain(device, seg)
        for size in (2 ** 14, 2 ** 20, 2 ** 22):
            x = torch.ones(size // 4, device=device)

            def alone(chain=chain):
                for _ in range(calls):
                    chain()
                sync()

            def interleaved(chain=chain, x=x):
                for _ in range(calls):
                    chain()
                    dist.all_reduce(x)
                sync()
            alone(), interleaved()  # warm-up
            # paired trials, the median of their differences: the machine's drift hits both halves of a pair
            pairs = [[_synced_times(f, 1, warmup=False)[0] for f in (alone, interleaved)]
                     for _ in range(effort.pairs)]
            extra = statistics.median(b - a for a, b in pairs) / calls
            # against the sweep accel.planning.plan reads
            rows.append((1.0, _sweep_time(iso["all_reduce"], size), extra))
    fixed, slowdown = _least_squares(rows)
    if slowdown < 1:  # never faster than alone: the fixed part alone then
        fixed, slowdown = statistics.median(extra - t for _, t, extra in rows), 1.0
    g = torch.ones(2 ** 21, device=device)  # 8 MiB: a gradient bucket's order
    t_comm = _synced_median(lambda: (dist.all_reduce(g), sync()), backend, device)
    chain = _compute_chain(device, t_comm)
    t_compute = _synced_median(lambda: (chain(), sync()), backend, device)

    def both():
        work = dist.all_reduce(g, async_op=True)
        chain()
        work.wait()
        sync()
    hidden = t_comm + t_compute - _synced_median(both, backend, device)
    return {"sync_fixed": max(0.0, fixed), "sync_slowdown": slowdown,
            "overlap": max(0.0, min(1.0, hidden / max(min(t_comm, t_compute), 1e-9)))}


def _backend_call_costs(backend: str, device: str, iso: dict, width: int = 256, blocks: int = 4,
                        trials: int = 7) -> dict:
    """Seconds torch's own backends add per collective beyond the sweep's time for it, on a small block stack
    (Linear(w, 2.7w) - GELU - Linear(2.7w, w), a [512, w] batch) against the same stack on one rank alone:
    `fsdp_call`: fully_shard per block, not resharded after forward (one all-gather and one reduce-scatter per
    block per step: copy-in/out, hooks, waits); `tp_call`: ColwiseParallel/RowwiseParallel per block (one
    all-reduce forward, one backward: DTensor dispatch, redistribution). Medians of 7 steps after 2."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    hidden = int(width * 2.7) // 2 * 2
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                                      torch.nn.Linear(hidden, width)) for _ in range(blocks)))
    stack = stack.to(device)
    x = torch.randn(512, width, device=device)
    mesh = init_device_mesh(device.split(":")[0], (dist.get_world_size(),))
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)

    def step_time(model) -> float:
        def step():
            model(x).square().mean().backward()
            sync()
        return _synced_median(step, backend, device, trials=trials)

    alone = step_time(copy.deepcopy(stack))
    sharded = copy.deepcopy(stack)
    for block in sharded:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
    block_bytes = sum(p.numel() for p in stack[0].parameters()) * 4
    fsdp = step_time(sharded) - alone - blocks * (_sweep_time(iso["all_gather"], block_bytes)
                                                  + _sweep_time(iso["reduce_scatter"], block_bytes))
    split = copy.deepcopy(stack)
    for block in split:
        parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    tp_alone = step_time(_halved(copy.deepcopy(stack)))  # a TP rank's matmuls: half the hidden width
    tp = step_time(split) - tp_alone - 2 * blocks * _sweep_time(iso["all_reduce"], x.numel() * 4)
    return {"fsdp_call": max(0.0, fsdp / (2 * blocks)), "tp_call": max(0.0, tp / (2 * blocks))}


def _halved(stack):
    """The stack with each block's hidden width halved (what one of 2 TP ranks computes)."""
    import torch

    for block in stack:
        first, last = block[0], block[2]
        block[0] = torch.nn.Linear(first.in_features, first.out_features // 2).to(first.weight.device)
        block[2] = torch.nn.Linear(last.in_features // 2, last.out_features).to(last.weight.device)
    return stack


def _sweep_time(points: list, size: int) -> float:
    """The sweep's time at `size` bytes, read as accel.planning.plan reads it (so what is subtracted is what it
    adds)."""
    from accel.planning.plan import _interpolate

    return _interpolate(points, size)


def _median_fields(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _synced_median(call, backend: str, device: str, trials: int = 7) -> float:
    """The median of `trials` timings: what a step typically meets (ranks drifting apart is the point here)."""
    return statistics.median(_synced_times(call, trials))


def _synced_times(call, trials: int, warmup: bool = True) -> list[float]:
    import torch.distributed as dist

    if warmup:
        call()
    times = []
    for _ in range(trials):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _least_squares(rows: Sequence[tuple[float, ...]]) -> list[float]:
    """Coefficients c minimizing sum (row[:-1] . c - row[-1])^2 (normal equations, Gaussian elimination)."""
    k = len(rows[0]) - 1
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * r[-1] for r in rows)] for i in range(k)]
    for i in range(k):
        pivot = max(range(i, k), key=lambda r: abs(a[r][i]))
        a[i], a[pivot] = a[pivot], a[i]
        if abs(a[i][i]) < 1e-30:
            return [0.0] * k
        for r in range(k):
            if r != i:
                f = a[r][i] / a[i][i]
                a[r] = [x - f * y for x, y in zip(a[r], a[i], strict=True)]
    return [a[i][k] / a[i][i] for i in range(k)]


def _affine(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of seconds against bytes."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def allreduce_bandwidth(backend: str, sizes=None, effort: Effort | None = None) -> tuple[dict, float]:
    """({collective: bytes/s} of a 2-process sweep of all_reduce, all_gather_into_tensor and
    reduce_scatter_tensor over `sizes` (16 KiB-16 MiB: TP activations to gradient buckets), seconds per ring hop
    of an all_reduce): a straight line through each collective's times, so the bandwidth is its slope and the
    latency its fixed cost per call (on gloo about 2 ms per MB-sized call, far above a 4-byte message's).
    `effort`: how long (EFFORT when None; `sizes` replaces its sweep)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    effort = effort or EFFORT
    mp.start_processes(_allreduce_worker, args=(2, port, backend, list(sizes or effort.sweep), queue, effort),
                       nprocs=2, join=True,
                       start_method="spawn")
    return queue.get()


def calibrate(path: Path | None = None, collectives: bool = True) -> dict:
    """Measure and store {"flops": FLOP/s (the best dtype, with this process's threads), "tokens_half" and
    "width_half" (accel.planning.plan's small-matmul efficiency), "intra_bandwidth": bytes/s, "intra_latency": s per
    hop, ...} at `path`."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    rates = {"fp32": matmul_tflops(device, torch.float32, 4096 if cuda else 1024, 20 if cuda else 4)}
    if cuda:
        rates["bf16"] = matmul_tflops(device, torch.bfloat16, 8192, 20)
    data: dict[str, Any] = {"version": CAL_VERSION, "time": time.time(),
                            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "matmul_tflops": rates,
                            "flops": max(rates.values()) * 1e12, "intra_bandwidth": None}
    best = torch.bfloat16 if cuda else torch.float32
    data["tokens_half"] = half_rate_size(device, best, data["flops"])
    data["width_half"] = half_rate_size(device, best, data["flops"], width=True)
    data["memory_bandwidth"] = memory_bandwidth(device, best)
    data["op_overhead"] = op_overhead(device)
    data["run_ahead"] = cuda  # CUDA queues kernels ahead of the host: FSDP2's forward gathers overlap there
    procs = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
    if collectives and procs >= 2:
        collective, data["intra_latency"] = allreduce_bandwidth("nccl" if cuda else "gloo")
        data["intra_bandwidth"] = collective["all_reduce"]
        data["gather_factor"] = collective["all_gather"] / collective["all_reduce"]
        data["scatter_factor"] = collective["reduce_scatter"] / collective["all_reduce"]
        data["collectives"] = {"world": 2, **collective["times"]}  # what accel.planning.plan interpolates
        data.update(collective["in_situ"])  # sync_fixed, sync_slowdown, overlap
        data["collective_backend"] = "nccl" if cuda else "gloo"
    path = Path(path or default_calibration_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return {**data, "path": str(path)}


def load_calibration(path: Path | str | None = None) -> dict | None:
    """The stored calibration, or None when there is none at the default place. A file named by `path`
    (`--calibration`) must be there; a file that is there must be one `calibrate` writes (figures checked by
    accel.planning.inputs.calibration): anything else is an EstimateError naming the file and key."""
    from accel.planning import inputs

    given = path is not None
    path = Path(inputs.path_text("--calibration", str(path)) if given else default_calibration_path())
    kind = inputs.kind_of(path)
    if kind is None and not given:
        return None
    if kind != "file":
        raise inputs.EstimateError(f"--calibration {inputs.show(str(path))}: no such file; allowed: a file written by "
                                   "accel plan --calibrate (run it with the same --calibration first)")
    data = inputs.calibration(inputs.read_json(path, inputs.CALIBRATION_FORMAT), path)
    return {**data, "path": str(path)}
