"""Prepared check for CUDA GPUs: sp 2 and cp 2 (allgather, ring) on 2 GPUs over NCCL against one GPU, fp32 and bf16.

Sequence parallelism (Ulysses) and context parallelism (all-gather and ring) on 2 GPUs over NCCL, against one GPU on
the whole sequence. One command, a few minutes:

    python benchmarks/gpu_check_long_context.py            # on a machine with >= 2 CUDA GPUs
    python benchmarks/gpu_check_long_context.py --cpu      # the same on 2 CPU processes (gloo), allgather only

Cases, each a `torchrun --nproc_per_node 2` launch of this script (`--worker`), in fp32 and in bf16 (accel's
`mixed_precision="bf16"`, i.e. autocast):

* sp 2 (`ParallelismConfig(sp_size=2)`);
* cp 2, `cp_comm_strategy="allgather"`;
* cp 2, `cp_comm_strategy="ring"` (torch's ring attention; CUDA only: with --cpu it is reported as SKIP).

The model (seed 0): a tiny transformers Llama from a LlamaConfig (no download): hidden 256, intermediate 512, 4
layers, 8 heads, 8 key/value heads, vocabulary 1024, attn sdpa, use_cache False, dropout 0. Data: 2 sequences of
--length tokens (default 1024) in a DataLoader of dict batches {input_ids, labels}; the model's own loss; AdamW
(lr 1e-3), --steps steps. The reference is plain PyTorch on one device (cuda:0, or the CPU with --cpu) on the whole
sequences, fp32 or under bf16 autocast. Per-step losses must agree: fp32 within 1e-4, bf16 within 2e-2 (absolute).
For ring, the worker also counts calls of accel's ring-attention path and fails if it never ran on CUDA.

Prints one PASS / FAIL / SKIP line per case and exits 1 if any case failed. With fewer than 2 GPUs (and no --cpu)
it prints SKIP and exits 0.
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

TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
CASES = {  # name -> ParallelismConfig fields
    "sp2": {"sp_size": 2},
    "cp2-allgather": {"cp_size": 2, "cp_comm_strategy": "allgather"},
    "cp2-ring": {"cp_size": 2, "cp_comm_strategy": "ring"},
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="2 CPU processes over gloo instead of 2 GPUs over NCCL "
                                                           "(ring is skipped: it runs on CUDA only)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16")
    parser.add_argument("--length", type=int, default=1024, help="tokens per sequence (a multiple of 4)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    # worker side (set by the launcher)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in args.cases.split(","):
        if name not in CASES:
            parser.error(f"--cases: unknown case {name!r}; allowed: {', '.join(CASES)}")
    for name in args.dtypes.split(","):
        if name not in TOLERANCE:
            parser.error(f"--dtypes: unknown dtype {name!r}; allowed: fp32, bf16")
    if args.length % 4:
        parser.error("--length must be a multiple of 4 (2 x cp_size chunks)")
    return args


# launcher side -------------------------------------------------------------------------------------------

def launch(cmd: list[str], out: Path, timeout: float, cpu: bool) -> tuple[dict | None, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1") if cpu else dict(os.environ)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        return None, f"exit {proc.returncode}:\n    " + "\n    ".join(tail)
    return json.loads(out.read_text()), f"{time.perf_counter() - start:.0f} s"


def run_all(args: argparse.Namespace) -> int:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.cpu and gpus < 2:
        print(f"SKIP: {gpus} CUDA GPU(s) visible; this check needs 2 (or run it with --cpu on 2 CPU processes)")
        return 0
    where = "2 CPU processes, gloo" if args.cpu else f"2 of {gpus} GPUs ({torch.cuda.get_device_name(0)}), NCCL"
    print(f"torch {torch.__version__}; {where}; tiny Llama, {args.layers} layers, 2 x {args.length} tokens, "
          f"{args.steps} steps", flush=True)
    script = str(Path(__file__).resolve())
    common = ["--length", str(args.length), "--layers", str(args.layers), "--steps", str(args.steps)]
    if args.cpu:
        common.append("--cpu")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu_check_long_context_") as tmp:
        for dtype in args.dtypes.split(","):
            out = Path(tmp) / f"reference-{dtype}.json"
            reference, note = launch([sys.executable, script, "--worker", "--reference", "--dtype", dtype,
                                      "--out", str(out), *common], out, args.timeout, args.cpu)
            if reference is None:
                print(f"FAIL reference {dtype}: one device, whole sequence: {note}", flush=True)
                failed += 1
                continue
            for case in args.cases.split(","):
                label = f"{case} {dtype}"
                if args.cpu and CASES[case].get("cp_comm_strategy") == "ring":
                    print(f"SKIP {label}: ring attention runs on CUDA only (on the CPU accel uses allgather)")
                    continue
                out = Path(tmp) / f"{case}-{dtype}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       script, "--worker", "--case", case, "--dtype", dtype, "--out", str(out), *common]
                record, note = launch(cmd, out, args.timeout, args.cpu)
                if record is None:
                    print(f"FAIL {label}: {note}", flush=True)
                    failed += 1
                    continue
                diff = max(abs(a - b) for a, b in zip(record["losses"], reference["losses"]))
                ok = diff <= TOLERANCE[dtype] and len(record["losses"]) == len(reference["losses"])
                extra = ""
                if "ring_calls" in record:
                    extra = f", ring-attention calls {record['ring_calls']}"
                    if not args.cpu and record["ring_calls"] == 0:
                        ok, extra = False, extra + " (the ring path never ran)"
                losses = " ".join(f"{x:.5f}" for x in record["losses"])
                ref = " ".join(f"{x:.5f}" for x in reference["losses"])
                print(f"{'PASS' if ok else 'FAIL'} {label}: max |loss - one device| {diff:.2e} "
                      f"(tolerance {TOLERANCE[dtype]:.0e}){extra}; losses {losses} vs {ref}; {note}", flush=True)
                failed += not ok
    print("FAILED" if failed else "ALL PASSED", f"({failed} failed)" if failed else "")
    return 1 if failed else 0


# worker side ---------------------------------------------------------------------------------------------

def make_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from accel.utils import set_seed

    set_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=1024, max_position_embeddings=4096,
                         attn_implementation="sdpa", use_cache=False, attention_dropout=0.0)
    return LlamaForCausalLM(config)


def make_loader(length: int):
    import torch

    tokens = torch.randint(0, 1024, (2 * 4, length), generator=torch.Generator().manual_seed(1))
    samples = [{"input_ids": row, "labels": row.clone()} for row in tokens]
    return torch.utils.data.DataLoader(samples, batch_size=2, shuffle=False)


def reference(args: argparse.Namespace) -> dict:
    """Plain PyTorch on one device, the whole sequences."""
    import contextlib

    import torch

    device = torch.device("cpu" if args.cpu else "cuda:0")
    model = make_model(args.layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step, batch in enumerate(make_loader(args.length)):
        if step >= args.steps:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                    else contextlib.nullcontext())
        with autocast:
            loss = model(**batch).loss
        loss.float().backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.float().item())
    return {"losses": losses}


def worker(args: argparse.Namespace) -> dict:
    import torch

    import accel.parallel.sequence as sequence
    from accel import Accelerator, ParallelismConfig

    calls = [0]
    original = sequence.SequenceParallel._ring_attention

    def counted(self, *a, **k):
        calls[0] += 1
        return original(self, *a, **k)

    sequence.SequenceParallel._ring_attention = counted
    accelerator = Accelerator(cpu=args.cpu, mixed_precision="bf16" if args.dtype == "bf16" else "no",
                              parallelism_config=ParallelismConfig(**CASES[args.case]))
    model = make_model(args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(args.length))
    model.train()
    losses = []
    for step, batch in enumerate(loader):
        if step >= args.steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach().float(), "mean").item())
    record = {"losses": losses}
    if CASES[args.case].get("cp_comm_strategy") == "ring":
        record["ring_calls"] = calls[0]
    accelerator.wait_for_everyone()
    return record if accelerator.is_main_process else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.worker:
        return run_all(args)
    record = reference(args) if args.reference else worker(args)
    if record is not None:
        Path(args.out).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
