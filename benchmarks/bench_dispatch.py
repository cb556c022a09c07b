"""Data loading through a prepared loader, 2 gloo processes: each rank reading its own share (sharded, the
default for map-style datasets) vs the main process reading and broadcasting every batch (`dispatch_batches`,
Accelerate's default for iterable datasets), vs a plain DataLoader over the rank's share (raw). Reports the
median time per batch and the ratios; asserts nothing.

    python benchmarks/bench_dispatch.py            # ~30 s on 2 cores
    python benchmarks/bench_dispatch.py --quick    # smoke run

Batches are dicts of an int64 (b, 512) token tensor and a float (b, 512) mask, b = 16: the shape of a language-model
batch. The dataset is in memory, so what is measured is accel's own cost (sharding, broadcast), not I/O.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import accel_command, run_job

SEQ, BATCH = 512, 16


def run_all(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = [*accel_command(), "launch", "--cpu", "--num_processes", "2", str(Path(__file__).resolve()),
               "--worker", "--out", str(out), *(["--quick"] if args.quick else [])]
        record = run_job(cmd, out, timeout=600)
    if record is None:
        return 1
    raw = record["raw"]
    print(f"{'loader':<12}{'ms / batch':>12}{'vs raw':>10}")
    for name in ("raw", "sharded", "dispatched"):
        print(f"{name:<12}{record[name] * 1e3:>12.3f}{record[name] / raw:>10.2f}")
    return 0


def worker(args: argparse.Namespace) -> int:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from accel import Accelerator
    from accel.data.loading import DataLoaderConfiguration

    class Tokens(Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 50000, (n, SEQ), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ)}

    n = 2 * BATCH * (20 if args.quick else 200)
    data = Tokens(n)

    def timed(loader) -> float:
        times, start = [], time.perf_counter()
        for _ in loader:
            now = time.perf_counter()
            times.append(now - start)
            start = now
        return statistics.median(times)

    results = {}
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    rank = accelerator.process_index
    raw = DataLoader(torch.utils.data.Subset(data, range(rank, n, 2)), batch_size=BATCH)
    for name, loader in (("raw", raw), ("sharded", accelerator.prepare(DataLoader(data, batch_size=BATCH)))):
        timed(loader)  # warm-up pass
        results[name] = timed(loader)
    dispatched = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = dispatched.prepare(DataLoader(data, batch_size=BATCH))
    timed(loader)
    results["dispatched"] = timed(loader)
    worst = {k: max(accelerator.gather(torch.tensor([v])).tolist()) for k, v in results.items()}  # slowest rank
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(worst))
    accelerator.end_training()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="run one job (set by the launcher)")
    parser.add_argument("--out", help="worker: where to write the JSON record")
    parser.add_argument("--quick", action="store_true", help="a few batches: checks it works; figures are noise")
    args = parser.parse_args(argv)
    return worker(args) if args.worker else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
