"""What a worker leaves behind when a collective hangs, so `accel launch` can say which rank was stuck and where.

A collective that one process never reaches makes the others wait until their process group's timeout
(`collective_timeout`); then the waiting ones fail (gloo raises in Python; NCCL's watchdog aborts the process after
dumping its flight recorder). The waiting ones cannot say who is missing, and the missing one says nothing at all.
So, in every worker `accel launch` started (it sets `ACCEL_DIAGNOSTICS_DIR`), `PartialState` calls
`install_worker_hooks`:

* `faulthandler` is registered on SIGUSR1, writing every thread's Python stack to `stack_rank<R>.txt`: the launcher
  asks the workers still running for their stacks before it stops them (faulthandler answers even while the main
  thread is blocked in C++, where a Python signal handler would never run). The file exists only once the hook is
  in place, and the launcher signals only ranks that have it (SIGUSR1's default action would kill the others); from
  then on SIGUSR1 never kills the worker, even while it shuts down.
* `sys.excepthook` writes `collective_rank<R>.json` when the uncaught exception is a failed collective: which one
  (from the traceback, else torch's flight recorder, which records every collective's name), whether it ran in
  backward, when it started (the flight recorder's wall-clock time: the launcher tells a peer that exited before
  it from one that exited while it waited), the message and the traceback's frames. Then the exception goes on to
  `accel.core.uncaught`'s hook, which leaves it (traceback and all) to the launcher to print once.
* When the script ends (it returned, called sys.exit, or raised), `ended_rank<R>.txt` gets the time, written at
  the start of the interpreter's shutdown, before `PartialState` destroys the process group (which is what makes
  the peers' collectives fail). The launcher then names a rank that left while the others waited in a collective,
  and lets it finish exiting instead of stopping it with the rest.

The launcher side (reading these and printing the report) is `accel/cli/hang_report.py`; the parsing helpers both
sides share are at the end of this module.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

from accel.core.uncaught import DIR_ENV  # the run folder `accel launch` chose; unset: no files, no hooks

STACK_SIGNAL = signal.SIGUSR1  # not among the signals torchrun forwards (SIGTERM, SIGINT, SIGHUP, SIGQUIT)
FLIGHT_RECORDER_DIR = "flight_recorder"
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"  # torch's own file name, so torch's fr_trace analyzer reads the folder

_hooks: dict[str, Any] = {}  # the stack file (kept open: faulthandler writes to its descriptor) and the timeout


class Frame(NamedTuple):
    filename: str
    lineno: int
    name: str


# ---------------------------------------------------------------------------------------------------------
# file layout (shared with the launcher)
# ---------------------------------------------------------------------------------------------------------

def attempt_folder(run_dir: str | os.PathLike, attempt: int | str) -> Path:
    """Each restart of the worker group (`--max_restarts`) writes apart, so a report never mixes two attempts."""
    return Path(run_dir) / f"attempt_{attempt}"


def stack_path(folder: Path, rank: int) -> Path:
    return folder / f"stack_rank{rank}.txt"


def record_path(folder: Path, rank: int) -> Path:
    return folder / f"collective_rank{rank}.json"


def ended_path(folder: Path, rank: int) -> Path:
    return folder / f"ended_rank{rank}.txt"


def read_ended(folder: Path, rank: int) -> float | None:
    """When rank `rank`'s script ended (time.time()), or None (it did not, or was killed)."""
    try:
        return int(ended_path(folder, rank).read_text()) / 1e9
    except (OSError, ValueError):
        return None


def flight_recorder_path(run_dir: str | os.PathLike, rank: int | str) -> Path:
    """Rank `rank`'s flight-recorder dump; rank "": the prefix torch appends each rank to."""
    return Path(run_dir) / FLIGHT_RECORDER_DIR / f"{FLIGHT_RECORDER_PREFIX}{rank}"


# ---------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------

def install_worker_hooks(rank: int, timeout_s: float | None = None) -> Path | None:
    """Register the stack dump and the failed-collective record for this worker (once; only under `accel launch`).

    Returns the folder written to, or None when not launched by `accel launch`. A script that already handles
    SIGUSR1 keeps its handler (and gives no stack)."""
    run_dir = os.environ.get(DIR_ENV)
    if not run_dir:
        return None
    _hooks["timeout_s"] = timeout_s
    if "folder" in _hooks:
        return _hooks["folder"]
    folder = attempt_folder(run_dir, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    folder.mkdir(parents=True, exist_ok=True)
    _hooks["folder"] = folder
    if signal.getsignal(STACK_SIGNAL) in (signal.SIG_DFL, None):
        _hooks["stack_file"] = open(stack_path(folder, rank), "w")  # noqa: SIM115 (faulthandler writes to it later)
        # faulthandler puts back the handler it found when the interpreter shuts down: ignore, so that a request
        # reaching a worker on its way out (the launcher asks as soon as a peer failed) cannot kill it
        signal.signal(STACK_SIGNAL, signal.SIG_IGN)
        faulthandler.register(STACK_SIGNAL, file=_hooks["stack_file"], all_threads=True, chain=False)
    previous = sys.excepthook

    def record_then_report(exc_type, exc, tb):
        try:
            write_record(record_path(folder, rank), exc)
        except Exception:  # a diagnostic must never hide the user's own error
            pass
        previous(exc_type, exc, tb)  # accel.core.uncaught's: the exception goes to the launcher (or one line)

    sys.excepthook = record_then_report

    pid = os.getpid()

    def note_the_end() -> None:
        if os.getpid() == pid:  # not a forked child's end
            with open(ended_path(folder, rank), "w") as fh:
                fh.write(str(time.time_ns()))

    # threading's exit hooks run first at shutdown, before the atexit module's (PartialState's destroy among them)
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython's threading
        import atexit

        register = atexit.register
    register(note_the_end)
    return folder


def write_record(path: Path, exc: BaseException) -> dict | None:
    """Write what the failed collective was (see `collective_failure`); nothing for any other exception."""
    failure = collective_failure(exc, _flight_recorder_entries())
    if failure is None:
        return None
    failure["timeout_s"] = _hooks.get("timeout_s")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(failure))
    os.replace(tmp, path)  # the launcher never reads half a record
    return failure


def collective_failure(exc: BaseException, recorded: list[dict] | None = None) -> dict | None:
    """{kind, op, in_backward, started_ns, message, frames} when `exc` (or an exception it was raised from) is a
    failed collective, else None. `recorded`: this process's flight recorder entries, to name an op the traceback
    does not show (DDP's and FSDP's gradient collectives run inside backward, below any Python frame) and to say
    when it started (`started_ns`: time.time_ns() when it was issued, None when unknown)."""
    failed = _failed_collective(exc)
    if failed is None:
        return None
    frames = [Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(failed.__traceback__)]
    message = " ".join(str(failed).split())
    entry = pending_collective(recorded or [])
    return {
        "kind": "timeout" if re.search(r"timed? ?out|timeout", message, re.I) else "error",
        "op": collective_name(frames, entry),
        "in_backward": any(_in_package(f.filename, "torch/autograd") for f in frames),
        "started_ns": started_ns(entry),
        "message": message[:300],
        "frames": [list(f) for f in frames],
    }


def _failed_collective(exc: BaseException | None) -> BaseException | None:
    """`exc` or the first exception of its chain that torch.distributed raised (a DistError, or gloo's and NCCL's
    RuntimeErrors, whose message names their source file)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _is_distributed_error(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _is_distributed_error(exc: BaseException) -> bool:
    try:
        from torch.distributed import DistError
    except ImportError:  # a torch without the distributed package
        return False
    if isinstance(exc, DistError):
        return True
    return isinstance(exc, RuntimeError) and re.search(r"gloo|nccl|c10d|ProcessGroup", str(exc), re.I) is not None


def _flight_recorder_entries() -> list[dict]:
    """This process's flight recorder (on by default in torch: the last 2000 collectives, gloo's too)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]  # private, not in torch's stubs

        return list(load_flight_recorder(_dump_fr_trace(True, False, False)).get("entries", []))
    except Exception:  # older/newer torch, or the recorder turned off
        return []


def collective_name(frames: list[Frame], entry: dict | None = None) -> str:
    """The torch.distributed function the user's code called (the outermost public one in the traceback), else the
    op the flight recorder saw last, else "a collective"."""
    for frame in frames:
        if frame.filename.endswith("distributed_c10d.py") and not frame.name.startswith("_") \
                and frame.name != "wrapper":
            return frame.name
    if entry and entry.get("profiling_name"):
        return str(entry["profiling_name"]).split(":")[-1]
    return "a collective"


# ---------------------------------------------------------------------------------------------------------
# reading (the launcher's side)
# ---------------------------------------------------------------------------------------------------------

class _PlainUnpickler(pickle._Unpickler):
    """A flight recorder dump holds only dicts, lists, strings and numbers: refuse anything else (no global, so
    nothing can be called). The pure-Python unpickler: its memo is a dict, where C pickle's memo array grows to the
    index a 9-byte pickle names (gigabytes)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a flight recorder dump")


MAX_FLIGHT_RECORDER_BYTES = 256 << 20


def load_flight_recorder(data: bytes) -> dict:
    import io

    if len(data) > MAX_FLIGHT_RECORDER_BYTES:
        raise pickle.UnpicklingError(f"a flight recorder dump of {len(data)} bytes; allowed: at most "
                                     f"{MAX_FLIGHT_RECORDER_BYTES} bytes")
    loaded = _PlainUnpickler(io.BytesIO(data)).load()
    return loaded if isinstance(loaded, dict) else {}


def pending_collective(entries: list[dict]) -> dict | None:
    """The collective a flight recorder shows the process waiting in, or None when all had completed.

    NCCL tracks completion: the first entry not completed is the one that hung (later ones queue behind it). gloo
    does not (its entries stay "scheduled"): the op in flight is the last one recorded."""
    if not entries:
        return None
    if str(entries[-1].get("profiling_name", "")).startswith("nccl:"):
        return next((e for e in entries if e.get("state") != "completed"), None)
    return entries[-1]


def started_ns(entry: dict | None) -> int | None:
    """When a flight recorder entry's collective was issued (wall clock, ns), or None."""
    value = (entry or {}).get("time_created_ns")
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


_FAULTHANDLER_LINE = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>.*)$')


def main_thread_stack(dump: str) -> list[Frame]:
    """The main thread's frames (outermost first) from a faulthandler dump: the thread whose stack starts at a
    module's top level (the script, or runpy for `-m`), else the first thread listed."""
    threads: list[list[Frame]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
            continue
        match = _FAULTHANDLER_LINE.match(line)
        if match and threads:
            threads[-1].append(Frame(match["file"], int(match["line"]), match["name"]))
    threads = [list(reversed(frames)) for frames in threads if frames]  # faulthandler lists the innermost first
    for frames in threads:
        if frames[0].name in ("<module>", "_run_module_as_main"):
            return frames
    return threads[0] if threads else []


def in_collective(frames: list[Frame]) -> bool:
    """Whether a stack is blocked inside torch.distributed (or in backward, where DDP/FSDP run theirs)."""
    return bool(frames) and (_in_package(frames[-1].filename, "torch/distributed")
                             or _in_package(frames[-1].filename, "torch/autograd"))


def _in_package(filename: str, package: str) -> bool:
    return f"/{package}/" in filename.replace(os.sep, "/")
