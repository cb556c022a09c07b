"""`accel merge-weights` / `merge_fsdp_weights`: one model file from a sharded checkpoint, on one process.

A sharded checkpoint is what several ranks wrote together with torch.distributed.checkpoint (DCP):

* accel's `save_state` folder (`accel_checkpoint.json` + `state/*.safetensors`; under ZeRO-3 / FSDP2 each rank
  wrote its own slices of every parameter), or its `state/` folder;
* a DCP folder of `__<rank>_<n>.distcp` files plus `.metadata` (Accelerate's FSDP `SHARDED_STATE_DICT`, e.g.
  `pytorch_model_fsdp_0`, or any `torch.distributed.checkpoint.save` with its default writer).

DCP's own planner rebuilds every full tensor from the saved metadata (no model, no process group needed) and the
result is written by `save_state_dict_sharded`: `model.safetensors` with every name of the model's state dict (a
tied weight under each of its names), atomically, loadable by `from_pretrained` / `load_state_dict`. accel never
pickles: `safe_serialization=False` (`--unsafe_serialization`) writes safetensors too, and says so once.

Accel's own `save_fsdp_model` (SHARDED_STATE_DICT) writes an accel checkpoint folder named `pytorch_model_fsdp_0`:
both forms are recognised by their files, not their names.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

DCP_METADATA = ".metadata"
ACCELERATE_FOLDERS = ("pytorch_model_fsdp_0", "optimizer_0")  # what Accelerate's save_state writes under FSDP
_warned_unsafe = False


class MergeError(ValueError):
    """A checkpoint folder that cannot be merged, or an output that cannot be written; one line naming the path.
    A ValueError, as Accelerate's `merge_fsdp_weights` raises for a missing folder."""


def merge_fsdp_weights(checkpoint_dir: str | os.PathLike, output_path: str | os.PathLike,
                       safe_serialization: bool = True, remove_checkpoint_dir: bool = False) -> Path | None:
    """Accelerate's `merge_fsdp_weights`: merge the sharded checkpoint `checkpoint_dir` into
    `output_path/model.safetensors`. In a distributed job every process calls it (as in Accelerate): the main one
    merges, the others wait for it and return None; a failure is the same one-line MergeError on every rank.
    `remove_checkpoint_dir`: delete the checkpoint once the merged file is in place (the whole save_state folder
    when given its `state/`: a manifest without its files would look like a complete checkpoint), renamed out of
    sight first (`layout.remove_folder`), so no reader sees it half-deleted."""
    from accel.checkpoint.layout import remove_folder

    checkpoint_dir = Path(checkpoint_dir)
    if not safe_serialization:
        _say_unsafe_once()
    written, error = None, None
    if _is_main_process():
        try:
            kind, folder = checkpoint_kind(checkpoint_dir)
            written = merge(kind, folder, Path(output_path))[0]
            if remove_checkpoint_dir:
                remove_folder(folder)
        except MergeError as exc:
            error = str(exc)
    error = _from_main(error)
    if error is not None:
        raise MergeError(error)
    return written


def _from_main(value):
    """The main process's `value` on every process of a job (the others wait for its merge); as is otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _say_unsafe_once() -> None:
    global _warned_unsafe
    if not _warned_unsafe:
        _warned_unsafe = True
        sys.stderr.write("accel merge-weights: --unsafe_serialization / safe_serialization=False: accel never "
                         "writes pickle files; model.safetensors is written instead of pytorch_model.bin\n")


def _is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# -------------------------------------------------------------------------------------------------------------
# what the folder is
# -------------------------------------------------------------------------------------------------------------

def checkpoint_kind(path: Path) -> tuple[str, Path]:
    """("dcp", folder) for a DCP folder with `.metadata`, ("accel", folder) for accel's save_state folder (also
    given as its `state/` subfolder); a MergeError saying what is allowed otherwise."""
    from accel.checkpoint.layout import MANIFEST

    if not path.exists():
        raise MergeError(f"checkpoint folder {path} not found{_accelerate_hint(path)}; allowed: a folder written by "
                         "accel's save_state or by torch.distributed.checkpoint (e.g. Accelerate's "
                         "pytorch_model_fsdp_0)")
    if not path.is_dir():
        raise MergeError(f"checkpoint {path} is a file, not a folder; allowed: a folder written by accel's save_state "
                         "or by torch.distributed.checkpoint (with a .metadata file)")
    # accel's manifest first: a `.metadata` dropped into a save_state folder (or its state/) is never read
    if (path / MANIFEST).is_file():
        return "accel", path
    if path.name == "state" and (path.parent / MANIFEST).is_file():
        return "accel", path.parent
    if (path / DCP_METADATA).is_file():
        return "dcp", path
    raise MergeError(f"{path} is not a sharded checkpoint: it has no {DCP_METADATA} (torch.distributed.checkpoint, "
                     f"Accelerate's SHARDED_STATE_DICT) and no {MANIFEST} (accel's save_state)"
                     f"{_accelerate_hint(path)}")


def _accelerate_hint(path: Path) -> str:
    """Accelerate's hint: the model / optimizer subfolders its save_state writes under FSDP."""
    found = [name for name in ACCELERATE_FOLDERS if (path / name / DCP_METADATA).is_file()]
    if not found:
        return ""
    return "; it holds " + " and ".join(str(path / name) for name in found) + ", pass one of those instead"


# -------------------------------------------------------------------------------------------------------------
# reading (DCP's planner rebuilds the full tensors) and writing
# -------------------------------------------------------------------------------------------------------------

def merge(kind: str, folder: Path, output: Path) -> list[Path]:
    """Write the merged model(s) of the checkpoint into `output`; the files written (model 0's first)."""
    if output.exists() and not output.is_dir():
        raise MergeError(f"output {output} is a file; allowed: a folder (created if missing) for model.safetensors")
    models = _accel_models(folder) if kind == "accel" else [_dcp_model(folder)]
    written: list[Path] = []
    for index, state in enumerate(models):
        target = output if index == 0 else output / f"model_{index}"  # a later model: its own loadable folder
        written += _write(state, target)
    return written


def _read_dcp(reader, planner) -> dict:
    import torch.distributed.checkpoint.format_utils as dcp_format
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    state: dict = {}
    root = logging.getLogger()  # DCP's loader logs a damaged file's traceback on the root logger: the error says it
    was_disabled, root.disabled = root.disabled, True
    try:
        dcp_format._load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:  # a damaged or truncated file; DCP's carries tracebacks
        first = next((line.strip() for line in reversed(str(exc).splitlines()) if line.strip()), type(exc).__name__)
        for refused in ("dcp_reader.MetadataError: ", "layout.CheckpointError: "):  # these name their file
            if refused in first:
                raise MergeError(f"cannot read the checkpoint: {first.split(refused, 1)[1]}") from None
        raise MergeError(f"cannot read the checkpoint in {reader.path}: {first}") from None
    finally:
        root.disabled = was_disabled
    return state


def _dcp_model(folder: Path) -> dict[str, torch.Tensor]:
    """A DCP folder's tensors; a single top-level entry (Accelerate's {"model": {...}}) is unwrapped. `.metadata`
    is read through dcp_reader's allow-list and checked against the folder's files first; non-tensor items (pickles
    torch would load with weights_only=False) are never read."""
    from accel.checkpoint.dcp_reader import MetadataError, SafeFileSystemReader, TensorsOnlyPlanner

    reader = SafeFileSystemReader(str(folder))
    try:
        metadata = reader.read_metadata()
    except MetadataError as exc:
        raise MergeError(f"cannot read the checkpoint: {exc}") from None
    state = _read_dcp(reader, TensorsOnlyPlanner())
    paths = metadata.planner_data or {}
    tops = {(paths.get(name) or (name,))[0] for name in metadata.state_dict_metadata}  # non-tensor entries too
    if len(state) == 1 and len(tops) == 1 and isinstance(next(iter(state.values())), dict):
        state = next(iter(state.values()))
    tensors = _flat_tensors(state, "")
    if not tensors:
        raise MergeError(f"{folder}: the checkpoint holds no tensors")
    return tensors


def _flat_tensors(tree, prefix: str) -> dict[str, torch.Tensor]:
    """Nested dicts flattened with dots (a state dict's own names); non-tensor entries are not weights."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, dict):
            out.update(_flat_tensors(value, name))
    return out


def _models_only_planner():
    """DCP's metadata-rebuilding planner, reading only the models' tensors of an accel checkpoint (not the
    optimizer's state, which would triple the memory)."""
    from accel.checkpoint.dcp_reader import TensorsOnlyPlanner

    return TensorsOnlyPlanner(keep=lambda key: key.startswith("/models/"))


def _check_manifest_shape(path: Path, manifest: dict) -> None:
    """The manifest holds what a merge reads in the shapes save_state writes it: the skeleton's models (parameter
    name -> {"__tensor__": key}), aliases (key -> key) and layouts; a manifest written by hand or by another tool is
    refused in one line instead of stopping the merge with a traceback."""
    allowed = "; allowed: the manifest accel's save_state writes (save the checkpoint again)"
    skeleton, aliases, layouts = manifest.get("skeleton", {}), manifest.get("aliases"), manifest.get("layouts")
    if not isinstance(skeleton, dict):
        raise MergeError(f"{path}: key 'skeleton': a {type(skeleton).__name__}, not an object{allowed}")
    models = skeleton.get("models")
    for index, spec in enumerate(models if isinstance(models, list) else []):
        if spec is not None and not isinstance(spec, dict):
            raise MergeError(f"{path}: key 'skeleton.models[{index}]': a {type(spec).__name__}, not an object{allowed}")
        for name, entry in (spec or {}).items():
            if isinstance(entry, dict) and "__tensor__" in entry and not isinstance(entry["__tensor__"], str):
                kind = type(entry["__tensor__"]).__name__
                raise MergeError(f"{path}: parameter {name!r}: its __tensor__ is a {kind}, not a tensor key{allowed}")
    if aliases is not None and not (isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values())):
        raise MergeError(f"{path}: key 'aliases': not an object of tensor keys{allowed}")
    if layouts is not None and not (isinstance(layouts, list)
                                    and all(isinstance(e, (dict, type(None))) for e in layouts)):
        raise MergeError(f"{path}: key 'layouts': not a list of objects{allowed}")


def _accel_models(folder: Path) -> list[dict[str, torch.Tensor]]:
    """Every model of an accel save_state checkpoint, by its parameter names, tied names sharing one tensor."""
    from accel.checkpoint.layout import MANIFEST, CheckpointError, checked_files, read_manifest

    opened = checked_files()  # every file is read through a checked descriptor, the one first checked
    try:
        manifest = read_manifest(folder, opened=opened)
    except CheckpointError as exc:
        raise MergeError(str(exc)) from None
    _check_manifest_shape(folder / MANIFEST, manifest)
    try:  # as load_state checks them: state/ holds only the listed files, whose headers span the manifest's shapes
        # (DCP's reader reads every .safetensors file there, and sizes a tensor from its pieces' offsets)
        from accel.checkpoint import state_checks

        checked_specs, checked_aliases = state_checks._checked_manifest(folder / MANIFEST, manifest)
        state_checks._check_state_files(folder, manifest, checked_specs, checked_aliases, opened)
    except CheckpointError as exc:
        raise MergeError(str(exc)) from None
    specs = manifest.get("skeleton", {}).get("models")
    if not isinstance(specs, list) or not specs:
        raise MergeError(f"{folder}: the checkpoint holds no model (nothing was prepared before save_state)")
    layouts = [entry for entry in manifest.get("layouts") or [] if entry]
    if layouts:
        names = ", ".join(sorted(layouts[0])[:3])
        raise MergeError(f"{folder}: parameters ({names}) are held in accel's tensor-parallel fused layout, which a "
                         "merge cannot put back without the model; write the full weights with "
                         "accelerator.save_model instead")
    try:
        from accel.checkpoint.state_load import state_reader

        reader = state_reader(folder, manifest, opened)
    except CheckpointError as exc:
        raise MergeError(f"cannot read the checkpoint: {exc}") from None
    saved = _read_dcp(reader, _models_only_planner())
    aliases = manifest.get("aliases") or {}
    models = []
    for spec in specs:
        state, used = {}, set()
        for name, entry in (spec or {}).items():
            if isinstance(entry, dict) and "__tensor__" in entry:
                key = aliases.get(entry["__tensor__"], entry["__tensor__"])
                if key not in saved:
                    raise MergeError(f"{folder / 'state'}: tensor {key!r} (parameter {name!r}) is missing")
                # a tied name gets its own copy: every name of the state dict is in the file (as in a DCP folder's
                # merge), so a strict load_state_dict works too
                state[name] = saved[key].clone() if key in used else saved[key]
                used.add(key)
        models.append(state)
    return models


def _write(state: dict[str, torch.Tensor], output: Path) -> list[Path]:
    from accel.checkpoint.model_io import save_state_dict_sharded

    try:
        return save_state_dict_sharded(state, output, max_shard_size=2**62, safe_serialization=True)
    except OSError as exc:
        raise MergeError(f"cannot write the merged weights to {output}: {exc.strerror or exc}") from None


def describe(path: Path) -> str:
    """One line for the CLI: what was written (read back through a checked descriptor, as every loader reads)."""
    from accel.checkpoint.model_io import safe_open_checked

    with safe_open_checked(path) as f:
        count = len(list(f.keys()))
    return f"merged {count} tensors into {path}"


__all__ = ["MergeError", "merge_fsdp_weights", "checkpoint_kind", "merge"]
