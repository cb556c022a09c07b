"""Writing model weights in Hugging Face's layout (`save_state_dict_sharded`): tensors planned into shards (tied
weights once), every file checksummed, the save built beside its folder and swapped in whole, keeping the
folder's other files.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from accel.checkpoint.layout import (
    PublishLock,
    atomic_write,
    file_checksums,
    fsync_dir,
    manifest_checksum,
    remove_stale_temporaries,
    swap_in,
    temporary_sibling,
    write_json,
)
from accel.checkpoint.model_files import (
    CHECKSUMS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    _CHECKSUMS_FORMAT,
    _CHECKSUMS_KEY,
    _INDEX_CHECKSUM_KEY,
    _OWNED_FILE_RE,
    _SAVE_ID_KEY,
    _TIED_KEY,
    _index_body,
    _is_model_file,
    _shard_name,
    parse_size,
    read_json,
)
from accel.checkpoint.model_state import _view_key


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


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
