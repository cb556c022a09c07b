"""Nothing a job started outlives it: every worker's process group is ended with the job, or with its launcher.

Every worker leads its own session, hence its own process group (torchrun starts fresh workers with
`Popen(start_new_session=True)`, a forked worker calls `setsid()`, forked_workers.py), and what it starts stays
in that group unless it leaves it itself: a `subprocess.Popen`, DataLoader workers, multiprocessing's children, the
checkpoint process of `--checkpoint_async process`. torchrun signals only the groups of workers still running when it
stops them; a worker that exited (0, or a failure) leaves its children running, and a SIGKILLed agent leaves
everything running. Around torchrun's agent, `reaping_workers()`:

* registers each worker's group when torchrun starts it (`SubprocessHandler`: fresh interpreters and forked workers
  alike);
* when the agent stops a worker group (the job's end, a failure, a restart under `--max_restarts`, a signal), first
  leaves a `stop` mark in the preemption folder (a worker then takes torchrun's SIGTERM as "stop now", not as a
  preemption request: accel/runtime/preemption.py), lets torchrun stop its workers, then ends what is left of every
  worker's group: SIGTERM, SIGKILL `GRACE_S` later. A new attempt starts only after that, and the launcher returns
  only after that;
* runs a sentinel: a tiny interpreter in a session of its own that reads a pipe whose write end only this launcher
  holds (a forked worker closes its copy at once; fresh interpreters never get it: the descriptor is not inheritable).
  The launcher writes each group in (`+pid`) and out (`-pid`); when the pipe ends while groups are still in, the
  launcher died without ending them (SIGKILL, the OOM killer): the sentinel SIGKILLs every group left at once (no
  grace: a save would publish a checkpoint into the folder a requeued job resumes from) and says so in one line. It
  ignores the signals a terminal or a scheduler sends to the launcher's process group; only its pipe ends it.

A group id is the worker's pid, and Linux does not hand a pid to a new process while a process group of that id has
a member, so signalling a group that is still in use reaches only the job's processes. A process that leaves the
worker's session (`setsid`, a daemon's double fork) is not followed. POSIX only (Linux reads /proc to tell running
members from zombies); elsewhere this is a no-op.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

GRACE_S = 2.0  # after SIGTERM, what is left of a worker group gets SIGKILL
SUPPORTED = os.name == "posix"

# the signals the sentinel ignores: blocked from before its start (the launcher blocks them around the fork; the
# mask survives exec) until it ignores them, so not even one sent while it starts ends it
SENTINEL_IGNORES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGTSTP", "SIGTTIN",
                    "SIGTTOU", "SIGXCPU", "SIGALRM")
SENTINEL_CODE = r"""
import os, signal, sys
ignored = [getattr(signal, name) for name in sys.argv[3].split(",") if hasattr(signal, name)]
for sig in ignored:
    signal.signal(sig, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
fd, groups, rest = int(sys.argv[1]), set(), b""
while True:
    try:
        data = os.read(fd, 65536)
    except OSError:
        data = b""
    if not data:
        break
    *lines, rest = (rest + data).split(b"\n")
    for line in lines:
        if line[:1] == b"+":
            groups.add(int(line[1:]))
        elif line[:1] == b"-":
            groups.discard(int(line[1:]))
ended = []
for group in sorted(groups):
    try:
        os.killpg(group, signal.SIGKILL)
        ended.append(str(group))
    except OSError:
        pass
if ended:
    os.write(2, ("accel launch: the launcher (pid %s) was killed; its workers were ended with it (SIGKILL to process "
                 "groups %s)\n" % (sys.argv[2], ", ".join(ended))).encode())
"""


def running_groups(groups: Iterable[int]) -> set[int]:
    """The process groups among `groups` that still have a running member (zombies, ended but not yet waited for by
    their parent, do not count)."""
    wanted = set(groups)
    if not wanted:
        return set()
    if not os.path.isdir("/proc/self"):
        found = set()
        for group in wanted:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, 0)
                found.add(group)
        return found
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != b"Z" and int(fields[2]) in wanted:  # state, ppid, pgrp
            found.add(int(fields[2]))
    return found


def _signal_groups(groups: Iterable[int], sig: int) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)


def end_groups(groups: Iterable[int], grace: float = GRACE_S) -> set[int]:
    """End every process of `groups`: SIGTERM, SIGKILL to what still runs `grace` seconds later. Returns the groups
    that had to be ended (empty when nothing was left)."""
    left = running_groups(groups)
    if not left:
        return set()
    had = set(left)
    _signal_groups(left, signal.SIGTERM)
    for sig, wait in ((signal.SIGKILL, grace), (None, 1.0)):
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = running_groups(left)
        if not left or sig is None:
            break
        _signal_groups(left, sig)
    return had


class Sentinel:
    """The process that ends the registered worker groups when this launcher dies (see the module docstring)."""

    def __init__(self) -> None:
        self._write: int | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        read, write = os.pipe()  # neither end is inheritable: a fresh worker never gets the write end
        ignored = [name for name in SENTINEL_IGNORES if hasattr(signal, name)]
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [getattr(signal, name) for name in ignored])
        try:  # blocked here, the signals wait for this thread (none is lost); in the sentinel, they are then ignored
            command = [sys.executable, "-I", "-S", "-c", SENTINEL_CODE, str(read), str(os.getpid()), ",".join(ignored)]
            self._proc = subprocess.Popen(command, pass_fds=(read,), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            os.close(write)
            return
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(read)
        self._write = write
        _SENTINEL_FDS.add(write)

    def _send(self, line: str) -> None:
        if self._write is not None:
            with contextlib.suppress(OSError):  # the sentinel is gone (killed): nothing to tell it
                os.write(self._write, line.encode())

    def add(self, group: int) -> None:
        self._send(f"+{group}\n")

    def remove(self, group: int) -> None:
        self._send(f"-{group}\n")

    def close(self) -> None:
        """Every group was ended: the pipe ends and the sentinel exits without signalling anything."""
        if self._write is not None:
            _SENTINEL_FDS.discard(self._write)
            os.close(self._write)
            self._write = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            self._proc = None


_SENTINEL_FDS: set[int] = set()  # write ends held by this process: a forked child closes them at once


def _close_in_child() -> None:
    for fd in list(_SENTINEL_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _SENTINEL_FDS.clear()


if SUPPORTED:
    os.register_at_fork(after_in_child=_close_in_child)


@contextlib.contextmanager
def reaping_workers(stop_mark: Callable[[bool], None] | None = None):
    """Within the block, every worker group torchrun's agent starts is ended with the job, at each stop of the worker
    group, and with this launcher (see the module docstring). `stop_mark(True)` is called before the agent stops
    a worker group, `stop_mark(False)` once it is stopped."""
    if not SUPPORTED:
        yield
        return
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    sentinel = Sentinel()
    sentinel.start()
    groups: set[int] = set()
    original_init, original_close = SubprocessHandler.__init__, SubprocessContext._close

    def init(handler, *args, **kwargs):
        original_init(handler, *args, **kwargs)
        groups.add(handler.proc.pid)
        sentinel.add(handler.proc.pid)

    def close(pcontext, death_sig, timeout: int = 30) -> None:
        if stop_mark is not None:
            stop_mark(True)
        try:
            original_close(pcontext, death_sig, timeout)
        finally:
            mine = [handler.proc.pid for handler in pcontext.subprocess_handlers.values()]
            end_groups(mine)
            for group in mine:
                groups.discard(group)
                sentinel.remove(group)
            if stop_mark is not None:
                stop_mark(False)

    SubprocessHandler.__init__ = init  # type: ignore[assignment]
    SubprocessContext._close = close  # type: ignore[assignment]
    try:
        yield
    finally:
        SubprocessHandler.__init__ = original_init  # type: ignore[method-assign]
        SubprocessContext._close = original_close  # type: ignore[method-assign]
        try:
            end_groups(groups)
        finally:
            sentinel.close()
