"""`accel plan MODEL`: enumerate data-parallel x ZeRO x TP x PP x sequence/context-parallel x offload x
activation-checkpointing layouts for a model, a global batch and sequence length on the given hardware, drop those
that do not fit, rank the rest by estimated step time and explain the choice in the seed's decision-tree terms.
Sequence (--sp_size, Ulysses) and context (--cp_size) parallelism are planned at the degree given, or, left out,
for long sequences (--seq_len 16384 and more). Expert parallelism (--ep_size) is planned for mixture-of-experts
models; --pp_schedule picks the pipeline layouts' schedule (default 1F1B).

`--json` prints {"layouts": [{"zero_stage", "tp_size", "pp_size", "sp_size", "cp_size", "dp_size", "offload",
"activation_checkpointing", "micro_batches", "model_state_bytes_per_rank", "memory_per_rank_bytes", "fits",
"step_time_s", ...}], "recommended": <index or null>, "explanation": [...], ...}. `--write cfg.yaml` saves the
winner as an accel config for `accel launch --config_file cfg.yaml train.py`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

from accel.cli._common import UsageError, add_flag
from accel.cli.estimate import add_model_argument

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30,
          "TIB": 2 ** 40}
MAX_MEMORY = 1e18  # bytes of one device or machine: an exabyte
MAX_PROCESSES = 1024  # devices per machine
MAX_MACHINES = 1024


def memory_size(text: str, flag: str, zero_ok: bool = False) -> float:
    """'80GB', '80GiB', '16e9' (bytes) or a number of GB, as bytes: finite, > 0 (>= 0 with `zero_ok`) and at most
    MAX_MEMORY."""
    from accel.planning.inputs import show

    allowed = (f"a size like 80GB or 80GiB (a bare number: GB), from {0 if zero_ok else 1} to {MAX_MEMORY:g} "
               "bytes")
    match = _SIZE.match(text)
    try:
        value = float(match.group(1)) * _UNITS[(match.group(2) or "GB").upper()] if match else float(text)
    except ValueError:
        raise UsageError(f"{flag} {show(text)}: not a size; allowed: {allowed}") from None
    if not (math.isfinite(value) and (0 if zero_ok else 1) <= value <= MAX_MEMORY):
        raise UsageError(f"{flag} {show(text)}: bad value; allowed: {allowed}")
    return value


def check_flags(args) -> None:
    """Every value flag, checked before anything is read or built (accel.planning.inputs): integers and
    numbers finite and in range, file names nameable; `args` gets the parsed values."""
    from accel.planning import inputs

    args.batch_size = inputs.integer("--batch_size", args.batch_size)
    args.seq_len = inputs.integer("--seq_len", args.seq_len)
    args.num_machines = inputs.integer("--num_machines", args.num_machines, hi=MAX_MACHINES)
    args.steps = inputs.integer("--steps", args.steps, lo=2)
    if args.num_processes is not None:
        args.num_processes = inputs.integer("--num_processes", args.num_processes, hi=MAX_PROCESSES)
    for name in ("sp_size", "cp_size", "ep_size"):
        if getattr(args, name) is not None:
            setattr(args, name, inputs.integer(f"--{name}", getattr(args, name), hi=MAX_PROCESSES * MAX_MACHINES))
    if args.top is not None:
        args.top = inputs.integer("--top", args.top)
    if args.device_memory is not None:  # bytes from here on
        args.device_memory = memory_size(args.device_memory, "--device_memory")
    if args.host_memory is not None:
        args.host_memory = memory_size(args.host_memory, "--host_memory", zero_ok=True)
    for name, lo in (("intra_bandwidth", 1e-9), ("inter_bandwidth", 1e-9), ("flops", 1e-9)):  # GB/s, TFLOP/s
        if getattr(args, name) is not None:
            setattr(args, name, inputs.number(f"--{name}", getattr(args, name), lo, 1e9))
    for name in ("write", "calibration"):
        if getattr(args, name) is not None:
            inputs.path_text(f"--{name}", getattr(args, name))
    if args.write is not None and inputs.kind_of(Path(args.write).expanduser()) == "dir":
        raise inputs.EstimateError(f"--write {inputs.show(args.write)}: a folder; allowed: the path of the config "
                                   "file to write")


def register(subparsers) -> argparse.ArgumentParser:
    from accel.config.schema import PP_SCHEDULES
    from accel.planning.devices import DEVICES

    parser = subparsers.add_parser(
        "plan", help="pick a parallel layout for a model on your hardware (estimates, no memory used)",
        description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    model_arg = next(a for a in parser._actions if a.dest == "model")
    model_arg.nargs, model_arg.required = "?", False  # `accel plan --calibrate` needs no model
    add_flag(parser, "batch_size", default=8,
             help="GLOBAL batch: samples per optimizer step over all processes (default %(default)s)")
    add_flag(parser, "seq_len", default=1024,
             help="tokens per sample (default %(default)s; from 16384, sequence/context parallelism are planned too)")
    add_flag(parser, "sp_size", default=None,
             help="plan every layout with this sequence-parallel degree (Ulysses; 1: none)")
    add_flag(parser, "cp_size", default=None,
             help="plan every layout with this context-parallel degree (1: none)")
    add_flag(parser, "ep_size", default=None,
             help="plan every layout with this expert-parallel degree (mixture-of-experts models; default: each "
                  "that divides the experts and dp)")
    add_flag(parser, "pp_schedule", default="1F1B", choices=PP_SCHEDULES,
             help="the pipeline layouts' schedule (default %(default)s; the split-backward ones, "
                  "InterleavedZeroBubble, ZBVZeroBubble and DualPipeV, only without data parallelism)")
    add_flag(parser, "num_processes", default=None, help="processes (devices) per machine (default 1)")
    add_flag(parser, "num_machines", default=1, help="machines (default 1)")
    add_flag(parser, "device_memory", default=None, help="memory per device, e.g. 80GB (default 80GB)")
    add_flag(parser, "host_memory", default=None, help="host memory per machine for offload (default 1024GB)")
    add_flag(parser, "intra_bandwidth", default=None,
             help="GB/s per device within a machine (default 150)")
    add_flag(parser, "inter_bandwidth", default=None,
             help="GB/s per device between machines (default 25)")
    add_flag(parser, "flops", default=None, help="peak TFLOP/s per device (default 312, A100 bf16)")
    add_flag(parser, "mixed_precision", default="bf16", choices=("no", "fp16", "bf16", "fp8"),
             help="the run's mixed precision (default %(default)s; fp8: the blocks' linears in float8, torchao)")
    add_flag(parser, "device", default=None, choices=tuple(DEVICES),
             help="a GPU's datasheet figures (peak bf16/fp8 FLOP/s, memory, bandwidths); the flags above override "
                  "each")
    add_flag(parser, "compile", action="store_true",
             help="the blocks run under torch.compile (fused memory-bound work); written with --write")
    add_flag(parser, "detect", action="store_true", help="read this machine's GPUs (else CPU cores and RAM)")
    add_flag(parser, "top", default=None,
             help="layouts to print (default 10); with --measure: layouts to run (default 3)")
    add_flag(parser, "write", default=None, help="save the recommended layout as an accel config file")
    add_flag(parser, "main_process_ip", default=None, help="with --write on several machines: machine 0's address")
    add_flag(parser, "activations", default="formula", choices=("formula", "measured"),
             help="formula: Korthikanti et al.'s per-layer formula (default); measured: scale it to accel "
                  "estimate-memory's fake-tensor run of the model (not for safetensors checkpoints)")
    add_flag(parser, "steps", default=5, help="with --measure: optimizer steps per layout (default 5)")
    add_flag(parser, "calibrate", action="store_true",
             help="measure this machine's matmul rate and all_reduce bandwidth and store them for later plans")
    add_flag(parser, "calibration", default=None,
             help="calibration file to write/read (default $XDG_CACHE_HOME/accel/calibration.json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--measure", nargs=argparse.REMAINDER, default=None, metavar="SCRIPT [ARGS]",
                        help="last flag: run the best layouts for --steps optimizer steps each with SCRIPT ARGS "
                             "on this machine and pick the fastest that runs")
    parser.set_defaults(func=run)
    return parser


def hardware(args):
    """The hardware a plan is for, from the flags `check_flags` parsed (memory sizes in bytes)."""
    from accel.planning.devices import device
    from accel.planning.plan import GB, Hardware, detect

    hw = detect() if args.detect else device(args.device).hardware(1) if args.device else Hardware()
    if args.num_processes is not None:
        hw.num_processes = args.num_processes
    hw.num_machines = args.num_machines
    if args.device_memory is not None:
        hw.device_memory = args.device_memory
    if args.host_memory is not None:
        hw.host_memory = args.host_memory
    if args.intra_bandwidth is not None:
        hw.intra_bw = args.intra_bandwidth * GB
    if args.inter_bandwidth is not None:
        hw.inter_bw = args.inter_bandwidth * GB
    if args.flops is not None:
        hw.flops = args.flops * 1e12
    return hw


def apply_calibration(args, hw) -> str | None:
    """Stored calibration figures as defaults for --flops/--intra_bandwidth the user did not give; a line
    saying so, or None."""
    from accel.planning.plan import apply_calibration as apply
    from accel.planning.measure import load_calibration

    if args.device and args.calibration is None:
        return None  # a preset describes other hardware than this machine's stored figures
    cal = load_calibration(args.calibration)
    if cal is None:
        return None
    used = apply(hw, cal, compute=args.flops is None, links=args.intra_bandwidth is None)
    return f"Calibration {cal['path']} ({cal.get('device')}): {', '.join(used)}." if used else None


def run(args) -> int:
    from accel.planning.estimate import EstimateError
    from accel.planning.plan import Recipe, plan, write_config

    start = time.perf_counter()
    try:
        check_flags(args)
    except EstimateError as exc:
        raise UsageError(str(exc)) from None
    if args.calibrate:
        return calibrate(args)
    if args.model is None:
        raise UsageError("MODEL missing; allowed: a transformers config, module:callable or "
                         "safetensors checkpoint (or --calibrate alone)")
    try:
        hw = hardware(args)
        calibration = apply_calibration(args, hw)
        spec, module = model(args.model)
        result = plan(spec, hw, args.batch_size, args.seq_len, args.mixed_precision, module=module,
                      measure_activations=args.activations == "measured", sp_size=args.sp_size,
                      cp_size=args.cp_size, ep_size=args.ep_size, pp_schedule=args.pp_schedule,
                      recipe=Recipe(compile=args.compile))
        if calibration:
            result["calibration"] = calibration
        if args.measure is not None:
            result = measure(args, result)
        if args.write:
            result["written"] = str(write_config(result, args.write, args.main_process_ip))
    except EstimateError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"--write {args.write}: cannot write ({exc.strerror or exc})") from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result, args.top or 10, time.perf_counter() - start))
    return 0


def model(name: str):
    """(ModelSpec, the module on the meta device or None): the module when MODEL has code (a transformers config
    or module:callable; a safetensors checkpoint has only headers), for its config's sizes and --activations
    measured."""
    from accel.planning import estimate

    if estimate.is_checkpoint(Path(name)):
        return estimate.load_spec(name), None
    module = estimate.load_module(name)
    return estimate.spec_from_module(module, name), module


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2 ** 30:.3g}"  # 3 digits: a small model's 0.00319, not 0.0


def render(result: dict, top: int, seconds: float) -> str:
    hw = result["hardware"]
    lines = [f"{result['model']}: {result['params']:,} parameters; batch {result['batch_size']} x seq "
             f"{result['seq_len']} on {hw['num_machines']} machine(s) x {hw['num_processes']} device(s) of "
             f"{hw['device_memory'] / 2 ** 30:.3g} GiB (planned in {seconds:.1f} s)", "",
             f"{'#':>3} {'zero':>4} {'tp':>3} {'pp':>3} {'seq':>4} {'ep':>3} {'dp':>4} {'offl':>4} {'ckpt':>4} "
             f"{'mb':>3} "
             f"{'states GiB':>10} {'peak GiB':>9} {'fits':>4} {'step s':>9}"]
    for i, r in enumerate(result["layouts"][:top]):
        step = "-" if r["step_time_s"] is None else f"{r['step_time_s']:.3g}"
        seq = next((f"{name}{r[name + '_size']}" for name in ("sp", "cp") if r.get(name + "_size", 1) > 1), "-")
        lines.append(f"{i:>3} {r['zero_stage']:>4} {r['tp_size']:>3} {r['pp_size']:>3} {seq:>4} "
                     f"{r.get('ep_size', 1):>3} {r['dp_size']:>4} "
                     f"{'yes' if r['offload'] else 'no':>4} {r['activation_checkpointing']:>4} "
                     f"{r['micro_batches']:>3} {_gib(r['model_state_bytes_per_rank']):>10} "
                     f"{_gib(r['memory_per_rank_bytes']):>9} {'yes' if r['fits'] else 'no':>4} {step:>9}")
    lines += ["", *result["explanation"], f"Activations: {result['activation_method']}."]
    if result.get("calibration"):
        lines.append(result["calibration"])
    if "measured" in result:
        lines += ["", *render_measured(result)]
    if result.get("written"):
        lines.append(f"Saved to {result['written']}: accel launch --config_file {result['written']} train.py")
    return "\n".join(lines)


def calibrate(args) -> int:
    from accel.planning.measure import calibrate as run_calibration

    try:
        data = run_calibration(args.calibration)
    except OSError as exc:
        raise UsageError(f"--calibration {args.calibration}: cannot write ({exc.strerror or exc})") from None
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rates = ", ".join(f"{k} {v:.2f}" for k, v in data["matmul_tflops"].items())
    bw = data["intra_bandwidth"]
    print(f"Matmul on {data['device']}: {rates} TFLOP/s; all_reduce (2 processes): "
          + (f"{bw / 1e9:.2f} GB/s" if bw else "not measured (one device)") + f". Saved to {data['path']}; "
          "accel plan uses these when --flops/--intra_bandwidth are not given.")
    return 0


def measure(args, result: dict) -> dict:
    from accel.planning.plan import PlanError
    from accel.planning.measure import measure as run_measure

    if not args.measure:
        raise UsageError("--measure: missing the script; allowed: --measure train.py [script args] as the last flag")
    script = Path(args.measure[0])
    if not script.is_file():
        raise UsageError(f"--measure: script {str(script)!r} not found")
    if result["hardware"]["num_machines"] != 1:
        raise PlanError("--measure runs on this machine only; allowed: --num_machines 1")
    top = 3 if args.top is None else args.top  # --top and --steps: checked with the other flags (check_flags)
    return run_measure(result, str(script), args.measure[1:], top, args.steps)


def _fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if unit == "s" else f"{value / 2 ** 20:.1f}"


def render_measured(result: dict) -> list[str]:
    lines = [f"Measured on this machine ({result['measured_steps']} optimizer steps each, warm-up excluded; "
             "memory per rank: the largest rank's):",
             f"{'#':>3} {'layout':<28} {'est s':>8} {'meas s':>8} {'est MiB':>9} {'meas MiB':>9}  memory"]
    for m in result["measured"]:
        row = result["layouts"][m["index"]]
        name = describe_short(row)
        if "measured_error" in m:
            lines.append(f"{m['index']:>3} {name:<28} {_fmt(row['step_time_s'], 's'):>8} {'failed':>8}  "
                         f"{m['measured_error']}")
            continue
        lines.append(f"{m['index']:>3} {name:<28} {_fmt(row['step_time_s'], 's'):>8} "
                     f"{_fmt(m['measured_step_time_s'], 's'):>8} {_fmt(row['memory_per_rank_bytes'], 'b'):>9} "
                     f"{_fmt(m['measured_memory_per_rank_bytes'], 'b'):>9}  {m['memory_kind']} "
                     f"(est. states {_fmt(row['model_state_bytes_per_rank'], 'b')} MiB)")
    best = result["measured_best"]
    lines.append("Picked by measurement: " + (f"#{best}, the fastest that ran." if best is not None else
                                              "none ran; the estimate's recommendation stands."))
    return lines


def describe_short(row: dict) -> str:
    from accel.planning.plan import layout_name

    return (f"{layout_name(row)} ac={row['activation_checkpointing']} mb={row['micro_batches']}")[:28]
