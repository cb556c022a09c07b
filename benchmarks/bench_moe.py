"""Expert parallelism on CPU: per-rank expert bytes and step time of ep 1, 2 and 4 on 4 processes (gloo), under DDP
and under ZeRO-3.

    python benchmarks/bench_moe.py            # Mixtral-style model, 8 experts, 6 launched jobs (about a minute)
    python benchmarks/bench_moe.py --quick    # smoke run (small model, 1 warm-up + 2 measured steps)

Then ep 2 with the other dimensions, each on 4 processes: dp 2 x sp 2, HSDP 2 x 2 (ZeRO-3), ZeRO-1 and
pp 2 (1F1B, 2 micro-batches), the router's auxiliary loss off (refused under sp/cp; a pipeline computes only the
loss_fn), batches from a prepared DataLoader (sp cuts them). Their expert bytes per rank against the theory: the
experts / ep (DDP, sp: the sequence ranks hold their dp rank's experts), / 4 (HSDP: sharded over replicate x
shard), / (ep x pp) (a stage holds its layers' experts); and the AdamW state per rank after the steps against
ZeRO-1's: (dense + experts / ep) x 8 bytes / (dp / ep), ZeroRedundancyOptimizer over the ranks holding the same
experts (its greedy partition rounds by whole tensors).

Six jobs, each `accel launch --cpu --num_processes 4 --ep_size N --zero_stage Z benchmarks/bench_moe.py --worker
...` with OMP_NUM_THREADS=1, Z in (0, 3): ep 1 is plain DDP (or ZeRO-3) over 4 ranks, ep 2 and ep 4 divide each MoE
layer's experts among 2 or 4 of the data-parallel ranks (tokens reach them by all-to-all); under ZeRO-3 the
stacked experts are also sharded over their 4 / ep replicas.

The model (seed 0): transformers' MixtralForCausalLM, hidden H, 8 experts of intermediate 2H, top-2, L layers,
vocab 1024, router auxiliary loss on. AdamW (lr 1e-4, fp32); each rank gets its own batch of B x T random tokens.
A step is `zero_grad(); loss = model(**batch).loss; accelerator.backward(loss); optimizer.step()`, timed with
perf_counter on rank 0 after a barrier.

Expert bytes per rank are counted from the parameters accel's expert parallelism holds after `prepare` (the
largest rank's local shards), beside the theory: the model's whole expert bytes / ep (ZeRO-3: / 4). On a CPU with
fewer cores than processes the step time measures mostly the shared cores; the all-to-all's cost shows against
DDP's all-reduce of the experts' gradients (which ep removes). Each worker writes one JSON record; the launcher
prints the table. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

from _common import layout_parser, per_rank, run_layouts

SIZES = {"full": (2, 128, 8, 64), "quick": (2, 32, 4, 16)}  # (layers, hidden, batch, tokens)
NUM_EXPERTS = 8
MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    parser = layout_parser(__doc__, 2, 5, "small model, 1 warm-up and 2 measured steps")
    parser.add_argument("--layout", default=None, help="worker: one layout of COMPOSED (ep 2 with another dimension)")
    return parser.parse_args(argv)


# launcher side -------------------------------------------------------------------------------------------

def run_all(args: argparse.Namespace) -> int:
    passed = ["--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    jobs = {(zero, ep): ["--num_processes", "4", "--ep_size", str(ep), "--zero_stage", str(zero)]
            for zero in (0, 3) for ep in (1, 2, 4)}
    results: dict[tuple, dict] = run_layouts(__file__, jobs, passed, args.timeout, "bench_moe_")
    if results:
        print_table(results)
    more: dict = {}
    for name in COMPOSED:  # the worker builds the layout's ParallelismConfig itself (HSDP has no launch flag)
        more.update(run_layouts(__file__, {name: ["--num_processes", "4"]}, [*passed, "--layout", name],
                                args.timeout, "bench_moe_"))
    if more:
        print_composed(more)
    return 0 if len(results) == len(jobs) and len(more) == len(COMPOSED) else 1


# ep 2 with the other dimensions: layout -> (ParallelismConfig fields, the expert divisor of the theory)
COMPOSED = {"sp2-ep2": ({"sp_size": 2, "ep_size": 2}, 2),
            "hsdp2x2-ep2": ({"dp_replicate_size": 2, "dp_shard_size": 2, "zero_stage": 3, "ep_size": 2}, 4),
            "zero1-ep2": ({"zero_stage": 1, "ep_size": 2}, 2),
            "pp2-ep2": ({"pp_size": 2, "ep_size": 2}, 4)}


def print_composed(results: dict[str, dict]) -> None:
    header = (f"{'layout':<12} {'expert MB/rank':>14} {'theory MB':>9} {'params MB/rank':>14} {'AdamW MB/rank':>13} "
              f"{'step ms':>8}")
    print("\nep 2 with the other dimensions, 4 processes, router auxiliary loss off")
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        theory = res["expert_total"] / COMPOSED[name][1]
        print(f"{name:<12} {max(res['expert_bytes']) / MB:>14.3f} {theory / MB:>9.3f} "
              f"{max(res['param_bytes']) / MB:>14.3f} {max(res['optimizer_bytes']) / MB:>13.3f} "
              f"{median(res['step']) * 1e3:>8.1f}")
        if name == "zero1-ep2":
            dense = res["n_params"] * 4 - res["expert_total"]
            print(f"{'':<12} ZeRO-1 AdamW theory: (dense {dense / MB:.3f} + experts / 2 "
                  f"{res['expert_total'] / 2 / MB:.3f}) MB x 2 / 2 replicas = "
                  f"{(dense + res['expert_total'] / 2) / MB:.3f} MB (+ steps; whole tensors per rank)")
    print("theory: the model's experts / 2 (ep; sp), / 4 (HSDP over replicate x shard; pp 2 x ep 2: half the layers "
          "per stage); AdamW MB/rank: the optimizer state each rank holds after the steps", flush=True)


def print_table(results: dict[tuple, dict]) -> None:
    first = next(iter(results.values()))
    print(f"\ntorch {first['torch']}, gloo on CPU, 4 processes, 1 thread each; Mixtral {first['n_params']:,} "
          f"parameters ({first['layers']} layers, hidden {first['hidden']}, {NUM_EXPERTS} experts, top-2), "
          f"experts {first['expert_total'] / MB:.2f} MB; AdamW fp32, batch {first['batch']} x {first['tokens']} "
          f"tokens per rank, {first['warmup']} warm-up + {first['steps']} measured steps")
    header = (f"{'config':<12} {'expert MB/rank':>14} {'theory MB':>9} {'params MB/rank':>14} {'step ms':>8} "
              f"{'min':>7} {'max':>7} {'vs ep1':>6}")
    print(header)
    print("-" * len(header))
    for (zero, ep), res in sorted(results.items()):
        base = results.get((zero, 1))
        step = [t * 1e3 for t in res["step"]]
        med = median(step)
        ratio = f"{med / median([t * 1e3 for t in base['step']]):6.2f}" if base else f"{'-':>6}"
        theory = res["expert_total"] / (4 if zero >= 2 else ep)
        label = f"{'ZeRO-3 ' if zero else 'DDP '}ep {ep}"
        print(f"{label:<12} {max(res['expert_bytes']) / MB:>14.3f} {theory / MB:>9.3f} "
              f"{max(res['param_bytes']) / MB:>14.3f} {med:>8.1f} {min(step):>7.1f} {max(step):>7.1f} {ratio}")
    print("expert MB/rank: the largest rank's expert parameters after prepare (local shards); theory: the model's "
          "experts / ep (DDP), / the 4 data-parallel ranks (ZeRO-3: stacked experts sharded again over their "
          "replicas); vs ep1: step time against ep 1 of the same ZeRO stage", flush=True)


# worker side ---------------------------------------------------------------------------------------------

def make_model(layers: int, hidden: int, **options):
    """The benchmark's Mixtral (seed 0): the model, its parameter count, its expert parameters' names and bytes."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from accel.parallel.expert import expert_param_names

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=NUM_EXPERTS,
                           num_experts_per_tok=2, vocab_size=1024, use_cache=False, **options)
    model = MixtralForCausalLM(config)
    params = dict(model.named_parameters())
    experts = expert_param_names(model)
    total = sum(params[n].numel() * params[n].element_size() for n in experts)
    return model, sum(p.numel() for p in model.parameters()), experts, total


def worker(args: argparse.Namespace) -> int:
    if args.layout:
        return composed_worker(args)
    import torch
    import torch.distributed as dist

    from accel import Accelerator

    layers, hidden, batch, tokens = SIZES["quick" if args.quick else "full"]
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    accelerator = Accelerator()  # ep_size from the launch flag
    model, n_params, experts, expert_total = make_model(layers, hidden, output_router_logits=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    held = dict(inner.named_parameters())
    local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in held.items()}  # DTensor: its shard
    mine = sum(local[n].numel() * local[n].element_size() for n in experts if n in local)
    everything = sum(p.numel() * p.element_size() for p in local.values())

    gen = torch.Generator().manual_seed(1 + accelerator.process_index)  # each rank its own batch
    ids = torch.randint(0, 1024, (batch, tokens), generator=gen)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    expert_ranks, param_ranks = per_rank(mine), per_rank(everything)
    if accelerator.is_main_process:
        record = {"torch": torch.__version__, "n_params": n_params, "layers": layers, "hidden": hidden,
                  "batch": batch, "tokens": tokens, "warmup": warmup, "steps": steps, "step": times,
                  "expert_total": expert_total, "expert_bytes": expert_ranks, "param_bytes": param_ranks}
        Path(args.out).write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    return 0


def composed_worker(args: argparse.Namespace) -> int:
    """One layout of COMPOSED: prepare, train, and record the bytes each rank holds and the step times."""
    import torch
    import torch.distributed as dist

    from accel import Accelerator, ParallelismConfig

    fields, _ = COMPOSED[args.layout]
    layers, hidden, batch, tokens = SIZES["quick" if args.quick else "full"]
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**fields))
    model, n_params, experts, expert_total = make_model(layers, hidden, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, ((warmup + steps) * batch * 4, tokens), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=batch)
    pipeline = fields.get("pp_size", 1) > 1

    def shifted(logits, targets):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    extra = {"loss_fn": shifted} if pipeline else {}
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, **extra)
    held = dict(accelerator.unwrap_model(model).named_parameters())
    local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in held.items()}  # DTensor: its shard
    mine = sum(local[n].numel() * local[n].element_size() for n in experts if n in local)
    everything = sum(p.numel() * p.element_size() for p in local.values())
    times = []
    for i, batch_ in enumerate(loader):
        if i >= warmup + steps:
            break
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        if pipeline:
            loss = model(batch_["input_ids"][:, :-1], target=batch_["labels"][:, 1:])
        else:
            loss = model(**batch_).loss
        accelerator.backward(loss)
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    inner = getattr(optimizer, "optimizer", optimizer)
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer: this rank's partition's optimizer
    tensors = [t for entry in inner.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
    state_bytes = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)
    expert_ranks, param_ranks, optimizer_ranks = per_rank(mine), per_rank(everything), per_rank(state_bytes)
    if accelerator.is_main_process:
        record = {"n_params": n_params, "step": times, "expert_total": expert_total, "expert_bytes": expert_ranks,
                  "param_bytes": param_ranks, "optimizer_bytes": optimizer_ranks}
        Path(args.out).write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
