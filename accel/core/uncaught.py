"""What an exception that nothing catches prints, in a process that imported accel.

* accel's one-line errors (`ConfigError` and its subclasses, `ClusterEnvError`: a message that names the value, where
  it came from and what is allowed) reach the top of a script as that line alone, `accel: error: <message>`, under
  plain `python` or `torchrun` too: their traceback shows only accel's own frames (the script can still catch them).
* In a worker of a multi-process `accel launch` (`ACCEL_DIAGNOSTICS_DIR` and torchrun's `TORCHELASTIC_ERROR_FILE`
  set) the worker prints nothing: the exception goes to torchrun's error file, in torch's own format (what
  `torch.distributed.elastic.multiprocessing.errors.record` writes) with a few fields of accel's, and the launcher
  prints it once: its summary line naming the rank and the exception first, then that rank's traceback, then one line
  for each other rank (accel.cli.failure_report). A KeyboardInterrupt (the launcher passes Ctrl-C on) is held the same
  way: the launcher's one line says it. When the file cannot be written, the exception is printed as usual.
* `ACCEL_FULL_TRACEBACKS=1`: every exception is printed as Python prints it, by every rank, one-line errors included
  (and the launcher shows torchrun's own log lines and the stacks of the ranks that only waited).

The hook is installed by `import accel` (a worker forked by `accel launch` inherits it) and reads the environment
when an exception arrives. A hook the script installs later (rich's, say) takes over from it.
"""

from __future__ import annotations

import os
import sys

FULL_ENV = "ACCEL_FULL_TRACEBACKS"
DIR_ENV = "ACCEL_DIAGNOSTICS_DIR"  # accel.core.diagnostics.DIR_ENV: set by `accel launch` in its workers
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun's: where a worker leaves its exception for the agent
ONE_LINE_ERRORS = ("ConfigError", "ClusterEnvError")  # known by name: they live in layers above this one
INFO_KEY = "accel"  # accel's fields in the error file's extraInfo (torch keeps and ignores them)


def full() -> bool:
    """`ACCEL_FULL_TRACEBACKS` asks for every traceback, as Python prints it."""
    return os.environ.get(FULL_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_one_line(exc_type: type) -> bool:
    """One of accel's one-line errors (or a subclass)."""
    return any(cls.__name__ in ONE_LINE_ERRORS and cls.__module__.startswith("accel.")
               for cls in getattr(exc_type, "__mro__", ()))


def one_line(exc: BaseException) -> str:
    """The exception's text on one line."""
    return " ".join(str(exc).split())


_LAUNCHERS: set[int] = set()  # processes that run torchrun's agent: never a worker (a forked worker has its own pid)


def not_a_worker() -> None:
    """This process is `accel launch` itself: its own exceptions are printed, whatever its environment holds."""
    _LAUNCHERS.add(os.getpid())


def error_file() -> str | None:
    """The error file of a worker started by `accel launch`, else None."""
    if not os.environ.get(DIR_ENV) or os.getpid() in _LAUNCHERS:
        return None
    return os.environ.get(ERROR_FILE_ENV) or None


def write_error_file(path: str, exc_type: type, exc: BaseException, tb, printed: bool) -> bool:
    """Write the exception as torch's `ErrorHandler.record_exception` does (its message and traceback), plus accel's
    fields: whether it is a one-line error, whether the worker printed it itself, when (ns). Written whole or not at
    all (the agent parses it). Returns whether it was written."""
    import json
    import time
    import traceback

    text = one_line(exc)
    try:
        stack = "".join(traceback.format_exception(exc_type, exc, tb))
    except Exception:  # an exception whose formatting fails: its type and text still go
        stack = f"{exc_type.__name__}: {text}\n"
    data = {"message": {
        "message": f"{exc_type.__name__}: {text}" if text else exc_type.__name__,
        "extraInfo": {
            "py_callstack": stack,
            "timestamp": str(int(time.time())),
            INFO_KEY: {"one_line": is_one_line(exc_type), "line": text, "printed": printed,
                       "time_ns": time.time_ns()},
        },
    }}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - never hide the user's exception behind our own
        try:
            os.remove(tmp)
        except OSError:
            pass
        return False
    return True


_installed: list[bool] = []


def install() -> None:
    """Put the hook in front of `sys.excepthook` (once per interpreter)."""
    if _installed:
        return
    _installed.append(True)
    previous = sys.excepthook

    def report(exc_type, exc, tb):
        everything = full()
        path = error_file()
        if path is not None and write_error_file(path, exc_type, exc, tb, printed=everything) and not everything:
            return  # the launcher prints it, once
        if not everything and is_one_line(exc_type):
            sys.stdout.flush()
            sys.stderr.write(f"accel: error: {one_line(exc)}\n")
            sys.stderr.flush()
            return
        previous(exc_type, exc, tb)

    sys.excepthook = report
