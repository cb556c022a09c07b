"""Checks of a training-state checkpoint before anything live changes: the manifest's fields and tensor specs, the
state/ files' safetensors headers against them, the optimizer types and the backends' parameter layouts.

A damaged or foreign checkpoint is one CheckpointError naming the file; `accel merge-weights` runs the same checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
import os
from pathlib import Path
from typing import Any, cast

import torch

from accel.checkpoint import layout, tree
from accel.checkpoint.backend_view import CheckpointBackend
from accel.checkpoint.layout import CheckpointError
from accel.core.safe_json import JSONFileError, parse_json
from accel.checkpoint.rank_agreement import first_cause
from accel.checkpoint.run_state import _optimizer_type


def _check_optimizer_fits(manifest_path: Path, i: int, saved: dict, optimizer) -> None:
    """An optimizer's saved state fits the prepared optimizer: the same type (when the checkpoint names it), as many
    parameter groups (their parameters may be split otherwise: pipeline stages), and no hyper-parameter the prepared
    one does not know (AdamW's state loaded into SGD would load, then fail at the first step with KeyError
    'momentum')."""
    where = f"{manifest_path}: optimizer {i}"
    saved_type, live_type = saved.get("accel_type"), _optimizer_type(optimizer)
    if saved_type is not None and saved_type != live_type:
        raise CheckpointError(f"{where} was saved from a {saved_type}, the prepared one is a {live_type}; "
                              "prepare the optimizer type the checkpoint was saved with")
    groups, live = saved.get("param_groups") or [], optimizer.param_groups
    if len(groups) != len(live):
        raise CheckpointError(f"{where} has {len(groups)} parameter group(s), the prepared one {len(live)}; prepare "
                              "the same parameter groups the checkpoint was saved with")
    for g, (group, mine) in enumerate(zip(groups, live, strict=True)):
        unknown = sorted(set(group) - set(mine) - {"params"})
        if unknown:
            raise CheckpointError(f"{where}, parameter group {g} has hyper-parameters {unknown} the prepared "
                                  f"{live_type.rsplit('.', 1)[-1]} does not know; prepare the optimizer type the "
                                  "checkpoint was saved with")


# -- checking a checkpoint before loading it ----------------------------------------------------------------

_PARTS = ("models", "optimizers", "schedulers", "dataloaders", "custom")
# torch dtype name -> safetensors dtype code: the dtypes a checkpoint may hold
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
           "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
           "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64"}
_ITEM_BYTES = {code: getattr(torch, name).itemsize for name, code in _DTYPES.items()}
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _checked_manifest(path: Path, manifest: dict) -> tuple[dict, dict]:
    """The tensor specs (dtypes from the allowed set, shapes lists of sizes) and aliases of a manifest whose every
    other field has the type save_state writes; every non-tensor value decodes."""
    skeleton = manifest.get("skeleton")
    if not isinstance(skeleton, dict) or not all(isinstance(skeleton.get(k), list) for k in _PARTS):
        raise CheckpointError(f"{path}: damaged (its skeleton needs lists {', '.join(_PARTS)})")
    fields: tuple[tuple[str, Any, str, Any], ...]  # name, type(s), what is allowed, default
    fields = (("world_size", int, "an integer >= 1", None), ("step", int, "an integer", 0),
              ("aliases", dict, "a mapping", {}), ("layouts", (list, type(None)), "a list", None),
              ("trackers", (dict, type(None)), "a mapping", None))
    for name, kind, allowed, default in fields:  # the defaults: what checkpoints of older accels lack
        value = manifest.setdefault(name, default)
        if not isinstance(value, kind) or isinstance(value, bool) or (name == "world_size" and cast(int, value) < 1):
            raise CheckpointError(f"{path}: damaged ({name} is {value!r}; allowed: {allowed})")
    try:
        specs = tree.tensor_specs(skeleton)
        tree.join(skeleton, {}, ("skeleton",))  # every JSON value decodes (tuples, numpy arrays, non-finite floats)
    except tree.BadTree as exc:
        raise CheckpointError(f"{path}: damaged ({exc})") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: damaged ({first_cause(exc)})") from None
    for key, (shape, dtype) in specs.items():
        if not isinstance(key, str) or not isinstance(dtype, str) or dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {key}: dtype {dtype!r}; allowed: {', '.join(_DTYPES)}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise CheckpointError(f"{path}: tensor {key}: shape {shape!r}; allowed: a list of sizes >= 0")
    aliases = manifest["aliases"]
    for key, original in aliases.items():
        if key not in specs or original not in specs or original in aliases:
            raise CheckpointError(f"{path}: damaged (alias {key!r} -> {original!r} names no saved tensor)")
    return specs, aliases


def _check_state_files(folder: Path, manifest: dict, specs: dict, aliases: dict, opened: Any = None) -> None:
    """state/ holds only the files the manifest lists (DCP reads every file there), and their safetensors
    headers hold every tensor of the manifest with its dtype and whole shape, inside the files' sizes (each read
    through a checked descriptor: `opened`, the load's record)."""
    state, path = folder / "state", folder / layout.MANIFEST
    listed = {rel: size for rel, size in manifest["files"].items() if rel.startswith("state/")}
    if not listed and not specs:
        return
    if not state.is_dir():
        raise CheckpointError(f"{state}: missing or not a folder; {folder} is not a complete accel checkpoint")
    for entry in sorted(os.listdir(state)):
        if f"state/{entry}" not in listed:
            raise CheckpointError(f"{state / entry}: not listed in {path}; a checkpoint's state/ holds only the "
                                  "files its manifest lists")
    chunks: dict[str, list] = {}
    opened = opened or layout.checked_files()
    for rel, size in listed.items():
        _read_header(folder / rel, size, chunks, opened)
    for key, (shape, dtype) in specs.items():
        if key not in aliases:
            _check_chunks(path, state, key, shape, dtype, chunks.get(key, []))


def _read_header(file: Path, size: int, chunks: dict, opened: Any = None) -> None:
    """Add the tensors a safetensors file's header lists to `chunks` (key -> [(dtype code, offsets, shape)]),
    after checking each lies inside the file with the bytes its dtype and shape need. The file is read through a
    descriptor checked to be a regular file of `size` bytes (the manifest's), never beyond it."""
    with (opened or layout.checked_files()).open(file, size=size) as checked:
        head = checked.read(0, min(8, size))
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{file}: damaged (not a safetensors file: header length {length}, file size {size})")
        try:
            header = parse_json(checked.read(8, length), "the header")
            sharding = parse_json((header.get("__metadata__") or {}).get("DCP_SHARDING_INFO") or "{}",
                                  "its DCP_SHARDING_INFO")
        except JSONFileError as exc:
            raise CheckpointError(f"{file}: damaged (header: {exc})") from None
        except (ValueError, AttributeError, TypeError) as exc:
            raise CheckpointError(f"{file}: damaged (header: {first_cause(exc)})") from None
    data_bytes = size - 8 - length
    spans = []  # each tensor's bytes, which no other tensor may share: the shapes a load allocates fit the file
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            offsets = (sharding.get(key) or {}).get("saved_offsets", [0] * len(shape))
            numbers = [*shape, *offsets, begin, end]
            valid = (code in _ITEM_BYTES and all(type(n) is int and n >= 0 for n in numbers)
                     and len(offsets) == len(shape) and begin <= end <= data_bytes
                     and end - begin == math.prod(shape) * _ITEM_BYTES[code])
        except (KeyError, TypeError, ValueError, AttributeError):
            valid = False
        if not valid:
            raise CheckpointError(f"{file}: damaged (tensor {key}: {str(info)[:200]})")
        chunks.setdefault(key, []).append((code, offsets, shape))
        spans.append((begin, end, key))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CheckpointError(f"{file}: damaged (tensors {first} and {second} share bytes; allowed: each tensor's "
                                  "own data_offsets)")


def _check_chunks(path: Path, state: Path, key: str, shape: list, dtype: str, found: list) -> None:
    """The pieces of one tensor in the files (one, or one per shard) have the manifest's dtype and together
    span its whole shape."""
    if not found:
        raise CheckpointError(f"{path}: tensor {key} is in no file of {state}")
    codes = sorted({code for code, _, _ in found})
    if codes != [_DTYPES[dtype]]:
        raise CheckpointError(f"{path}: tensor {key}: dtype {dtype}, but {state} holds it as {', '.join(codes)}")
    if any(len(piece) != len(shape) for _, _, piece in found):
        held = found[0][2]
    else:
        held = [max(offsets[d] + piece[d] for _, offsets, piece in found) for d in range(len(shape))]
    if held != shape or sum(math.prod(piece) for _, _, piece in found) < math.prod(shape):
        raise CheckpointError(f"{path}: tensor {key}: shape {shape}, but {state} holds {held}")


def _held_keys(backend: CheckpointBackend) -> Callable[[str], bool]:
    """Which checkpoint keys this process loads: model tensors (`/models/<i>/<name>`) and optimizer state
    (`/optimizers/<i>/state/<name>/...`) of the names the backend holds, everything else; the held names are
    asked once per load, also where no live tensor exists yet (ZeRO-1 off its first data-parallel rank)."""
    model_names, optimizer_names = backend.held_names(), backend.held_names(for_optimizer=True)

    def loads(key: str) -> bool:
        parts = key.split("/")
        if parts[1] == "models" and model_names is not None:
            return "/".join(parts[3:]) in model_names
        if parts[1] == "optimizers" and len(parts) > 4 and parts[3] == "state" and optimizer_names is not None:
            return parts[4] in optimizer_names
        return True

    return loads


def _check_layouts(folder: Path, saved: list[dict], backend: CheckpointBackend, models: list) -> None:
    """A parameter held in a backend's own layout (TP's reordered fused q/k/v) is only resumed into the same
    layout: loading it into another would scramble it silently."""
    for model, before in zip(models, saved, strict=False):
        now = backend.checkpoint_layouts(model)
        mine = {name for name, _ in backend.unwrap_model(model).named_parameters()}  # without DDP's prefix
        for name in sorted((set(now) | set(before)) & mine):
            if now.get(name) != before.get(name):
                raise CheckpointError(
                    f"{folder}: {name}: saved {before.get(name, 'in the model order')}, but this run holds it "
                    f"{now.get(name, 'in the model order')}; resume with the parallelism it was saved with "
                    "(save_model's weights, in the model order, load under any)")
