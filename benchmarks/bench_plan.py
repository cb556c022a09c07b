"""Accuracy of `accel plan`: its step-time ranking vs the measured one, and what `--measure` picks.

    python benchmarks/bench_plan.py                      # 2 processes, every layout that fits (~10 minutes)
    python benchmarks/bench_plan.py --num_processes 4    # 4 processes (TP x DP, PP x DP, ...)
    python benchmarks/bench_plan.py --quick              # 3 layouts, 3 steps: checks it works, figures are noise

1. Calibrates this machine as `accel plan --calibrate` does (matmul rate with one thread, as each launched
   process gets one core, gloo all_reduce bandwidth and latency) into a temporary file.
2. Plans a tiny Llama (transformers `LlamaConfig`, untied: hidden 256, 4 layers, vocab 4096; global batch 8 x 128
   tokens) for N processes of this machine, with the calibrated rates and memory enough for every layout.
3. Runs every layout that fits with `accel.planning.measure.measure_one` (what `accel plan --measure` runs: this
   file as the unmodified training script under `accel launch --config_file <layout>.yaml`, stopped after
   --steps optimizer steps; median step after 2 warm-up steps, the slowest rank), one layout at a time, in a
   shuffled order (a slow drift of the machine's speed would otherwise line up with the estimated ranking).
4. Prints estimated next to measured, the Spearman rank correlation of the two (target >= 0.8) and the layout
   `--measure` would pick (the fastest measured of the estimate's --top best) against the fastest measured of
   all (target within 10%). Asserts nothing.

The worker is an ordinary accel training loop in the pipeline-ready form (`loss_fn` given to prepare, `loss =
model(x, target=y)`), so the same script runs every layout: DDP, ZeRO 1-3, offload, TP, PP, checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH, SEQ, VOCAB = 8, 128, 4096


def llama():
    """The benchmark's model (also `accel plan benchmarks/bench_plan.py:llama`-style MODEL for the planner)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False))


def loss_fn(logits, targets):
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def worker() -> int:
    """Train until accel stops the job (ACCEL_STOP_AFTER_STEPS, set by the measuring driver)."""
    import torch

    from accel import Accelerator

    accelerator = Accelerator()
    par = accelerator.parallelism_config
    dp = accelerator.num_processes // (par.tp_size * par.pp_size)
    torch.manual_seed(0)
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer, loss_fn=loss_fn)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH // dp, SEQ + 1), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(accelerator.device)
    # the DataLoader the plan asks for: batch_size per_process / gradient_accumulation_steps (a pipeline splits the
    # whole per-process batch into its micro-batches itself)
    micro = tokens.chunk(accelerator.gradient_accumulation_steps) if par.pp_size == 1 else [tokens]
    for _ in range(10_000):
        for batch in micro:
            with accelerator.accumulate(model):
                loss = model(batch[:, :-1], target=batch[:, 1:])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return 3  # not reached when measured


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def layout_key(row: dict) -> str:
    from accel.planning.plan import describe

    return describe({**row, "step_time_s": None})


def planned(cal: dict, num_processes: int, mixed_precision: str) -> dict:
    """The plan of the benchmark's model for this machine's calibration `cal`."""
    import torch

    from accel.planning.estimate import spec_from_module
    from accel.planning.plan import GB, Hardware, apply_calibration, plan

    hw = Hardware(num_processes=num_processes, device_memory=64 * GB, host_memory=64 * GB)
    apply_calibration(hw, cal)
    with torch.device("meta"):
        module = llama()
    return plan(spec_from_module(module, "bench_plan:llama"), hw, GLOBAL_BATCH, SEQ, mixed_precision, module=module)


def show_calibration(cal: dict) -> None:
    print(f"calibration (1 thread): {cal['flops'] / 1e9:.1f} GFLOP/s (half rate at {cal['tokens_half']:.0f} rows, "
          f"width {cal['width_half']:.0f}), memory-bound work {cal['memory_bandwidth'] / 1e9:.1f} GB/s, all_reduce "
          f"{cal['intra_bandwidth'] / 1e9:.2f} GB/s, latency {cal['intra_latency'] * 1e6:.0f} us per hop, "
          f"all-gather / reduce-scatter at {cal['gather_factor']:.2f} / {cal['scatter_factor']:.2f} of its "
          f"bandwidth; in a step a blocking collective takes {cal['sync_fixed'] * 1e3:.2f} ms + "
          f"{cal['sync_slowdown']:.2f} x its time alone; {cal['op_overhead'] * 1e6:.0f} us per op; "
          f"{cal['overlap']:.0%} of an all-reduce hides behind matmuls")


def score(result: dict, measured: dict[str, float], fitting: list[int], top: int) -> dict:
    """Spearman of estimated vs measured over the layouts that ran, and what `--measure --top` would pick."""
    from accel.planning.plan import describe

    ran = [(i, result["layouts"][i], measured[layout_key(result["layouts"][i])]) for i in fitting
           if measured.get(layout_key(result["layouts"][i])) is not None]
    if len(ran) < 3:
        print("fewer than 3 layouts ran: no ranking")
        return {}
    rho = spearman([r["step_time_s"] for _, r, _ in ran], [m for _, _, m in ran])
    fastest = min(m for _, _, m in ran)
    pick = min(ran[:top], key=lambda x: x[2])
    ratio = pick[2] / fastest
    print(f"\nSpearman rank correlation, estimated vs measured step time over {len(ran)} layouts: {rho:.3f} "
          f"(target >= 0.8: {'ok' if rho >= 0.8 else 'MISSED'})")
    print(f"--measure --top {top} picks #{pick[0]} ({describe(pick[1])}): {pick[2]:.3f} s vs the fastest "
          f"measured {fastest:.3f} s: x{ratio:.3f} (target <= 1.10: {'ok' if ratio <= 1.10 else 'MISSED'})")
    return {"spearman": rho, "pick_ratio": ratio}


def run(args) -> int:
    import torch

    from accel.planning.plan import describe
    from accel.planning.measure import calibrate, load_calibration, measure_one

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    torch.set_num_threads(1)
    if args.rescore:  # the current model against a saved run's measurements and calibration
        saved = json.loads(Path(args.rescore).read_text())
        cal = load_calibration(Path(args.calibration)) if args.calibration else saved["calibration"]
        show_calibration(cal)
        result = planned(cal, args.num_processes, args.mixed_precision)
        measured = {r["key"]: r["measured_s"] for r in saved["rows"]}
        fitting = [i for i, r in enumerate(result["layouts"]) if r["fits"]]
        for i in fitting:
            row = result["layouts"][i]
            meas = measured.get(layout_key(row))
            print(f"{i:>3} {describe(row):<90} " + (f"meas {meas:.3f} s" if meas is not None else "not measured"))
        score(result, measured, fitting, args.top)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        cal = (load_calibration(Path(args.calibration)) if args.calibration else
               calibrate(Path(tmp) / "calibration.json", collectives=True))
        show_calibration(cal)
        result = planned(cal, args.num_processes, args.mixed_precision)
        fitting = [i for i, r in enumerate(result["layouts"]) if r["fits"]]
        if args.quick:
            fitting = fitting[:3]
        print(f"{len(fitting)} layouts fit; measuring each for {args.steps} optimizer steps", flush=True)
        rows = []
        order = list(fitting)
        random.Random(0).shuffle(order)  # the machine's slow drifts must not line up with the estimated ranking
        for i in order:
            row = result["layouts"][i]
            got = measure_one(result, i, __file__, ["--worker"], args.steps, Path(tmp), timeout=600, env=env)
            meas = got.get("measured_step_time_s")
            rows.append((i, row, meas))
            print(f"{i:>3} {describe(row):<90} est {row['step_time_s']:.3f} s  "
                  + (f"meas {meas:.3f} s" if meas is not None else f"failed: {got['measured_error']}"), flush=True)
    summary = score(result, {layout_key(r): m for _, r, m in rows}, fitting, args.top)
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "calibration": cal, "rows": [
            {"index": i, "key": layout_key(r), "layout": describe(r), "estimated_s": r["step_time_s"],
             "measured_s": m, "breakdown": r.get("time_breakdown_s")} for i, r, m in rows]}, indent=2))
    return 0 if summary else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=3, help="what --measure would run (default 3)")
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows and the calibration to this file")
    parser.add_argument("--calibration", default=None, help="use this stored calibration instead of calibrating")
    parser.add_argument("--rescore", default=None, metavar="RUN.json",
                        help="measure nothing: score the current model against a --json run's measurements")
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    if args.quick:
        args.steps = 3
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
