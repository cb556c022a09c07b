"""Accuracy of `accel estimate-memory`: estimated vs measured model-state bytes per rank (2 or 4 gloo processes).

    python benchmarks/bench_estimate.py                 # DDP, ZeRO-1/2/3, ZeRO-3 + offload, ZeRO-3 bf16 (~1 minute)
    python benchmarks/bench_estimate.py --configs ddp,zero3 --num_processes 4

One job per layout, `accel launch --cpu --num_processes 2 --mixed_precision M --zero_stage S
benchmarks/bench_estimate.py --worker ...`, on a tiny Llama (transformers; 4 layers, hidden 128, untied head).
The worker runs two AdamW steps and, after the second `optimizer.step()` (before `zero_grad()`), counts the
bytes of the tensors the rank holds: parameters, their `.grad`, every tensor of the optimizer state (the
ZeroRedundancyOptimizer's local `.optim` for ZeRO-1), local shards for DTensors; the larger rank is reported
next to `accel.estimate.training()` for the same model built on the meta device. Asserts nothing.
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
CONFIGS = {"ddp": (0, False, "no"), "zero1": (1, False, "no"), "zero2": (2, False, "no"),
           "zero3": (3, False, "no"), "zero3_offload": (3, True, "no"), "zero3_bf16": (3, False, "bf16")}


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)


def _bytes(tensors) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def worker(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from accel import Accelerator, ParallelismConfig

    stage, offload, _ = CONFIGS[args.config]
    accelerator = Accelerator(parallelism_config=ParallelismConfig(
        zero_stage=stage, offload_optimizer=offload, offload_params=offload))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(accelerator.process_index))
    for _ in range(2):
        optimizer.zero_grad()
        accelerator.backward(model(input_ids=ids.to(accelerator.device), labels=ids.to(accelerator.device)).loss)
        optimizer.step()
    params = list(model.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer -> the prepared one
    inner = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer keeps this rank's partition in .optim
    state = [v for st in inner.state.values() for v in st.values() if hasattr(v, "numel")]
    record = {"params_bytes": _bytes(params), "grads_bytes": _bytes([p.grad for p in params if p.grad is not None]),
              "optimizer_bytes": _bytes(state)}
    records = accelerator.gather_for_metrics([record], use_gather_object=True)
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(records))
    accelerator.end_training()
    return 0


def estimated(n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from accel.estimate import spec_from_module, training

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config())
    return training(spec_from_module(model), num_processes=n)["layouts"]


def run_all(configs: list[str], n: int) -> int:
    layouts = estimated(n)
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes")
    print(f"{n} processes")
    print(f"{'layout':<14} {'part':<16} {'estimated':>11} {'measured':>11} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            stage, offload, mp = CONFIGS[name]
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
            est = layouts[name.replace("_bf16", "")]
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
