"""What fault tolerance's weight check costs (fault_tolerance.check_every): one fingerprint of every parameter
(accel/fault_tolerance/fingerprint.py) against one training step of the same model, on this machine's CPU.

    python benchmarks/bench_fingerprint.py            # a 124M-parameter GPT-2-sized stand-in, 1 thread
    python benchmarks/bench_fingerprint.py --quick    # a 10M one (a smoke run)

The model is GPT-2 small's parameter layout (embedding, 12 blocks of the four matrices), run as plain linear layers
on a batch of `--tokens` tokens: forward, backward, AdamW. The check's all-reduces carry 16 bytes per parameter
tensor (about 2 KB here), negligible beside the fingerprint; the fingerprint reads every parameter once, so on a GPU
it costs what reading the weights from memory costs (about 1.3 ms per GB at 3 TB/s). Prints the fingerprint's time,
the step's, and the share of the run the check takes at the default check_every (100).
"""

from __future__ import annotations

import argparse
import time

import torch

from accel.fault_tolerance.fingerprint import fingerprints


def stand_in(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    blocks: list[torch.nn.Module] = [torch.nn.Embedding(vocab, hidden)]
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden),
                   torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)]
    return torch.nn.ModuleList(blocks)


def step(model: torch.nn.ModuleList, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    x = model[0](ids)
    for i in range(1, len(model), 4):
        qkv, out, up, down = model[i:i + 4]
        x = x + out(qkv(x)[..., : x.shape[-1]])
        x = x + down(torch.nn.functional.gelu(up(x)))
    (x @ model[0].weight.T).logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def timed(fn, repeat: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden, layers, vocab = (256, 4, 8192) if args.quick else (768, 12, 50257)
    model = stand_in(hidden, layers, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (1, args.tokens))
    params = sum(p.numel() for p in model.parameters())
    check = timed(lambda: fingerprints([model]), 3)
    one_step = timed(lambda: step(model, optimizer, ids), 2)
    print(f"model: {params / 1e6:.1f}M parameters ({params * 4 / 1e9:.2f} GB fp32), {args.threads} thread(s), "
          f"{args.tokens} tokens per step")
    print(f"fingerprint: {check * 1e3:.1f} ms ({params * 4 / check / 1e9:.2f} GB/s); step: {one_step * 1e3:.0f} ms; "
          f"fingerprint / step: {check / one_step:.3f}; at check_every 100: "
          f"{100 * check / (check + 100 * one_step):.4f}% of the run")


if __name__ == "__main__":
    main()
