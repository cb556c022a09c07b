"""Hugging Face's weights layout by name: the weights and index file names, shard names, the keys accel adds to
an index or a header (checksums, the save's id, tied names), sizes such as "5GB", and the JSON of an index.

The writer and the reader of model weights (`model_writer`, `model_reader`) both follow these names.
"""

from __future__ import annotations

import os
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path




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


def _shard_name(base: str, index: int, total: int) -> str:
    stem, ext = base.rsplit(".", 1)
    return f"{stem}-{index:05d}-of-{total:05d}.{ext}"


def _index_body(index: dict) -> dict:
    """What an index's own checksum covers: all of it but that checksum (``manifest_checksum`` skips only a
    top-level ``checksum``)."""
    meta = {k: v for k, v in (index.get("metadata") or {}).items() if k != _INDEX_CHECKSUM_KEY}
    return {k: v for k, v in index.items() if k not in ("metadata", "checksum")} | {"metadata": meta}


def _is_model_file(name: str, new: set[str]) -> bool:
    """A file of the model saved in a folder (this save's, or an earlier one's weights, index, checksums)."""
    return name in new or _OWNED_FILE_RE.match(name) is not None


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
