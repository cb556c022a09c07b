"""Collective bytes per step against the theory: every collective each layout issues, counted, beside the payload
its layout needs (gloo on CPU).

    python benchmarks/bench_collectives.py              # 10 layouts, small Llama / Mixtral (~3-4 minutes on 2 cores)
    python benchmarks/bench_collectives.py --layouts ddp,tp2
    python benchmarks/bench_collectives.py --big        # also the 1B-parameter DDP job: prepare and clip_grad_norm_

One job per layout, `accel launch --cpu --num_processes N --mixed_precision no benchmarks/bench_collectives.py
--worker --layout L` (OMP_NUM_THREADS=1); the worker passes the layout's `ParallelismConfig` to `Accelerator`: DDP,
ZeRO-1, ZeRO-2, ZeRO-3 (2 processes), HSDP 2 x 2 (4), TP 2, PP 2 (1F1B, 2 micro-batches), SP 2 (Ulysses), CP 2
(allgather), EP 2 (2 processes). The model (seed 0): transformers' LlamaForCausalLM, L=2 layers, hidden H=128,
intermediate 256, 4 heads = kv heads, vocab 512, sdpa; EP: MixtralForCausalLM of the same sizes, 4 experts, top-2,
router auxiliary loss off. AdamW fp32; batches of B=4 x S=64 tokens per data-parallel rank from a prepared
DataLoader (sp/cp cut them; tp/pp ranks share them). A step: `zero_grad`, forward, `accelerator.backward`,
`accelerator.clip_grad_norm_(.., 1.0)`, `optimizer.step()`, each inside a `record_function` naming its phase.

Counting: every c10d collective goes through a dispatcher op (`c10d::allreduce_`, `c10d::_allgather_base_`,
`c10d::send`, ...), also when DDP's C++ reducer, FSDP2 or DTensor's functional collectives issue it, so a
`torch.profiler` over the measured steps (CPU, record_shapes) sees each one with its tensors' shapes and dtypes
(`experimental_event_tree`, which records tensor lists too). Bytes are the payload: the larger of the op's inputs
and outputs (all-reduce, broadcast, send, recv: the tensor; all-gather: the gathered output; reduce-scatter: the
input; all-to-all: the input), not what a ring puts on the wire. torch.distributed's Python functions are wrapped
in a `record_function` naming the group's size, shown where known (DDP's reducer calls from C++: no size).

Theory per layout, in payload bytes per rank per step, from the parameter count P, 4-byte fp32 and the sizes
above (N = 2; act = B S H x 4 bytes): DDP all-reduce P; ZeRO-1 all-reduce P + broadcast P (each rank's updated
partition); ZeRO-2 all-gather P (forward) + reduce-scatter P; ZeRO-3 the same + all-gather P again in backward;
HSDP the same over the shard group + all-reduce P/2 over the replicas; TP (Megatron's f/g pairs) forward all-reduce
(2L + 1) act (after o_proj and down_proj, and the vocabulary-split embedding) + all-gather of the logits (lm_head
split by vocabulary, loss not vocabulary-parallel), backward all-reduce (2L + 1) act (one per column-split input:
attention, MLP, lm_head); PP send and recv act x (S-1)/S (the inputs drop the last token): each micro-batch's
activation one way, its gradient the other; SP all-to-all 4 L act / N forward (q, k, v, attention output) and as
much backward + all-reduce P; CP all-gather 2 L act (K and V) forward, reduce-scatter as much backward +
all-reduce P; EP all-to-all 2 L k act + the split counts forward (tokens to their experts and back) and 2 L k act
backward, all-reduce of the dense parameters (each expert lives on one rank). Clipping needs one small all-reduce
per mesh whose gradients are sharded (none for DDP, ZeRO-1, SP, CP). A collective the theory does not list is
printed as "not needed by the layout?", with what it is for where known (`EXTRAS`).

`--big`: a 1B-parameter model (15 Linear(8192, 8192), 1,006,755,840 parameters, built on the meta device, fp32)
under DDP on 2 processes with `gradient_as_bucket_view=True` (no copy of the gradients: 8 GB per process); no
optimizer. Counted and timed: `prepare` (DDP's parameter broadcast and shape check, and `fix_bucket_layout`'s
all-reduce of zeros, timed alone), and `clip_grad_norm_` after one forward and backward. It needs about 18 GB free
(it does not start with less); its processes are the kernel's first choice if memory runs out, and the launcher
kills them if the machine's available memory falls under 1 GB. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import accel_command, per_rank, run_layouts

# name -> (processes, ParallelismConfig fields, model family)
LAYOUTS = {
    "ddp": (2, {}, "llama"),
    "zero1": (2, {"zero_stage": 1}, "llama"),
    "zero2": (2, {"zero_stage": 2}, "llama"),
    "zero3": (2, {"zero_stage": 3}, "llama"),
    "hsdp2x2": (4, {"dp_replicate_size": 2, "dp_shard_size": 2, "zero_stage": 3}, "llama"),
    "tp2": (2, {"tp_size": 2}, "llama"),
    "pp2": (2, {"pp_size": 2, "pp_microbatches": 2, "pp_schedule": "1F1B"}, "llama"),
    "sp2": (2, {"sp_size": 2}, "llama"),
    "cp2": (2, {"cp_size": 2}, "llama"),
    "ep2": (2, {"ep_size": 2}, "mixtral"),
}
SIZES = dict(layers=2, hidden=128, heads=4, vocab=512, seq=64, batch=4, experts=4, top_k=2)
KINDS = {  # c10d dispatcher op -> the collective it is
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "reduce_": "reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "barrier": "barrier", "monitored_barrier_": "barrier",
    "gather_": "gather", "scatter_": "scatter",
}
WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
           "broadcast", "all_to_all", "all_to_all_single", "barrier", "reduce",
           "all_gather_object", "broadcast_object_list")
MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run one job (set by the launcher)")
    parser.add_argument("--out", help="worker: where to write the JSON record")
    parser.add_argument("--layout", default=None, help="worker: one layout of LAYOUTS, or 'big'")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the counted ones")
    parser.add_argument("--steps", type=int, default=2, help="counted steps (figures are per step)")
    parser.add_argument("--big", action="store_true", help="also the 1B-parameter DDP job (prepare, clipping)")
    parser.add_argument("--big-only", action="store_true", help="only the 1B-parameter job")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launched job")
    parser.add_argument("--big-width", type=int, default=BIG[1], help=argparse.SUPPRESS)  # a smaller try of --big
    parser.add_argument("--json", help="also write every job's record (all ranks, by phase) to this file")
    return parser.parse_args(argv)


# counting (worker side) ----------------------------------------------------------------------------------------

def label_groups() -> None:
    """Wrap torch.distributed's collective functions so each call sits in a record_function naming its group's size
    (the profiler's c10d ops carry their tensors but not their group)."""
    import functools

    import torch.distributed as dist
    from torch.profiler import record_function

    for name in WRAPPED:
        original = getattr(dist, name)

        @functools.wraps(original)
        def wrapped(*args, _original=original, **kwargs):
            group = kwargs.get("group")
            try:
                size = dist.get_world_size(group)
            except Exception:  # noqa: BLE001 - a group this rank is not in: no label
                return _original(*args, **kwargs)
            with record_function(f"group:{size}"):
                return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


def tensor_bytes(value) -> int | None:
    """Bytes of a recorded tensor or (nested) tensor list; None where the profiler did not record it."""
    if isinstance(value, list):
        parts = [tensor_bytes(v) for v in value]
        return sum(p for p in parts if p is not None) if parts and None not in parts else None
    if hasattr(value, "sizes") and hasattr(value, "dtype"):
        import torch

        count = 1
        for size in value.sizes:
            count *= size
        return count * torch.empty((), dtype=value.dtype).element_size()
    return None


def dtype_of(value) -> str:
    if isinstance(value, list):
        return next((d for d in map(dtype_of, value) if d), "")
    return str(value.dtype).replace("torch.", "") if hasattr(value, "dtype") else ""


def collectives(profiler) -> list[dict]:
    """Each c10d op the profiler saw (the innermost, where one calls another): its phase (the nearest
    `phase:` record_function above it), op, kind, group size (where known), payload bytes and dtype."""
    found = []

    def walk(event, phase: str, group: str):
        name = event.name
        if name.startswith("phase:"):
            phase = name[len("phase:"):]
        elif name.startswith("group:"):
            group = name[len("group:"):]
        op = name[len("c10d::"):] if name.startswith("c10d::") else None
        if op in KINDS and not any(_has_collective(child) for child in event.children):
            inputs = list(event.extra_fields.inputs)
            sizes = [tensor_bytes(v) for v in inputs]
            known = [s for s in sizes if s is not None]
            payload = max(known, default=0)
            unrecorded_output = op in ("allgather_", "reduce_scatter_") and group.isdigit()
            if unrecorded_output:  # the list-of-lists side is not recorded: the other side x the group
                payload *= int(group)
            found.append({"phase": phase, "op": op, "kind": KINDS[op], "group": group, "bytes": payload,
                          "dtype": next((dtype_of(v) for v in inputs if dtype_of(v)), "")})
            return
        for child in event.children:
            walk(child, phase, group)

    for root in profiler.profiler.kineto_results.experimental_event_tree():
        walk(root, "other", "?")
    return found


def _has_collective(event) -> bool:
    name = event.name
    if name.startswith("c10d::") and name[len("c10d::"):] in KINDS:
        return True
    return any(_has_collective(child) for child in event.children)


def summarize(found: list[dict], steps: int = 1) -> list[dict]:
    """Counts and bytes per (phase, kind, op, group, dtype), divided by `steps`."""
    totals: dict = collections.defaultdict(lambda: [0, 0])
    for item in found:
        key = (item["phase"], item["kind"], item["op"], item["group"], item["dtype"])
        totals[key][0] += 1
        totals[key][1] += item["bytes"]
    return [{"phase": k[0], "kind": k[1], "op": k[2], "group": k[3], "dtype": k[4], "count": c / steps,
             "bytes": b / steps} for k, (c, b) in sorted(totals.items())]


def profiled():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], record_shapes=True)


# the layouts' worker -----------------------------------------------------------------------------------------

def make_model(family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from accel.utils import set_seed

    set_seed(0)
    s = SIZES
    sizes = dict(hidden_size=s["hidden"], intermediate_size=2 * s["hidden"], num_hidden_layers=s["layers"],
                 num_attention_heads=s["heads"], num_key_value_heads=s["heads"], vocab_size=s["vocab"],
                 max_position_embeddings=s["seq"], attn_implementation="sdpa", use_cache=False)
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=s["experts"],
                                                num_experts_per_tok=s["top_k"], output_router_logits=False,
                                                router_aux_loss_coef=0.0))
    return LlamaForCausalLM(LlamaConfig(**sizes))


def worker(args: argparse.Namespace) -> int:
    import torch
    from torch.profiler import record_function

    from accel import Accelerator, ParallelismConfig

    _, fields, family = LAYOUTS[args.layout]
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**fields))
    label_groups()
    model = make_model(family)
    n_params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    s = SIZES
    rows = (args.warmup + args.steps) * s["batch"] * accelerator.num_processes
    ids = torch.randint(0, s["vocab"], (rows, s["seq"]), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r.clone()} for r in ids], batch_size=s["batch"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pipeline = fields.get("pp_size", 1) > 1

    def shifted(logits, targets):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    with profiled() as at_prepare, record_function("phase:prepare"):
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader,
                                                       **({"loss_fn": shifted} if pipeline else {}))
    prepare = summarize(collectives(at_prepare))
    model.train()
    counted, seen = None, []
    batches = iter(loader)
    for i in range(args.warmup + args.steps):
        batch = next(batches)
        if i == args.warmup:
            counted = profiled()
            counted.__enter__()
        optimizer.zero_grad()
        with record_function("phase:forward"):
            if pipeline:
                loss = model(batch["input_ids"][:, :-1], target=batch["labels"][:, 1:])
            else:
                loss = model(**batch).loss
        with record_function("phase:backward"):
            accelerator.backward(loss)
        with record_function("phase:clip"):
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        with record_function("phase:optimizer"):
            optimizer.step()
        seen.append(tuple(batch["input_ids"].shape))
    counted.__exit__(None, None, None)
    step = summarize(collectives(counted), args.steps)
    ranks = per_rank({"step": step, "prepare": prepare, "batch_shape": seen[-1]})
    if accelerator.is_main_process:
        record = {"torch": torch.__version__, "layout": args.layout, "fields": fields, "family": family,
                  "world": accelerator.num_processes, "n_params": n_params, "experts": experts, "sizes": SIZES,
                  "warmup": args.warmup, "steps": args.steps, "ranks": ranks}
        Path(args.out).write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    return 0


# the 1B job's worker -----------------------------------------------------------------------------------------

BIG = (15, 8192)  # (layers, width): 15 x (8192^2 + 8192) = 1,006,755,840 parameters


def big_worker(args: argparse.Namespace) -> int:
    """1B parameters under DDP: the collectives of `prepare` (with `fix_bucket_layout` timed alone) and of
    `clip_grad_norm_` after one backward, with their times."""
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function

    import accel.backends.ddp as ddp_module
    from accel import Accelerator, DistributedDataParallelKwargs

    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    label_groups()
    layers, width = BIG[0], args.big_width
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.01 if p.dim() > 1 else 0.0)
    n_params = sum(p.numel() for p in model.parameters())
    times: dict[str, float] = {}
    original = ddp_module.fix_bucket_layout

    def timed_fix(ddp):
        start = time.perf_counter()
        with record_function("phase:fix_bucket_layout"):
            original(ddp)
        times["fix_bucket_layout"] = time.perf_counter() - start

    ddp_module.fix_bucket_layout = timed_fix
    dist.barrier()
    start = time.perf_counter()
    with profiled() as at_prepare, record_function("phase:prepare"):
        model = accelerator.prepare(model)
    times["prepare"] = time.perf_counter() - start
    ddp_module.fix_bucket_layout = original
    x = torch.randn(1, width)
    start = time.perf_counter()
    model(x).square().mean().backward()
    times["forward_backward"] = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    with profiled() as at_clip, record_function("phase:clip"):
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    times["clip"] = time.perf_counter() - start
    found = summarize(collectives(at_prepare)) + summarize(collectives(at_clip))
    ranks = per_rank({"found": found, "times": times, "norm": float(norm)})
    if accelerator.is_main_process:
        record = {"torch": torch.__version__, "n_params": n_params, "world": accelerator.num_processes,
                  "ranks": ranks}
        Path(args.out).write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    return 0


# theory (launcher side) --------------------------------------------------------------------------------------

F, BW, OPT = ("forward",), ("backward",), ("optimizer",)


def theory(rec: dict) -> list[tuple[str, tuple, float, str]]:
    """(kind, phases, payload bytes per rank per step, what) the layout needs, fp32."""
    layout, n, p, s = rec["layout"], rec["world"], rec["n_params"] * 4, rec["sizes"]
    L, B, S, H, k = s["layers"], s["batch"], s["seq"], s["hidden"], s["top_k"]  # noqa: N806 - the usual symbols
    act = B * S * H * 4  # one activation of a rank's batch
    shard = [("all_gather", F, p, "parameters"), ("reduce_scatter", BW, p, "gradients")]
    table = {
        "ddp": [("all_reduce", BW, p, "gradients")],
        "zero1": [("all_reduce", BW, p, "gradients"), ("broadcast", OPT, p, "each rank's updated partition")],
        "zero2": shard,
        "zero3": [*shard, ("all_gather", BW, p, "parameters again (resharded after forward)")],
        "hsdp2x2": [*shard, ("all_gather", BW, p, "parameters again"),
                    ("all_reduce", BW, p / 2, "gradient shards over the replicas")],
        "tp2": [("all_reduce", F, (2 * L + 1) * act, "after o_proj, down_proj; vocab-split embedding"),
                ("all_gather", F, B * S * s["vocab"] * 4, "logits (lm_head split by vocabulary)"),
                ("all_reduce", BW, (2 * L + 1) * act, "one per column-split input: attention, MLP, lm_head")],
        "pp2": [("send", F, act * (S - 1) / S, "activations (stage 0) or their gradients (stage 1)"),
                ("recv", F, act * (S - 1) / S, "the other direction (the schedule runs backward too)")],
        "sp2": [("all_to_all", F, 4 * L * act / n, "q, k, v, attention output"),
                ("all_to_all", BW, 4 * L * act / n, "their gradients"), ("all_reduce", BW, p, "gradients")],
        "cp2": [("all_gather", F, 2 * L * act, "K and V"), ("reduce_scatter", BW, 2 * L * act, "their gradients"),
                ("all_reduce", BW, p, "gradients (+ K/V gradients: all-reduced where the backend is not NCCL)")],
        "ep2": [("all_to_all", F, 2 * L * act * k + L * s["experts"] * 8, "tokens to experts and back; counts"),
                ("all_to_all", BW, 2 * L * act * k, "their gradients"),
                ("all_reduce", BW, (rec["n_params"] - rec["experts"]) * 4, "dense gradients (experts: 1 rank)")],
    }
    return table[layout]


# what a collective the theory does not list is for: (layout, kind, phase) -> why
EXTRAS = {
    ("ddp", "broadcast", "forward"): "DDP broadcast_buffers: the rotary inv_freq buffer",
    ("zero1", "broadcast", "forward"): "DDP broadcast_buffers",
    ("sp2", "broadcast", "forward"): "DDP broadcast_buffers",
    ("cp2", "broadcast", "forward"): "DDP broadcast_buffers",
    ("ep2", "broadcast", "forward"): "DDP broadcast_buffers",
    ("pp2", "broadcast", "forward"): "the loss, from the last stage to every rank",
    ("sp2", "all_gather", "forward"): "whole labels (shift) and their count",
    ("cp2", "all_gather", "backward"): "K and V gathered again: attention recomputed in backward",
    ("sp2", "all_reduce", "forward"): "loss: token count and value (scalars)",
    ("cp2", "all_reduce", "forward"): "loss: token count and value (scalars)",
}


# launcher side -----------------------------------------------------------------------------------------------

def run_all(args: argparse.Namespace) -> int:
    names = [] if args.big_only else [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layouts {unknown}; allowed: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    passed = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    failed = 0
    results = {}
    for name in names:
        jobs = {name: ["--num_processes", str(LAYOUTS[name][0])]}
        got = run_layouts(__file__, jobs, [*passed, "--layout", name], args.timeout, "bench_collectives_")
        failed += name not in got
        results.update(got)
    if results:
        print_table(results)
    if args.big or args.big_only:
        record = run_big(args.timeout, args.big_width)
        failed += record is None
        if record:
            print_big(record)
            results["big"] = record
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


def run_big(timeout: float, width: int) -> dict | None:
    """The 1B job, killed if the machine's available memory runs low (others share it): its processes are the
    kernel's first choice when memory runs out (oom_score_adj 1000), and it does not start without room."""
    layers = BIG[0]
    need = 2 * 2 * layers * (width * width + width) * 4 + 1.5e9  # 2 processes x (parameters + DDP's buckets)
    if available_bytes() < need:
        print(f"  big: skipped: needs {need / 1e9:.1f} GB of available memory, {available_bytes() / 1e9:.1f} GB "
              "available")
        return None
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as adj:
        adj.write("1000")  # inherited by the launched processes
    with tempfile.TemporaryDirectory(prefix="bench_collectives_") as tmp:
        out = Path(tmp) / "big.json"
        cmd = [*accel_command(), "launch", "--cpu", "--num_processes", "2", "--mixed_precision", "no",
               str(Path(__file__).resolve()), "--worker", "--layout", "big", "--out", str(out),
               "--big-width", str(width)]
        print("$ OMP_NUM_THREADS=1 " + " ".join(cmd), flush=True)
        job = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
        low = threading.Event()

        def watch():
            while job.poll() is None:
                if available_bytes() < 1.0e9:
                    low.set()
                    os.killpg(job.pid, signal.SIGKILL)
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()
        try:
            rc = job.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            rc = "timeout"
        if low.is_set() or rc != 0 or not out.exists():
            print(f"  big: FAILED (exit {rc}{', killed: available memory under 1 GB' if low.is_set() else ''})")
            return None
        return json.loads(out.read_text())


def available_bytes() -> float:
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float("inf")


def by_phase(entries: list[dict]) -> dict[tuple[str, str], dict]:
    """(kind, phase) -> {count, bytes, ops, groups} over the step's entries (clipping left out)."""
    rows: dict = {}
    for e in entries:
        if e["phase"] in ("clip", "prepare"):
            continue
        row = rows.setdefault((e["kind"], e["phase"]), {"count": 0.0, "bytes": 0.0, "ops": set(), "groups": set()})
        row["count"] += e["count"]
        row["bytes"] += e["bytes"]
        row["ops"].add(e["op"])
        row["groups"].add(e["group"])
    return rows


def compared(rec: dict, entries: list[dict]) -> list[tuple]:
    """(kind, phase, count, measured bytes, theory bytes or None, note, ops) for one rank: each theory entry beside
    what that rank issued of its kind in its phase, then what no entry lists."""
    rows, out = by_phase(entries), []
    for kind, phases, want, what in theory(rec):
        for phase in phases:
            got = rows.pop((kind, phase), {"count": 0, "bytes": 0.0, "ops": set(), "groups": set()})
            out.append((kind, phase, got["count"], got["bytes"], want, what, got["ops"], got["groups"]))
    for (kind, phase), got in sorted(rows.items()):
        why = EXTRAS.get((rec["layout"], kind, phase))
        out.append((kind, phase, got["count"], got["bytes"], None,
                    "not needed by the layout?" + (f" ({why})" if why else ""), got["ops"], got["groups"]))
    return out


def print_table(results: dict[str, dict]) -> None:
    first = next(iter(results.values()))
    s = first["sizes"]
    print(f"\ntorch {first['torch']}, gloo on CPU; Llama {s['layers']} layers, hidden {s['hidden']}, {s['heads']} "
          f"heads, vocab {s['vocab']} (EP: Mixtral, {s['experts']} experts, top-{s['top_k']}); batch {s['batch']} x "
          f"{s['seq']} tokens per data-parallel rank, fp32; {first['steps']} counted steps after {first['warmup']}")
    header = (f"{'layout':<13} {'collective':<14} {'phase':<9} {'n/step':>6} {'MB/step':>8} {'theory MB':>9} "
              f"{'ratio':>6} {'group':<5} note [ops]")
    print(header)
    print("-" * len(header))
    for name, rec in results.items():
        ranks = rec["ranks"]
        rows = compared(rec, ranks[0]["step"])
        differ = any([r[:4] for r in compared(rec, other["step"])] != [r[:4] for r in rows] for other in ranks)
        label = f"{name} P={rec['n_params'] / 1e3:.0f}k"
        for kind, phase, count, got, want, note, ops, groups in rows:
            ratio = f"{got / want:6.2f}" if want else f"{'-':>6}"
            theory_mb = f"{want / MB:9.4f}" if want else f"{'-':>9}"
            print(f"{label:<13} {kind:<14} {phase:<9} {count:>6.1f} {got / MB:>8.4f} {theory_mb} {ratio} "
                  f"{'/'.join(sorted(groups)) or '-':<5} {note} [{'+'.join(sorted(ops)) or '-'}]")
            label = ""
        clip = [e for e in ranks[0]["step"] if e["phase"] == "clip"]
        at_clip = ", ".join(f"{e['count']:.0f} {e['kind']} {e['bytes']:.0f} B" for e in clip) or "none"
        prep: dict = {}
        for e in ranks[0]["prepare"]:
            got = prep.setdefault(e["kind"], [0.0, 0.0])
            got[0], got[1] = got[0] + e["count"], got[1] + e["bytes"]
        at_prepare = ", ".join(f"{c:.0f} {k} {b / MB:.3f} MB" for k, (c, b) in sorted(prep.items()))
        print(f"{'':<13} clip_grad_norm_: {at_clip}; prepare: {at_prepare or 'none'}"
              + ("; ranks differ (rank 0 shown)" if differ else ""))
    print("MB = 1e6 bytes of payload per rank (rank 0), per step; theory: the docstring's formulas; group: the "
          "group's size where known (? = issued from C++ or by a function not wrapped)", flush=True)


def print_big(record: dict) -> None:
    rank0 = record["ranks"][0]
    times = {k: max(r["times"][k] for r in record["ranks"]) for k in rank0["times"]}
    print(f"\nbig job: {record['n_params']:,} parameters fp32 ({record['n_params'] * 4 / 1e9:.2f} GB), DDP over "
          f"{record['world']} gloo processes, gradient_as_bucket_view; rank 0's collectives, the slower rank's seconds")
    print(f"{'phase':<18} {'collective':<12} {'op':<12} {'dtype':<8} {'n':>3} {'GB':>8}")
    for e in rank0["found"]:
        print(f"{e['phase']:<18} {e['kind']:<12} {e['op']:<12} {e['dtype']:<8} {e['count']:>3.0f} "
              f"{e['bytes'] / 1e9:>8.3f}")
    if not any(e["phase"] == "clip" for e in rank0["found"]):
        print(f"{'clip':<18} none")
    print("seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return big_worker(args) if args.layout == "big" else worker(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
