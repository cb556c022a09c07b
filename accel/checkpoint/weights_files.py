"""One weights file read safely: its checksum verified against the save's index or sidecar, safetensors opened
through a descriptor checked to be a regular file of its declared size, `.bin` files through
`torch.load(weights_only=True)` only (never an arbitrary pickle).
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from accel.checkpoint.layout import (
    CheckpointError,
    checked_files,
    manifest_checksum,
    verify_file_checksum,
)
from accel.core.checked_file import CheckedFiles
from accel.checkpoint.model_files import (
    CHECKSUMS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    WEIGHTS_INDEX_NAME,
    _CHECKSUMS_FORMAT,
    _CHECKSUMS_KEY,
    _INDEX_CHECKSUM_KEY,
    _SAVE_ID_KEY,
    _index_body,
    loads_json,
    read_json,
)


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
