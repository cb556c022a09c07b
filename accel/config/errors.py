"""The config's one error type (below every config module, so each can raise it), and how a bad value is shown."""

from __future__ import annotations

import reprlib


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the source, the key, the value and what is allowed."""


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 60, 60, 40
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 6


def shown(value: object) -> str:
    """`repr(value)` for an error message, bounded: a huge string, a long number or a deeply nested list is shortened
    with "..." (and never recurses deeply), so the message stays one readable line."""
    if isinstance(value, int) and value.bit_length() > 10_000:  # repr() refuses above 4300 digits
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    try:
        return _SHOWN.repr(value)
    except Exception:  # noqa: BLE001 (an object whose repr fails is still named)
        return f"<a {type(value).__name__}>"


# How deep a config file, a DeepSpeed JSON or a value in them may nest (theirs are 3 or 4 levels): deeper input is
# refused in one line before Python's recursion limit is near (reading, copying or showing it).
MAX_NESTING = 64


def nesting_depth(value: object, limit: int = MAX_NESTING) -> int:
    """How deep `value`'s lists and mappings nest (a scalar: 0), counted without recursion and only up to
    `limit` + 1."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest
