"""Runs one of Accelerate's own test scripts (`accelerate/test_utils/scripts/NAME.py`) and records, per test
function that its `main()` calls, whether it passed on this rank: one JSON line per call in OUT/rank{R}.jsonl,
written as soon as the call ends (a later hang or crash keeps the earlier results).

Under `accel launch --accelerate_shim` its `import accelerate` gives accel; under `torchrun` with the real
Accelerate installed, the same runner measures Accelerate itself. A failing function's exception is recorded and
`main()` goes on with the next one, so one failure does not hide the others."""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import traceback


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 and sys.argv[3] else None
    os.makedirs(out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    log = open(os.path.join(out, f"rank{rank}.jsonl"), "a", buffering=1)
    module = importlib.import_module(f"accelerate.test_utils.scripts.{name}")
    depth = [0]
    me = os.getpid()  # processes forked by notebook_launcher inherit the wrappers: they do not record

    def record(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if depth[0] or os.getpid() != me:
                return function(*args, **kwargs)  # a helper called by a test function, or in a forked worker
            if only is not None and function.__name__ not in only:
                return None
            depth[0] += 1
            entry = {"function": function.__name__, "args": _describe(args, kwargs)}
            try:
                result = function(*args, **kwargs)
                entry["ok"] = True
                return result
            except BaseException as exc:  # noqa: BLE001 (the record is the point; SystemExit too)
                entry.update(ok=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                             where=_where(exc))
                return None
            finally:
                depth[0] -= 1
                log.write(json.dumps(entry) + "\n")

        return wrapper

    for attr, value in list(vars(module).items()):
        if callable(value) and getattr(value, "__module__", None) == module.__name__ and attr != "main" \
                and not isinstance(value, type):
            setattr(module, attr, record(value))
    module.main()
    log.write(json.dumps({"function": "<main finished>", "ok": True}) + "\n")


def _describe(args, kwargs) -> str:
    parts = [type(a).__name__ if not isinstance(a, (bool, int, str, float)) else repr(a) for a in args]
    parts += [f"{k}={v!r}" if isinstance(v, (bool, int, str, float)) else f"{k}={type(v).__name__}"
              for k, v in kwargs.items()]
    return ", ".join(parts)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


if __name__ == "__main__":
    main()
