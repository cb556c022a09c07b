"""What `accel plan` and `accel estimate-memory` read, checked where it enters, one place per kind: the numbers of
their flags (finite, in range), file paths, JSON files (UTF-8, parseable, not nested past reason), safetensors
headers and sharded indexes, transformers model configs and `accel plan --calibrate`'s calibration file.

A bad input is one `EstimateError` (the CLI prints it as one line, exit code 2) naming the flag or the file (and
its key or tensor), the bad value and what is allowed. Torch-free, so the estimator and the planner import it
first.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any


class EstimateError(ValueError):
    """A model that cannot be read, a bad flag or file, or degrees that do not fit: one line for the user."""


MAX_COUNT = 2 ** 31 - 1  # batch sizes, sequence lengths, --top, --steps: far beyond any real run
MAX_JSON_BYTES = 100_000_000  # a config, an index or a calibration file (safetensors' own header limit)
MAX_SHOWN = 60  # characters of a bad value an error repeats


def show(value: Any) -> str:
    """A bad value as an error repeats it: strings quoted, anything long cut."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN - 3]}..."


def json_kind(value: Any) -> str:
    """A JSON value's kind as JSON names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__)


def _bad(flag: str, value: Any, allowed: str, problem: str = "bad value") -> EstimateError:
    """A flag's error: `--flag VALUE: problem; allowed: ...`."""
    return EstimateError(f"{flag} {show(value)}: {problem}; allowed: {allowed}")


def _bad_key(where: str, value: Any, allowed: str, problem: str = "bad value") -> EstimateError:
    """A file's error: `file: key 'k': problem VALUE; allowed: ...`."""
    return EstimateError(f"{where}: {problem} {show(value)}; allowed: {allowed}")


# -- flags ------------------------------------------------------------------------------------------------------
def integer(flag: str, value: Any, lo: int = 1, hi: int = MAX_COUNT) -> int:
    """`value` (a flag's text, or an int default) as an integer in [lo, hi]."""
    allowed = f"an integer from {lo} to {hi}"
    number = value
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            raise _bad(flag, value, allowed, "not an integer") from None
    if isinstance(number, bool) or not isinstance(number, int) or not lo <= number <= hi:
        raise _bad(flag, number, allowed)
    return number


def number(flag: str, value: Any, lo: float, hi: float) -> float:
    """`value` as a finite number from lo to hi: no nan, no infinity, nothing so small or large that the plan's
    figures built on it would overflow."""
    allowed = f"a number from {lo:g} to {hi:g}"
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        raise _bad(flag, value, allowed, "not a number") from None
    if not (math.isfinite(x) and lo <= x <= hi):
        raise _bad(flag, value, allowed)
    return x


def names(flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated list flag: at least one name, each one of `allowed` (repeats dropped)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    choice = f"comma-separated names of {', '.join(allowed)}"
    if not items:
        raise _bad(flag, text, choice, "no name given")
    for item in items:
        if item not in allowed:
            raise EstimateError(f"{flag}: bad value {show(item)}; allowed: {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def path_text(what: str, text: str) -> str:
    """A file or folder name from the command line: not empty, no NUL byte (the OS cannot name it)."""
    if not text or "\x00" in text:
        raise _bad(what, text, "a file or folder name (not empty, no NUL character)")
    return text


def kind_of(path: Path) -> str | None:
    """"file", "dir" or None (missing, or a name the OS refuses: too long, a NUL byte)."""
    try:
        return "dir" if path.is_dir() else "file" if path.is_file() else None
    except (OSError, ValueError):
        return None


# -- JSON files -------------------------------------------------------------------------------------------------
def decode_json(raw: bytes, where: str, what: str) -> Any:
    """`raw` as UTF-8 JSON; an error names `where` and says `what` was expected."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EstimateError(f"{where}: not UTF-8 (byte {exc.start}); allowed: {what}, as UTF-8 JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise EstimateError(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                            f"allowed: {what}") from None
    except RecursionError:
        raise EstimateError(f"{where}: JSON nested too deeply; allowed: {what}") from None


def read_json(path: Path, what: str) -> Any:
    """The JSON in file `path` (at most MAX_JSON_BYTES)."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise EstimateError(f"{path}: {path.stat().st_size} bytes; allowed: {what} of at most "
                                f"{MAX_JSON_BYTES} bytes")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise EstimateError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise EstimateError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    return decode_json(raw, str(path), what)


# -- safetensors ------------------------------------------------------------------------------------------------
# bits per element of every dtype the safetensors format names
SAFETENSORS_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U64": 64,
                    "U32": 32, "U16": 16, "U8": 8, "BOOL": 8, "C64": 64, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2": 8,
                    "F8_E5M2FNUZ": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}
SAFETENSORS_FORMAT = "a safetensors file (an 8-byte little-endian header length, a JSON header, the data)"
MAX_DIMS = 64


def safetensors_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, checked against the format: the header
    length within the file, a UTF-8 JSON object, each tensor's dtype, shape and data_offsets (inside the data,
    as many bytes as dtype and shape need), `__metadata__` an object."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise EstimateError(f"{file}: {size} bytes, shorter than the header length; allowed: "
                                    f"{SAFETENSORS_FORMAT}")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, MAX_JSON_BYTES):
                raise EstimateError(f"{file}: header length {length} exceeds the {size - 8} bytes after it (or "
                                    f"{MAX_JSON_BYTES}); allowed: {SAFETENSORS_FORMAT}")
            raw = f.read(length)
    except FileNotFoundError:
        raise EstimateError(f"{file}: no such file") from None
    except (OSError, ValueError) as exc:
        if isinstance(exc, EstimateError):
            raise
        raise EstimateError(f"{file}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    header = decode_json(raw, f"{file}: header", SAFETENSORS_FORMAT)
    if not isinstance(header, dict):
        raise EstimateError(f"{file}: the header is {json_kind(header)}; allowed: an object of tensors, "
                            "as in " + SAFETENSORS_FORMAT)
    data = size - 8 - length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise EstimateError(f"{file}: __metadata__ {show(info)}: bad value; allowed: an object of strings")
            continue
        tensors[name] = _tensor_entry(file, name, info, data)
    return tensors


def _tensor_entry(file: Path, name: str, info: Any, data: int) -> tuple[str, tuple[int, ...]]:
    where = f"{file}: tensor {show(name)}"
    if not isinstance(info, dict):
        raise _bad_key(where, info, 'an object {"dtype", "shape", "data_offsets"}')
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
        raise _bad_key(f"{where}: dtype", dtype, ", ".join(SAFETENSORS_BITS))
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise _bad_key(f"{where}: shape", shape, f"a list of at most {MAX_DIMS} integers >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data):
        raise _bad_key(f"{where}: data_offsets", offsets, f"[begin, end] with 0 <= begin <= end <= {data}, the file's "
                                                      "data bytes")
    bits, stored = SAFETENSORS_BITS[dtype] * math.prod(shape), (offsets[1] - offsets[0]) * 8
    if (stored != bits) if SAFETENSORS_BITS[dtype] % 8 == 0 else not bits <= stored < bits + 8 * max(1, len(shape)):
        raise EstimateError(f"{where}: data_offsets {offsets} hold {stored // 8} bytes; allowed: the "
                            f"{-(-bits // 8)} bytes its dtype {dtype} and shape {shape} need")
    return dtype, tuple(shape)


def safetensors_index(index: Path) -> list[Path]:
    """The shard files a `*.safetensors.index.json` names (its "weight_map": tensor name -> file in its folder)."""
    what = 'a safetensors index: a JSON object with "weight_map": {tensor name: shard file name}'
    data = read_json(index, what)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise EstimateError(f"{index}: no \"weight_map\" object; allowed: {what}")
    files = []
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or "\x00" in file:
            raise _bad_key(f"{index}: weight_map {show(name)}", file, "the name of a shard file in the index's folder")
        files.append(file)
    for file in sorted(set(files)):
        if kind_of(index.parent / file) != "file":
            raise EstimateError(f"{index}: weight_map names {show(file)}, which is not a file in {index.parent}; "
                                "allowed: the shard files beside the index")
    return [index.parent / f for f in sorted(set(files))]


# -- transformers model configs ------------------------------------------------------------------------------------
MAX_LAYERS = 1024  # every model built on the meta device takes time per layer; no real model has this many
MAX_WIDTH = 2 ** 24  # hidden sizes, heads, vocabularies, positions, experts
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers")
WIDTH_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "head_dim", "max_position_embeddings", "n_embd", "n_head", "n_inner", "n_positions", "n_ctx", "d_model",
              "d_ff", "d_kv", "ffn_dim", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
              "encoder_ffn_dim", "decoder_ffn_dim", "num_local_experts", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim")
CONFIG_FORMAT = "a transformers config.json: a JSON object with model_type and the model's sizes"


def model_config(file: Path, config_classes) -> dict:
    """The JSON object of a transformers config file: its model_type one of `config_classes` (model type ->
    config class, transformers' CONFIG_MAPPING), its sizes integers in range (null where transformers allows
    it), no key naming one of the config class's methods. What transformers then refuses is reported where the
    model is built."""
    data = read_json(file, CONFIG_FORMAT)
    if not isinstance(data, dict):
        raise EstimateError(f"{file}: {json_kind(data)}, not an object; allowed: {CONFIG_FORMAT}")
    model_type = data.get("model_type")
    if model_type is None:
        raise EstimateError(f"{file}: key 'model_type' missing; allowed: {CONFIG_FORMAT}")
    if not isinstance(model_type, str) or model_type not in config_classes:
        raise _bad_key(f"{file}: key 'model_type'", model_type, "a model type transformers knows, e.g. llama, gpt2")
    check_config_sizes(data, str(file))
    config_class = config_classes[model_type]
    for key in data:
        if callable(getattr(config_class, key, None)):
            raise EstimateError(f"{file}: key {show(key)} names a method of {config_class.__name__}; allowed: the "
                                "model's settings")
    return data


def check_config_sizes(data: dict, where: str, prefix: str = "") -> None:
    """The size keys of a config (and of its sub-configs, e.g. text_config): null or an integer in range."""
    for key, value in data.items():
        if key.startswith("__"):
            raise EstimateError(f"{where}: key '{prefix}{key}': not a config key; allowed: the model's settings")
        hi = MAX_LAYERS if key in LAYER_KEYS else MAX_WIDTH if key in WIDTH_KEYS else None
        if hi is not None and value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi):
            raise _bad_key(f"{where}: key '{prefix}{key}'", value, f"an integer from 1 to {hi} (or null)")
        if isinstance(value, dict) and key.endswith("_config"):
            check_config_sizes(value, where, f"{prefix}{key}.")


# -- `accel plan --calibrate`'s file -------------------------------------------------------------------------------
# key -> (lowest, highest), both allowed; null is allowed for all but flops (not measured). Rates are per second
# (FLOP, bytes), times seconds: the lowest rates keep every time the plan derives from them finite
CALIBRATION_NUMBERS = {
    "flops": (1e3, 1e21), "tokens_half": (0.0, 1e12), "width_half": (0.0, 1e12), "memory_bandwidth": (1.0, 1e18),
    "op_overhead": (0.0, 3600.0), "intra_bandwidth": (1.0, 1e18), "intra_latency": (0.0, 3600.0),
    "gather_factor": (1e-6, 1e6), "scatter_factor": (1e-6, 1e6), "overlap": (0.0, 1.0), "sync_fixed": (0.0, 3600.0),
    "sync_slowdown": (0.0, 1e6), "fsdp_call": (0.0, 3600.0), "tp_call": (0.0, 3600.0),
}
CALIBRATION_PAIRS = (("gather_factor", "scatter_factor"), ("sync_fixed", "sync_slowdown"), ("fsdp_call", "tp_call"))
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
CALIBRATION_FORMAT = "a file written by accel plan --calibrate (run it again, or delete the file)"


def calibration(data: Any, path: Path) -> dict:
    """A calibration record's figures checked: each a finite number in range (or null), paired figures given
    together, run_ahead true/false, the timed collectives [[bytes, seconds], ...] at two or more sizes."""
    if not isinstance(data, dict):
        raise EstimateError(f"{path}: {json_kind(data)}, not an object; allowed: {CALIBRATION_FORMAT}")
    if data.get("flops") is None:
        raise EstimateError(f"{path}: key 'flops' missing; allowed: {CALIBRATION_FORMAT}")
    for key, (lo, hi) in CALIBRATION_NUMBERS.items():
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or not lo <= value <= hi):
            raise _bad_key(f"{path}: key '{key}'", value, f"a number from {lo:g} to {hi:g} (or null); "
                                                           f"{CALIBRATION_FORMAT}")
    for first, second in CALIBRATION_PAIRS:
        if (data.get(first) is None) != (data.get(second) is None):
            raise EstimateError(f"{path}: keys '{first}' and '{second}': one is missing; allowed: both or neither "
                                f"({CALIBRATION_FORMAT})")
    if data.get("run_ahead") is not None and not isinstance(data["run_ahead"], bool):
        raise _bad_key(f"{path}: key 'run_ahead'", data["run_ahead"], "true, false or null")
    for key in ("device",):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise _bad_key(f"{path}: key '{key}'", data[key], "a name (a string) or null")
    collectives = data.get("collectives")
    if collectives is not None:
        if not isinstance(collectives, dict):
            raise _bad_key(f"{path}: key 'collectives'", collectives, "an object {kind: [[bytes, seconds], ...]}")
        for kind in COLLECTIVE_KINDS:
            if collectives.get(kind) is not None:
                _timings(collectives[kind], f"{path}: key 'collectives.{kind}'")
    return data


def _timings(points: Any, where: str) -> None:
    allowed = ("a list of [bytes, seconds] pairs at two or more different sizes, bytes from 1 to 1e18, seconds > 0 "
               "and at most 3600")
    if not isinstance(points, list) or len(points) < 2 or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        for v in p)
            and 1 <= p[0] <= 1e18 and 0 < p[1] <= 3600 for p in points):
        raise _bad_key(where, points, allowed)
    if len({p[0] for p in points}) != len(points):
        raise _bad_key(where, points, allowed, "a size given twice in")
