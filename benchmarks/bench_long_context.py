"""Long sequences on CPU: activation memory per rank and step time of sp N and cp N against one process.

Sequence parallelism (Ulysses, sp) and context parallelism (cp, all-gather K/V) against one process on the whole
sequence (gloo).

    python benchmarks/bench_long_context.py                  # 1 process, sp 2, cp 2; length 2048 (~1-2 min, 2 cores)
    python benchmarks/bench_long_context.py --max_procs 4    # also sp 4 and cp 4
    python benchmarks/bench_long_context.py --quick          # smoke run (length 256, 2 layers, 1 measured step)
    python benchmarks/bench_long_context.py --moe --max_procs 4  # a Mixtral: also sp 2 x ep 2 and cp 2 x ep 2

One launched job per layout, each with OMP_NUM_THREADS=1 (one core per process):

* 1 process: `accel launch --cpu --num_processes 1 benchmarks/bench_long_context.py --worker ...`;
* sp N: `accel launch --cpu --num_processes N --sp_size N ...`;
* cp N: `accel launch --cpu --num_processes N --cp_size N ...` (cp_comm_strategy allgather, the only one on CPU);
* with `--moe` and 4 processes, sp 2 x ep 2 and cp 2 x ep 2: 2 data-parallel ranks (each its own sequence) x 2
  sequence ranks, the experts divided over the 2 data-parallel ranks (`--ep_size 2`).

The model (seed 0): a tiny transformers Llama built from a LlamaConfig (no download): hidden 256, intermediate 512,
4 layers, 8 heads, 8 key/value heads, vocabulary 1024, attn_implementation sdpa, use_cache False. One batch of
1 x length random tokens (a dict {input_ids, labels}) in a DataLoader, prepared, so every sequence rank gets its
slice; the model's own loss; AdamW fp32. A step is `zero_grad(); loss = model(**batch).loss;
accelerator.backward(loss); optimizer.step()`, timed with perf_counter on rank 0 after a barrier. With `--moe` the
model is a tiny transformers Mixtral of the same sizes with 4 experts, top-2 (no router auxiliary loss: refused under
sp/cp).

Activation memory is the bytes autograd saves for backward during the forward, counted on every rank: every saved
tensor passes through `torch.autograd.graph.saved_tensors_hooks` and its storage is counted once (deduplicated by
`untyped_storage().data_ptr()`; parameters excluded). It does not depend on the device or the allocator. The table
prints the largest rank's figure, its ratio to one process's, and that ratio against 1/N, N the sequence degree
(each rank holds 1/N of one sequence; with ep, each expert's tokens come from every ep rank, about as many as its
own under balanced routing) (target: within 10%, i.e. "vs 1/N" <= 1.10). Each worker writes one JSON record into
a temporary folder; the launcher prints the table.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

from _common import per_rank, run_layouts

MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run one job (set by the launcher)")
    parser.add_argument("--out", help="worker: where to write the JSON record")
    parser.add_argument("--length", type=int, default=2048, help="tokens in the one sequence (default 2048)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8, help="attention heads (and key/value heads)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up")
    parser.add_argument("--max_procs", type=int, default=2, choices=[2, 4],
                        help="2: sp 2 and cp 2; 4: also sp 4 and cp 4")
    parser.add_argument("--quick", action="store_true", help="length 256, 2 layers, 1 warm-up + 1 measured step")
    parser.add_argument("--moe", action="store_true", help="a Mixtral (4 experts, top-2); with --max_procs 4 also "
                        "sp 2 x ep 2 and cp 2 x ep 2")
    parser.add_argument("--seq_degree", type=int, default=1, help=argparse.SUPPRESS)  # set by the launcher side
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launched job")
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.layers, args.warmup, args.steps = 256, 2, 1, 1
    return args


# launcher side -------------------------------------------------------------------------------------------

def layouts(max_procs: int, moe: bool = False) -> dict[str, tuple[list[str], int]]:
    """Layout name -> (launch flags, sequence degree)."""
    jobs = {"1 process": (["--num_processes", "1"], 1)}
    for degree in (2, 4):
        if degree <= max_procs:
            jobs[f"sp {degree}"] = (["--num_processes", str(degree), "--sp_size", str(degree)], degree)
            jobs[f"cp {degree}"] = (["--num_processes", str(degree), "--cp_size", str(degree)], degree)
    if moe and max_procs >= 4:
        for kind in ("sp", "cp"):
            jobs[f"{kind} 2 x ep 2"] = (["--num_processes", "4", f"--{kind}_size", "2", "--ep_size", "2"], 2)
    return jobs


def run_all(args: argparse.Namespace) -> int:
    passed = ["--length", str(args.length), "--layers", str(args.layers), "--hidden", str(args.hidden),
              "--heads", str(args.heads), "--vocab", str(args.vocab), "--warmup", str(args.warmup),
              "--steps", str(args.steps)]
    passed += ["--moe"] if args.moe else []
    results: dict[str, dict] = {}
    jobs = layouts(args.max_procs, args.moe)
    for name, (flags, degree) in jobs.items():
        results.update(run_layouts(__file__, {name: flags}, [*passed, "--seq_degree", str(degree)], args.timeout,
                                   "bench_long_context_"))
    if results:
        print_table(results)
    return 0 if len(results) == len(jobs) else 1


def print_table(results: dict[str, dict]) -> None:
    first = next(iter(results.values()))
    print(f"\ntorch {first['torch']}, transformers {first['transformers']}, gloo on CPU, 1 thread per process; "
          f"{first.get('model', 'Llama')} {first['n_params']:,} parameters ({first['layers']} layers, "
          f"hidden {first['hidden']}, "
          f"{first['heads']} heads = kv heads, sdpa), 1 sequence of {first['length']} tokens, AdamW fp32, "
          f"{first['warmup']} warm-up + {first['steps']} measured steps")
    header = (f"{'layout':<12} {'saved MiB/rank':>14} {'least rank':>10} {'of 1 proc':>9} {'1/N':>6} {'vs 1/N':>7} "
              f"{'ok':>3} "
              f"{'step ms':>8} {'min':>7} {'vs 1 proc':>9} {'loss':>8}")
    print(header)
    print("-" * len(header))
    base = results.get("1 process")
    base_bytes = base["saved"][0] if base else None
    base_ms = median(base["step"]) * 1e3 if base else None
    for name, res in results.items():
        degree = res.get("seq_degree", res["degree"])
        mine = max(res["saved"])
        step = [t * 1e3 for t in res["step"]]
        med = median(step)
        if base_bytes:
            share = mine / base_bytes
            versus = share * degree
            mem = f"{share:>9.3f} {1 / degree:>6.3f} {versus:>7.3f} {'yes' if versus <= 1.10 else 'no':>3}"
        else:
            mem = f"{'-':>9} {'-':>6} {'-':>7} {'-':>3}"
        ratio = f"{med / base_ms:>9.2f}" if base_ms else f"{'-':>9}"
        least = min(res["saved"]) / MiB
        print(f"{name:<12} {mine / MiB:>14.1f} {least:>10.1f} {mem} {med:>8.0f} {min(step):>7.0f} {ratio} "
              f"{res['loss']:>8.4f}")
    print("saved = bytes autograd keeps for backward during one forward (distinct storages, parameters excluded), "
          "the largest rank (least rank: the smallest; under ep the experts' tokens follow the router, so ranks "
          "differ); "
          "ok: within 10% of 1/N of one process", flush=True)


# worker side ---------------------------------------------------------------------------------------------

def make_model(args: argparse.Namespace):
    from accel.utils import set_seed

    set_seed(0)
    sizes = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                 max_position_embeddings=args.length, attn_implementation="sdpa", use_cache=False)
    if args.moe:
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2,
                                                output_router_logits=False, router_aux_loss_coef=0.0))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**sizes))


def saved_bytes(model, batch) -> tuple[float, int]:
    """One forward + backward; the loss and the bytes autograd saved for backward during the forward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    return loss, sum(seen.values())


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import transformers

    from accel import Accelerator

    accelerator = Accelerator()
    model = make_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, args.vocab, (args.length,), generator=generator) for _ in range(4)]
    loader = torch.utils.data.DataLoader([{"input_ids": t, "labels": t.clone()} for t in sequences], batch_size=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batch = next(iter(loader))
    model.train()

    times, saved, losses = [], 0, []
    for i in range(args.warmup + args.steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        if i == 0:
            loss, saved = saved_bytes(model, batch)  # the warm-up step counts the saved tensors
        else:
            loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())

    ranks = per_rank(saved)
    if accelerator.is_main_process:
        record = {"torch": torch.__version__, "transformers": transformers.__version__, "n_params": n_params,
                  "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "length": args.length,
                  "warmup": args.warmup, "steps": args.steps, "degree": len(ranks), "saved": ranks,
                  "step": times, "loss": losses[0], "seq_degree": args.seq_degree,
                  "model": "Mixtral (4 experts, top-2)" if args.moe else "Llama"}
        Path(args.out).write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
