"""Loading model weights in Hugging Face's layout into a model (`load_checkpoint_in_model`): the checkpoint found
(a file, a folder, an index), every file it names checked first, then each tensor read into its place; a
mismatch leaves the model unchanged.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from torch import nn

from accel.checkpoint import weights_files
from accel.checkpoint.layout import CheckpointError, checked_files
from accel.checkpoint.model_files import (
    _CHECKSUMS_KEY,
    _FOLDER_CANDIDATES,
    _INDEX_CHECKSUM_KEY,
    _TIED_KEY,
    _TORCH_LOAD_SUFFIXES,
    _index_body,
    _parse_tied,
    read_json,
)
from accel.checkpoint.model_state import unwrap_model
from accel.checkpoint.weights_files import (
    _PICKLE_ALLOWED,
    _check_own_checksum,
    _verify_files,
    safe_open_checked,
    torch_load_weights,
)
from accel.core.checked_file import CheckedFiles


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        candidate = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise ValueError(f"Invalid dtype {dtype!r}: expected a torch.dtype or its name, such as 'float16'.")


_SHARD_ENTRY_ALLOWED = ("allowed: a file name, or a relative path without '..', inside the index's folder, ending in "
                        ".safetensors, .bin, .pt or .pth")


def _checked_shard_path(folder: Path, entry, index_path: Path, key: str | None = None) -> Path:
    """The shard file an index entry names: a relative name inside the index's folder, checked lexically (no
    absolute path, no '..', no backslash). The folder's own symbolic links are followed, as every loader follows
    them: a model in the Hugging Face Hub cache is a folder of links into ``../../blobs``."""
    what = f"{index_path}: shard file entry {str(entry)[:200]!r}" + (f" (for {key[:200]!r})" if key else "")
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"{what} is not a file name; {_SHARD_ENTRY_ALLOWED}")
    pure = PurePosixPath(entry)
    if pure.is_absolute() or ".." in pure.parts or "\\" in entry or "\x00" in entry or PureWindowsPath(entry).drive:
        raise ValueError(f"{what} names a file outside the index's folder; {_SHARD_ENTRY_ALLOWED}")
    if not (entry.endswith(".safetensors") or entry.endswith(_TORCH_LOAD_SUFFIXES)):
        raise ValueError(f"{what} is not a weights file; {_SHARD_ENTRY_ALLOWED}")
    path = folder / pure
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing or not a regular file (listed in {index_path.name})")
    return path


def _read_index(index_path: Path, opened: CheckedFiles) -> tuple[list[tuple[Path, list[str] | None]], dict[str, str]]:
    index = read_json(index_path)
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ValueError(f"{index_path}: no 'weight_map' mapping; allowed: a JSON object with 'weight_map' (tensor "
                         "name -> shard file) and optionally 'metadata' (an object)")
    meta = index.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{index_path}: 'metadata' is {type(meta).__name__}; allowed: a JSON object")
    tied = _parse_tied(meta.get(_TIED_KEY), f"index {str(index_path)!r}")

    folder = index_path.parent
    paths: dict[str, Path] = {}
    files: dict[str, list[str]] = {}
    for key, entry in index["weight_map"].items():
        if not isinstance(entry, str) or entry not in paths:
            paths[entry] = _checked_shard_path(folder, entry, index_path, key)
            files[entry] = []
        files[entry].append(key)
    if _CHECKSUMS_KEY in meta or _INDEX_CHECKSUM_KEY in meta:  # else written by another tool: nothing to verify
        _check_own_checksum(index_path, meta.get(_INDEX_CHECKSUM_KEY), _index_body(index))
        checksums = meta.get(_CHECKSUMS_KEY)
        if not isinstance(checksums, dict) or not set(paths) <= set(checksums):
            raise CheckpointError(f"{index_path}: damaged ('{_CHECKSUMS_KEY}' does not list every shard file)")
        _verify_files(index_path, {name: checksums[name] for name in paths}, opened)  # the files this load reads
    return [(paths[entry], keys) for entry, keys in files.items()], tied


def _resolve_checkpoint(checkpoint, opened: CheckedFiles) -> tuple[list[tuple[Path, list[str] | None]], dict[str, str]]:
    """[(file, keys from the index or None)], tied aliases from the index. The checksums of a save_model folder
    (the index's, or ``accel_checksums.json``'s) are verified here, before anything reads a tensor, each file
    through a checked descriptor recorded in ``opened``."""
    path = Path(checkpoint)
    if path.is_dir():
        for candidate in _FOLDER_CANDIDATES:
            if (path / candidate).is_file():
                path = path / candidate
                break
        else:
            raise FileNotFoundError(
                f"No checkpoint found in folder {str(path)!r}: looked for {', '.join(_FOLDER_CANDIDATES)}."
            )
    elif not path.exists():
        aside = sorted(path.parent.glob(f".old-{path.name}-*")) if path.parent.is_dir() else []
        hint = f"; an interrupted save left the previous one at {str(aside[-1])!r}" if aside else ""
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist{hint}.")
    if path.name.endswith(".json"):
        return _read_index(path, opened)
    if path.suffix == ".safetensors" or path.suffix in _TORCH_LOAD_SUFFIXES:
        weights_files.verify_saved_file(path, opened)  # (looked up here: a test may replace it)
        return [(path, None)], {}
    raise ValueError(
        f"Unsupported checkpoint file {str(path)!r}: expected .safetensors, .bin, .pt, .pth or an index .json."
    )


def _torch_load(path: Path, opened: CheckedFiles) -> dict[str, torch.Tensor]:
    obj = torch_load_weights(path, opened)
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise ValueError(f"{path}: does not hold a flat dict of tensor name to tensor; {_PICKLE_ALLOWED}")
    return obj


def format_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:10])
    more = f", ... ({len(keys) - 10} more)" if len(keys) > 10 else ""
    return f"{len(keys)} key(s): {shown}{more}"


def _model_slots(model: nn.Module):
    """name -> (owner module, attribute, is_parameter) for every parameter and persistent buffer, and
    id(tensor) -> all (module, attribute, is_parameter) places holding that very object."""
    slots: dict[str, tuple[nn.Module, str, bool]] = {}
    places: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for attr, param in module._parameters.items():
            if param is None:
                continue
            slots.setdefault(prefix + attr, (module, attr, True))
            places.setdefault(id(param), [])
            if (module, attr, True) not in places[id(param)]:
                places[id(param)].append((module, attr, True))
        for attr, buf in module._buffers.items():
            if buf is None or attr in module._non_persistent_buffers_set:
                continue
            slots.setdefault(prefix + attr, (module, attr, False))
            places.setdefault(id(buf), [])
            if (module, attr, False) not in places[id(buf)]:
                places[id(buf)].append((module, attr, False))
    return slots, places


class TensorLoader:
    def __init__(self, model: nn.Module, dtype: torch.dtype | None):
        self.dtype = dtype
        self.slots, self.places = _model_slots(model)
        self.consumed: set[tuple] = set()  # storages now owned by the model

    def current(self, name: str) -> torch.Tensor:
        module, attr, is_param = self.slots[name]
        return (module._parameters if is_param else module._buffers)[attr]

    def check_shape(self, name: str, shape) -> None:
        expected = tuple(self.current(name).shape)
        if tuple(shape) != expected:
            raise RuntimeError(
                f"Shape mismatch for {name!r}: checkpoint has shape {tuple(shape)}, model expects {expected}."
            )

    def _fresh(self, value: torch.Tensor, device, dtype) -> torch.Tensor:
        out = value.to(device=device, dtype=dtype)
        key = (out.device, out.untyped_storage().data_ptr()) if out.numel() else None
        if out is value and key is not None and key in self.consumed:
            out = out.clone()
            key = (out.device, out.untyped_storage().data_ptr())
        if key is not None:
            self.consumed.add(key)
        return out

    def target_dtype(self, name: str, value_dtype: torch.dtype) -> torch.dtype:
        """The dtype ``name`` ends up in: the load's ``dtype`` for floating-point values, else the model's."""
        target = self.current(name)
        if self.dtype is not None and target.is_floating_point() and value_dtype.is_floating_point:
            return self.dtype
        return target.dtype

    def assign(self, name: str, value: torch.Tensor, device: torch.device | str | None = None) -> None:
        """Load ``value`` into ``name``; a meta tensor is replaced by a new one on ``device`` (default CPU)."""
        self.check_shape(name, value.shape)
        target = self.current(name)
        dtype = self.target_dtype(name, value.dtype)
        with torch.no_grad():
            if target.device.type == "meta":
                new = self._fresh(value, "cpu" if device is None else device, dtype)
                if isinstance(target, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=target.requires_grad)
                for module, attr, is_param in self.places.get(id(target), [self.slots[name]]):
                    (module._parameters if is_param else module._buffers)[attr] = new
                # Every place that held the meta tensor now holds the same new object.
                replacement = self.current(name)
                self.places[id(replacement)] = self.places.pop(id(target), [self.slots[name]])
            elif dtype != target.dtype:
                target.data = self._fresh(value, target.device, dtype)
            else:
                target.copy_(value)


_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


class CheckpointPlan:
    """A checkpoint's files and keys, checked against the model (names, shapes) before anything is changed."""

    def __init__(self, checkpoint, loader: TensorLoader):
        self.checkpoint = checkpoint
        self.opened = checked_files()  # every file is read through a checked descriptor, the same file each time
        files, tied = _resolve_checkpoint(checkpoint, self.opened)
        expected = set(loader.slots)
        self.files: list[tuple[Path, list[str] | None]] = []  # keys None: a whole .bin file, read later
        checkpoint_keys: list[str] = []
        for path, index_keys in files:
            keys = index_keys
            if path.suffix == ".safetensors":
                with safe_open_checked(path, self.opened) as f:
                    try:
                        file_keys = list(f.keys())
                        file_tied = _parse_tied((f.metadata() or {}).get(_TIED_KEY), f"file {str(path)!r}")
                        keys = file_keys if index_keys is None else index_keys
                        absent = [k for k in keys if k not in set(file_keys)]
                        if absent:
                            raise KeyError(
                                f"Shard {str(path)!r} does not hold {format_keys(absent)} listed in the index."
                            )
                        for key in keys:
                            if key in expected:
                                loader.check_shape(key, f.get_slice(key).get_shape())
                    except (KeyError, ValueError, RuntimeError):
                        raise
                    except Exception as exc:
                        raise RuntimeError(f"Could not read safetensors file {str(path)!r}: {exc}") from exc
                tied = {**file_tied, **tied}
            self.files.append((path, keys))
            if keys is not None:
                checkpoint_keys.extend(keys)

        self.single_bin: dict[str, torch.Tensor] | None = None
        if len(files) == 1 and files[0][1] is None and files[0][0].suffix != ".safetensors":
            self.single_bin = _torch_load(files[0][0], self.opened)
            checkpoint_keys = list(self.single_bin)
            for key, value in self.single_bin.items():
                if key in expected:
                    loader.check_shape(key, value.shape)

        saved = set(checkpoint_keys)
        tied = {alias: target for alias, target in tied.items() if target in saved and alias not in saved}
        present = saved | set(tied)
        self.missing = [name for name in loader.slots if name not in present]
        self.unexpected = [name for name in list(dict.fromkeys(checkpoint_keys)) + list(tied) if name not in expected]
        self.aliases_of: dict[str, list[str]] = {}  # saved name -> model names tied to it
        for alias, target in tied.items():
            if alias in expected:
                self.aliases_of.setdefault(target, []).append(alias)

    def key_problems(self) -> str | None:
        """One message naming the missing and unexpected keys, or None."""
        problems = []
        if self.missing:
            problems.append(f"missing keys (in the model, not in the checkpoint): {format_keys(self.missing)}")
        if self.unexpected:
            problems.append(
                f"unexpected keys (in the checkpoint, not in the model): {format_keys(self.unexpected)}"
            )
        return f"Loading checkpoint {str(self.checkpoint)!r}: " + "; ".join(problems) if problems else None

    def tensors(self, loader: TensorLoader):
        """Yields ``(file, key, stored dtype, read)`` for every saved tensor, one file at a time; ``read()``
        returns the value (for safetensors the data is read only then, so a caller may skip it). Several files
        advance a progress bar (drawn on a terminal only)."""
        from accel.runtime.progress import progress

        files = self.files if len(self.files) < 2 else progress(self.files, desc="Loading checkpoint shards")
        for path, keys in files:
            if path.suffix == ".safetensors":
                assert keys is not None  # a safetensors file's keys were read when it was checked
                with safe_open_checked(path, self.opened) as f:
                    for key in keys:
                        stored = getattr(torch, _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype(), ""), None)
                        yield path, key, stored, lambda f=f, key=key, path=path: _read_safetensor(f, path, key)
                continue
            shard = self.single_bin if self.single_bin is not None else _torch_load(path, self.opened)
            wanted: list[str] = list(shard) if keys is None else keys
            absent = [k for k in wanted if k not in shard]
            if absent:
                raise KeyError(f"Shard {str(path)!r} does not hold {format_keys(absent)} listed in the index.")
            for key in wanted:
                if key in loader.slots:
                    loader.check_shape(key, shard[key].shape)
            for key in wanted:
                yield path, key, shard[key].dtype, lambda value=shard[key]: value
            del shard


def _read_safetensor(f, path: Path, key: str) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except Exception as exc:
        raise RuntimeError(f"Could not read tensor {key!r} from safetensors file {str(path)!r}: {exc}") from exc


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    strict: bool = False,
) -> tuple[list[str], list[str]]:
    """Load a checkpoint written in Hugging Face's layout into ``model``'s parameters and buffers.

    ``checkpoint`` is a ``.safetensors`` file, a ``.bin``/``.pt``/``.pth`` file (read with
    ``torch.load(weights_only=True)`` only), an index ``.json`` or a folder holding one of
    ``model.safetensors.index.json``, ``model.safetensors``, ``pytorch_model.bin.index.json``,
    ``pytorch_model.bin`` (looked for in that order).

    Tensors are read one shard (safetensors: one tensor) at a time and copied in place; with ``dtype``
    floating-point tensors end up in that dtype (the Parameter object is kept), otherwise in the
    model's dtype. Parameters/buffers on the meta device are replaced by new CPU tensors (every place
    sharing the meta tensor gets the same new one; ``requires_grad`` is kept). Tied aliases recorded by
    :func:`save_state_dict_sharded` are filled from their saved tensor.

    Loading with a ``device_map`` is :func:`accel.big_model.modeling.load_checkpoint_in_model` (also
    ``accel.load_checkpoint_in_model``), which builds on this module: this one never imports device maps.

    Returns ``(missing_keys, unexpected_keys)``; both are warned about, or raised as ``RuntimeError``
    when ``strict``. Shape mismatches always raise ``RuntimeError``. For safetensors checkpoints keys and
    shapes are checked from the headers before the model is modified.
    """
    loader = TensorLoader(unwrap_model(model), resolve_dtype(dtype))
    plan = CheckpointPlan(checkpoint, loader)
    message = plan.key_problems()
    if message and strict:
        raise RuntimeError(message)
    if message:
        warnings.warn(message, stacklevel=2)

    for _, key, _, read in plan.tensors(loader):
        if key not in loader.slots:
            continue
        value = read()
        loader.assign(key, value)
        source = loader.current(key)
        for alias in plan.aliases_of.get(key, ()):
            if loader.current(alias) is not source:
                loader.assign(alias, value)
        del value
    return plan.missing, plan.unexpected
