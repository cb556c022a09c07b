"""What the input fuzzers share: `accel` run in this process (a subprocess per example would cost a second each), the
rule every bad input must follow, and hypothesis strategies for the values a new user's mistakes are made of.

The rule (docs/troubleshooting.md): an `accel` command either succeeds (exit 0) or fails with exit code 2 and
exactly one line on stderr, `accel <command>: error: ...`, no traceback. A Python exception escaping `main` is a
failure of the rule too (it would print a traceback).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# edge numbers: what overflows a C int, a timedelta, a platform's time, or is no number at all
# the fuzzers' settings: derandomized (CI runs the same examples every time), no example database, no deadline (a
# busy machine); ACCEL_FUZZ_SCALE=10 runs ten times the examples, by hand
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
SCALE = float(os.environ.get("ACCEL_FUZZ_SCALE", "1"))

EDGE_NUMBERS = [0, -1, 1, 2, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e308, math.inf, -math.inf, math.nan, 0.5, -0.0,
                1e-320]
EDGE_TEXTS = ["", " ", "\t", "-1", "nan", "inf", "1e308", "9" * 40, "x" * 10_000, "yes", "null", "~", "[]", "{}",
              "\u00e9\u00e8", "\x00", "a\nb", "--help", "0x10", "1_000"]


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    def follows_the_rule(self) -> bool:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        if self.code == 0:
            return "Traceback" not in self.stderr
        return (self.code == 2 and len(lines) == 1 and lines[0].startswith("accel") and ": error: " in lines[0]
                and "Traceback" not in self.stderr)

    def __str__(self) -> str:
        return f"exit {self.code}; stderr:\n{self.stderr[-3000:]}"


def run_accel(argv: list[str], stdin: str | None = None, show_warnings: bool = False) -> Outcome:
    """`accel ARGV...` in this process: its exit code (SystemExit's too) and what it wrote. An exception that escapes
    is returned as exit code 1 with its traceback text, so the rule check fails with the traceback shown. `stdin`:
    what the command reads from its standard input (e.g. "" for `accel config` with no answers). `show_warnings`:
    Python warnings are written to its stderr as a fresh `accel` process would print them (pytest otherwise keeps
    them), so a warning before an error line counts against the rule."""
    import traceback

    from accel.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    feed = contextlib.nullcontext() if stdin is None else _stdin(stdin)
    shown = _warnings_to(err) if show_warnings else contextlib.nullcontext()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), feed, shown:
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        except BaseException:  # noqa: BLE001 (the rule's failure: shown, not raised)
            err.write(traceback.format_exc())
            code = 1
    return Outcome(int(code), out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _warnings_to(err: io.StringIO):
    """Python's default warning filters (each warning shown; deprecations and resource warnings not), written to
    `err` as the interpreter writes them."""
    import warnings

    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("always")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        yield


def scalars() -> st.SearchStrategy:
    """Values of every JSON/YAML scalar kind, edges first."""
    return st.one_of(st.sampled_from(EDGE_NUMBERS), st.sampled_from(EDGE_TEXTS), st.booleans(), st.none(),
                     st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30))


def wrong_values() -> st.SearchStrategy:
    """Scalars, lists and mappings of them, and deep nesting: what a config key may be given by mistake."""
    nested = st.recursive(scalars(), lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                          max_leaves=6)
    deep = st.integers(min_value=50, max_value=5000).map(lambda depth: _nest(depth))
    return st.one_of(scalars(), nested, deep)


def _nest(depth: int):
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def flag_values() -> st.SearchStrategy:
    """What a command-line flag may be given: edge numbers and texts as strings, and random text."""
    return st.one_of(st.sampled_from([str(n) for n in EDGE_NUMBERS]), st.sampled_from(EDGE_TEXTS),
                     st.text(max_size=20))


@contextlib.contextmanager
def _stdin(text: str):
    import sys

    saved = sys.stdin
    sys.stdin = io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def dump_text(value: object, fmt: str = "json") -> str:
    """`value` as JSON or YAML flow text, without recursion (so `_nest`'s 5000 levels can be written): what a user's
    file with that value holds. YAML floats are written as YAML reads them back (1.0e+308, .inf, .nan)."""
    scalar = _json_scalar if fmt == "json" else _yaml_scalar
    out: list[str] = []
    stack: list[tuple[bool, object]] = [(False, value)]  # (is literal text, item)
    while stack:
        literal, item = stack.pop()
        if literal:
            out.append(str(item))
        elif isinstance(item, dict):
            parts: list[tuple[bool, object]] = [(True, "{")]
            for i, (key, sub) in enumerate(item.items()):
                parts += [(True, (", " if i else "") + _json_scalar(str(key)) + ": "), (False, sub)]
            stack += reversed(parts + [(True, "}")])
        elif isinstance(item, (list, tuple)):
            parts = [(True, "[")]
            for i, sub in enumerate(item):
                parts += [(True, ", ")] * bool(i) + [(False, sub)]
            stack += reversed(parts + [(True, "]")])
        else:
            out.append(scalar(item))
    return "".join(out)


def _json_scalar(value: object) -> str:
    import json

    return json.dumps(value)  # NaN/Infinity as Python's json writes and reads them


def _yaml_scalar(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return (mantissa if "." in mantissa else mantissa + ".0") + e + exponent  # YAML 1.1 floats need a dot
    return _json_scalar(value)  # null, true/false, integers and double-quoted strings read the same in YAML


def nested_text(depth: int, opener: str = "[", key: str | None = None) -> str:
    """JSON/YAML flow text nested `depth` levels deep (lists with "[", mappings with "{"), under `key` if given."""
    inner = "[" * depth + "1" + "]" * depth if opener == "[" else '{"k": ' * depth + "1" + "}" * depth
    return inner if key is None else "{" + _json_scalar(key) + ": " + inner + "}"


def bad_encodings(text: str) -> st.SearchStrategy:
    """The bytes of a good `text` file saved wrongly: UTF-16, Latin-1 (an accent is then no UTF-8), a BOM, an
    invalid byte or a NUL at some place, a multi-byte character cut in half."""
    accented = text + " \u00e9"
    return st.one_of(
        st.sampled_from([text.encode("utf-16"), accented.encode("latin-1"), b"\xef\xbb\xbf" + text.encode(),
                         accented.encode()[:-1], text.encode("utf-32")]),
        st.tuples(st.integers(min_value=0, max_value=len(text)), st.sampled_from([b"\xff", b"\x00", b"\xc3", b"\x80"]))
        .map(lambda at: text.encode()[:at[0]] + at[1] + text.encode()[at[0]:]))
