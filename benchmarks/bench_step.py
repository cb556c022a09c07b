"""Per-step overhead of the prepared loop: accel, Accelerate and Lightning Fabric, each against the raw PyTorch loop
of the same layout (2 gloo processes, CPU).

    python benchmarks/bench_step.py --layout ddp           # ddp | zero3 | tp2 | pp2; one launched job per peer
    python benchmarks/bench_step.py --layout tp2 --quick   # smoke run: 4 rounds per size, figures are noise
    python benchmarks/bench_step.py --layout pp2 --control # + an A/A job: a second raw loop (the noise floor)

Each peer runs in a launched job of its own (2 processes, OMP_NUM_THREADS=1: one core each), in which its loop and
the raw loop of the layout alternate in blocks of steps (raw, peer | peer, raw | ...), so machine noise hits both
alike; the job prints peer/raw, and accel/peer = (accel/raw) / (peer/raw). The raw loops (`_step_loops.py`):

* ddp:   DistributedDataParallel(model), DistributedSampler, loss.backward()
* zero3: fully_shard(block, reshard_after_forward=True) for each block, then the root (FSDP2)
* tp2:   parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}); both ranks the same batch
* pp2:   torch.distributed.pipelining: PipelineStage per half of the blocks, Schedule1F1B, 2 micro-batches (accel's
         defaults for pp_size 2); rank 0 feeds inputs, rank 1 targets

The peers: accel (`accel launch --cpu` with the layout's flags, `Accelerator()`, prepare, accelerator.backward;
PP: `loss = model(x, target=y)`); Accelerate 1.15 (torchrun; DDP); Fabric 2.6 (torchrun; strategy "ddp", ZeRO-3
and TP 2 as its ModelParallelStrategy: FSDP2 and DTensor through the raw loop's own calls). Accelerate and Fabric
are imported from benchmarks/wheels/site (`bash benchmarks/fetch_versus_wheels.sh`, installed offline by this
script), never from the main environment, where accel's `accelerate` shim lives. A peer that cannot run a layout
prints one line saying why.

Every loop trains its own copy of the same residual MLP (same initial weights) on the same in-memory tensors, MSE,
batch 64 per process, plain SGD. Each size runs in two halves with the loops built in either order, pooled. A step
is timed on rank 0 from fetching the batch to the end of optimizer.step(); warm-up blocks are dropped. Printed: the
median per-step milliseconds of each loop, their ratio (target: accel/raw <= 1.0), the median of the per-round
ratios with quartiles, and the ratio within each half. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import accel_command

HERE = Path(__file__).resolve().parent
TARGET_RATIO = 1.0
LAYOUTS = ("ddp", "zero3", "tp2", "pp2")
PEERS = ("accel", "accelerate", "fabric")
PACKAGE = {"accelerate": "accelerate", "fabric": "lightning_fabric"}
ACCEL_FLAGS = {"ddp": [], "zero3": ["--zero_stage", "3"], "tp2": ["--tp_size", "2"],
               "pp2": ["--pp_size", "2", "--pp_schedule", "1F1B", "--pp_microbatches", "2"]}
CANNOT = {
    ("accelerate", "zero3"): "Accelerate 1.15 turns FSDP on only on accelerators (AcceleratorState: MULTI_GPU, "
                             "MULTI_XPU, ...); on the CPU (MULTI_CPU) it ignores the FSDP plugin and runs DDP",
    ("accelerate", "tp2"): "Accelerate's tensor parallelism applies a transformers model's own tp_plan "
                           "(ParallelismConfig tp_size); a plain nn.Module has none",
    ("accelerate", "pp2"): "Accelerate has no pipeline-parallel training (prepare_pippy is inference only)",
    ("fabric", "pp2"): "Fabric has no pipeline-parallel strategy",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=LAYOUTS, default="ddp")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {', '.join(PEERS)}")
    parser.add_argument("--control", action="store_true", help="also an A/A job: a second raw loop in the peer's "
                        "place, whose ratio shows the noise floor of this machine")
    parser.add_argument("--sizes", default="1M,10M", help="comma-separated, from 1M, 10M")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--block", type=int, default=10, help="steps per block before switching loops")
    parser.add_argument("--warmup-blocks", type=int, default=2, help="blocks of each loop dropped at each half's start")
    parser.add_argument("--rounds", default="40,8", help="measured rounds per size (one block of each loop per "
                        "round), comma-separated in --sizes order")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 rounds per size")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launched job")
    parser.add_argument("--worker", choices=[*PEERS, "control"], help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("--out", help=argparse.SUPPRESS)  # worker: where rank 0 writes its JSON record
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------------------
# launcher side
# ------------------------------------------------------------------------------------------------------------

def job_command(peer: str, layout: str) -> list[str]:
    """accel's job under `accel launch` with the layout's flags; the others under torchrun."""
    if peer == "accel":
        return [*accel_command(), "launch", "--cpu", "--num_processes", "2", "--mixed_precision", "no",
                "--gradient_accumulation_steps", "1", *ACCEL_FLAGS[layout]]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def peer_site() -> Path | str:
    """benchmarks/wheels/site with Accelerate and Fabric installed from the wheels (offline), or why not."""
    from versus import SITE, WHEELS, install_wheels

    if not list(WHEELS.glob("*.whl")):
        return "no wheels in benchmarks/wheels (bash benchmarks/fetch_versus_wheels.sh, then rerun)"
    install_wheels()
    return SITE


def cannot_run(peer: str, layout: str, site: Path | str) -> str | None:
    if (peer, layout) in CANNOT:
        return CANNOT[(peer, layout)]
    if peer in PACKAGE and isinstance(site, str):
        return site
    if peer in PACKAGE and not (Path(site) / PACKAGE[peer]).is_dir():
        return f"{PACKAGE[peer]} is not in {site} (bash benchmarks/fetch_versus_wheels.sh, then rerun)"
    return None


def run_peer(peer: str, args: argparse.Namespace, passed: list[str], site, folder: Path) -> dict | str:
    """One launched job of `peer` against raw: its record, or why it failed."""
    out = folder / f"{peer}.json"
    cmd = [*job_command(peer, args.layout), str(Path(__file__).resolve()), "--worker", peer, "--out", str(out), *passed]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if peer in PACKAGE:  # the real package first on the path, ahead of accel's shim
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(HERE), env.get("PYTHONPATH", "")) if p)
    print("$ OMP_NUM_THREADS=1 " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    try:
        rc: int | str = subprocess.call(cmd, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0 or not out.exists():
        return f"the job failed (exit {rc}); its output is above"
    print(f"  {peer}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(out.read_text())


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    passed = [a for a in argv if a not in ("--control",)]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()] + (["control"] if args.control else [])
    site = peer_site() if any(p in PACKAGE for p in peers) else ""
    load_before = os.getloadavg()
    results: dict[str, dict | str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        for peer in peers:
            why = cannot_run(peer, args.layout, site)
            results[peer] = why if why else run_peer(peer, args, passed, site, Path(tmp))
    print_table(args.layout, results, load_before, os.getloadavg())
    return 0 if all(isinstance(r, dict) or (p, args.layout) in CANNOT for p, r in results.items()) else 1


def print_table(layout: str, results: dict[str, dict | str], load_before, load_after) -> None:
    records = [r for r in results.values() if isinstance(r, dict)]
    if records:
        first = records[0]
        print(f"\nlayout {layout}: torch {first['torch']}, 2 processes (gloo, CPU), 1 thread each, batch "
              f"{first['batch']} per process, SGD, blocks of {first['block']} steps; load average (1 min) "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after")
        for peer, record in results.items():
            if isinstance(record, dict):
                print(f"  {peer}: {record['describe']}")
    header = (f"{'model':<6} {'params':>10} {'peer':<10} {'steps':>5} {'raw ms':>8} {'peer ms':>8} {'peer/raw':>9} "
              f"{'per-round [q1, q3]':>24} {'raw 1st / peer 1st':>19} {'accel/peer':>10}")
    print(header)
    print("-" * len(header))
    accel_rows = {row["size"]: row for row in results.get("accel", {}).get("rows", [])} \
        if isinstance(results.get("accel"), dict) else {}
    sizes = [row["size"] for record in records for row in record["rows"]]
    for size in dict.fromkeys(sizes):
        for peer, record in results.items():
            row = next((r for r in record["rows"] if r["size"] == size), None) if isinstance(record, dict) else None
            if row is None:
                continue
            versus = "" if peer in ("accel", "control") or size not in accel_rows else \
                f"{accel_rows[size]['ratio'] / row['ratio']:.3f}"
            print(f"{size:<6} {row['params']:>10,} {peer:<10} {row['steps']:>5} {row['raw']:>8.2f} "
                  f"{row['peer']:>8.2f} {row['ratio']:>9.3f} {row['r_med']:>8.3f} [{row['r_q1']:.3f}, "
                  f"{row['r_q3']:.3f}] {row['halves'][0]:>9.3f} / {row['halves'][1]:.3f} {versus:>10}")
    for peer, record in results.items():
        if isinstance(record, str):
            print(f"{peer}: cannot run {layout} here: {record}")
    print(f"\nper-step median on rank 0 (batch fetch + zero_grad + forward + backward + SGD step), both halves pooled; "
          f"target accel/raw <= {TARGET_RATIO}; accel/peer = (accel/raw) / (peer/raw)", flush=True)


# ------------------------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------------------------

def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return quantile(values, 0.5)


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    from _step_loops import DATA_PARALLEL, PEER_LOOPS, SIZES, ResidualMLP, raw_loop

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")  # the raw loop's own init; every peer finds it and uses it
    peer = PEER_LOOPS[args.worker](args.layout)
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    rounds = [4] * len(sizes) if args.quick else [int(r) for r in args.rounds.split(",")]
    rounds += [rounds[-1]] * (len(sizes) - len(rounds))
    batch = args.batch_size
    clock = time.perf_counter

    def block(step) -> list[float]:
        times = []
        for _ in range(args.block):
            start = clock()
            step()
            times.append(clock() - start)
        return times

    rows = []
    for size, n_rounds in zip(sizes, rounds, strict=False):
        width, blocks = SIZES[size]
        torch.manual_seed(0)
        replicas = world if DATA_PARALLEL[args.layout] else 1
        n = 2 * replicas * batch * 32  # 64 steps per epoch: epoch boundaries are part of the loop
        dataset = TensorDataset(torch.randn(n, width), torch.randn(n, width))
        base = ResidualMLP(width, blocks)
        raw_times: list[float] = []
        peer_times: list[float] = []
        round_ratios: list[float] = []
        halves: list[float] = []
        # Two halves, the loops built in either order: in some A/A runs the loop built second was a few percent
        # faster (allocator state?), so neither loop gets that edge for the whole run.
        for half in range(2):
            if half == 0:
                raw_step = raw_loop(args.layout, base, dataset, batch)
                peer_step = peer.build(base, dataset, batch)
            else:
                peer_step = peer.build(base, dataset, batch)
                raw_step = raw_loop(args.layout, base, dataset, batch)
            first = len(raw_times)
            for r in range(args.warmup_blocks + (n_rounds + 1 - half) // 2):
                if r % 2 == 0:  # raw, peer | peer, raw | ...: neither loop always goes first
                    raw_block, peer_block = block(raw_step), block(peer_step)
                else:
                    peer_block = block(peer_step)
                    raw_block = block(raw_step)
                if r >= args.warmup_blocks:
                    raw_times += raw_block
                    peer_times += peer_block
                    round_ratios.append(median(peer_block) / median(raw_block))
            halves.append(median(peer_times[first:]) / median(raw_times[first:]))
            dist.barrier()
            del raw_step, peer_step
            peer.release()
        rows.append(dict(size=size, params=sum(p.numel() for p in base.parameters()), steps=len(raw_times),
                         raw=median(raw_times) * 1e3, peer=median(peer_times) * 1e3,
                         ratio=median(peer_times) / median(raw_times), r_med=median(round_ratios),
                         r_q1=quantile(round_ratios, 0.25), r_q3=quantile(round_ratios, 0.75), halves=halves))
        if rank == 0:
            print(f"  {args.worker} {size}: {rows[-1]['ratio']:.3f} x raw ({len(raw_times)} measured steps per loop)",
                  flush=True)
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(dict(describe=peer.describe, torch=torch.__version__, batch=batch,
                                                  block=args.block, rows=rows)))
    peer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
