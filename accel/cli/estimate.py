"""`accel estimate-memory MODEL`: weights per dtype, the largest layer, and the training model-state bytes per
rank (parameters, gradients, AdamW state) for DDP, ZeRO 1/2/3 and offload, built on the meta device.

`--json` prints one object: {"model", "params", "weights": [{"dtype", "total_bytes", "largest_layer": {"name",
"params", "bytes"}, "largest_param": {...}}], "training": {"num_processes", "tp_size", "pp_size", "sp_size",
"cp_size", "dp_size", "layouts": {"ddp"|"zero1"|"zero2"|"zero3"|"zero3_offload": {"params_bytes", "grads_bytes",
"optimizer_bytes", "master_bytes", "device_bytes", "host_bytes"}}}, "assumptions"}, and with --batch_size/--seq_len
"activations": {"batch_size", "seq_len", "mixed_precision", "no_checkpointing_bytes", "full_checkpointing_bytes",
"method"}: forward + backward on fake tensors under torch's MemTracker (accel/planning/estimate.py); per process, so
with --sp_size/--cp_size divided by the degree (plus context parallelism's gathered K/V), with "sp_size",
"cp_size" and the whole sequence's "one_process_no_checkpointing_bytes" / "one_process_full_checkpointing_bytes".
"""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
import time

from accel.cli._common import UsageError, add_flag


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """MODEL, in the forms `accel.planning.estimate` builds on the meta device (also `accel plan`'s)."""
    parser.add_argument("model", help="transformers config (config.json, folder, or model type like gpt2), "
                                      "module:callable returning an nn.Module, or a safetensors file/index/folder")


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "estimate-memory", help="estimate a model's weights and training memory per rank (meta device, no memory)",
        description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_flag(parser, "dtypes", default="float32,bfloat16", help="comma-separated weight dtypes (default %(default)s)")
    add_flag(parser, "num_processes", default=1, help="ranks in all (default 1)")
    add_flag(parser, "tp_size", default=1, help="tensor-parallel degree (default 1)")
    add_flag(parser, "pp_size", default=1, help="pipeline-parallel degree (default 1)")
    add_flag(parser, "sp_size", default=1,
             help="sequence-parallel degree (Ulysses; default 1): ZeRO shards over dp x sp, activations / sp_size")
    add_flag(parser, "cp_size", default=1,
             help="context-parallel degree (default 1): ZeRO shards over dp x cp, activations / cp_size plus the "
                  "all-gathered K/V")
    add_flag(parser, "ep_size", default=1,
             help="expert-parallel degree (default 1): each rank holds 1/ep_size of the MoE layers' experts")
    add_flag(parser, "batch_size", default=None,
             help="per-process micro-batch: also measure the activation memory of one training step (fake tensors)")
    add_flag(parser, "seq_len", default=None, help="tokens per sample, with --batch_size")
    add_flag(parser, "mixed_precision", default="no", choices=["no", "bf16", "fp16"],
             help="autocast dtype for the activation measurement (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)
    return parser


MAX_RANKS = 2 ** 20  # --num_processes, --tp_size, --pp_size, --sp_size, --cp_size


def check_flags(args) -> list[str]:
    """Every value flag, checked before the model is read (accel.planning.inputs): `args` gets the parsed
    integers; the dtypes to report."""
    from accel.planning import inputs
    from accel.planning.estimate import DTYPE_BYTES

    for name in ("num_processes", "tp_size", "pp_size", "sp_size", "cp_size", "ep_size"):
        setattr(args, name, inputs.integer(f"--{name}", getattr(args, name), hi=MAX_RANKS))
    for name in ("batch_size", "seq_len"):
        if getattr(args, name) is not None:
            setattr(args, name, inputs.integer(f"--{name}", getattr(args, name)))
    return inputs.names("--dtypes", args.dtypes, tuple(DTYPE_BYTES))


def run(args) -> int:
    from accel.planning.estimate import EstimateError, activations, estimate, load_spec

    if (args.batch_size is None) != (args.seq_len is None):
        raise UsageError("--batch_size and --seq_len: give both (the micro-batch per process and its tokens per "
                         "sample) to measure activations, or neither")
    start = time.perf_counter()
    try:
        dtypes = check_flags(args)
        result = estimate(load_spec(args.model), dtypes, args.num_processes, args.tp_size, args.pp_size,
                          args.sp_size, args.cp_size, args.ep_size)
        if args.batch_size is not None:
            result["activations"] = activations(args.model, args.batch_size, args.seq_len, args.mixed_precision,
                                                args.sp_size, args.cp_size)
    except EstimateError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result, time.perf_counter() - start))
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def render(result: dict, seconds: float, width: int | None = None) -> str:
    """The report as text: the tables as they are, the prose (the largest layer, how activations were measured, what
    is assumed) wrapped to `width` columns (default: `text_width()`)."""
    width = text_width() if width is None else width
    lines = [f"{result['model']}: {result['params']:,} parameters (built on the meta device in {seconds:.1f} s)", "",
             f"{'dtype':<10} {'weights':>12} {'largest layer':>14}  {'largest parameter':>18}"]
    for w in result["weights"]:
        lines.append(f"{w['dtype']:<10} {_size(w['total_bytes']):>12} {_size(w['largest_layer']['bytes']):>14}  "
                     f"{_size(w['largest_param']['bytes']):>18}")
    w = result["weights"][0]
    unit = w["largest_layer"]["name"]
    unit = "<root> (the parameters outside the repeated blocks: FSDP2's root unit)" if unit == "<root>" else unit
    lines += _wrapped(f"largest layer: {unit}; largest parameter: {w['largest_param']['name']}", width)
    t = result["training"]
    sequence = "".join(f" x {name} {t[f'{name}_size']}" for name in ("sp", "cp") if t.get(f"{name}_size", 1) > 1)
    lines += ["", f"Training with AdamW, per rank: {t['num_processes']} processes = dp {t['dp_size']} x "
                  f"tp {t['tp_size']} x pp {t['pp_size']}{sequence}" + (
                      " (ZeRO shards over dp x the sequence degree)" if sequence else ""),
              f"{'layout':<14} {'params':>11} {'grads':>11} {'optimizer':>11} {'master':>8} {'device':>11} "
              f"{'host':>11}"]
    for name, e in t["layouts"].items():
        lines.append(f"{name:<14} {_size(e['params_bytes']):>11} {_size(e['grads_bytes']):>11} "
                     f"{_size(e['optimizer_bytes']):>11} {_size(e['master_bytes']):>8} "
                     f"{_size(e['device_bytes']):>11} {_size(e['host_bytes']):>11}")
    a = result.get("activations")
    if a:
        degree = "".join(f", {name}_size {a[f'{name}_size']}" for name in ("sp", "cp") if a.get(f"{name}_size", 1) > 1)
        lines += ["", f"Activations of one training step, per process: micro-batch {a['batch_size']} x "
                      f"{a['seq_len']} tokens{degree}, mixed precision {a['mixed_precision']}"]
        for name in ("no", "full"):
            whole = a.get(f"one_process_{name}_checkpointing_bytes")
            lines.append(f"  {name + ' checkpointing:':<20}{_size(a[f'{name}_checkpointing_bytes']):>11}"
                         + (f"  (one process, whole sequence: {_size(whole)})" if whole is not None else ""))
        lines += _wrapped(f"measured by {a['method']}", width, indent="  ")
    lines += ["", *_wrapped("Assumed: " + result["assumptions"] + ".", width)]
    return "\n".join(lines)


MAX_WIDTH = 100  # prose lines wrap at the terminal's width, at most this (a wide terminal's lines stay readable)


def text_width() -> int:
    """The terminal's columns (100 when stdout is no terminal), at most MAX_WIDTH."""
    return max(40, min(shutil.get_terminal_size((MAX_WIDTH, 24)).columns, MAX_WIDTH))


def _wrapped(text: str, width: int, indent: str = "") -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False)
