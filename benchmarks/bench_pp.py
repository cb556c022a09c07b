"""Pipeline parallelism on CPU: step time of p = 2 stages for m = 1, 2, 4, 8, 16 micro-batches against one
process on the same batch, and the measured bubble fraction against the theory (p - 1) / (m + p - 1).

    python benchmarks/bench_pp.py              # 8 x Linear(2048, 2048) MLP, batch 2048 (~4 minutes on 2 cores)
    python benchmarks/bench_pp.py --quick      # smoke run (small model)
    python benchmarks/bench_pp.py --compare    # 1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV at p = 2 and 4

Jobs, each with OMP_NUM_THREADS=1 (one core per process):

* one process: plain PyTorch (no accel), `loss = mse(model(x), y); loss.backward(); optimizer.step()`;
* p = 2: `accel launch --cpu --num_processes 2 --pp_size 2 --pp_schedule S --pp_microbatches m`, the loop
  `loss = model(x, target=y); accelerator.backward(loss); optimizer.step()`.

The model is `nn.Sequential` of L x (Linear(D, D), ReLU) (seed 0), split by accel into two stages of equal
parameter count; AdamW (fp32); fixed synthetic tensors. Step times are medians over the measured steps, on
rank 0 (the pipeline's ranks finish a step together).

Bubble (measured): the idle fraction of each process during the pipelined forward/backward
(`loss = model(x, target=y)`): 1 - busy / elapsed, where busy is the time inside the stage's forward and
backward of each micro-batch (PipelineStage.forward_one_chunk / backward_one_chunk, timed by wrapping them;
receives are waited for outside them), averaged over the processes. The theory, (p - 1) / (m + p - 1), assumes
equal stages and free communication. The speed-up column is the end-to-end effect, optimizer step included;
it also pays for what the bubble leaves out: on one CPU thread per process, small micro-batches make the
matrix products less efficient and each micro-batch adds its gradients into .grad (memory traffic), so the busy
time grows with m. Asserts nothing.

`--compare` (`--pp 2 4`, `--microbatches 8`): at each p, the same m for 1F1B, Interleaved1F1B (2 stages per
process), ZBVZeroBubble and DualPipeV (2 stages per process in V order), on 16 x Linear(1024, 1024), batch 1024 (2p
stages of equal parameter count). Busy time there also counts the weight-gradient half of a split backward
(`backward_weight_one_chunk`). Theory, equal stages, free communication, in units of one stage's forward F
(full backward B = 2F, its weight part W = F), as the idle fraction of a step (p - 1) k / (m + (p - 1) k):
k = 1 for 1F1B ((p - 1)/(m + p - 1)); k = 1/v for Interleaved1F1B, v = 2 stages per process (Megatron's
(p - 1)/(v m) bubble ratio); k = 0 for ZBVZeroBubble (ZB-V, arXiv 2401.10241, section 6: no bubble when F = I = W);
k = 1/3 for DualPipeV (DeepSeek-V3, arXiv 2412.19437, table 2: (PP/2 - 1)(F&B + B - 3W) over 2p half-size stages,
F&B = F + B as CPU processes overlap nothing: (p - 1) F against 1F1B's 3 (p - 1) F). The same factors as
`accel.planning.plan.pipeline_bubble`. On 2 cores, p = 4 runs 4 processes on 2 cores: its times are noisy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from _common import accel_command, run_job

SIZES = {"full": (8, 2048, 2048), "quick": (4, 256, 64), "compare": (16, 1024, 1024)}  # (layers, width, batch)
MICROBATCHES = (1, 2, 4, 8, 16)
COMPARED = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
BUBBLE_SHARE = {"1F1B": 1.0, "Interleaved1F1B": 0.5, "ZBVZeroBubble": 0.0, "DualPipeV": 1 / 3}  # k, of 1F1B's


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["single", "pipeline"], help="run one job (set by the launcher)")
    parser.add_argument("--out", help="worker: where to write the JSON record")
    parser.add_argument("--schedule", default="GPipe", help="GPipe (default: it also runs m = 1), 1F1B, ...")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--compare", action="store_true", help="the schedules of COMPARED at each --pp")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="--compare: pipeline sizes")
    parser.add_argument("--microbatches", type=int, default=8, help="--compare: micro-batches (DualPipeV: >= 2p)")
    parser.add_argument("--size", default=None, help=argparse.SUPPRESS)  # worker: the model size (set by --compare)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launched job")
    return parser.parse_args(argv)


# worker side ---------------------------------------------------------------------------------------------

def build(size: str):
    import torch

    layers, width, batch = SIZES[size]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), x, y


def worker(args: argparse.Namespace) -> None:
    import torch  # here, not at the top: the launcher side never imports torch

    model, optimizer, x, y = build(args.size or ("quick" if args.quick else "full"))
    loss_fn = torch.nn.functional.mse_loss
    if args.worker == "single":
        def step():
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        main = True
    else:
        from accel import Accelerator

        accelerator = Accelerator()
        model, optimizer = accelerator.prepare(model, optimizer, loss_fn=loss_fn)

        def step():
            start = time.perf_counter()
            loss = model(x, target=y)
            pipelined.append(time.perf_counter() - start)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        main = accelerator.is_main_process
    times, pipelined, busy = [], [], [0.0]
    for i in range(args.warmup + args.steps):
        if i == args.warmup and args.worker == "pipeline":
            pipelined.clear()
            time_stage_compute(model, busy)
        start = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    record = {"step_s": median(times)}
    if args.worker == "pipeline":
        idle = torch.tensor([1 - busy[0] / sum(pipelined)])
        record["idle"] = accelerator.gather(idle).tolist()
    if main:
        Path(args.out).write_text(json.dumps(record))


def time_stage_compute(model, busy: list) -> None:
    """Add the seconds spent in each micro-batch's stage forward and backward (both halves of a split one) to
    busy[0] (benchmark-only: wraps the PipelineStage objects of the prepared model's schedules)."""
    for _, stages in model._schedules.values():
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                original = getattr(stage, name)

                def timed(*args, _original=original, **kwargs):
                    start = time.perf_counter()
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        busy[0] += time.perf_counter() - start

                setattr(stage, name, timed)


# launcher side -------------------------------------------------------------------------------------------

def run_all(args: argparse.Namespace) -> int:
    me = str(Path(__file__).resolve())
    passed = ["--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    layers, width, batch = SIZES["quick" if args.quick else "full"]
    p = 2
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        single = run_job([sys.executable, me, "--worker", "single", "--out", f"{tmp}/single.json", *passed],
                         Path(tmp) / "single.json", args.timeout)
        rows = []
        for m in MICROBATCHES:
            out = Path(tmp) / f"pp{m}.json"
            cmd = [*accel_command(), "launch", "--cpu", "--num_processes", str(p), "--pp_size", str(p),
                   "--pp_schedule", args.schedule, "--pp_microbatches", str(m), "--mixed_precision", "no",
                   me, "--worker", "pipeline", "--out", str(out), *passed]
            rows.append((m, run_job(cmd, out, args.timeout)))
    if single is None:
        return 1
    single = single["step_s"]
    params = layers * (width * width + width)
    print(f"\nmodel: {layers} x Linear({width}, {width}) = {params / 1e6:.1f}M parameters, batch {batch}, "
          f"schedule {args.schedule}, p = {p}, one thread per process")
    print(f"one process (plain PyTorch): {single * 1e3:.0f} ms/step\n")
    print(f"{'m':>3} {'step ms':>8} {'vs 1 proc':>9} {'speed-up':>8} {'bubble':>7} {'theory':>7} {'diff':>6}  per rank")
    for m, record in rows:
        if record is None:
            print(f"{m:>3}  failed")
            continue
        step, idle = record["step_s"], record["idle"]
        bubble = sum(idle) / len(idle)
        theory = (p - 1) / (m + p - 1)
        print(f"{m:>3} {step * 1e3:>8.0f} {step / single:>9.3f} {single / step:>8.2f} {bubble:>7.1%} {theory:>7.1%} "
              f"{(bubble - theory) * 100:>+5.1f}  {' '.join(f'{v:.1%}' for v in idle)}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """Each schedule of COMPARED at each p, the same m: measured bubble against theory, step time against 1F1B's."""
    me = str(Path(__file__).resolve())
    passed = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--size", "compare"]
    layers, width, batch = SIZES["compare"]
    m, results = args.microbatches, {}
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        for p in args.pp:
            for schedule in COMPARED:
                out = Path(tmp) / f"{schedule}-{p}.json"
                cmd = [*accel_command(), "launch", "--cpu", "--num_processes", str(p), "--pp_size", str(p),
                       "--pp_schedule", schedule, "--pp_microbatches", str(m), "--mixed_precision", "no",
                       me, "--worker", "pipeline", "--out", str(out), *passed]
                results[schedule, p] = run_job(cmd, out, args.timeout, label=f"{schedule} p={p}: ")
    print(f"\nmodel: {layers} x Linear({width}, {width}), batch {batch}, m = {m} micro-batches, one thread per "
          "process; theory: idle = (p-1)k / (m + (p-1)k), k: 1F1B 1, Interleaved1F1B 1/2, ZBVZeroBubble 0, "
          "DualPipeV 1/3\n")
    print(f"{'p':>2} {'schedule':<16} {'step ms':>8} {'vs 1F1B':>8} {'bubble':>7} {'theory':>7} {'diff':>6}  per rank")
    for p in args.pp:
        base = results.get(("1F1B", p))
        for schedule in COMPARED:
            record = results[schedule, p]
            if record is None:
                print(f"{p:>2} {schedule:<16}  failed")
                continue
            step, idle = record["step_s"], record["idle"]
            bubble = sum(idle) / len(idle)
            k = BUBBLE_SHARE[schedule]
            theory = (p - 1) * k / (m + (p - 1) * k)
            ratio = f"{step / base['step_s']:>8.3f}" if base else f"{'-':>8}"
            print(f"{p:>2} {schedule:<16} {step * 1e3:>8.0f} {ratio} {bubble:>7.1%} {theory:>7.1%} "
                  f"{(bubble - theory) * 100:>+5.1f}  {' '.join(f'{v:.1%}' for v in idle)}")
    return 0 if all(r is not None for r in results.values()) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return run_compare(args) if args.compare else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
