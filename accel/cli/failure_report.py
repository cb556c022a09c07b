"""What `accel launch` prints when workers fail: the cause once, first.

1. The summary line: the rank that failed first (local rank, pid), how it ended (exit code, signal) and its exception
   in one line (`ValueError: ...`, cut to output.MESSAGE_CHARS). An accel one-line error is its own line first,
   `accel: error: <message>`, as everywhere else, then the rank's line.
2. That rank's traceback, once, as `[rank<R>]: ` lines: the worker left it in torchrun's error file instead of
   printing it (accel/core/uncaught.py). A rank hidden by --local_ranks_filter: its last stderr lines come before.
3. One line for each other failed rank: stopped by accel launch after the first failure, exited with the same error,
   or its own exception in one line (its traceback: ACCEL_FULL_TRACEBACKS=1, or --log_dir's rank<R>.stderr.log).

The first failure is the first rank to end on its own (a rank accel launch stopped never is): in the order forked
workers ended (known exactly), else when each reported its exception, else when torchrun saw it end. A rank whose
exception only says that a peer's connection broke comes after those with a cause of their own: it is the peer's
end seen from the other side, and the two can end within one look of the launcher. When a rank
failed while others waited for it in a collective, hang_report.py says it in the same order; a restart
(--max_restarts) is announced the same way, in one line, followed by the failed rank's traceback.
"""

from __future__ import annotations

from collections.abc import Callable

from accel.cli import forked_workers, hang_report, output
from accel.cli.output import HeldError


def ended(exitcode: int, note: str = "") -> str:
    """How a worker ended (then `note`), and for a signal what it means (its own crash, the OOM killer, another
    process)."""
    if exitcode >= 0:
        return f"exited with code {exitcode}{note}"
    signum = -exitcode
    return (f"was killed by signal {signum}{hang_report.signal_name(signum)}{note}: "
            f"{hang_report.signal_meaning(signum)}")


def stopped_after(first_rank: int, exitcode: int) -> str:
    """A rank accel launch stopped (torchrun's agent signals the others when one fails) because `first_rank` failed."""
    signum = -exitcode
    return (f"was stopped by accel launch (signal {signum}, {hang_report.signal_name(signum).strip(' ()')}) after rank "
            f"{first_rank} failed")


def label(rank: int, failure) -> str:
    return f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"


LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "NCCL communicator was aborted", "remote process exited or there was a network error")


def lost_peer(error: HeldError | None) -> bool:
    """Whether an exception says only that a peer of a collective went away (gloo's and NCCL's words for it)."""
    return error is not None and any(words in error.message for words in LOST_PEER)


def order(failures: dict, errors: dict[int, HeldError], stopped: Callable[[int], bool]) -> list[int]:
    """The failed ranks, the first failure first: those that ended on their own before those accel launch stopped,
    each in the order they ended, a lost peer after a cause of its own."""
    by_end = forked_workers.by_end(failures)
    if by_end is None:
        def when(rank: int) -> float:
            error = errors.get(rank)
            return error.time_ns / 1e9 if error is not None and error.time_ns else float(failures[rank].timestamp)

        by_end = sorted(failures, key=when)
    own = [rank for rank in by_end if not (failures[rank].exitcode < 0 and stopped(rank))]
    own.sort(key=lambda rank: lost_peer(errors.get(rank)))  # stable: the order of ending within each kind
    return own + [rank for rank in by_end if rank not in own]


def _how(rank: int, failure, error: HeldError | None, first: int, first_error: HeldError | None, note: str = "",
         stopped: Callable[[int], bool] = lambda rank: False) -> str:
    """One rank's end in words: stopped by accel launch, or how it ended and its exception."""
    if rank != first and failure.exitcode < 0 and stopped(rank):
        return stopped_after(first, failure.exitcode)
    how = ended(failure.exitcode, note)
    if error is None or failure.exitcode < 0:  # a signal's meaning is the cause (a KeyboardInterrupt says no more)
        return how
    if rank != first and first_error is not None and error.message == first_error.message:
        return f"{how}: the same error"
    return f"{how}: {error.short()}"


def failure_lines(failures: dict, first_rank: int, errors: dict[int, HeldError], stopped: Callable[[int], bool],
                  hidden: list[str] | None = None) -> list[str]:
    """The lines after torchrun's `ChildFailedError` when no hang report applies (see the module docstring);
    `hidden`: --local_ranks_filter's tails of hidden failed ranks (output.RankLogsSpecs.hidden_lines), printed
    after the summary."""
    first, error = failures[first_rank], errors.get(first_rank)
    note = " (first failure)" if len(failures) > 1 else ""
    said = error is not None and error.one_line and not error.printed
    if said:
        assert error is not None
        head = [f"accel: error: {error.line}",
                f"accel launch: {label(first_rank, first)} {ended(first.exitcode, note)}: the error above"]
    else:
        head = [f"accel launch: {label(first_rank, first)} {_how(first_rank, first, error, first_rank, error, note)}"]
    lines = head + list(hidden or [])
    if not said:
        lines += output.error_lines(first_rank, error)
    for rank, failure in sorted(failures.items()):
        if rank != first_rank:
            lines.append(f"accel launch: {label(rank, failure)} "
                         f"{_how(rank, failure, errors.get(rank), first_rank, error, stopped=stopped)}")
    return lines


def restart_lines(failures: dict, errors: dict[int, HeldError], stopped: Callable[[int], bool],
                  restart: str) -> list[str]:
    """The announcement of a restart of the worker group: every failed rank in one line (`; ` between ranks), the
    first to end first, then `restart` (what happens now); then the first's traceback."""
    if not failures:
        return [f"accel launch: a worker failed; {restart}"]
    ranks = order(failures, errors, stopped)
    first, first_error = ranks[0], errors.get(ranks[0])
    what = "; ".join(f"rank {rank} {_how(rank, failures[rank], errors.get(rank), first, first_error, stopped=stopped)}"
                     for rank in ranks)
    more = [] if first_error is None or first_error.one_line else output.error_lines(first, first_error)
    return [f"accel launch: {what}; {restart}", *more]
