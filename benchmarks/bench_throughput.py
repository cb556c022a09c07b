"""Step time with the throughput monitor on vs off, on the same loop, and the monitor's own cost per step.

    python benchmarks/bench_throughput.py              # 300 paired steps: ~2 minutes on 2 busy cores
    python benchmarks/bench_throughput.py --quick      # smoke run: checks it works; its figures are noise
    python benchmarks/bench_throughput.py --control    # A/A: both loops off, the noise floor of this machine

One process on the CPU, one torch thread (`--threads`). Two prepared copies of the same tiny Llama (transformers; 4
layers, hidden 128, vocab 1024, same initial weights) train with AdamW on the same synthetic token batches (8 x 64
tokens): one under `Accelerator(throughput_monitor=True, log_with="jsonl")` (a report logged every 10 optimizer
steps, tokens counted from every batch), one under a plain `Accelerator()`. A step is timed from fetching the batch
to the end of `optimizer.step()` + `zero_grad()`. The loops alternate step by step (on, off | off, on | ...; `--block
N`: N steps each), so bursts of machine noise hit both; the first 2 rounds are warm-up. It prints the median step
time of each loop and their ratio, the median and quartiles of the per-round on/off ratios (paired: the figure held
to the target, <= 1.01; `--control` shows how far two identical loops land from 1.00 on this machine), and
the monitor's own cost measured directly: `count(batch)` + `step()` called in a tight loop, the reports (a jsonl log
line, getrusage) included at their rate, against the median step. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel import Accelerator


def build_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def batches(n: int, batch: int, seq: int) -> torch.utils.data.DataLoader:
    torch.manual_seed(1)
    data = [{"input_ids": torch.randint(0, 1024, (seq,))} for _ in range(n * batch)]
    return torch.utils.data.DataLoader(data, batch_size=batch)


class Loop:
    def __init__(self, accelerator: Accelerator, batch: int, seq: int):
        self.accelerator = accelerator
        model = build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.model, self.optimizer, self.data = accelerator.prepare(model, optimizer, batches(64, batch, seq))
        self.model.train()
        self.batches = iter(())

    def _next(self):
        batch = next(self.batches, None)
        if batch is None:  # a new epoch: epoch boundaries are in the timed steps, as in a real run
            self.batches = iter(self.data)
            batch = next(self.batches)
        return batch

    def steps(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            batch = self._next()
            loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            self.accelerator.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        return times


def own_cost_us(monitor, batch, calls: int) -> float:
    """µs per step of the monitor's own work: one batch counted and one step ticked, its reports included."""
    start = time.perf_counter()
    for _ in range(calls):
        monitor.count(batch)
        monitor.step()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="measured rounds (each: a block of each loop)")
    parser.add_argument("--block", type=int, default=1, help="steps per block (1: the loops alternate step by step)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="6 rounds of 1 step")
    parser.add_argument("--control", action="store_true", help="A/A: the monitor off in both loops")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the other benchmarks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.block = 6, 1
    warmup = 2
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as folder:
        on = Accelerator(cpu=True, throughput_monitor=not args.control, log_with="jsonl", project_dir=folder)
        on.init_trackers("bench")
        off = Accelerator(cpu=True)
        loops = {"on": Loop(on, args.batch_size, args.seq), "off": Loop(off, args.batch_size, args.seq)}
        times: dict[str, list[float]] = {"on": [], "off": []}
        ratios = []
        for round_ in range(warmup + args.rounds):
            order = ("on", "off") if round_ % 2 == 0 else ("off", "on")
            block = {name: loops[name].steps(args.block) for name in order}
            if round_ >= warmup:
                for name in order:
                    times[name].extend(block[name])
                ratios.append(statistics.median(block["on"]) / statistics.median(block["off"]))
        step_on, step_off = statistics.median(times["on"]), statistics.median(times["off"])
        params = sum(p.numel() for p in loops["off"].model.parameters())
        label = "on (A/A control: off too)" if args.control else "on"
        print(f"tiny Llama ({params / 1e6:.1f}M parameters), batch {args.batch_size} x {args.seq} tokens, AdamW, CPU, "
              f"{torch.get_num_threads()} threads; {args.rounds} rounds x {args.block} steps per loop")
        print(f"  median step, monitor {label:26s} {step_on * 1e3:8.2f} ms")
        print(f"  median step, monitor off{'':22s} {step_off * 1e3:8.2f} ms")
        print(f"  on/off (medians)                               {step_on / step_off:8.4f}")
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"  per-round on/off: median {statistics.median(ratios):.4f}, quartiles {q[0]:.4f} .. {q[2]:.4f}")
        monitor = on.throughput
        if monitor is not None:
            batch = next(iter(loops["on"].data))
            own_cost_us(monitor, batch, 200)  # warm
            cost = statistics.median(own_cost_us(monitor, batch, 2000) for _ in range(5))
            print(f"  the monitor's own work: {cost:.2f} µs per step (reports every {monitor.log_every} steps "
                  f"included) = {cost * 1e-6 / step_off:.3%} of the median step")
        on.end_training()


if __name__ == "__main__":
    main()
