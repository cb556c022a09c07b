"""Checkpoint cost: accel's save_state/load_state and save_model/load_checkpoint_in_model against plain PyTorch.

    python benchmarks/bench_checkpoint.py            # ~100M-parameter MLP + AdamW, 3 runs each (~3-4 minutes)
    python benchmarks/bench_checkpoint.py --quick    # smoke run (12.6M parameters, 1 run): its figures are noise
    python benchmarks/bench_checkpoint.py --sizes 100M,1G,10G   # how save/load times grow (one run each, ~10 min)

Every measured operation runs in a fresh interpreter (a worker: this file with --worker), so peak memory of one
operation never carries over to the next. Each worker builds the same model (seed 0: an MLP of 12 blocks
Linear(1024, 4096) - GELU - Linear(4096, 1024), 100,724,736 parameters), prepares it with AdamW through
`Accelerator(cpu=True)` (one process), does one real training step (so the optimizer holds exp_avg, exp_avg_sq
and step for every parameter: about 3x the parameters) and drops the gradients; then it times one operation:

* training state: `accelerator.save_state(dir)` / `accelerator.load_state(dir)` against
  `torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, file)` /
  `torch.load(file, weights_only=True)` + `model.load_state_dict` + `optimizer.load_state_dict`;
* weights only: `accelerator.save_model(model, dir, max_shard_size="500MB")` /
  `load_checkpoint_in_model(model, dir)` against `safetensors.torch.save_file(model.state_dict(), file)` /
  `safetensors.torch.load_file(file)` + `model.load_state_dict`.

accel's saves fsync what they write (they are atomic: temporary name, fsync, rename); the plain saves do not.
Their workers therefore fsync the file after the timed save and time that separately, so the table shows the
plain save both without and with fsync ("+ fsync"), and no dirty page cache is left to slow the next worker.
Loads read checkpoints written a moment earlier, i.e. from the page cache (dropping it needs root). What any
operation imports (torch.distributed.checkpoint: ~0.6 s) is imported before timing, in every worker.

Memory, two measures of what the operation needs on top of the live model and optimizer:
* "peak +MB": the worker resets its peak-RSS counter just before the operation (writes 5 to
  /proc/self/clear_refs, Linux >= 4.0) and reads VmRSS; after it, VmHWM; the difference. It counts every
  resident page, including the pages of a checkpoint file that a reader maps (safetensors' safe_open), which
  the kernel can drop at will. Without clear_refs it falls back to the ru_maxrss difference (which can hide
  an operation's peak below the setup's).
* "anon +MB": the highest RssAnon (heap: buffers and copies) during the operation minus RssAnon before it,
  sampled every 5 ms by the driver from /proc/<pid>/status (a sampling thread inside the worker would be
  starved of the GIL while a big buffer is being copied). A spike shorter than 5 ms can be missed.

Checksums: save_state and load_state also run with the crc32 checksums switched off in the worker (the writer's
inline crc32 and the manifest's hashing replaced by constants; load_state's verification skipped), so their cost is
the difference of the medians, stated as a share of the save time; the load worker also times crc32 and sha256 over
the checkpoint's files (from the page cache, one thread) for their throughput. Where `layout.crc32` is isal's, the
load worker's paired loads and throughput also run through zlib's crc32, for the comparison.

--sizes: one fresh worker per size builds the same blocks until parameters + AdamW's moments reach it (the moments
set as a step sets them: its gradients would not fit beside 10 GB), then times save_state, load_state with and
without checksums, torch.save + fsync and torch.load(mmap=True) + load_state_dict, removing each checkpoint once
timed; a size waits (up to MEMORY_WAIT_S) for 1.25x its bytes of available memory, else it is skipped.

Runs alternate (each operation of a group first in turn); the table shows median, min and max seconds, MB/s
(tensor bytes / median seconds; MB = 10**6 bytes), memory and the size on disk, with accel/plain ratios. Each
load checks that it restored a parameter (and, for training state, its exp_avg) disturbed just before it.
Everything is written under a temporary folder in the system temp dir (/tmp), removed at the end.
A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from statistics import median

MB = 1e6
MARKER = "BENCH_CHECKPOINT_RESULT "
SAMPLE_S = 0.005  # RssAnon sampling interval
# (blocks, width, hidden): blocks x [Linear(width, hidden), GELU, Linear(hidden, width)]
SIZES = {"full": (12, 1024, 4096), "quick": (6, 512, 2048)}
# groups (accel, plain[, accel without checksums]); saves first, since each round's loads read what round 0 saved
SAVE_PAIRS = [("accel_save_state", "torch_save", "accel_save_state_nocrc", "accel_save_state_async"),
              ("accel_save_model", "st_save_file")]
LOAD_PAIRS = [("accel_load_state", "torch_load", "accel_load_state_nocrc", "accel_load_state_fresh",
               "accel_load_state_fresh_nocrc"), ("accel_load_model", "st_load_file")]
LABELS = {
    "accel_save_state": "accel save_state",
    "accel_save_state_nocrc": "accel save_state, no checksums",
    "accel_save_state_async": "accel save_state(async_save=True) x2",
    "accel_load_state_fresh": "accel load_state, into fresh tensors",
    "accel_load_state_fresh_nocrc": "  the same, no checksums",
    "torch_save": "torch.save",
    "accel_load_state": "accel load_state",
    "accel_load_state_nocrc": "accel load_state, no checksums",
    "torch_load": "torch.load + load_state_dict",
    "accel_save_model": "accel save_model (500MB shards)",
    "st_save_file": "safetensors save_file",
    "accel_load_model": "accel load_checkpoint_in_model",
    "st_load_file": "safetensors load_file + load_state_dict",
}
# where each save writes (relative to its run folder); loads read round 0's
OUTPUT = {"accel_save_state": "state", "torch_save": "state.pt", "accel_save_model": "model",
          "st_save_file": "model.safetensors", "accel_save_state_nocrc": "state_nocrc",
          "accel_save_state_async": "state_async"}
SOURCE = {"accel_load_state": "accel_save_state", "torch_load": "torch_save", "accel_load_model": "accel_save_model",
          "st_load_file": "st_save_file", "accel_load_state_nocrc": "accel_save_state",
          "accel_load_state_fresh": "accel_save_state", "accel_load_state_fresh_nocrc": "accel_save_state"}
USER_SIZE = (6, 1024, 2048)  # 25,190,400 parameters: the "as a user would" case on 2 processes
# name -> (--zero_stage, import torch.distributed.optim before timing): accel's ZeRO backend imports it at the first
# save (0.2-0.4 s of TorchScript compilation of torch's functional optimizers), the second ZeRO-3 row leaves that out
USER_LAYOUTS = {"DDP": (0, False), "ZeRO-3": (3, False), "ZeRO-3'": (3, True)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each operation (fresh process each)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 12.6M parameters, 1 run")
    parser.add_argument("--part", choices=["all", "single", "user"], default="all",
                        help="single: the 1-process table; user: the first save of a 2-process run (DDP, ZeRO-3)")
    parser.add_argument("--sizes", help="instead of the tables above: save_state/load_state against torch.save at "
                        "these sizes of training state (parameters + AdamW), e.g. 100M,1G,10G; one run each")
    parser.add_argument("--size-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--user-worker", choices=["sync", "async"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--import-optim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", choices=sorted(SIZES), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def disk_usage(path: Path) -> tuple[int, int]:
    """(bytes, files) of a checkpoint file or folder."""
    if path.is_file():
        return path.stat().st_size, 1
    files = [Path(root) / name for root, _, names in os.walk(path) for name in names]
    return sum(f.stat().st_size for f in files), len(files)


# ------------------------------------------------------------------------------------------------------------
# worker: one fresh process, one measured operation
# ------------------------------------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakRSS:
    """Peak resident memory an operation adds on top of what the process holds when it starts: VmHWM (reset just
    before) - VmRSS before, all resident pages, file-backed ones (mapped by safetensors' readers) included.
    Also notes RssAnon and the monotonic clock at both ends, for the driver's sampling of RssAnon."""

    def __enter__(self) -> "PeakRSS":
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.method = "VmHWM"
            self.before_kb = _status_kb("VmRSS")
        except OSError:
            self.method = "ru_maxrss"
            self.before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.anon_before_kb = _status_kb("RssAnon")
        self.t_start = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.t_end = time.monotonic()
        self.anon_after_kb = _status_kb("RssAnon")
        if self.method == "VmHWM":
            self.peak_kb = _status_kb("VmHWM") - self.before_kb
        else:
            self.peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.before_kb


def build(size: str | tuple, **kwargs):
    """The model and optimizer, prepared by Accelerator(cpu=True), after one real AdamW step."""
    import torch
    from torch import nn

    from accel import Accelerator

    torch.manual_seed(0)
    blocks, width, hidden = SIZES[size] if isinstance(size, str) else size
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    accelerator = Accelerator(**{"cpu": True, **kwargs})
    model, optimizer = accelerator.prepare(model, optimizer)
    train_step(accelerator, model, optimizer, width)
    optimizer.zero_grad(set_to_none=True)
    return accelerator, model, optimizer


def train_step(accelerator, model, optimizer, width: int, set_to_none: bool = True) -> None:
    """One training step on a random batch of 8: forward, backward, the prepared optimizer's step, zero_grad."""
    import torch

    loss = model(torch.randn(8, width)).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fsync_dir)
    finally:
        os.close(fsync_dir)


def without_checksums() -> None:
    """Switch save_state's and load_state's checksums off in this worker: the writer's inline crc32 and the
    manifest's hashing give a constant, load_state verifies nothing (the manifest still lists every file)."""
    from accel.checkpoint import layout, streaming_writer

    class NoCrc32:
        def feed(self, part) -> None:
            pass

        def drain(self) -> None:
            pass

        def stop(self) -> None:
            pass

        def finish(self) -> str:
            return "crc32:00000000"

    streaming_writer._Crc32 = NoCrc32  # type: ignore[misc,assignment]
    layout.file_checksums = lambda folder, names, algorithms=None: dict.fromkeys(names, "crc32:00000000")
    layout._verify_checksums = lambda *args, **kwargs: None
    layout.FileVerification = NoVerification  # type: ignore[misc,assignment]


class NoVerification:
    """layout.FileVerification without the hashing: what load_state costs with no checksums."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def result(self) -> None:
        pass

    def stop(self) -> None:
        pass


PAIRED_REPS = 5  # load_state with and without checksums, alternately, in one process (see paired_loads)


def paired_loads(accelerator, path: Path) -> dict:
    """load_state's checksum cost measured within one process, so that noise between processes does not count:
    PAIRED_REPS rounds, each loading `path` with and without checksum verification (in turn first), read in place and
    into fresh tensors: the median seconds of each."""
    import accel.checkpoint.state_load as state_load
    from accel.checkpoint import layout

    real = (getattr(layout, "FileVerification", None), layout._verify_checksums, state_load.STAGING_BYTES,
            getattr(layout, "_crc32_function", None))
    modes = ["crc", "nocrc"] + (["zlib"] if real[3] is not None and real[3]() is not zlib.crc32 else [])
    times: dict[str, list[float]] = {}
    try:
        for rnd in range(PAIRED_REPS):
            for mode in modes[rnd % len(modes):] + modes[:rnd % len(modes)]:
                checks = mode != "nocrc"
                for fresh in (False, True):
                    if real[0] is not None:
                        layout.FileVerification = real[0] if checks else NoVerification  # type: ignore[misc]
                    layout._verify_checksums = real[1] if checks else (lambda *args, **kwargs: None)
                    if real[3] is not None:  # crc32 through zlib's, where accel would use isal's
                        layout._crc32_function = (lambda: zlib.crc32) if mode == "zlib" else real[3]
                    state_load.STAGING_BYTES = 2**40 if fresh else real[2]
                    gc.collect()
                    t0 = time.perf_counter()
                    accelerator.load_state(str(path))
                    key = f"paired_{'fresh' if fresh else 'in_place'}_{mode}_s"
                    times.setdefault(key, []).append(time.perf_counter() - t0)
    finally:
        if real[0] is not None:
            layout.FileVerification = real[0]  # type: ignore[misc]
        if real[3] is not None:
            layout._crc32_function = real[3]
        layout._verify_checksums, state_load.STAGING_BYTES = real[1], real[2]
    return {k: median(v) for k, v in times.items()}


def staging_wait_counter():
    """Seconds the optimizer steps waited for asynchronous saves' staging copies so far (accel.checkpoint.async_save's
    counter; 0 with an accel from before the copy was made in the background, where save_state made it itself)."""
    from accel.checkpoint import async_save

    return getattr(async_save, "staging_waited", lambda: 0.0)


def checksum_speed(folder: Path) -> dict:
    """Seconds to crc32 and to sha256 every file of a checkpoint, one thread, from the page cache."""
    from accel.checkpoint import layout

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    speed = {"checksum_bytes": sum(p.stat().st_size for p in files)}
    for algorithm in ("crc32", "sha256"):
        t0 = time.perf_counter()
        for p in files:
            layout.file_checksum(p, algorithm)
        speed[f"{algorithm}_s"] = time.perf_counter() - t0
    chosen = getattr(layout, "_crc32_function", None)
    if chosen is not None and chosen() is not zlib.crc32:
        layout._crc32_function = lambda: zlib.crc32
        try:
            t0 = time.perf_counter()
            for p in files:
                layout.file_checksum(p, "crc32")
            speed["zlib_crc32_s"] = time.perf_counter() - t0
        finally:
            layout._crc32_function = chosen
    return speed


def worker(op: str, path: Path, size: str) -> None:
    import torch

    # Import what any of the operations needs before timing anything, the same in every worker: the first
    # save_state/load_state of a process would otherwise also pay for importing torch.distributed.checkpoint.
    t0 = time.perf_counter()
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    dcp_import_s = time.perf_counter() - t0
    import safetensors.torch  # noqa: F401

    import accel.checkpoint.model_io  # noqa: F401
    import accel.checkpoint.state_load
    import accel.checkpoint.training_state  # noqa: F401

    start = time.perf_counter()
    accelerator, model, optimizer = build(size)
    setup_s = time.perf_counter() - start
    inner = accelerator.unwrap_model(model)
    raw_opt = optimizer.optimizer
    first = next(inner.parameters())
    model_bytes = sum(t.numel() * t.element_size() for t in inner.state_dict().values())
    opt_bytes = sum(v.numel() * v.element_size() for s in raw_opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor))
    result = {"op": op, "setup_s": setup_s, "model_bytes": model_bytes, "opt_bytes": opt_bytes,
              "params": sum(p.numel() for p in inner.parameters()), "fsync_s": 0.0,
              "dcp_import_s": dcp_import_s}

    # Loads: disturb the live state first, so the worker can tell the load really restored it.
    expect = None
    if op in SOURCE:
        expect = (first.detach().clone(), raw_opt.state[first]["exp_avg"].clone())
        with torch.no_grad():
            first.add_(1.0)
            raw_opt.state[first]["exp_avg"].add_(1.0)
        gc.collect()

    if op.endswith("_nocrc"):
        without_checksums()
        op = op.removesuffix("_nocrc")
    if op.endswith("_fresh"):  # read into fresh tensors, as every rank's share up to STAGING_BYTES (1 GiB) is
        accel.checkpoint.state_load.STAGING_BYTES = 2**40
        op = op.removesuffix("_fresh")
    width = SIZES[size][1]
    if op == "accel_save_state_async":  # the loop's own step time, gradients kept (as in a loop): the baseline
        steps = []
        for _ in range(4):
            t0 = time.perf_counter()
            train_step(accelerator, model, optimizer, width, set_to_none=False)
            steps.append(time.perf_counter() - t0)
        result["step_s"] = median(steps[1:])
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        if op == "accel_save_state":
            accelerator.save_state(str(path))
        elif op == "accel_save_state_async":  # two saves, each followed at once by a training step
            staging_waited = staging_wait_counter()
            for i in (1, 2):
                t1 = time.perf_counter()
                accelerator.save_state(f"{path}_{i}" if i == 1 else str(path), async_save=True)
                result[f"call{i}_s"] = time.perf_counter() - t1
                waited, t1 = staging_waited(), time.perf_counter()
                train_step(accelerator, model, optimizer, width, set_to_none=False)  # waits for the copy first
                result[f"step{i}_s"] = time.perf_counter() - t1
                result[f"staging_wait{i}_s"] = staging_waited() - waited
                result[f"blocked{i}_s"] = result[f"call{i}_s"] + result[f"staging_wait{i}_s"]
                t1 = time.perf_counter()
                accelerator.wait_for_checkpoint()
                result[f"wait{i}_s"] = time.perf_counter() - t1
        elif op == "torch_save":
            torch.save({"model": inner.state_dict(), "optimizer": raw_opt.state_dict()}, path)
        elif op == "accel_save_model":
            accelerator.save_model(model, str(path), max_shard_size="500MB")
        elif op == "st_save_file":
            from safetensors.torch import save_file

            save_file(inner.state_dict(), str(path))
        elif op == "accel_load_state":
            accelerator.load_state(str(path))
        elif op == "torch_load":
            state = torch.load(path, weights_only=True)
            inner.load_state_dict(state["model"])
            raw_opt.load_state_dict(state["optimizer"])
            del state
        elif op == "accel_load_model":
            from accel.checkpoint import load_checkpoint_in_model

            load_checkpoint_in_model(model, str(path))
        elif op == "st_load_file":
            from safetensors.torch import load_file

            state = load_file(str(path))
            inner.load_state_dict(state)
            del state
        else:
            raise SystemExit(f"unknown operation {op!r}")
        result["seconds"] = time.perf_counter() - t0
    if op in ("torch_save", "st_save_file"):  # the durability accel pays for: timed apart from the save
        t0 = time.perf_counter()
        fsync_path(path)
        result["fsync_s"] = time.perf_counter() - t0
    if op == "accel_load_state" and result["op"] == op:  # the checksums' throughput, over what was loaded
        result.update(checksum_speed(path))
        result.update(paired_loads(accelerator, path))
    if expect is not None:
        first = next(inner.parameters())  # load_state_dict copies in place; this is the same object
        restored = torch.equal(first, expect[0])
        if op in ("accel_load_state", "torch_load"):
            restored = restored and torch.equal(optimizer.optimizer.state[first]["exp_avg"], expect[1])
        result["restored"] = bool(restored)
    result.update(peak_mb=peak.peak_kb * 1024 / MB, peak_method=peak.method, t_start=peak.t_start, t_end=peak.t_end,
                  anon_before_kb=peak.anon_before_kb, anon_after_kb=peak.anon_after_kb)
    print(MARKER + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------------------

def _anon_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run_worker(op: str, path: Path, size: str, scratch: Path) -> dict:
    """Run one worker; meanwhile sample its RssAnon every 5 ms from here (a thread inside the worker would be
    starved of the GIL exactly while a big buffer is being copied)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", op, "--path", str(path), "--size", size]
    samples: list[tuple[float, int]] = []
    with open(scratch / "stdout", "w+") as out, open(scratch / "stderr", "w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        while proc.poll() is None:
            kb = _anon_kb(proc.pid)
            if kb is not None:
                samples.append((time.monotonic(), kb))
            time.sleep(SAMPLE_S)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [line for line in stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(stdout + stderr)
        raise SystemExit(f"worker {op} failed (exit {proc.returncode})")
    result = json.loads(lines[-1][len(MARKER):])
    inside = [kb for t, kb in samples if result["t_start"] <= t <= result["t_end"]]
    result["anon_mb"] = (max(inside + [result["anon_after_kb"]]) - result["anon_before_kb"]) * 1024 / MB
    result["anon_samples"] = len(inside)
    return result


def user_worker(mode: str, out: Path, import_optim: bool = False) -> None:
    """One job of the 2-process case (launched by `accel launch --cpu --num_processes 2 --zero_stage N`): the run's
    first save_state, synchronous or asynchronous, each rank timing the call and the training step right after it."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 (imported before timing, as in the 1-process workers)

    staging_waited = staging_wait_counter()
    if import_optim:
        import torch.distributed.optim  # noqa: F401
    width = USER_SIZE[1]
    accelerator, model, optimizer = build(USER_SIZE)
    steps = []
    for _ in range(5):
        t0 = time.perf_counter()
        train_step(accelerator, model, optimizer, width, set_to_none=False)
        steps.append(time.perf_counter() - t0)
    record = {"rank": accelerator.process_index, "step_s": median(steps[2:]), "params": sum(
        p.numel() for p in accelerator.unwrap_model(model).parameters()), "torch": torch.__version__,
        "imported_optim": "torch.distributed.optim" in sys.modules}
    accelerator.wait_for_everyone()
    t0 = time.perf_counter()
    accelerator.save_state(str(out.with_suffix("")), async_save=mode == "async")
    record["call_s"] = time.perf_counter() - t0
    record["first_save_imported_optim"] = not record.pop("imported_optim") and "torch.distributed.optim" in sys.modules
    waited, t0 = staging_waited(), time.perf_counter()
    train_step(accelerator, model, optimizer, width, set_to_none=False)
    record["step_after_s"] = time.perf_counter() - t0
    record["staging_wait_s"] = staging_waited() - waited
    t0 = time.perf_counter()
    accelerator.wait_for_checkpoint()
    record["wait_s"] = time.perf_counter() - t0
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    if accelerator.is_main_process:
        out.write_text(json.dumps(everyone))
    accelerator.end_training()


def user_case(args: argparse.Namespace) -> None:
    """The first save of a 2-process run, synchronous against asynchronous, under DDP and ZeRO-3 (fresh launches)."""
    from _common import accel_command, run_job

    runs = 1 if args.quick else max(1, args.runs)
    results: dict[tuple[str, str], list[list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="accel-bench-checkpoint-user-") as tmp:
        for rnd in range(runs):
            for index, (name, (stage, import_optim)) in enumerate(USER_LAYOUTS.items()):
                for mode in (("sync", "async") if (rnd + index) % 2 == 0 else ("async", "sync")):
                    out = Path(tmp) / f"{index}-{mode}-{rnd}.json"
                    cmd = [*accel_command(), "launch", "--cpu", "--num_processes", "2", "--mixed_precision", "no",
                           "--zero_stage", str(stage), os.path.abspath(__file__), "--user-worker", mode,
                           "--out", str(out), *(["--import-optim"] if import_optim else [])]
                    record = run_job(cmd, out, 600, label=f"{name} {mode} (run {rnd + 1}/{runs}): ")
                    if record is not None:
                        results.setdefault((name, mode), []).append(record)
                    shutil.rmtree(out.with_suffix(""), ignore_errors=True)
    if not results:
        return
    first = next(iter(results.values()))[0][0]
    blocks, width, hidden = USER_SIZE
    print(f"\nthe first save_state of a run, as a user would: {blocks} x [Linear({width}, {hidden}), GELU, "
          f"Linear({hidden}, {width})], {first['params']:,} parameters, AdamW, 2 processes (gloo, 1 thread each), "
          f"batch 8 per process, torch {first['torch']}; medians of {runs} fresh launch(es); per run the slowest rank")
    header = (f"{'layout':<8}{'sync save s':>12}{'async: returns s':>17}{'+ step waits s':>15}{'blocked s':>10}"
              f"{'blocked/sync':>13}{'loop lost s':>12}{'lost/sync':>10}{'step s':>8}")
    print(header)
    print("-" * len(header))
    for name in USER_LAYOUTS:
        sync, asyn = results.get((name, "sync")), results.get((name, "async"))
        if not sync or not asyn:
            print(f"{name:<8} (a launch failed)")
            continue

        def worst(runs_: list[list[dict]], key) -> float:
            return median([max(key(r) for r in ranks) for ranks in runs_])

        step = worst(sync + asyn, lambda r: r["step_s"])
        sync_s = worst(sync, lambda r: r["call_s"])
        sync_lost = worst(sync, lambda r: r["call_s"] + r["step_after_s"]) - step
        call = worst(asyn, lambda r: r["call_s"])
        waited = worst(asyn, lambda r: r["staging_wait_s"])
        blocked = worst(asyn, lambda r: r["call_s"] + r["staging_wait_s"])
        lost = worst(asyn, lambda r: r["call_s"] + r["step_after_s"]) - step
        print(f"{name:<8}{sync_s:>12.2f}{call:>17.2f}{waited:>15.2f}{blocked:>10.2f}{blocked / sync_s:>12.2f}x"
              f"{lost:>12.2f}{lost / sync_lost:>9.2f}x{step:>8.2f}")
    print("ZeRO-3: the first save imports torch.distributed.optim (accel/backends/zero.py), in both saves' time; "
          "ZeRO-3': imported before timing")
    print("blocked: save_state's return + the wait of the next optimizer step for the staging copy (target <= 0.2x "
          "the synchronous save); loop lost: save_state + the step after it - a step without a save, against the same "
          "for the synchronous save (under DDP the main process saves alone: the other waits in the next all-reduce)")


def main(args: argparse.Namespace) -> None:
    start, load = time.perf_counter(), os.getloadavg()
    if args.part in ("all", "single"):
        single(args)
    if args.part in ("all", "user"):
        user_case(args)
    print(f"total {time.perf_counter() - start:.0f} s; load average {load[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs (other work slows every figure)")


def single(args: argparse.Namespace) -> None:
    import torch

    size = "quick" if args.quick else "full"
    runs = 1 if args.quick else max(1, args.runs)
    root = Path(tempfile.mkdtemp(prefix="accel-bench-checkpoint-"))
    results: dict[str, list[dict]] = {op: [] for pair in SAVE_PAIRS + LOAD_PAIRS for op in pair}
    sizes: dict[str, tuple[int, int]] = {}
    try:
        for rnd in range(runs):
            folder = root / f"run{rnd}"
            folder.mkdir()
            for pair in SAVE_PAIRS:
                for op in pair[rnd % len(pair):] + pair[:rnd % len(pair)]:
                    results[op].append(run_worker(op, folder / OUTPUT[op], size, root))
                    print(f"  round {rnd + 1}/{runs}  {LABELS[op]:<40} {results[op][-1]['seconds']:7.2f} s",
                          flush=True)
            for pair in LOAD_PAIRS:
                for op in pair[rnd % len(pair):] + pair[:rnd % len(pair)]:
                    source = root / "run0" / OUTPUT[SOURCE[op]]
                    results[op].append(run_worker(op, source, size, root))
                    print(f"  round {rnd + 1}/{runs}  {LABELS[op]:<40} {results[op][-1]['seconds']:7.2f} s",
                          flush=True)
            if rnd == 0:
                sizes = {op: disk_usage(folder / name) for op, name in OUTPUT.items()}
            else:
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    info = results["accel_save_state"][0]
    state_bytes = info["model_bytes"] + info["opt_bytes"]
    blocks, width, hidden = SIZES[size]
    print()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, temp folder on {tempfile.gettempdir()}, "
          f"{runs} run(s) per operation, each in a fresh process")
    every = [r for v in results.values() for r in v]
    print(f"per worker, untimed: build + prepare + 1 AdamW step {median([r['setup_s'] for r in every]):.1f} s, "
          f"import torch.distributed.checkpoint {median([r['dcp_import_s'] for r in every]):.2f} s (medians; "
          "imported before timing in every worker)")
    print(f"model: {blocks} x [Linear({width}, {hidden}), GELU, Linear({hidden}, {width})], {info['params']:,} "
          f"parameters, {info['model_bytes'] / MB:.1f} MB; AdamW state after 1 step {info['opt_bytes'] / MB:.1f} MB; "
          f"training state {state_bytes / MB:.1f} MB")
    print(f"peak +MB: {info['peak_method']} increase over the RSS before the operation (file pages mapped by "
          "readers included); anon +MB: RssAnon increase (heap only), "
          "sampled every 5 ms from the driver; MB = 10**6 bytes\n")

    def ratio(a: float, b: float, floor: float = 10.0) -> str:
        diff = f"{round(a - b):+d} MB"
        return f"{a / b:.2f}x ({diff})" if b >= floor else f"{diff} (plain < {floor:.0f} MB)"

    header = (f"{'operation':<42}{'median s':>9}{'min s':>7}{'max s':>7}{'MB/s':>7}{'peak +MB':>9}{'anon +MB':>9}"
              f"{'disk MB':>9}{'files':>6}{'restored':>9}")
    for title, pairs, payload in (("training state (model + AdamW)", [SAVE_PAIRS[0], LOAD_PAIRS[0]], state_bytes),
                                  ("model weights only", [SAVE_PAIRS[1], LOAD_PAIRS[1]], info["model_bytes"])):
        print(f"{title}: {payload / MB:.1f} MB of tensors")
        print(header)
        print("-" * len(header))
        for accel_op, plain_op, *others in pairs:
            rows = {}
            for op in (accel_op, plain_op, *others):
                runs_ = results[op]
                secs = [r["seconds"] for r in runs_]
                rows[op] = (median(secs), median([r["peak_mb"] for r in runs_]), median([r["anon_mb"] for r in runs_]))
                disk, files = sizes.get(op) or sizes.get(SOURCE.get(op, ""), (0, 0))
                ok = "" if "restored" not in runs_[0] else ("yes" if all(r["restored"] for r in runs_) else "NO")
                print(f"{LABELS[op]:<42}{rows[op][0]:>9.2f}{min(secs):>7.2f}{max(secs):>7.2f}"
                      f"{payload / MB / rows[op][0]:>7.0f}{round(rows[op][1]):>9d}{round(rows[op][2]):>9d}"
                      f"{disk / MB:>9.1f}{files:>6}{ok:>9}")
            (t_a, p_a, n_a), (t_p, p_p, n_p) = rows[accel_op], rows[plain_op]
            ratio_line = (f"  accel/plain: time {t_a / t_p:.2f}x, peak {ratio(p_a, p_p)}, "
                          f"anon {ratio(n_a, n_p)}")
            if plain_op in ("torch_save", "st_save_file"):
                synced_all = [r["seconds"] + r["fsync_s"] for r in results[plain_op]]
                synced = median(synced_all)
                print(f"{LABELS[plain_op] + ' + fsync':<42}{synced:>9.2f}{min(synced_all):>7.2f}"
                      f"{max(synced_all):>7.2f}{payload / MB / synced:>7.0f}")
                ratio_line += f"; time against the fsynced save {t_a / synced:.2f}x"
                if accel_op == "accel_save_state":
                    ratio_line += f" (target <= 1.10); anon +{round(n_a)} MB (target <= one file, 268 MB)"
            print(ratio_line)
        print()
    save = median([r["seconds"] for r in results["accel_save_state"]])
    runs_async = results["accel_save_state_async"]
    print("asynchronous save_state (two saves per worker, each followed at once by a training step; the first save of "
          "the process allocates the staging buffers, the second reuses them), against the synchronous save_state's "
          "median (also the first save of a fresh process):")
    step = median([r["step_s"] for r in runs_async])
    print(f"  a training step without a save (forward + backward + AdamW, batch 8): {step:.2f} s")
    for i, what in ((1, "first save "), (2, "second save")):
        def med(key: str, i: int = i) -> float:
            return median([r[f"{key}{i}_s"] for r in runs_async])

        blocked, delay = med("blocked"), med("call") + med("step") - step
        print(f"  {what}: save_state returned in {med('call'):.2f} s, the next step waited {med('staging_wait'):.2f} s "
              f"for the copy: blocked {blocked:.2f} s = {blocked / save:.2f}x the synchronous save (target <= 0.2); "
              f"the loop lost {delay:.2f} s = {delay / save:.2f}x (save_state + that step - a step; the copy's thread "
              f"shares the cores with the step); written in the background in {med('wait'):.2f} s more")
    extra = median([r["anon_mb"] for r in runs_async])
    print(f"  extra memory: anon +{round(extra)} MB over both saves (the staging copy, kept for the next save), "
          f"{extra * MB / state_bytes:.2f}x the training state")
    print()
    print("checksums (crc32) of the training state, their cost as the difference of the medians:")
    for what, op in (("save_state", "accel_save_state"), ("load_state (read in place: > 1 GiB)", "accel_load_state"),
                     ("load_state into fresh tensors", "accel_load_state_fresh")):
        on = median([r["seconds"] for r in results[op]])
        off = median([r["seconds"] for r in results[op + "_nocrc"]])
        print(f"  {what} {on:.2f} s, without checksums {off:.2f} s: {on - off:+.2f} s = "
              f"{(on - off) / save * 100:+.1f}% of the save time ({(on - off) / off * 100:+.1f}% of this operation)"
              f"  (target <= 5% of the save time)")
    paired = [r for r in results["accel_load_state"] if "paired_in_place_crc_s" in r]
    if paired:
        print(f"  the same within one process ({PAIRED_REPS} loads each way per worker, alternating; medians):")
        for what, key in (("read in place", "in_place"), ("into fresh tensors", "fresh")):
            on = median([r[f"paired_{key}_crc_s"] for r in paired])
            off = median([r[f"paired_{key}_nocrc_s"] for r in paired])
            print(f"    load_state {what} {on:.2f} s, without checksums {off:.2f} s: {on - off:+.2f} s = "
                  f"{(on - off) / save * 100:+.1f}% of the save time  (target <= 5%)")
            if f"paired_{key}_zlib_s" in paired[0]:
                slow = median([r[f"paired_{key}_zlib_s"] for r in paired])
                print(f"      the same verified through zlib's crc32 {slow:.2f} s: {slow - off:+.2f} s = "
                      f"{(slow - off) / save * 100:+.1f}% of the save time")
    timed = [r for r in results["accel_load_state"] if "crc32_s" in r]
    if timed:
        nbytes = timed[0]["checksum_bytes"]
        for algorithm in ("crc32", "zlib_crc32", "sha256"):
            if f"{algorithm}_s" not in timed[0]:
                continue
            secs = median([r[f"{algorithm}_s"] for r in timed])
            print(f"  {algorithm} of the checkpoint's {nbytes / MB:.0f} MB, one thread, from the page cache: "
                  f"{secs:.2f} s, {nbytes / secs / 1e9:.2f} GB/s")


# ------------------------------------------------------------------------------------------------------------
# --sizes: how save and load times grow with the training state
# ------------------------------------------------------------------------------------------------------------

BLOCK_STATE = 12 * (2 * 1024 * 4096 + 4096 + 1024)  # bytes of one block's parameters + AdamW moments: ~100.7 MB


def parse_size(text: str) -> int:
    """`100M`, `1G`, `10G`, `1.5G` (decimal units) -> bytes."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def size_worker(target: int, path: Path) -> None:
    """One size: the MLP of enough blocks for `target` bytes of parameters + AdamW state (the moments are set as
    a step sets them, without its gradients and activations, which would not fit beside 10 GB), then save_state,
    load_state (with and without checksums), torch.save + fsync and torch.load(mmap=True) + load_state_dict, each
    checkpoint removed once timed."""
    import safetensors.torch  # noqa: F401 (what save_state and load_state import, imported before timing)
    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    from torch import nn

    import accel.checkpoint.dcp_reader  # noqa: F401
    import accel.checkpoint.training_state  # noqa: F401
    from accel import Accelerator
    from accel.checkpoint import layout

    blocks = max(1, round(target / BLOCK_STATE))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    raw = optimizer.optimizer
    for group in raw.param_groups:
        for p in group["params"]:
            raw.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.full_like(p, 1e-3),
                            "exp_avg_sq": torch.full_like(p, 1e-6)}
    inner = accelerator.unwrap_model(model)
    state_bytes = sum(t.numel() * t.element_size() for t in inner.state_dict().values()) + sum(
        v.numel() * v.element_size() for st in raw.state.values() for v in st.values())
    result = {"blocks": blocks, "state_bytes": state_bytes, "setup_s": time.perf_counter() - t0,
              "params": sum(p.numel() for p in inner.parameters())}
    first = next(inner.parameters())
    expect = first.detach().clone()

    def timed(fn) -> float:
        gc.collect()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    folder = path / "state"
    result["save_s"] = timed(lambda: accelerator.save_state(str(folder)))
    result["disk_bytes"], result["files"] = disk_usage(folder)
    for key, checks in (("load_s", True), ("load_nocrc_s", False)):
        with torch.no_grad():
            first.add_(1.0)
        real = (layout.FileVerification, layout._verify_checksums)
        if not checks:
            layout.FileVerification, layout._verify_checksums = NoVerification, lambda *a, **k: None  # type: ignore
        try:
            result[key] = timed(lambda: accelerator.load_state(str(folder)))
        finally:
            layout.FileVerification, layout._verify_checksums = real  # type: ignore[misc]
        result.setdefault("restored", True)
        result["restored"] &= bool(torch.equal(first.detach(), expect))
    shutil.rmtree(folder)

    file = path / "state.pt"
    result["torch_save_s"] = timed(lambda: torch.save({"model": inner.state_dict(), "optimizer": raw.state_dict()},
                                                      file))
    result["torch_fsync_s"] = timed(lambda: fsync_path(file))
    with torch.no_grad():
        first.add_(1.0)

    def torch_load() -> None:
        loaded = torch.load(file, mmap=True, weights_only=True)
        inner.load_state_dict(loaded["model"])
        raw.load_state_dict(loaded["optimizer"])

    result["torch_load_s"] = timed(torch_load)
    result["restored"] &= bool(torch.equal(first.detach(), expect))
    file.unlink()
    print(MARKER + json.dumps(result), flush=True)


MEMORY_WAIT_S = 900  # how long a size waits for the memory it needs (a shared machine's other jobs end)


def memory_for(nbytes: float) -> bool:
    """Whether MemAvailable reaches `nbytes`, waiting up to MEMORY_WAIT_S for it."""
    deadline = time.monotonic() + MEMORY_WAIT_S
    while True:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        if available >= nbytes:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(10)


def sizes_case(args: argparse.Namespace) -> None:
    """save_state/load_state against torch.save (+ fsync) / torch.load at each of `--sizes`, one fresh worker each."""
    import torch

    sizes = [s for s in args.sizes.split(",") if s.strip()]
    results = []
    load = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="accel-bench-checkpoint-sizes-"))
    try:
        for text in sizes:
            if not memory_for(1.25 * parse_size(text)):
                print(f"  {text}: skipped (under {1.25 * parse_size(text) / 1e9:.1f} GB of memory available for "
                      f"{MEMORY_WAIT_S} s)", flush=True)
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--size-worker", str(parse_size(text)), "--path",
                   str(root)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
            if done.returncode != 0 or not lines:
                sys.stderr.write(done.stdout + done.stderr)
                print(f"  {text}: worker failed (exit {done.returncode})", flush=True)
                continue
            results.append((text, json.loads(lines[-1][len(MARKER):])))
            print(f"  {text}: done", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs, temp folder on {tempfile.gettempdir()}, one run per "
          "size, one process; training state: an MLP's parameters + AdamW's moments (12 bytes a parameter); load_state "
          "reads in place above 1 GiB; torch.load with mmap=True (a copy of 10 GB would not fit beside the live one); "
          "MB/s: state bytes / seconds, MB = 10**6 bytes")
    header = (f"{'size':<6}{'state MB':>10}{'files':>6}{'save s':>8}{'MB/s':>6}{'torch.save+fsync s':>19}{'MB/s':>6}"
              f"{'ratio':>7}{'load s':>8}{'MB/s':>7}{'torch.load s':>13}{'ratio':>7}{'checksums':>11}{'restored':>9}")
    print(header)
    print("-" * len(header))
    for text, r in results:
        mb = r["state_bytes"] / MB
        plain = r["torch_save_s"] + r["torch_fsync_s"]
        crc = (r["load_s"] - r["load_nocrc_s"]) / r["save_s"] * 100
        print(f"{text:<6}{mb:>10.0f}{r['files']:>6}{r['save_s']:>8.2f}{mb / r['save_s']:>6.0f}{plain:>19.2f}"
              f"{mb / plain:>6.0f}{r['save_s'] / plain:>6.2f}x{r['load_s']:>8.2f}{mb / r['load_s']:>7.0f}"
              f"{r['torch_load_s']:>13.2f}{r['load_s'] / r['torch_load_s']:>6.2f}x{crc:>+10.1f}%"
              f"{'yes' if r['restored'] else 'NO':>9}")
    print("checksums: load_state with - without them (the next load, same process), as a share of the save time; "
          f"load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.size_worker:
        size_worker(arguments.size_worker, Path(arguments.path))
    elif arguments.sizes:
        sizes_case(arguments)
    elif arguments.worker:
        worker(arguments.worker, Path(arguments.path), arguments.size)
    elif arguments.user_worker:
        user_worker(arguments.user_worker, Path(arguments.out), arguments.import_optim)
    else:
        main(arguments)
