"""torch.compile through accel: compile time, graphs captured and steady-state step time of eager, regional
compilation (each repeated block compiled in place) and whole-model compilation, on a GPT-2 model (one process,
CPU, inductor).

Each mode runs in a fresh process with its own empty inductor cache directory (`TORCHINDUCTOR_CACHE_DIR`), so every
compile is cold: nothing compiled by an earlier mode or an earlier run of this script is reused. In each process:
`Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend=..., use_regional_compilation=...))`, then
`model, optimizer = accelerator.prepare(model, optimizer)` and a plain training loop (zero_grad, forward with
labels, `accelerator.backward(loss)`, AdamW step) on the same seeded model and the same seeded batches. Reported:

* first step: wall time of step 1 (where the compile happens, lazily, in forward and backward);
  compile s = first step minus eager's median step (the cost a user sees once; eager's own first step is shown
  for scale: it has one-off allocations too);
* graphs: `torch._dynamo.utils.counters["stats"]["unique_graphs"]` after the run (dynamo frames compiled; the
  backward graphs AOTAutograd makes from them are not counted) and the number of graph breaks;
* step ms: the median of the measured steps after the warm-up steps, and its ratio to eager;
* max |loss - eager loss| over all steps (the runs are bit-for-bit comparable only at step 1; after that AdamW
  carries the rounding differences on).

    python benchmarks/bench_compile.py [--layers 12 --width 384 --heads 6 --batch 4 --seq 128 --warmup 3 --steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = {"eager": ("no", False), "regional": ("inductor", True), "whole": ("inductor", False)}


def measure(args, mode: str) -> dict:
    """One mode, in this process: per-step wall times and losses, graphs captured."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import GPT2Config, GPT2LMHeadModel

    from accel import Accelerator
    from accel.utils import TorchDynamoPlugin

    torch.set_num_threads(args.threads)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    # named: left unset (GPT2LMHeadModel's name gives none), transformers logs a warning_once inside forward, which
    # is a graph break under torch.compile (and the rest of that frame runs eager)
    model.loss_type = "ForCausalLM"
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    total = args.warmup + args.steps + 1
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator) for _ in range(total)]
    backend, regional = MODES[mode]
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend=backend,
                                                                        use_regional_compilation=regional))
    model, optimizer = accelerator.prepare(model, optimizer)
    times, losses = [], []
    for tokens in batches:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"times": times, "losses": losses, "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=3, help="steps after the first, not measured")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (median)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--modes", default="eager,regional,whole", help="comma-separated; eager always runs")
    parser.add_argument("--quick", action="store_true", help="a small model, for a smoke run")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one mode and print JSON
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.heads, args.batch, args.seq, args.warmup, args.steps = 2, 64, 2, 2, 32, 1, 2
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return
    modes = ["eager"] + [m for m in args.modes.split(",") if m and m != "eager"]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; allowed: {', '.join(MODES)}")
    rows, load_before = {}, os.getloadavg()
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="bench_compile_") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)  # cold compile every mode and every run
            started = time.perf_counter()
            done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", mode], capture_output=True, text=True,
                                  env=env, check=False)
            if done.returncode:
                sys.exit(f"mode {mode} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            rows[mode]["process_s"] = time.perf_counter() - started
    eager = rows["eager"]
    eager_step = statistics.median(eager["times"][1 + args.warmup:])
    print(f"torch {eager['torch']}, {eager['threads']} threads (of {os.cpu_count()} cores), inductor on CPU, fp32")
    print(f"GPT-2 ({eager['params']:,} parameters): {args.layers} layers, width {args.width}, {args.heads} heads, "
          f"vocabulary {args.vocab}, batch {args.batch} x {args.seq} tokens, AdamW; 1 first step + {args.warmup} "
          f"warm-up + {args.steps} measured steps; each mode in a fresh process with an empty inductor cache")
    header = (f"{'mode':9s} {'graphs':>6s} {'breaks':>6s} {'1st step s':>10s} {'compile s':>9s} {'step ms':>8s} "
              f"{'x eager':>7s} {'min ms':>7s} {'max ms':>7s} {'max |dloss|':>11s} {'step-1 |dloss|':>14s} "
              f"{'process s':>9s}")
    print(header)
    print("-" * len(header))
    for mode, row in rows.items():
        measured = row["times"][1 + args.warmup:]
        step = statistics.median(measured)
        diffs = [abs(a - b) for a, b in zip(row["losses"], eager["losses"])]
        print(f"{mode:9s} {row['unique_graphs']:6d} {row['graph_breaks']:6d} {row['times'][0]:10.2f} "
              f"{row['times'][0] - eager_step:9.2f} {step * 1e3:8.1f} {step / eager_step:7.2f} "
              f"{min(measured) * 1e3:7.1f} {max(measured) * 1e3:7.1f} {max(diffs):11.2e} {diffs[0]:14.2e} "
              f"{row['process_s']:9.1f}")
    print(f"load average (1 min) before / after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores; other work on the machine shows up as noise in every figure")
    print("compile s = first step - eager's median step; graphs = dynamo's unique_graphs (forward frames); "
          "|dloss| = |loss - eager's loss| at the same step")


if __name__ == "__main__":
    main()
