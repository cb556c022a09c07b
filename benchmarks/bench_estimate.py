"""Accuracy of `accel estimate-memory`: estimated vs measured model-state bytes per rank (2 or 4 gloo processes).

    python benchmarks/bench_estimate.py                 # every layout that fits on 2 processes (a few minutes)
    python benchmarks/bench_estimate.py --num_processes 4   # also the 4-process TP x DP / PP x TP / PP x DP ones
    python benchmarks/bench_estimate.py --configs ddp,zero3,tp2 --num_processes 4

One job per layout, `accel launch --cpu --num_processes N --mixed_precision M --zero_stage S
benchmarks/bench_estimate.py --worker ...`, on a tiny Llama (transformers; 4 layers, hidden 128, untied head);
the worker sets the layout with `ParallelismConfig(zero_stage=, tp_size=, pp_size=, pp_microbatches=)`. Layouts:
data parallelism over all N ranks (ddp, zero1/2/3, zero3_offload, zero3_bf16), TP 2 (tp2; on 4 processes
dp2xtp2 = DDP x TP, zero2xtp2, zero3xtp2: FSDP2 over dp of the TP shards), PP 2 (pp2; on 4 processes pp2xtp2,
and pp2xdp2 / pp2xzero1 / pp2xzero3: DDP, ZeroRedundancyOptimizer or FSDP2 per stage). ZeRO-1 with TP is
refused by accel, so there is no zero1xtp2. A layout that needs more processes than given is skipped with a line.
The worker runs two AdamW steps (a pipeline: `loss = model(ids, target=ids)` with 2 micro-batches) and, after the
second `optimizer.step()` (before `zero_grad()`), counts the bytes of the tensors the rank holds: the optimizer's
parameters (a pipeline rank's optimizer holds only its stage's; DTensors: their local shard), their `.grad`,
every tensor of the optimizer state (the ZeroRedundancyOptimizer's local `.optim` for ZeRO-1), each tensor once;
the largest rank is reported next to `accel.planning.estimate.training(spec, N, tp, pp)` for the same model built on the
meta device. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> (zero_stage, offload, mixed_precision, tp_size, pp_size, processes needed (0: any))
CONFIGS = {"ddp": (0, False, "no", 1, 1, 0), "zero1": (1, False, "no", 1, 1, 0), "zero2": (2, False, "no", 1, 1, 0),
           "zero3": (3, False, "no", 1, 1, 0), "zero3_offload": (3, True, "no", 1, 1, 0),
           "zero3_bf16": (3, False, "bf16", 1, 1, 0),
           "tp2": (0, False, "no", 2, 1, 2), "pp2": (0, False, "no", 1, 2, 2),
           "dp2xtp2": (0, False, "no", 2, 1, 4), "zero2xtp2": (2, False, "no", 2, 1, 4),
           "zero3xtp2": (3, False, "no", 2, 1, 4), "pp2xtp2": (0, False, "no", 2, 2, 4),
           "pp2xdp2": (0, False, "no", 1, 2, 4), "pp2xzero1": (1, False, "no", 1, 2, 4),
           "pp2xzero3": (3, False, "no", 1, 2, 4)}
LAYOUT = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}  # the estimate's row for a zero_stage


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)


def _bytes(tensors) -> int:
    """Bytes of `tensors` (DTensors: the local shard), each tensor object once."""
    unique = {id(t): t for t in tensors if t is not None}
    local = [t.to_local() if hasattr(t, "to_local") else t for t in unique.values()]
    return sum(t.numel() * t.element_size() for t in local)


def loss_fn(logits, target):
    """A pipeline's loss on its last stage (the stage output is the logits)."""
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def worker(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from accel import Accelerator, ParallelismConfig

    stage, offload, _, tp, pp, _ = CONFIGS[args.config]
    accelerator = Accelerator(parallelism_config=ParallelismConfig(
        zero_stage=stage, offload_optimizer=offload, offload_params=offload, tp_size=tp, pp_size=pp,
        **({"pp_microbatches": 2} if pp > 1 else {})))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer, **({"loss_fn": loss_fn} if pp > 1 else {}))
    dp_rank = accelerator.backend.data_parallel_rank  # TP and PP ranks of one replica see the same batch
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(dp_rank)).to(accelerator.device)
    for _ in range(2):
        optimizer.zero_grad()
        if pp > 1:
            accelerator.backward(model(ids, target=ids))  # the schedule runs forward and backward
        else:
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer -> the prepared one
    params = [p for group in inner.param_groups for p in group["params"]]  # a pipeline rank: its stage's
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer keeps this rank's partition in .optim
    state = [v for st in inner.state.values() for v in st.values() if hasattr(v, "numel")]
    record = {"params_bytes": _bytes(params), "grads_bytes": _bytes([p.grad for p in params]),
              "optimizer_bytes": _bytes(state)}
    records = [None] * accelerator.num_processes  # every rank (gather_for_metrics gathers the dp ranks only)
    torch.distributed.all_gather_object(records, record)
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(records))
    accelerator.end_training()
    return 0


def estimated(n: int, tp: int, pp: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from accel.planning.estimate import spec_from_module, training

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config())
    return training(spec_from_module(model), num_processes=n, tp=tp, pp=pp)["layouts"]


def run_all(configs: list[str], n: int) -> int:
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes")
    print(f"{n} processes")
    print(f"{'layout':<14} {'part':<16} {'estimated':>11} {'measured':>11} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            if name not in CONFIGS:
                print(f"{name}: unknown layout; allowed: {', '.join(CONFIGS)}")
                continue
            stage, offload, mp, tp, pp, needs = CONFIGS[name]
            if needs and needs != n:
                print(f"{name}: skipped (needs --num_processes {needs})")
                continue
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", str(n),
                   "--mixed_precision", mp, "--zero_stage", str(stage), __file__, "--worker", "--config", name,
                   "--out", str(out)]
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                  text=True, timeout=600)
            if proc.returncode:
                print(f"{name}: failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
                continue
            ranks = json.loads(out.read_text())
            est = estimated(n, tp, pp)["zero3_offload" if offload else LAYOUT[stage]]
            for key in (*keys, "total"):
                measured = max(sum(r[k] for k in keys) if key == "total" else r[key] for r in ranks)
                guess = sum(est[k] for k in keys) if key == "total" else est[key]
                print(f"{name:<14} {key:<16} {guess:>11,} {measured:>11,} {guess / measured:>7.3f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--config", default="ddp")
    parser.add_argument("--out")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--num_processes", type=int, default=2)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    return run_all([c for c in args.configs.split(",") if c], args.num_processes)


if __name__ == "__main__":
    sys.exit(main())
