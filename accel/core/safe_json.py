"""Reading a JSON file that came from outside this process (a checkpoint's manifest, an index, an RNG state, an
offload folder's index): bounded, and every refusal one line naming the file.

`read_json(path)` reads at most `max_bytes` of a regular file (a FIFO or a device is refused before it is read:
nothing blocks), decodes UTF-8 (a BOM is fine) and parses it with Python's json, then checks what Python's json
does not bound:

* integers of at most MAX_INT_DIGITS digits (Python's own limit, 4300 digits, raises a ValueError naming neither
  the file nor the key);
* at most `max_depth` levels of objects and arrays (Python's parser would recurse until RecursionError);
* each key of an object once (a second value for a key would silently replace the first);
* the top level of the expected type (an object by default).

A refusal is `error(message)` (JSONFileError, a ValueError, unless the caller passes its own class, such as
CheckpointError), the message one line: `<file>: key 'a.b[3]': <what is wrong: the value, shortened>; allowed:
<what is>`. `parse_json(data, source)` checks text already in memory (a safetensors header) the same way.
"""

from __future__ import annotations

import json
import os
from typing import Any

MAX_BYTES = 64 << 20  # 64 MiB: a manifest or a 100k-tensor index is a few MB; Python's objects take ~10x the text
MAX_DEPTH = 100  # levels of objects and arrays: accel writes fewer than 20 (a registered object's own nesting adds)
MAX_INT_DIGITS = 128  # sizes, offsets, seeds and RNG words are at most 20 digits


class JSONFileError(ValueError):
    """A JSON file (or text) that is refused: the message is one line naming the file, what is wrong with it and
    what is allowed."""


class _LongInt:
    """Stands in for an integer literal over MAX_INT_DIGITS digits until the walk names its key."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


class _Duplicate:
    """Stands in for an object that names a key twice until the walk names where it is."""

    __slots__ = ("key",)

    def __init__(self, key: str):
        self.key = key


def short(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to about `limit` characters (a hostile value can be megabytes long)."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    text = repr(value) if not isinstance(value, _LongInt) else value.text
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def key_path(parts: list | tuple) -> str:
    """`a.b[3].c` for the keys and indices leading to a value (a key that is not a plain name is quoted)."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part and part.replace("_", "a").replace("-", "a").isalnum():
            text += f".{part}" if text else part
        else:
            text += f"[{short(part, 40)}]"
    return text if len(text) <= 100 else text[:60] + "..." + text[-37:]


def _at(where: tuple) -> str:
    return f"key {key_path(where)!r}" if where else "its top level"


def read_json(path: str | os.PathLike, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
              top: type | tuple[type, ...] | None = dict, error: type[Exception] = JSONFileError) -> Any:
    """The parsed content of the JSON file `path`, checked as the module says; `error(one line)` otherwise. A
    missing or unreadable file is `error` too (`<file>: cannot be read (No such file or directory)`)."""
    data = read_bounded(path, max_bytes, "a JSON file", error)
    return parse_json(data, str(path), max_depth=max_depth, top=top, error=error)


def read_bounded(path: str | os.PathLike, max_bytes: int, allowed: str, error: type[Exception]) -> bytes:
    """The bytes of `path`, a regular file (a link to one is followed) of at most `max_bytes`, read through the
    descriptor that was checked (`accel.core.checked_file`: a pipe or device is refused without blocking, even one
    that replaced the file after a check by name) and never beyond the size checked; `error(one line)` naming the
    file and `allowed` (what the file should be) otherwise."""
    from accel.core.checked_file import open_checked

    with open_checked(path, error=error, allowed=allowed) as checked:
        if checked.size > max_bytes:
            raise error(f"{path}: {checked.size} bytes; allowed: {allowed} of at most {_size(max_bytes)}")
        return checked.read()


def parse_json(data: bytes | str, source: str, *, max_depth: int = MAX_DEPTH,
               top: type | tuple[type, ...] | None = dict, error: type[Exception] = JSONFileError) -> Any:
    """`data` parsed and checked as `read_json` checks a file's content; `source` names it in the messages."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise error(f"{source}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); allowed: "
                        "a UTF-8 JSON file") from None
    else:
        text = data
    try:
        value = json.loads(text, parse_int=_parse_int, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise error(f"{source}: not JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); allowed: a JSON "
                    "file as accel writes it") from None
    except RecursionError:
        raise error(f"{source}: nested too deeply for the parser; allowed: at most {max_depth} levels of objects "
                    "and arrays") from None
    except ValueError as exc:  # what json.loads raises beyond its decode errors
        raise error(f"{source}: not JSON ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                    "allowed: a JSON file as accel writes it") from None
    _walk(value, source, max_depth, error)
    if top is not None and not isinstance(value, top):
        wanted = " or ".join(_KINDS.get(t, t.__name__) for t in (top if isinstance(top, tuple) else (top,)))
        raise error(f"{source}: its top level is {_kind(value)}; allowed: {wanted}")
    return value


def _parse_int(text: str) -> Any:
    digits = len(text) - text.startswith("-")
    return int(text) if digits <= MAX_INT_DIGITS else _LongInt(text)


def _object(pairs: list) -> Any:
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                return _Duplicate(key)
            seen.add(key)
    return found


def _walk(value: Any, source: str, max_depth: int, error: type[Exception]) -> None:
    """Refuse what the parser let through (long integers, repeated keys, depth), naming the key path."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        elif isinstance(node, _LongInt):
            raise error(f"{source}: {_at(where)}: an integer of {len(node.text.lstrip('-'))} digits "
                        f"({short(node, 24)}); allowed: integers of at most {MAX_INT_DIGITS} digits")
        elif isinstance(node, _Duplicate):
            raise error(f"{source}: {_at(where)}: names the key {short(node.key, 40)} twice; allowed: "
                        "each key of an object once")
        else:
            continue
        if depth >= max_depth:
            raise error(f"{source}: {_at(where)}: nested more than {max_depth} levels deep; allowed: at "
                        f"most {max_depth} levels of objects and arrays")
        for key, child in items:
            if isinstance(child, (dict, list, _LongInt, _Duplicate)):
                stack.append((child, (*where, key), depth + 1))


_KINDS = {dict: "a JSON object", list: "a JSON array", str: "a string", int: "an integer", float: "a number",
          bool: "true or false", type(None): "null"}


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


__all__ = ["JSONFileError", "MAX_BYTES", "MAX_DEPTH", "MAX_INT_DIGITS", "key_path", "parse_json", "read_bounded",
           "read_json", "short"]
