"""Activation checkpointing: activation memory kept for backward, and the step-time cost, for none / selective /
full on a GPT-style model (one process, CPU).

Each mode runs in a fresh process and reports two figures:
* the peak RSS growth over one forward + backward (the process's high-water mark after the step minus before it:
  the activations kept, plus the transient memory of backward, gradients included);
* the bytes autograd itself saves for backward during the forward (every saved tensor passes through
  `torch.autograd.graph.saved_tensors_hooks`; distinct storages, parameters excluded). For `selective` this misses
  the matmul/attention outputs that checkpoint's own cache keeps, so read the RSS figure for it.
Theory for `full`: each of the L blocks keeps only its input (B x T x D floats), plus what the un-checkpointed
parts (embeddings, final norm, head, loss) keep.

    python benchmarks/bench_ac.py [--layers 8 --width 512 --batch 8 --seq 256 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from accel import Accelerator, ParallelismConfig


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def saved_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for backward during one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def step_ms(model: nn.Module, tokens: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])  # the first run warms up


def measure(args, mode: str) -> dict:
    """One mode, in this process: peak RSS growth of one step, autograd-saved bytes, median step time."""
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    model = GPT(args.vocab, args.width, args.layers, args.heads, args.seq)
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(activation_checkpointing=mode))
    model = accelerator.prepare(model)
    small = tokens[:1, :8]  # warm up on a tiny input: one-off allocations stay out of the measured peak
    nn.functional.cross_entropy(model(small).flatten(0, 1), small.flatten()).backward()
    model.zero_grad(set_to_none=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    model.zero_grad(set_to_none=True)
    return {"peak": peak, "saved": saved_bytes(model, tokens), "ms": step_ms(model, tokens, args.repeats)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small model, for a smoke run")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one mode and print JSON
    args, rest = parser.parse_known_args()
    if args.quick:
        args.layers, args.width, args.batch, args.seq, args.repeats = 2, 64, 2, 32, 1
    if args.one:
        print(json.dumps(measure(args, args.one)))
        return
    rows = {}
    for mode in ("no", "selective", "full"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", mode], capture_output=True,
                             text=True, check=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    block_input = args.batch * args.seq * args.width * 4
    print(f"GPT: {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} tokens, fp32, "
          f"{torch.get_num_threads()} threads, each mode in a fresh process")
    base = rows["no"]
    for mode, row in rows.items():
        print(f"  {mode:9s} peak RSS growth {row['peak'] / 2**20:8.1f} MiB ({row['peak'] / base['peak']:5.3f} of none)"
              f"   autograd-saved {row['saved'] / 2**20:8.1f} MiB ({row['saved'] / base['saved']:5.3f})"
              f"   step {row['ms']:8.1f} ms ({row['ms'] / base['ms']:5.2f}x none)")
    outside = rows["full"]["saved"] - args.layers * block_input
    print(f"  theory for full: {args.layers} block inputs x {block_input / 2**20:.1f} MiB = "
          f"{args.layers * block_input / 2**20:.1f} MiB kept by the blocks; measured autograd-saved "
          f"{rows['full']['saved'] / 2**20:.1f} MiB, so {outside / 2**20:.1f} MiB outside the blocks (embeddings, "
          "final norm, head, loss)")


if __name__ == "__main__":
    main()
