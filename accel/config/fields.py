"""Config field specs: how a field is declared (`spec`), what it allows in words, how a value is checked, and the
unknown-key errors. Every section of the config tree (accel/config/schema.py, accel/config/parallelism.py) declares
its fields with `spec`; the launch flags, the `accel config` questions and the reference pages are generated from
the same declarations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accel.config.errors import ConfigError, shown

# The ranges every config value is checked against, where it enters (a file, a flag, an answer, an argument), so a
# value no consumer can take never reaches a worker or torchrun:
C_INT_MAX = 2**31 - 1  # a C int: what torch and torchrun take for sizes, ranks, counts (every int key's default bound)
INT64_MAX = 2**63 - 1  # counts of parameters
# processes `accel launch` starts on one machine: more than the largest machines have cores (a typo such as 1000000
# would fork that many processes before anything could fail)
MAX_PROCESSES_PER_MACHINE = 4096
# Seconds: a year. timedelta, threading.Timer (at most threading.TIMEOUT_MAX), time.sleep and torch's millisecond
# timeouts (int64) all take it; beyond it a value is a mistake (1e308, a duration in milliseconds, ...).
MAX_SECONDS = 365 * 24 * 3600
# a host name, IPv4 or IPv6 address as torchrun's rendezvous endpoint takes it ([\w.:-]+, brackets for IPv6); not
# starting with "-" (it would read as an option of torchrun or ssh)
HOST_PATTERN = r"(?!-)[\w.:-]{1,253}|\[[0-9A-Fa-f:.%\w]{1,251}\]"


def spec(default: Any, kind: type, *, choices: tuple = (), lo: float | None = None, hi: float | None = None,
         optional: bool = False, help: str = "", unit: str = "", pattern: str = "", what: str = "",
         ask: str = "") -> Any:
    """A config field: its kind and allowed values. An int without `hi` is bounded by C_INT_MAX (named in a message
    only to a value above it); `unit` names what a number counts ("seconds"); a string with `pattern` must match it
    whole, and `what` says in words what it must be. `help` is the field's meaning (the launch flag's help and the
    reference row); `ask` is the question `accel config` asks for it (none: not asked)."""
    meta = {"kind": kind, "choices": choices, "lo": lo, "hi": hi, "optional": optional, "help": help, "unit": unit,
            "pattern": pattern, "what": what, "ask": ask}
    if kind is int and hi is None:
        meta.update(hi=C_INT_MAX, hi_implicit=True)
    return field(default=default, metadata=meta)


def allowed_values(meta: Mapping, value: Any = None) -> str:
    """What a field allows, in words. An int's implicit bound (C_INT_MAX) is named only when `value` is above it."""
    kind, choices, lo, hi = meta["kind"], meta["choices"], meta["lo"], meta["hi"]
    if meta.get("hi_implicit") and not (isinstance(value, int) and not isinstance(value, bool) and value > hi):
        hi = None
    if choices:
        text = "one of " + ", ".join(choices)
    elif kind is bool:
        text = "true or false"
    elif kind is dict:
        text = "a mapping of module names to style names"
    elif kind is list:
        text = "a list of module names"
    elif kind in (int, float):
        noun = "an integer" if kind is int else "a number"
        if meta.get("unit"):
            noun = f"a finite number of {meta['unit']}" if kind is float else f"a number of {meta['unit']}"
        if lo is not None and hi is not None:
            text = f"{noun} from {lo} to {hi}"
        elif lo is not None:
            text = f"{noun} >= {lo}"
        else:
            text = noun
    else:
        text = meta.get("what") or "a string"
    if meta.get("auto"):
        text += ' or "auto"'
    return text + (" (or null)" if meta["optional"] else "")


def check_value(value: Any, meta: Mapping, key: str, source: str) -> Any:
    """Return `value` in canonical form, or raise ConfigError naming source/key/value/allowed."""

    def fail() -> None:
        raise ConfigError(f"{source}: key '{key}': bad value {shown(value)}; allowed: {allowed_values(meta, value)}")

    kind = meta["kind"]
    if value is None:
        if meta["optional"]:
            return None
        fail()
    if kind is bool:
        if not isinstance(value, bool):
            fail()
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail()
        if (meta["lo"] is not None and value < meta["lo"]) or (meta["hi"] is not None and value > meta["hi"]):
            fail()
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail()
        if (meta["lo"] is not None and value < meta["lo"]) or (meta["hi"] is not None and value > meta["hi"]):
            fail()
        return float(value)
    if kind is list:  # of names; a comma-separated string is accepted too (launch flags)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            fail()
        return list(value)
    if kind is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            fail()
        return dict(value)
    # strings
    if key.endswith("gpu_ids") and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        fail()
    if meta.get("pattern") and not re.fullmatch(meta["pattern"], value):
        fail()
    if meta["choices"]:
        for choice in meta["choices"]:
            if value.lower() == choice.lower():
                return choice
        fail()
    return value


def validate_fields(obj: Any, source: str) -> None:
    """Check every spec'd field of the dataclass `obj` and store its canonical value; ConfigError names `source`."""
    for f in dataclasses.fields(obj):
        if "kind" in f.metadata:
            setattr(obj, f.name, check_value(getattr(obj, f.name), f.metadata, f.name, source))


def field_specs(cls: type) -> dict[str, Mapping]:
    """Name -> spec of each field of `cls` declared with `spec`, in declaration order."""
    return {f.name: f.metadata for f in dataclasses.fields(cls) if "kind" in f.metadata}


@dataclass(frozen=True)
class _Unknown:
    name: str                # as shown, with its section (`parallelism.tp_sise`)
    close: str | None        # the known key it most likely meant
    where: str               # the section ("parallelism."), "" at the top level
    known: tuple[str, ...]   # the keys known there


class UnknownKeyError(ConfigError):
    """One or more unknown keys of one source, named in one line: `unknown_key` makes one, `UnknownKeys` joins those
    of a whole layer so that every typo is named at once."""

    def __init__(self, source: str, unknown: list[_Unknown]):
        self.source, self.unknown = source, unknown
        super().__init__(_unknown_message(source, unknown))


def _unknown_message(source: str, unknown: list[_Unknown]) -> str:
    if len(unknown) == 1:
        one = unknown[0]
        hint = f"did you mean '{one.close}'?" if one.close else f"known keys: {', '.join(sorted(one.known))}"
        return f"{source}: unknown key '{one.name}'; {hint}"
    names = ", ".join(f"'{u.name}'" + (f" (did you mean '{u.close}'?)" if u.close else "") for u in unknown)
    known = {u.where: u.known for u in unknown if not u.close}  # one list per section with a key matching nothing
    tails = [f"known {where.rstrip('.') + ' ' if where else ''}keys: {', '.join(sorted(keys))}"
             for where, keys in known.items()]
    return f"{source}: unknown keys {names}" + "".join(f"; {tail}" for tail in tails)


def unknown_key(key: str, known: tuple[str, ...] | list[str], source: str, where: str = "") -> UnknownKeyError:
    name = str(key) if isinstance(key, str) and len(key) <= 60 and key.isprintable() else shown(key).strip("'\"")
    close = difflib.get_close_matches(str(key)[:100], list(known), n=1, cutoff=0.6)
    return UnknownKeyError(source, [_Unknown(f"{where}{name}", close[0] if close else None, where, tuple(known))])


class UnknownKeys:
    """Every unknown key of a layer, named at once: run each key's check under `check()`; an unknown key is kept and
    the next key checked. Once one was found, another mistake (a bad value) is not raised: the unknown keys came
    first and are what `raise_found()` names, in one line."""

    def __init__(self, source: str):
        self.source = source
        self.found: list[_Unknown] = []

    @contextlib.contextmanager
    def check(self):
        try:
            yield
        except UnknownKeyError as exc:
            self.found.extend(exc.unknown)
        except ConfigError:
            if not self.found:
                raise

    def raise_found(self) -> None:
        if self.found:
            raise UnknownKeyError(self.source, self.found)
