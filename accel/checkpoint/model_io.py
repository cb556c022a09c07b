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

Checksums. Every file of a save (the shards, and extra files such as the ``config.json`` of ``Accelerator.save_model``)
gets ``layout.file_checksum`` (crc32, ``crc32:<8 hex>``), verified by :func:`load_checkpoint_in_model` before any
tensor is read, so a flipped bit or a same-size edit is a one-line ``CheckpointError`` naming the file, and the model
is left unchanged. Where they live:

* a sharded save: in its index, ``metadata.accel_checksums`` ({file: checksum}) and ``metadata.accel_index_checksum``
  (the index's own content, every key but that one, as ``layout.manifest_checksum`` computes it). Hugging Face's
  index format allows extra metadata keys (transformers and safetensors readers use ``weight_map`` only), the
  checksums travel with the index wherever the model is copied, and a later save by another tool rewrites the index,
  so they never describe files that tool wrote;
* a single-file save has no index, and the checksum cannot go into the safetensors header (it is part of the bytes
  checksummed; a ``.bin`` file has none), so a small sidecar ``accel_checksums.json`` is written last
  (``{"format": "accel-model-checksums", "version": 1, "files": {...}, "checksum": ...}``): Hugging Face loaders
  look for weights and configs by name and never open it.

Files written by other tools (no checksum anywhere) load as before, unchecked. A single-file save's header and sidecar
carry the same random ``accel_save_id``, so a ``model.safetensors`` another tool later writes into the folder
(``save_pretrained``) is not checked against the stale sidecar. A load verifies the files it reads (the weights);
``config.json`` is checksummed too, for tools that check a whole folder, but editing it does not stop a weights load.

A save is built in a temporary folder beside its target and replaces the model there in one step, keeping the
folder's other files (see :func:`save_state_dict_sharded`).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import secrets
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from decimal import Decimal, InvalidOperation
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import cast

import torch
from torch import nn

from accel.checkpoint.layout import (
    CheckpointError,
    PublishLock,
    atomic_write,
    checked_files,
    file_checksums,
    fsync_dir,
    manifest_checksum,
    remove_stale_temporaries,
    swap_in,
    temporary_sibling,
    verify_file_checksum,
    write_json,
)
from accel.core.checked_file import CheckedFiles

__all__ = [
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "CHECKSUMS_NAME",
    "parse_size",
    "save_state_dict_sharded",
    "load_checkpoint_in_model",
    "get_full_state_dict",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
CHECKSUMS_NAME = "accel_checksums.json"  # the checksums of a single-file save (a sharded one: in its index)
_CHECKSUMS_FORMAT = "accel-model-checksums"
_CHECKSUMS_KEY = "accel_checksums"  # index metadata: {file name: checksum} for every file of the save
_SAVE_ID_KEY = "accel_save_id"  # a single-file save: in its safetensors header and its sidecar, the same random id
_INDEX_CHECKSUM_KEY = "accel_index_checksum"  # index metadata: the checksum of the index's own content

# Looked for in a checkpoint folder, in this order.
_FOLDER_CANDIDATES = (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME)

# Files a save into a folder owns: anything matching these and not written by the current save is stale.
_OWNED_FILE_RE = re.compile(
    r"^(?:model(?:-\d{5,}-of-\d{5,})?\.safetensors"
    r"|model\.safetensors\.index\.json"
    r"|pytorch_model(?:-\d{5,}-of-\d{5,})?\.bin"
    r"|pytorch_model\.bin\.index\.json"
    r"|accel_checksums\.json)$"
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
    *,
    extra_files: Mapping[str, Callable[[Path], object]] | None = None,
) -> list[Path]:
    """Write ``state_dict`` into ``save_directory`` in Hugging Face's (sharded) layout, replacing the model there.

    Shards are filled in state-dict order, each holding at most ``max_shard_size`` bytes of tensor data
    (a single larger tensor gets a shard of its own). One shard is written as ``model.safetensors``
    (``pytorch_model.bin`` with ``safe_serialization=False``), several as ``model-0000k-of-0000N.safetensors``
    plus ``model.safetensors.index.json``. Tied tensors (same storage, offset, shape, stride and dtype) are
    saved once under their first name; see the module docstring for how the aliases are recorded.

    ``extra_files`` (file name -> ``write(path)``) are more files of the save, such as a transformers model's
    ``config.json``: written, checksummed and published with the weights. Every file of the save gets a checksum
    (the index's metadata, or ``accel_checksums.json`` for a single file: see the module docstring), which
    :func:`load_checkpoint_in_model` verifies.

    The save is built in a temporary folder beside the target (every file fsynced) and replaces the model
    there in one step (:func:`accel.checkpoint.layout.swap_in`, under the folder's publish lock): a save that
    fails or is killed at any moment leaves the previous model complete and loadable, never a mix. Files in the
    folder that are not the model's (a tokenizer, a README, a user's subfolder) are kept, as hard links in the new
    folder (no byte is copied). Where the folder cannot be replaced whole (a mount point, the working directory,
    a parent folder that cannot be written, hard links refused) the files are moved in one by one; a save killed
    then leaves a folder whose checksums no longer match, refused at load instead of loading as a mix.

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
    extra = dict(extra_files or {})
    for name in extra:
        if (not isinstance(name, str) or not name or name.startswith(".") or any(c in name for c in "/\\\0")
                or _OWNED_FILE_RE.match(name)):
            raise ValueError(f"extra_files: {name!r} is not a plain file name other than the weights' and their "
                             "index's.")
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save_directory {str(directory)!r} exists and is not a directory.")

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

    folder = Path(os.path.realpath(directory))  # a link to a folder: the folder it names is replaced
    save_id = secrets.token_hex(8)
    staging, in_place = _staging_folder(folder)
    published = False
    try:
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
                if total == 1:  # ties the sidecar to this file: another tool's later file is not checked against it
                    header[_SAVE_ID_KEY] = save_id
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

            atomic_write(staging, file_name, write)
            del tensors

        for name, write_extra in extra.items():
            atomic_write(staging, name, lambda tmp, write_extra=write_extra: write_extra(Path(tmp)))
        checksums = file_checksums(staging, [*names, *extra])
        if total > 1:
            index_meta: dict = {"total_size": sum(_nbytes(state_dict[n]) for n in kept)}
            if aliases:
                index_meta[_TIED_KEY] = dict(aliases)
            index_meta[_CHECKSUMS_KEY] = checksums
            index: dict = {"metadata": index_meta, "weight_map": weight_map}
            index_meta[_INDEX_CHECKSUM_KEY] = manifest_checksum(_index_body(index))
            record, content = index_name, index
        else:
            sidecar: dict = {"format": _CHECKSUMS_FORMAT, "version": 1, "save_id": save_id, "files": checksums}
            sidecar["checksum"] = manifest_checksum(sidecar)
            record, content = CHECKSUMS_NAME, sidecar
        atomic_write(staging, record, lambda tmp: write_json(tmp, content))  # last: it completes the save
        fsync_dir(staging)
        published = True  # from here on _publish owns the staging folder (and removes it on failure)
        _publish(staging, folder, in_place, [*names, *extra, record])
    except BaseException:
        if not published:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return [directory / name for name in names] + ([directory / index_name] if total > 1 else [])


def _index_body(index: dict) -> dict:
    """What an index's own checksum covers: all of it but that checksum (``manifest_checksum`` skips only a
    top-level ``checksum``)."""
    meta = {k: v for k, v in (index.get("metadata") or {}).items() if k != _INDEX_CHECKSUM_KEY}
    return {k: v for k, v in index.items() if k not in ("metadata", "checksum")} | {"metadata": meta}


def _in_place_reason(folder: Path) -> str | None:
    """Why an existing folder cannot be replaced whole, or None."""
    if os.path.ismount(folder):
        return "is a mount point"
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except OSError:
        return None
    if cwd == folder or folder in cwd.parents:
        return "holds the working directory"
    return None


def _staging_folder(folder: Path) -> tuple[Path, bool]:
    """Where a save writes its files, and whether they are then moved into ``folder`` one by one (in place)
    instead of the folder being replaced whole: a temporary folder beside it, else one inside it. Abandoned
    temporaries of earlier saves to ``folder`` are removed (only those: see ``layout.remove_stale_temporaries``)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(folder.parent, folder.name)
    exists = folder.is_dir()
    if exists:
        remove_stale_temporaries(folder, folder.name)
    sibling = temporary_sibling(folder)
    reason = _in_place_reason(folder) if exists else None
    if reason is None:
        try:
            sibling.mkdir()
            return sibling, False
        except OSError as exc:
            if not exists:
                raise
            reason = f"cannot have a folder beside it ({exc.strerror or exc})"
    _warn_in_place(folder, reason)
    inside = folder / sibling.name
    inside.mkdir()
    return inside, True


def _warn_in_place(folder: Path, reason: str) -> None:
    warnings.warn(f"{folder} {reason}: the model's files are replaced there one by one (a save interrupted midway "
                  "leaves files whose checksums do not match, refused at load), not the folder in one step.",
                  stacklevel=4)


def _is_model_file(name: str, new: set[str]) -> bool:
    """A file of the model saved in a folder (this save's, or an earlier one's weights, index, checksums)."""
    return name in new or _OWNED_FILE_RE.match(name) is not None


def _publish(staging: Path, folder: Path, in_place: bool, names: list[str]) -> None:
    """Make the complete save in ``staging`` the model in ``folder``, holding the folder's publish lock.

    Whole: every entry of ``folder`` that is not the model's is hard-linked into ``staging`` (subfolders
    rebuilt, their files linked), then ``staging`` replaces ``folder`` in one step; files another process added
    or replaced in the old folder meanwhile are moved over, and the old folder (old model files and links) is
    removed. In place (or when a link is refused): the files move in one by one, the checksum record last, and
    the earlier model's files this save did not write are removed."""
    new = set(names)
    old: Path | None = None
    complete = True
    try:
        with PublishLock(folder):
            if not in_place and folder.is_dir():
                try:
                    _link_tree(folder, staging, lambda name: _is_model_file(name, new))
                    shutil.copymode(folder, staging)
                except (OSError, NotImplementedError) as exc:  # another user's file under fs.protected_hardlinks,
                    in_place = True  # a filesystem without links, Windows' os.link of a symbolic link
                    _warn_in_place(folder, f"keeps files that cannot be linked ({getattr(exc, 'strerror', 0) or exc})")
            if not in_place:
                _fsync_folders(staging)
                try:
                    old = swap_in(staging, folder)
                except OSError as exc:  # a bind mount (same device, so not found before) cannot be renamed
                    if exc.errno not in (errno.EBUSY, errno.EXDEV) or not folder.is_dir():
                        raise
                    in_place = True
                    _warn_in_place(folder, f"cannot be renamed ({exc.strerror or exc})")
                fsync_dir(folder.parent)
                if old is not None:
                    complete = _sweep(old, folder, lambda name: _is_model_file(name, new))
            if in_place:
                _move_into(staging, folder, names)
    except BaseException:
        if old is None:  # not swapped: the staging folder is still this save's (else it is the old folder)
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if in_place:
        shutil.rmtree(staging, ignore_errors=True)
    elif old is not None and complete:
        shutil.rmtree(old, ignore_errors=True)
    elif old is not None:
        kept = folder.parent / f".old-{folder.name}-{uuid.uuid4().hex[:8]}"
        os.replace(old, kept)
        warnings.warn(f"{folder}: the previous folder is kept at {kept}: some of its files could not be moved into "
                      "the new one (compare them and remove it).", stacklevel=3)


def _link_tree(source: Path, dest: Path, skip: Callable[[str], bool] | None) -> None:
    """Rebuild ``source`` in ``dest``: subfolders made (with their mode), everything else hard-linked (a symbolic
    link as itself); top-level names for which ``skip`` is true are left out."""
    with os.scandir(source) as entries:
        for entry in entries:
            if skip is not None and skip(entry.name):
                continue
            target = dest / entry.name
            if entry.is_dir(follow_symlinks=False):
                os.mkdir(target)
                _link_tree(Path(entry.path), target, None)
                shutil.copymode(entry.path, target, follow_symlinks=False)
            else:
                os.link(entry.path, target, follow_symlinks=False)


def _fsync_folders(folder: Path) -> None:
    """Flush the entries of ``folder`` and its subfolders (their files are flushed, or links to flushed files)."""
    for root, _dirs, _files in os.walk(folder):
        fsync_dir(Path(root))


def _sweep(old: Path, new: Path, skip: Callable[[str], bool] | None) -> bool:
    """Move into ``new`` what another process wrote into ``old`` after it was linked: a name ``new`` lacks, or a
    file replaced by a newer one. False when something could not be moved (the caller then keeps ``old``)."""
    complete = True
    with os.scandir(old) as entries:
        for entry in entries:
            if skip is not None and skip(entry.name):
                continue
            target = new / entry.name
            try:
                there = os.lstat(target)
            except FileNotFoundError:
                there = None
            try:
                here = entry.stat(follow_symlinks=False)
                if there is None:
                    os.rename(entry.path, target)
                elif stat.S_ISDIR(here.st_mode) and stat.S_ISDIR(there.st_mode):
                    complete = _sweep(Path(entry.path), target, None) and complete
                elif (here.st_ino, here.st_dev) != (there.st_ino, there.st_dev):
                    if stat.S_ISDIR(here.st_mode) or stat.S_ISDIR(there.st_mode):
                        complete = False
                    elif here.st_mtime_ns > there.st_mtime_ns:
                        os.replace(entry.path, target)
            except OSError:
                complete = False
    return complete


def _move_into(staging: Path, folder: Path, names: list[str]) -> None:
    """The in-place publication: an index of the earlier model without checksums is removed first (its shards
    are about to change, and nothing could tell), then the new files move in, the checksum record last, then the
    earlier model's files this save did not write go."""
    for record in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        path = folder / record
        if path.is_file() and not _has_checksums(path):
            path.unlink()
    fsync_dir(folder)
    for name in names:
        os.replace(staging / name, folder / name)
    fsync_dir(folder)
    removed = False
    for entry in folder.iterdir():
        if entry.name not in names and _OWNED_FILE_RE.match(entry.name) and entry.is_file():
            entry.unlink()
            removed = True
    if removed:
        fsync_dir(folder)


def _has_checksums(index_path: Path) -> bool:
    try:
        meta = read_json(index_path).get("metadata") or {}
        return isinstance(meta, dict) and _CHECKSUMS_KEY in meta
    except (OSError, ValueError, AttributeError):
        return False


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
        raw = loads_json(raw, f"{_TIED_KEY!r} record in {source}", top=None)
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError(f"Invalid {_TIED_KEY!r} record in {source}: expected a mapping of alias name to saved name.")
    return raw


def loads_json(text: str | bytes, source: str | os.PathLike, *, top: type | None = dict,
               error: type[Exception] = ValueError):
    """JSON text from a file (a safetensors header, a metadata string), read by ``accel.core.safe_json``: a number of
    thousands of digits, nesting deeper than it allows, a repeated key or bytes that are not UTF-8 are one line naming
    ``source`` and the key (a ``ValueError``, or ``error``)."""
    from accel.core.safe_json import JSONFileError, parse_json

    try:
        return parse_json(text, str(source), top=top)
    except JSONFileError as exc:
        raise error(str(exc)) from None


def read_json(path: Path, *, top: type | None = dict, error: type[Exception] = ValueError):
    """The JSON content of ``path`` (an index, a checksum record), read by ``accel.core.safe_json`` (at most its
    ``MAX_BYTES``, a regular file; a link is followed); every refusal is one line naming the file."""
    from accel.core.safe_json import JSONFileError
    from accel.core.safe_json import read_json as safe_read_json

    try:
        return safe_read_json(path, top=top)
    except JSONFileError as exc:
        raise error(str(exc)) from None


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


# ------------------------------------------------------------------------------------------ checksums


def _check_own_checksum(record: Path, saved, body: dict) -> None:
    """A checksum record's checksum of its own content: a same-size edit of the record is found too."""
    algorithm = saved.partition(":")[0] if isinstance(saved, str) else None
    try:
        ok = algorithm is not None and saved == manifest_checksum(body, algorithm)
    except (ValueError, RecursionError):  # an unknown algorithm; content nested too deeply to encode again
        ok = False
    if not ok:
        raise CheckpointError(f"{record}: damaged (its content does not match its checksum: edited or corrupted)")


def _verify_files(record: Path, checksums: dict, opened: CheckedFiles | None = None) -> None:
    """Every file ``checksums`` lists (plain names in ``record``'s folder) against its checksum, several at a time;
    the first mismatch (in name order) is one line naming the file. Each is read through a checked descriptor
    (``opened``: the load's record, so the load later reads the file verified here)."""
    opened = opened or checked_files()
    folder = record.parent
    for name, expected in checksums.items():
        if not isinstance(name, str) or not name or any(c in name for c in "/\\\0") or name in (".", ".."):
            raise CheckpointError(f"{record}: damaged (it lists {str(name)[:80]!r}, not a file name)")
        if not isinstance(expected, str):
            raise CheckpointError(f"{record}: damaged (the checksum of {name} is {str(expected)[:80]!r})")
        if not os.path.lexists(folder / name):  # what is there is checked on its descriptor when read
            raise CheckpointError(f"{folder / name}: missing (listed in {record.name})")

    def matches(name: str) -> bool | None:
        try:
            return verify_file_checksum(folder / name, checksums[name], opened)
        except ValueError:  # not a checksum accel knows
            return None

    names = sorted(checksums)
    if len(names) < 2:
        results = [matches(name) for name in names]
    else:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, len(names))) as pool:
            results = list(pool.map(matches, names))
    for name, ok in zip(names, results, strict=True):
        if ok is None:
            raise CheckpointError(f"{record}: damaged (the checksum of {name} is {checksums[name][:80]!r}; allowed: "
                                  "crc32:<8 hex digits> or sha256:<64 hex digits>)")
        if not ok:
            raise CheckpointError(f"{folder / name}: damaged (its bytes do not match the checksum in {record.name}: "
                                  "corrupted or changed since the save)")


def _load_record(path: Path) -> dict:
    content = read_json(path, top=None, error=CheckpointError)  # its one line names the file (unreadable too)
    if not isinstance(content, dict):
        raise CheckpointError(f"{path}: damaged (not a JSON object)")
    return content


def verify_saved_file(path: str | os.PathLike, opened: CheckedFiles | None = None) -> None:
    """Verify one weights file against the checksums of the save it belongs to, when one beside it lists it:
    ``accel_checksums.json`` (a single-file save: every file it lists is verified, ``config.json`` too) or the
    index (that shard). Raises a one-line :class:`CheckpointError` naming a damaged file; a file no record lists
    (written by another tool) passes unchecked. ``opened``: the load's record of the files it checked (a later read
    of the file must find the one verified here)."""
    path = Path(path)
    opened = opened or checked_files()
    folder = path.parent
    sidecar = folder / CHECKSUMS_NAME
    if sidecar.is_file():
        content = _load_record(sidecar)
        if content.get("format") != _CHECKSUMS_FORMAT or not isinstance(content.get("files"), dict):
            raise CheckpointError(f"{sidecar}: damaged (not accel's checksums of a saved model)")
        version = content.get("version")
        if not isinstance(version, int) or version > 1:
            raise CheckpointError(f"{sidecar}: written by a newer accel (format version {version!r})")
        if path.name in content["files"] and _described_by(path, content.get("save_id"), opened):
            _check_own_checksum(sidecar, content.get("checksum"), content)
            _verify_files(sidecar, {path.name: content["files"][path.name]}, opened)  # the file this load reads
            return
    for index_name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        index_path = folder / index_name
        if path.name == index_name or not index_path.is_file():
            continue
        index = _load_record(index_path)
        meta = index.get("metadata")
        checksums = meta.get(_CHECKSUMS_KEY) if isinstance(meta, dict) else None
        if isinstance(meta, dict) and isinstance(checksums, dict) and path.name in checksums:
            _check_own_checksum(index_path, meta.get(_INDEX_CHECKSUM_KEY), _index_body(index))
            _verify_files(index_path, {path.name: checksums[path.name]}, opened)
            return


def _described_by(path: Path, save_id, opened: CheckedFiles) -> bool:
    """Whether a sidecar with `save_id` describes this weights file: a safetensors file another tool wrote over the
    save (transformers' save_pretrained into the same folder) lacks the id in its header, and loads unchecked. A
    header that cannot be read is checked (its checksum then names the damage). Read through a checked descriptor
    (a pipe or device in the file's place is one CheckpointError), never beyond the file's size."""
    if path.suffix != ".safetensors" or not isinstance(save_id, str):
        return True
    try:
        with opened.open(path) as checked:
            length = int.from_bytes(checked.read(0, min(8, checked.size)), "little")
            header = loads_json(checked.read(8, min(length, checked.size - 8, 100_000_000)), path)
        return (header.get("__metadata__") or {}).get(_SAVE_ID_KEY) == save_id
    except (OSError, ValueError, AttributeError, TypeError):
        return True


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
        verify_saved_file(path, opened)
        return [(path, None)], {}
    raise ValueError(
        f"Unsupported checkpoint file {str(path)!r}: expected .safetensors, .bin, .pt, .pth or an index .json."
    )


@contextmanager
def safe_open_checked(path: str | os.PathLike, opened: CheckedFiles | None = None, device="cpu") -> Iterator:
    """safetensors' ``safe_open`` of ``path`` through a descriptor checked to be a regular file (``opened``: the
    load's record, so it is the file checked before): safetensors maps the file the descriptor holds, by its name
    (``CheckedFile.name``), so the file is never read whole into memory, and a pipe or device that took the name
    after a check is one CheckpointError line, never a hang."""
    from safetensors import safe_open

    with (opened or checked_files()).open(path) as checked:
        _check_declared_size(checked, Path(path))
        try:
            handle = safe_open(checked.name, framework="pt", device=device)
        except Exception as exc:
            raise RuntimeError(f"Could not read safetensors file {str(path)!r}: {exc}") from exc
    with handle as f:
        yield f


_MAX_HEADER = 100_000_000  # safetensors' own limit on a header


def _check_declared_size(checked, path: Path) -> None:
    """A safetensors file holds the bytes its header declares (8 + the header + the last tensor's end): a shorter
    one (cut by a copy, or replaced) is one CheckpointError line naming both sizes; what else is wrong with the
    header is left to safetensors, which names it."""
    if checked.size < 8:
        raise CheckpointError(f"{path}: damaged (size {checked.size} bytes; allowed: a safetensors file, at least 8)")
    length = int.from_bytes(checked.read(0, 8), "little")
    if length > min(checked.size - 8, _MAX_HEADER):
        raise CheckpointError(f"{path}: damaged (size {checked.size} bytes, its header alone declares {8 + length})")
    try:
        header = json.loads(checked.read(8, length))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        declared = 8 + length + int(end)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return  # not a header safetensors reads: it says so itself
    if checked.size < declared:
        raise CheckpointError(f"{path}: damaged (size {checked.size} bytes, its header declares {declared})")


_PICKLE_ALLOWED = ("allowed: tensors and plain containers (dict, list, tuple, str, int, float, bool, None); "
                   "convert the file to safetensors to load it without pickle")


class UnsafeWeightsError(pickle.UnpicklingError, RuntimeError):
    """A torch file the weights-only unpickler refuses: an ``UnpicklingError`` as Accelerate's load raises, and a
    ``RuntimeError`` as accel's did."""


def torch_load_weights(path: str | os.PathLike, opened: CheckedFiles | None = None):
    """``torch.load(path, weights_only=True)`` on the CPU. A file the weights-only unpickler refuses (a pickle that
    would import a function or build an object: ``os.system``, a class of the saving script) is one line naming the
    file and what it asked for (:class:`UnsafeWeightsError`); nothing of the file runs. What weights_only admits but
    could allocate at the pickle's word (``bytearray(2**28)`` from a 150-byte record, a tensor reaching past its
    storage) is refused first by accel.checkpoint.torch_file, as is a pre-1.6 (non-zip) file. Another failure (a
    truncated archive) is one ``RuntimeError`` line. The check and torch read the same file, through one checked
    descriptor (``opened``: the load's record): a pipe or device there is one CheckpointError line."""
    with (opened or checked_files()).open(path) as checked:
        return _torch_load_checked(Path(path), checked.name)


def _torch_load_checked(path: Path, name: str):
    """`torch_load_weights` of the file opened as `name` (its checked descriptor's); messages name `path`."""
    from accel.checkpoint.torch_file import TorchFileError, check_torch_zip

    try:
        check_torch_zip(name, str(path))
    except TorchFileError as exc:
        what = str(exc).removeprefix(f"{path}: ").split("; allowed:")[0]
        raise UnsafeWeightsError(f"{path}: refused before torch.load(weights_only=True): {what}; "
                                 f"{_PICKLE_ALLOWED}") from None
    try:
        return torch.load(name, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeWeightsError(f"{path}: refused by torch.load(weights_only=True): {_refused_global(exc)}; "
                                 f"{_PICKLE_ALLOWED}") from None
    except Exception as exc:
        raise RuntimeError(f"{path}: cannot be read by torch.load(weights_only=True) ({_first_line(exc)}); "
                           f"{_PICKLE_ALLOWED}") from None


def _refused_global(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused, from its message (``GLOBAL posix.system``), in a few words."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"the pickle imports {found.group(1)}"
    found = re.search(r"[Uu]nsupported operand (\S+)", text)
    if found:
        return f"the pickle uses opcode {found.group(1)}"
    for line in text.splitlines():  # torch's first line is the generic 'Weights only load failed. ...'
        if line.strip() and not line.startswith("Weights only load failed") and "torch.load" not in line:
            return line.strip()[:200]
    return "the pickle holds something other than tensors"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0][:200] if lines else type(exc).__name__)


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
