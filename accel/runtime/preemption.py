"""Preemption: a scheduler's "stop soon" signal becomes `accelerator.preemption_requested`, the same step on every rank.

SLURM and Kubernetes send SIGTERM (or the signal `#SBATCH --signal` names) some time before they kill a job. Under a
multi-process `accel launch` the launcher receives it and, instead of stopping the workers, asks them to stop: it
writes a request file into the folder `ACCEL_PREEMPTION_DIR` names (see accel/cli/preemption.py). A file rather than
a signal from the launcher to the workers because the workers already use SIGUSR1 for their stack dumps
(accel/core/diagnostics.py), a signal whose default action kills (SIGUSR2) would kill a worker that has not installed
its handler yet, and a file is seen whenever the worker looks, even by a worker (re)started after the request.

`requested(state)` (the `Accelerator.preemption_requested` property) is read once per step on every rank:

* its local answer: the request file exists, or (without a launcher's agent, see below) a signal arrived;
* agreed through one all_reduce (MAX of a one-element tensor) over the default process group, so every rank turns
  True at the same step even when the request arrived while the ranks were between their reads; one process: no
  collective. Once True it stays True without further collectives.

The worker leaves two marks in the folder for the launcher: `listening_rank<R>` at its first read (a launcher whose
workers never read the property stops them at once on SIGTERM, as before) and `seen_rank<R>` once the answer is True
(the launcher then knows the workers stopped for the request, not because training was over).

The process may receive the signal itself as well: `python script.py`, `accel launch` of one process (which replaces
itself with the script), and, under a multi-process `accel launch`, a signal sent to every process of the job at once
(systemd's control-group kill, SLURM's signal to every process of a job step, `kill` of each pid) or to the workers
only. At its first read, handlers that only set a flag are installed for SIGTERM and the config's
`preemption_signal` (only for signals still at their default action: before its first read, a worker dies of them,
as the launcher's rule for workers that do not listen has it). The flag is this rank's local answer, so the ranks
still agree at the same step. A second signal, or `grace_period` seconds after the first, ends the process by that
signal, as it would have without them. Under `accel launch` the launcher's own stop must still stop a worker at once:
torchrun's agent stops workers with SIGTERM (at the grace period's end, at a second signal, when a worker failed,
at a restart), so before it does the launcher leaves a `stop` mark in the folder (accel/cli/preemption.py,
accel/cli/job_reaper.py), and a signal that finds the mark ends the worker at once. Under plain `torchrun` nothing is
installed (torchrun stops its workers with SIGTERM): name the signals to catch in `ACCEL_PREEMPTION_SIGNALS` (e.g.
`SIGTERM`; torchrun then waits 30 s for the workers before killing them).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from accel.config.schema import DEFAULT_GRACE_PERIOD
from accel.config.schema import PREEMPTION_SIGNALS as SIGNALS

DIR_ENV = "ACCEL_PREEMPTION_DIR"  # set by a multi-process `accel launch`: where the request file appears
SIGNALS_ENV = "ACCEL_PREEMPTION_SIGNALS"  # comma-separated signals the process itself turns into a request
REQUEST_FILE = "request"
STOP_FILE = "stop"  # the launcher is stopping the workers (torchrun's SIGTERM follows): a signal now stops at once
# `accel launch`'s exit code when the workers stopped for a preemption request: sysexits.h's EX_TEMPFAIL, "a
# temporary failure; the user is invited to retry" (SLURM's RequeueExit, a Kubernetes podFailurePolicy can name it)
EXIT_CODE = 75

_local: dict[str, Any] = {"signal": None, "agreed": False, "listening": False, "installed": False, "timer": None,
                          "ray": None}


def listening_path(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"listening_rank{rank}"


def seen_path(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"seen_rank{rank}"


def request_path(folder: str | os.PathLike) -> Path:
    return Path(folder) / REQUEST_FILE


def stop_path(folder: str | os.PathLike) -> Path:
    return Path(folder) / STOP_FILE


# ---------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------

def requested(state) -> bool:
    """Whether the job was asked to stop, agreed by every process (`state`: the PartialState). Call it at the same
    point of every step on every rank: it is a collective when there are several processes."""
    if _local["agreed"]:
        return True
    rank = state.process_index
    folder = os.environ.get(DIR_ENV)
    if not _local["listening"]:
        _local["listening"] = True
        _mark(folder, listening_path, rank)
        _install_handlers()
    local = _local["signal"] is not None or (folder is not None and request_path(folder).exists())
    local = _ray_preemption() or local  # (first: Ray's call is a barrier every worker must reach at each read)
    agreed = _agree(state, local)
    if agreed:
        _local["agreed"] = True
        _mark(folder, seen_path, rank)
    return agreed


def _ray_preemption() -> bool:
    """Under Ray Train: whether a node of this job is being drained (a spot reclaim, a KubeRay scale-down), as
    `ray.train.get_preemption_info()` says. Ray sends no signal before the drain's deadline, so it is asked; its call
    is itself a barrier of every worker, which read the property at the same step. Outside a Ray Train worker (or with
    a Ray without the call) it is not asked again."""
    if _local["ray"] is False:
        return False
    train = sys.modules.get("ray.train")  # imported in every Ray Train worker; accel never imports Ray itself
    ask = getattr(train, "get_preemption_info", None)
    if ask is None:
        _local["ray"] = False
        return False
    try:
        info = ask()
    except (RuntimeError, DeprecationWarning):  # not a Ray Train worker (Ray raises outside one, and in a Ray Tune
        # session): the same answer on every process
        _local["ray"] = False
        return False
    _local["ray"] = True
    if info is not None:  # (said once: the answer is then agreed, and Ray is not asked again)
        nodes = ", ".join(getattr(info, "preempted_node_ids", []) or ["?"])
        say(f"accel: Ray Train: node(s) {nodes} are being drained (deadline {getattr(info, 'deadline_ms', None)} ms): "
            "preemption_requested")
    return info is not None


def _agree(state, local: bool) -> bool:
    """The MAX of every rank's `local` (one tiny all_reduce on the default group); `local` itself on one process."""
    import torch
    import torch.distributed as dist

    if state.num_processes <= 1 or not (dist.is_available() and dist.is_initialized()):
        return local
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=state.device)  # where the group works
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _mark(folder: str | None, path_of, rank: int) -> None:
    if folder is None:
        return
    try:
        path_of(folder, rank).touch()
    except OSError:  # the launcher's folder is gone (it is being stopped): nothing to tell it
        pass


# -- handlers in the process itself ------------------------------------------------------------------------

def signals_to_handle(environ=os.environ) -> list[signal.Signals]:
    """The signals this process turns into a request itself: `ACCEL_PREEMPTION_SIGNALS` when set, else SIGTERM and
    the config's `preemption_signal`, unless plain torchrun's agent runs this process (it stops workers with
    SIGTERM). Under `accel launch` too: a signal sent to every process of the job (or to the workers only) is the
    same request as the launcher's; the launcher's own stop is told apart by its `stop` mark."""
    given = environ.get(SIGNALS_ENV)
    if given is not None:
        return [parse_signal(name, SIGNALS_ENV) for name in given.split(",") if name.strip()]
    if DIR_ENV not in environ and "TORCHELASTIC_RUN_ID" in environ:  # plain torchrun's agent
        return []
    names = ["SIGTERM"]
    extra = _config_value("preemption_signal")
    if extra and extra not in names:
        names.append(extra)
    return [getattr(signal, name) for name in names]


def parse_signal(name: str, source: str) -> signal.Signals:
    """`SIGTERM`, `SIGUSR1` or `SIGUSR2` (case-insensitive) as a signal; ValueError in one line otherwise."""
    text = name.strip().upper()
    if text not in SIGNALS:
        raise ValueError(f"{source}: bad value {name.strip()!r}; allowed: one of {', '.join(SIGNALS)}")
    return getattr(signal, text)


def _config_value(key: str) -> Any:
    try:
        from accel.config import worker_config

        return getattr(worker_config(), key)
    except Exception:  # no readable config: the defaults (SIGTERM only, the default grace period)
        return None


def _install_handlers() -> None:
    if _local["installed"] or threading.current_thread() is not threading.main_thread():
        return
    _local["installed"] = True
    for sig in signals_to_handle():
        if signal.getsignal(sig) in (signal.SIG_DFL, None):  # a script's own handler stays
            signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame) -> None:
    """The first signal only sets the flag; a second one (the timer sends it when the grace period runs out), or
    any signal once the launcher left its `stop` mark (it is stopping the workers), ends the process as the signal
    would have."""
    folder = os.environ.get(DIR_ENV)
    if _local["signal"] is not None or (folder is not None and stop_path(folder).exists()):
        _stop(signum)
        return
    _local["signal"] = signum
    grace = _config_value("grace_period") or DEFAULT_GRACE_PERIOD
    name = signal.Signals(signum).name
    if folder is None:
        say(f"accel: got {name}: preemption_requested turns true at the next step; save and stop within {grace:g} s "
            f"(a second {name} stops the process now)")
    elif not request_path(folder).exists():  # not asked by the launcher (it says so itself): the worker says it
        say(f"accel: rank {os.environ.get('RANK', '?')} got {name}: preemption_requested turns true at the next step "
            f"on every rank; save and stop within {grace:g} s (a second {name} stops the process now)")
    timer = threading.Timer(grace, signal.pthread_kill, args=(threading.get_ident(), signum))  # runs in main
    timer.daemon = True
    timer.start()
    _local["timer"] = timer


def say(line: str) -> None:
    """One line on stderr from a signal handler: the handler may run inside a write to sys.stderr, where writing to it
    again raises ("reentrant call"); then straight to the descriptor."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except RuntimeError:
        os.write(2, (line + "\n").encode(errors="replace"))


def _stop(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _reset_for_tests() -> None:
    for sig in SIGNALS:
        if signal.getsignal(getattr(signal, sig)) is _on_signal:
            signal.signal(getattr(signal, sig), signal.SIG_DFL)
    if _local["timer"] is not None:
        _local["timer"].cancel()
    _local.update(signal=None, agreed=False, listening=False, installed=False, timer=None, ray=None)
