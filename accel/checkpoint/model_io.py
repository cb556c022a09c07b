"""Saving and loading model weights in Hugging Face's on-disk layout.

Layout written by :func:`save_state_dict_sharded` (and read by :func:`load_checkpoint_in_model`):

* everything fits in one shard: ``model.safetensors`` (or ``pytorch_model.bin``);
* otherwise ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``::

      {"metadata": {"total_size": <bytes of all saved tensors>, "accel_tied": {alias: kept_name}},
       "weight_map": {tensor_name: shard_file_name}}

  (``pytorch_model-0000k-of-0000N.bin`` and ``pytorch_model.bin.index.json`` for the legacy format).

Tensors sharing storage (tied weights such as an embedding and an lm_head) are written once under the
first name in state-dict order. Safetensors files record the other names in their header metadata as
``"accel_tied": json.dumps({alias: kept_name})`` (in the file holding the kept name) so that loading
restores them. Legacy ``.bin`` shards store the alias as a second key referring to the same tensor
(``torch.save`` keeps the storage once), which ``torch.load(weights_only=True)`` restores shared.

Loading never unpickles arbitrary objects: ``.bin``/``.pt``/``.pth`` files go through
``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path, PurePath
from typing import cast

import torch
from torch import nn

from accel.checkpoint.layout import atomic_write, fsync_dir, write_json

__all__ = [
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "parse_size",
    "save_state_dict_sharded",
    "load_checkpoint_in_model",
    "get_full_state_dict",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

# Looked for in a checkpoint folder, in this order.
_FOLDER_CANDIDATES = (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME)

# Files a save into a folder owns: anything matching these and not written by the current save is stale.
_OWNED_FILE_RE = re.compile(
    r"^(?:model(?:-\d{5,}-of-\d{5,})?\.safetensors"
    r"|model\.safetensors\.index\.json"
    r"|pytorch_model(?:-\d{5,}-of-\d{5,})?\.bin"
    r"|pytorch_model\.bin\.index\.json)$"
)

_TIED_KEY = "accel_tied"
_TORCH_LOAD_SUFFIXES = (".bin", ".pt", ".pth")


# ----------------------------------------------------------------------------------------------- sizes

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_SIZE_FORMS = (
    "an int number of bytes, or a string like '10GB', '500MB', '2GiB', '100KB', '1.5GB' "
    "(units B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024; case-insensitive)"
)


def parse_size(size: int | str) -> int:
    """Number of bytes in ``size``: an int (bytes) or a string such as ``"10GB"``, ``"2GiB"``, ``"1.5 GB"``.

    KB/MB/GB/TB are decimal (10**3 ...), KiB/MiB/GiB/TiB binary (2**10 ...); case-insensitive, optional
    space between number and unit; a bare number string means bytes. Fractions of a byte are dropped.
    Raises ``ValueError`` naming the value and the accepted forms for anything else (negative numbers,
    unknown units, bools, floats, ...).
    """
    if isinstance(size, bool):
        raise ValueError(f"Invalid size {size!r}: expected {_SIZE_FORMS}.")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"Invalid size {size!r}: a size cannot be negative; expected {_SIZE_FORMS}.")
        return size
    if not isinstance(size, str):
        raise ValueError(f"Invalid size {size!r} of type {type(size).__name__}: expected {_SIZE_FORMS}.")
    match = _SIZE_RE.match(size)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"Invalid size {size!r}: expected {_SIZE_FORMS}.")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # pragma: no cover - the regex only lets decimal literals through
        raise ValueError(f"Invalid size {size!r}: expected {_SIZE_FORMS}.") from None
    return int(number * _SIZE_UNITS[match.group(2).lower()])


# ------------------------------------------------------------------------------------------ state dict


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DistributedDataParallel / DataParallel and torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


def _strip_compile_prefix(name: str) -> str:
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _view_key(tensor: torch.Tensor) -> tuple | None:
    """Identifies a tensor view exactly (storage, offset, shape, stride, dtype); None when it cannot be shared."""
    if tensor.device.type == "meta" or tensor.numel() == 0 or tensor.layout != torch.strided:
        return None
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return None
    if ptr == 0:
        return None
    return (tensor.device, ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def get_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every tensor detached and on CPU, keys without ``_orig_mod.``.

    Accepts a model wrapped in DistributedDataParallel/DataParallel (``.module`` is used) or compiled
    with ``torch.compile``. Tensors sharing the same view of the same storage (tied weights) come back as
    the same tensor object, so :func:`save_state_dict_sharded` writes them once. DTensor values are
    gathered with ``full_tensor()`` (a collective: call this on every rank). Non-tensor entries (extra
    state) are passed through unchanged.
    """
    model = unwrap_model(model)
    try:  # optional: only present in distributed-enabled builds
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        DTensor = None  # type: ignore[misc, assignment]  # noqa: N806

    result: dict[str, torch.Tensor] = {}
    converted: dict[tuple, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        key = _strip_compile_prefix(name)
        if key in result:
            raise ValueError(f"Two state-dict entries map to {key!r} once '_orig_mod.' is removed.")
        if not isinstance(value, torch.Tensor):
            result[key] = value
            continue
        if DTensor is not None and isinstance(value, DTensor):
            value = value.full_tensor()
        if value.device.type == "meta":
            raise ValueError(f"State-dict entry {name!r} is on the meta device and holds no data.")
        view = _view_key(value)
        if view is not None and view in converted:
            result[key] = converted[view]
            continue
        cpu_value = value.detach().to("cpu")
        if view is not None:
            converted[view] = cpu_value
        result[key] = cpu_value
    return result


# ------------------------------------------------------------------------------------------------ save


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _shard_name(base: str, index: int, total: int) -> str:
    stem, ext = base.rsplit(".", 1)
    return f"{stem}-{index:05d}-of-{total:05d}.{ext}"


def _plan_saved_tensors(state_dict: Mapping[str, torch.Tensor]):
    """Returns (kept names in order, {alias: kept}, names whose data must be copied before saving)."""
    kept: list[str] = []
    aliases: dict[str, str] = {}
    by_view: dict[tuple, str] = {}
    holders: dict[tuple, list[str]] = {}  # (device, storage pointer) -> kept names on that storage
    for name, tensor in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"State-dict keys must be strings, got {name!r}.")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"State-dict entry {name!r} is a {type(tensor).__name__}, not a torch.Tensor; "
                "only tensors can be saved."
            )
        if tensor.device.type == "meta":
            raise ValueError(f"State-dict entry {name!r} is on the meta device and holds no data.")
        if tensor.layout != torch.strided:
            raise ValueError(f"State-dict entry {name!r} has layout {tensor.layout}; only dense tensors can be saved.")
        view = _view_key(tensor)
        if view is not None and view in by_view:
            aliases[name] = by_view[view]
            continue
        kept.append(name)
        if view is not None:
            by_view[view] = name
            holders.setdefault((view[0], view[1]), []).append(name)
    # Saved as an independent compact copy: a tensor sharing its storage with another, different view
    # (safetensors refuses those), a non-contiguous one, or a view of a bigger storage (torch.save would
    # write the whole storage).
    needs_copy: set[str] = set()
    for names in holders.values():
        for name in names:
            tensor = state_dict[name]
            if len(names) > 1 or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != _nbytes(tensor):
                needs_copy.add(name)
    return kept, aliases, needs_copy


def save_state_dict_sharded(
    state_dict: dict[str, torch.Tensor],
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write ``state_dict`` into ``save_directory`` in Hugging Face's (sharded) layout.

    Shards are filled in state-dict order, each holding at most ``max_shard_size`` bytes of tensor data
    (a single larger tensor gets a shard of its own). One shard is written as ``model.safetensors``
    (``pytorch_model.bin`` with ``safe_serialization=False``), several as ``model-0000k-of-0000N.safetensors``
    plus ``model.safetensors.index.json``. Tied tensors (same storage, offset, shape, stride and dtype) are
    saved once under their first name; see the module docstring for how the aliases are recorded.

    Every file is written to a temporary name in the folder, fsynced and renamed into place; the folder
    is fsynced at the end. Weight files of an earlier save that this save did not write (other shard
    counts, the other format, a stale index) are removed only after the new files are complete.

    ``metadata`` (str -> str) is added to every safetensors header (``"format": "pt"`` and the tie record
    take precedence); it is not stored by the legacy ``.bin`` format.

    Returns the paths written: the shards in order, then the index if any.
    """
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}.")
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise TypeError("metadata must be a dict of str to str (safetensors header metadata).")
        if _TIED_KEY in metadata:
            raise ValueError(f"metadata key {_TIED_KEY!r} is reserved for the record of tied tensors.")
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save_directory {str(directory)!r} exists and is not a directory.")
    directory.mkdir(parents=True, exist_ok=True)

    kept, aliases, needs_copy = _plan_saved_tensors(state_dict)

    # Fill shards in state-dict order.
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name in kept:
        size = _nbytes(state_dict[name])
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)  # a tensor bigger than the limit thus lands alone in a fresh shard
        current_size += size
    if current or not shards:
        shards.append(current)

    base = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    index_name = SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME
    total = len(shards)
    names = [base] if total == 1 else [_shard_name(base, i + 1, total) for i in range(total)]

    aliases_of: dict[str, list[str]] = {}
    for alias, target in aliases.items():
        aliases_of.setdefault(target, []).append(alias)

    from accel.runtime.progress import progress

    written: list[Path] = []
    weight_map: dict[str, str] = {}
    pairs = zip(shards, names, strict=True)
    for shard, file_name in progress(pairs, total, "Saving checkpoint shards") if total > 1 else pairs:
        tensors: dict[str, torch.Tensor] = {}
        for name in shard:
            tensor = state_dict[name].detach()
            if tensor.device.type != "cpu":
                tensor = tensor.to("cpu")
                if not tensor.is_contiguous():
                    tensor = tensor.contiguous()
            elif name in needs_copy:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            tensors[name] = tensor
            weight_map[name] = file_name
        shard_tied = {alias: name for name in shard for alias in aliases_of.get(name, ())}

        if safe_serialization:
            from safetensors.torch import save_file

            header = {**(metadata or {}), "format": "pt"}
            if shard_tied:
                header[_TIED_KEY] = json.dumps(shard_tied, sort_keys=True)

            def write(tmp, tensors=tensors, header=header):
                save_file(tensors, str(tmp), metadata=header)

        else:
            for alias, target in shard_tied.items():
                tensors[alias] = tensors[target]  # torch.save stores the shared storage once
                weight_map[alias] = file_name

            def write(tmp, tensors=tensors):  # type: ignore[misc]  # torch.save's file has no header
                with open(tmp, "wb") as f:
                    torch.save(tensors, f)
                    f.flush()

        written.append(atomic_write(directory, file_name, write))
        del tensors

    if total > 1:
        index_meta: dict = {"total_size": sum(_nbytes(state_dict[n]) for n in kept)}
        if aliases:
            index_meta[_TIED_KEY] = dict(aliases)
        index = {"metadata": index_meta, "weight_map": weight_map}
        written.append(atomic_write(directory, index_name, lambda tmp: write_json(tmp, index)))
    fsync_dir(directory)

    # Only now that the new checkpoint is complete: remove what an earlier save left behind.
    written_names = {p.name for p in written}
    removed = False
    for entry in directory.iterdir():
        if entry.name not in written_names and _OWNED_FILE_RE.match(entry.name) and entry.is_file():
            entry.unlink()
            removed = True
    if removed:
        fsync_dir(directory)
    return written


# ------------------------------------------------------------------------------------------------ load


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        candidate = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise ValueError(f"Invalid dtype {dtype!r}: expected a torch.dtype or its name, such as 'float16'.")


def _parse_tied(raw, source: str) -> dict[str, str]:
    if raw is None:
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"Invalid {_TIED_KEY!r} record in {source}: {exc}") from exc
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError(f"Invalid {_TIED_KEY!r} record in {source}: expected a mapping of alias name to saved name.")
    return raw


def _checked_shard_path(folder: Path, entry, index_path: Path) -> Path:
    """The shard file an index entry names, refusing anything that leaves the index's folder."""
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"Index {str(index_path)!r} has an invalid shard file entry {entry!r}.")
    pure = PurePath(entry)
    if pure.is_absolute() or pure.drive or pure.root or ".." in pure.parts or "\\" in entry or "\x00" in entry:
        raise ValueError(
            f"Index {str(index_path)!r} names shard file {entry!r}, which is outside the checkpoint folder; refused."
        )
    if not (entry.endswith(".safetensors") or entry.endswith(_TORCH_LOAD_SUFFIXES)):
        raise ValueError(
            f"Index {str(index_path)!r} names shard file {entry!r}: expected a .safetensors, .bin, .pt or .pth file."
        )
    path = folder / pure
    real_folder = folder.resolve()
    real = path.resolve()
    if real != real_folder and real_folder not in real.parents:
        raise ValueError(
            f"Index {str(index_path)!r} names shard file {entry!r}, which resolves outside the checkpoint "
            f"folder ({str(real)!r}); refused."
        )
    if not path.is_file():
        raise FileNotFoundError(f"Shard file {entry!r} listed in index {str(index_path)!r} is missing.")
    return path


def _read_index(index_path: Path) -> tuple[list[tuple[Path, list[str] | None]], dict[str, str]]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Index file {str(index_path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise ValueError(f"Index file {str(index_path)!r} has no 'weight_map' mapping.")
    meta = index.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"Index file {str(index_path)!r} has an invalid 'metadata' entry.")
    tied = _parse_tied(meta.get(_TIED_KEY), f"index {str(index_path)!r}")

    folder = index_path.parent
    paths: dict[str, Path] = {}
    files: dict[str, list[str]] = {}
    for key, entry in index["weight_map"].items():
        if entry not in paths:
            paths[entry] = _checked_shard_path(folder, entry, index_path)
            files[entry] = []
        files[entry].append(key)
    return [(paths[entry], keys) for entry, keys in files.items()], tied


def _resolve_checkpoint(checkpoint) -> tuple[list[tuple[Path, list[str] | None]], dict[str, str]]:
    """[(file, keys from the index or None)], tied aliases from the index."""
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
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")
    if path.name.endswith(".json"):
        return _read_index(path)
    if path.suffix == ".safetensors" or path.suffix in _TORCH_LOAD_SUFFIXES:
        return [(path, None)], {}
    raise ValueError(
        f"Unsupported checkpoint file {str(path)!r}: expected .safetensors, .bin, .pt, .pth or an index .json."
    )


def _safe_open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:
        raise RuntimeError(f"Could not read safetensors file {str(path)!r}: {exc}") from exc


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RuntimeError(
            f"Could not load {str(path)!r} with torch.load(weights_only=True) (only tensors and plain "
            f"containers are accepted; arbitrary pickled objects are refused): {exc}"
        ) from exc
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise ValueError(f"{str(path)!r} does not hold a flat dict of tensor name to tensor.")
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
        files, tied = _resolve_checkpoint(checkpoint)
        expected = set(loader.slots)
        self.files: list[tuple[Path, list[str] | None]] = []  # keys None: a whole .bin file, read later
        checkpoint_keys: list[str] = []
        for path, index_keys in files:
            keys = index_keys
            if path.suffix == ".safetensors":
                with _safe_open(path) as f:
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
            self.single_bin = _torch_load(files[0][0])
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
                with _safe_open(path) as f:
                    for key in keys:
                        stored = getattr(torch, _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype(), ""), None)
                        yield path, key, stored, lambda f=f, key=key, path=path: _read_safetensor(f, path, key)
                continue
            shard = self.single_bin if self.single_bin is not None else _torch_load(path)
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
