"""`accel launch`'s hang report: when a collective times out, name the ranks that never reached it.

Without it, the rank that waited is the one that fails (after the process group's timeout) and the stuck rank is
merely stopped, so torchrun names the healthy rank as the first failure. `HangWatch` runs around torchrun's agent:

1. Before the agent starts the workers, `worker_env()` gives them the run folder (`ACCEL_DIAGNOSTICS_DIR`, where
   `accel.core.diagnostics` writes each rank's failed-collective record and its stack on demand) and NCCL's settings:
   dump the flight recorder of a rank whose collective times out (`TORCH_NCCL_DUMP_ON_TIMEOUT`) into that folder.
2. While the workers run, each worker's end is noted as the agent sees it (torchrun's
   `SubprocessContext._capture_process_failures`, which polls them): rank, exit code and when. torchrun forgets a
   worker that exited 0, and names a first failure by the second: the report needs both to name a rank that left.
3. When the agent is about to stop the workers after a failure (torchrun's `SubprocessContext._close`), and a
   collective failed or a worker already ended, the workers still running are asked for their Python stacks
   (SIGUSR1, answered by faulthandler), then stopped as usual.
4. After torchrun's `ChildFailedError`, `report()` sorts the ranks: waiting (a record, a flight recorder entry
   still pending, or a stack blocked in torch.distributed), left (it ended on its own, outside any collective,
   while or before the others waited: its script returned, called sys.exit, or crashed), and stuck (still running
   elsewhere), and returns the lines printed last, the rank that left or else the stuck one named as the first
   failure. When the rank that left failed (a non-zero exit code, a signal), the others only waited for it: the
   headline names it and its exception, its traceback follows once, then one line for each other rank (where it
   waited, no stack; ACCEL_FULL_TRACEBACKS=1 shows the stacks), as failure_report.py does without a collective.

Each machine's launcher reports its own ranks only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import linecache
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from accel.cli import output
from accel.cli.output import HeldError
from accel.core import diagnostics as diag
from accel.core import uncaught
from accel.core.diagnostics import Frame

# the report's order, its first failure first; "stopped": stopped by the launcher outside any collective after a
# rank left (not stuck: nobody waited for it)
ROLE_ORDER = ("left", "stuck", "failed", "waiting", "stopped")
STACK_WAIT_S = 2.0  # how long a worker gets to write its stack after SIGUSR1 (faulthandler takes milliseconds)
ENDING_WAIT_S = 5.0  # how long a worker whose script ended gets to finish exiting before the launcher stops it
FLIGHT_RECORDER_FILE_ENVS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # torch's new and old name
_PATHS = sysconfig.get_paths()
# where library code lives (the stdlib, installed packages, accel itself): stacks show the script's frames in full
_LIBRARY_DIRS = tuple({str(Path(p)) + os.sep for p in (_PATHS["stdlib"], _PATHS["purelib"], _PATHS["platlib"],
                                                        Path(diag.__file__).parent, Path(__file__).parent)})


@dataclass
class RankOutcome:
    """One failed rank as the report tells it."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    role: str  # one of ROLE_ORDER
    op: str = ""
    detail: str = ""
    frames: list[Frame] = field(default_factory=list)
    started: float | None = None  # a waiting rank: when its collective started (time.time()), when known
    ended_at: float | None = None  # a rank that left: when its script ended, else when the agent saw it end


@dataclass
class WorkerEnd:
    """A worker's end as torchrun's agent saw it."""

    local_rank: int
    pid: int
    exitcode: int
    at: float  # time.time() when the agent saw it (it polls every --monitor_interval, 0.1 s)
    stopped: bool  # it was still running when the launcher stopped the workers


@dataclass
class HangReport:
    lines: list[str]
    first_rank: int
    exitcode: int | None = None  # the worker exit code `accel launch` exits with (None: the first rank's failure's)
    keeps_folder: bool = True  # the lines name the run folder: it is kept


class HangWatch:
    """The run folder of one `accel launch`, the hook around torchrun's agent, and the report."""

    def __init__(self, collective_timeout: float, machines: int = 1) -> None:
        self.timeout_s = collective_timeout
        self.machines = machines  # one: every rank is this launcher's, so none can be missing elsewhere
        self.run_dir = Path(tempfile.mkdtemp(prefix="accel-run-"))
        self.folder: Path | None = None  # the attempt whose running workers were asked for their stacks
        self.latest: Path | None = None  # the last attempt the agent ran (--max_restarts: each writes apart)
        self.stopped: dict[int, int | None] = {}  # rank -> where its new stack starts in its file (None: no file)
        self.ends: dict[Path, dict[int, WorkerEnd]] = {}  # attempt folder -> rank -> how its worker ended
        self.running_at_stop: dict[Path, set[int]] = {}  # attempt folder -> ranks the launcher stopped

    # -- before and while the workers run ---------------------------------------------------------------------
    def worker_env(self) -> dict[str, str]:
        """The variables for the workers; torch's are left as the user set them."""
        env = {diag.DIR_ENV: str(self.run_dir)}
        if not any(name in os.environ for name in FLIGHT_RECORDER_FILE_ENVS):
            prefix = diag.flight_recorder_path(self.run_dir, "")
            prefix.parent.mkdir(parents=True, exist_ok=True)
            env.update(dict.fromkeys(FLIGHT_RECORDER_FILE_ENVS, str(prefix)))
        if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ:
            env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        return env

    @contextlib.contextmanager
    def around_agent(self):
        """Note each worker's end, and ask for the stacks whenever torchrun's agent stops its workers, for as long as
        the block runs."""
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext

        original = SubprocessContext._close
        capture = SubprocessContext._capture_process_failures

        def close(pcontext, death_sig, timeout: int = 30):
            try:
                self.before_stop(pcontext)
            except Exception as exc:  # the stop itself must happen whatever goes wrong here
                said = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever the exception says
                sys.stderr.write(f"accel launch: warning: could not collect the workers' stacks: {said}\n")
            return original(pcontext, death_sig, timeout)

        def capture_and_note(pcontext, done_local_ranks: set[int]) -> None:
            capture(pcontext, done_local_ranks)
            with contextlib.suppress(Exception):  # a diagnostic: the agent's bookkeeping goes on regardless
                self.note_ends(pcontext, done_local_ranks)

        SubprocessContext._close = close
        SubprocessContext._capture_process_failures = capture_and_note
        try:
            yield self
        finally:
            SubprocessContext._close = original
            SubprocessContext._capture_process_failures = capture

    @staticmethod
    def _ranks(pcontext) -> tuple[str, dict[int, int]]:
        return (pcontext.envs[0].get("TORCHELASTIC_RESTART_COUNT", "0"),
                {local: int(env["RANK"]) for local, env in pcontext.envs.items()})

    def note_ends(self, pcontext, done_local_ranks: set[int]) -> None:
        """Note the workers the agent just found ended (the first time each is seen)."""
        attempt, ranks = self._ranks(pcontext)
        folder = self.latest = diag.attempt_folder(self.run_dir, attempt)
        ends = self.ends.setdefault(folder, {})
        stopped = self.running_at_stop.get(folder, set())
        now = time.time()
        for local in done_local_ranks:
            proc = pcontext.subprocess_handlers[local].proc
            if ranks[local] not in ends and proc.returncode is not None:
                at = getattr(proc, "ended_at", None) or now  # a forked worker's end is known exactly
                ends[ranks[local]] = WorkerEnd(local, proc.pid, proc.returncode, at, ranks[local] in stopped)

    def before_stop(self, pcontext) -> None:
        """After a failed collective, or once a worker ended, ask the workers still running for their stacks (the
        agent stops them next)."""
        attempt, ranks = self._ranks(pcontext)
        folder = self.latest = diag.attempt_folder(self.run_dir, attempt)
        running = {ranks[local]: handler.proc for local, handler in pcontext.subprocess_handlers.items()
                   if handler.proc.poll() is None}
        # a worker whose script ended is on its way out (its end made the others fail): let it exit on its own
        wait_for_exit([proc for rank, proc in running.items() if diag.ended_path(folder, rank).exists()],
                      ENDING_WAIT_S)
        running = {rank: proc for rank, proc in running.items() if proc.poll() is None}
        if not running:  # the agent closes again once they are stopped: keep what the first close found
            return
        self.running_at_stop.setdefault(folder, set()).update(running)
        if not self.ends.get(folder) and not any(self._timed_out(folder, rank) for rank in ranks.values()):
            return
        self.folder = folder
        self.stopped = ask_for_stacks(folder, running)

    def _timed_out(self, folder: Path, rank: int) -> bool:
        """A collective of `rank` timed out (a peer that died makes the others' collectives fail too, but sooner and
        with another error: that is the dead peer's failure, reported as usual)."""
        record = read_record(folder, rank)
        if record is not None:
            return record.get("kind") == "timeout"
        return diag.pending_collective(read_flight_recorder(self.run_dir, rank)) is not None

    # -- after the agent returned -----------------------------------------------------------------------------
    def report(self, failures: dict, errors: dict[int, HeldError] | None = None) -> HangReport | None:
        """The report for torchrun's failures (global rank -> ProcessFailure; `errors`: the exceptions the workers
        left in their error files, output.py), or None when no collective timed out and no rank left while
        others waited in one (failure_report.py then says what failed)."""
        folder = self.latest or self.folder or self._last_attempt()
        if folder != self.folder:  # the stacks were asked for in an earlier attempt (or never)
            self.stopped = {}
        if folder is None:
            return None
        outcomes = self._with_leavers(folder, [self._outcome(folder, rank, failure)
                                               for rank, failure in sorted(failures.items())])
        if not any(o.role == "left" for o in outcomes) and not any(self._timed_out(folder, o.rank) for o in outcomes):
            return None
        first = first_failure(outcomes)
        # a rank that left with exit code 0 is named first, but the job failed: exit with the first failure's code
        code = first.exitcode if first.exitcode != 0 else next(o.exitcode for o in outcomes if o.rank in failures)
        lines = report_lines(outcomes, self._timeout(folder, outcomes), folder, self._dumps(),
                             whole_job=self.machines == 1, errors=errors)
        return HangReport(lines, first_rank=first.rank, exitcode=code,
                          keeps_folder=any(str(folder) in line for line in lines))

    def _with_leavers(self, folder: Path, outcomes: list[RankOutcome]) -> list[RankOutcome]:
        """`outcomes`, the ranks that left early marked "left": they ended on their own (the launcher did not stop
        them) outside any collective, while others waited in one (a failed collective makes torchrun stop the rest
        at once: a rank that ended on its own was gone before); their script returned, called sys.exit or crashed.
        Those that exited 0 (torchrun forgets them) are added. Unchanged when no rank waited in a collective."""
        ends = self.ends.get(folder, {})
        waiting = [o for o in outcomes if o.role == "waiting"]
        if not ends or not waiting:
            return outcomes
        by_rank = {o.rank: o for o in outcomes}
        leavers = []
        for rank, end in sorted(ends.items()):
            outcome = by_rank.get(rank)
            if end.stopped or (outcome is not None and outcome.role != "failed"):
                continue
            outcome = outcome or RankOutcome(rank, end.local_rank, end.pid, end.exitcode, "failed")
            outcome.role, outcome.ended_at = "left", diag.read_ended(folder, rank) or end.at
            leavers.append(outcome)
        if not leavers:
            return outcomes
        for outcome in outcomes:
            if outcome.role == "stuck":  # stopped at once after a rank left: nobody waited for it
                outcome.role, outcome.detail = "stopped", ""
            elif outcome.role == "waiting" and outcome.detail.startswith("failed ("):  # gloo: connection closed
                outcome.detail = f"failed without {names(leavers)}"
        return sorted(outcomes + [o for o in leavers if o.rank not in by_rank], key=lambda o: o.rank)

    def stopped_by_launcher(self, rank: int, attempt: int | None = None) -> bool:
        """`rank` was still running when the agent stopped the workers (of `attempt`, else of the last attempt): the
        signal it ended by was the launcher's, sent because another rank failed."""
        latest = diag.attempt_folder(self.run_dir, attempt) if attempt is not None else self.latest
        if latest is not None:  # the agent's own bookkeeping: exact
            return rank in self.running_at_stop.get(latest, set())
        folder = self._last_attempt()
        if folder is not None and folder in self.running_at_stop:
            return rank in self.running_at_stop[folder]
        return any(rank in ranks for ranks in self.running_at_stop.values())

    def cleanup(self, keep: bool) -> None:
        """Remove the run folder unless a report points to it."""
        if not keep:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _last_attempt(self) -> Path | None:
        attempts = sorted(self.run_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
        return attempts[-1] if attempts else None

    def _dumps(self) -> Path | None:
        folder = self.run_dir / diag.FLIGHT_RECORDER_DIR
        return folder if folder.is_dir() and any(folder.iterdir()) else None

    def _timeout(self, folder: Path, outcomes: list[RankOutcome]) -> float:
        """The timeout the workers ran with (InitProcessGroupKwargs may have changed it), else the configured one."""
        for outcome in outcomes:
            record = read_record(folder, outcome.rank)
            if record and record.get("timeout_s"):
                return float(record["timeout_s"])
        return self.timeout_s

    def _outcome(self, folder: Path, rank: int, failure) -> RankOutcome:
        """What a failed rank was doing: its record (it raised), its flight recorder (NCCL's watchdog aborted it after
        a dump), or the stack it dumped when asked (it was still running: stuck, or waiting with time left)."""
        outcome = RankOutcome(rank, failure.local_rank, failure.pid, failure.exitcode, "failed")
        record = read_record(folder, rank)
        pending = diag.pending_collective(read_flight_recorder(self.run_dir, rank))
        if record:
            outcome.role, outcome.op = "waiting", record["op"] + (" in backward" if record.get("in_backward") else "")
            outcome.detail = "timed out" if record["kind"] == "timeout" else f"failed ({record['message'][:160]})"
            outcome.frames = [Frame(*frame) for frame in record["frames"]]
            outcome.started = record["started_ns"] / 1e9 if record.get("started_ns") else None
        elif pending is not None:
            outcome.role, outcome.op, outcome.detail = "waiting", diag.collective_name([], pending), "timed out"
            outcome.frames = [Frame(f["filename"], f["line"], f["name"]) for f in reversed(pending.get("frames", []))]
            started = diag.started_ns(pending)
            outcome.started = started / 1e9 if started else None
        elif rank in self.stopped:
            self._from_stack(outcome, folder, self.stopped[rank])
        return outcome

    @staticmethod
    def _from_stack(outcome: RankOutcome, folder: Path, offset: int | None) -> None:
        outcome.frames = diag.main_thread_stack(read_from(diag.stack_path(folder, outcome.rank), offset))
        if diag.in_collective(outcome.frames):  # in the collective too, with time left on its own timeout
            in_c10d = diag.collective_name(outcome.frames)
            outcome.role, outcome.detail = "waiting", "was still waiting"
            outcome.op = in_c10d if in_c10d != "a collective" else "backward"
        elif offset is None:
            outcome.role, outcome.detail = "stuck", ("no stack: it had not reached accel's PartialState, or the script "
                                                     "handles SIGUSR1 itself")
        else:
            outcome.role = "stuck"
            outcome.detail = "" if outcome.frames else "no stack: it did not answer SIGUSR1"


# ---------------------------------------------------------------------------------------------------------
# reading the run folder
# ---------------------------------------------------------------------------------------------------------

def ask_for_stacks(folder: Path, running: dict[int, subprocess.Popen]) -> dict[int, int | None]:
    """Send SIGUSR1 to the running workers that registered for it and wait (briefly) for their dumps.

    Returns rank -> the size of its stack file before the dump (where the dump starts), None for a worker that never
    registered (it is not signalled: SIGUSR1 would kill it)."""
    offsets: dict[int, int | None] = {}
    for rank, proc in running.items():
        path = diag.stack_path(folder, rank)
        offsets[rank] = path.stat().st_size if path.exists() else None
        if offsets[rank] is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, diag.STACK_SIGNAL)
    deadline = time.monotonic() + STACK_WAIT_S

    def waiting_for_dump() -> bool:
        return any(offset is not None and running[rank].poll() is None
                   and diag.stack_path(folder, rank).stat().st_size <= offset for rank, offset in offsets.items())

    while time.monotonic() < deadline and waiting_for_dump():
        time.sleep(0.05)
    time.sleep(0.05)  # the last lines of a dump being written
    return offsets


def wait_for_exit(procs: list[subprocess.Popen], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))


def read_record(folder: Path, rank: int) -> dict | None:
    try:
        return json.loads(diag.record_path(folder, rank).read_text())
    except (OSError, ValueError):
        return None


def read_flight_recorder(run_dir: Path, rank: int) -> list[dict]:
    try:
        return list(diag.load_flight_recorder(diag.flight_recorder_path(run_dir, rank).read_bytes()).get("entries", []))
    except Exception:  # absent, partial or from another torch: the other evidence decides
        return []


def read_from(path: Path, offset: int | None) -> str:
    if offset is None:
        return ""
    try:
        with open(path, errors="replace") as fh:
            fh.seek(offset)
            return fh.read()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------

def first_failure(outcomes: list[RankOutcome]) -> RankOutcome:
    """The stuck rank when there is one (the waiting ones only failed because of it), else one that failed on its
    own, else the first waiting."""
    for role in ROLE_ORDER:
        for outcome in outcomes:
            if outcome.role == role:
                return outcome
    return outcomes[0]


def report_lines(outcomes: list[RankOutcome], timeout_s: float, folder: Path, dumps: Path | None,
                 whole_job: bool = False, errors: dict[int, HeldError] | None = None) -> list[str]:
    left, stuck, failed, waiting, _ = ([o for o in outcomes if o.role == role] for role in ROLE_ORDER)
    first = first_failure(outcomes)
    if left and any(o.exitcode for o in left) and not uncaught.full():
        return failed_while_waited(outcomes, left, waiting, timeout_s, errors or {})
    lines = [left_headline(left, waiting, timeout_s) if left
             else headline(stuck, failed, waiting, timeout_s, whole_job)]
    for outcome in sorted(outcomes, key=lambda o: ROLE_ORDER.index(o.role)):
        lines.append(rank_line(outcome, outcome is first))
        lines += stack_lines(outcome.frames)
        if outcome.role in ("left", "failed"):  # its own exception (a waiting rank's is its failed collective)
            lines += output.error_lines(outcome.rank, (errors or {}).get(outcome.rank))
    where = f"every thread's stack: {folder}" + (f"; NCCL flight recorder dumps: {dumps} (read them with "
                                                  f"`torchfrtrace {dumps}`)" if dumps else "")
    if not left or dumps or any(path.stat().st_size for path in folder.glob("stack_rank*.txt")):
        lines.append(f"accel launch: {where}")  # (when a rank left, the others may all have ended: no stacks)
    if left and all(o.exitcode == 0 for o in left):
        lines.append(f"accel launch: {names(left)} ended without reaching the collective that {names(waiting)} waited "
                     "in: every rank must run the same collectives in the same order (the same number of batches and "
                     "steps, no collective that only some ranks reach, no rank returning early)")
        return lines
    if left:
        lines.append(f"accel launch: the job failed because {names([o for o in left if o.exitcode])} ended (see its "
                     "output above); the others only waited for it")
        return lines
    busy = names(stuck) if stuck else "a rank"
    lines.append(f"accel launch: if {busy} was busy on purpose (e.g. preparing data under main_process_first), raise "
                 "collective_timeout (config key, --collective_timeout SECONDS, or InitProcessGroupKwargs(timeout=))")
    return lines


def failed_while_waited(outcomes: list[RankOutcome], left: list[RankOutcome], waiting: list[RankOutcome],
                        timeout_s: float, errors: dict[int, HeldError]) -> list[str]:
    """A rank failed (it left with a non-zero exit code, or was killed) while, or before, the others waited for it
    in a collective: the headline names it and its exception, its traceback follows once, then one line for each
    other rank, where it waited or that it was stopped, without stacks."""
    first = first_failure(outcomes)
    error = errors.get(first.rank)
    shown = error is not None and not error.printed
    said = shown and error is not None and error.one_line  # an accel one-line error: its line first, as everywhere
    lines = output.error_lines(first.rank, error) if said else []
    lines.append(left_headline(left, waiting, timeout_s, first if shown else None, None if said else error))
    if not said:
        lines += output.error_lines(first.rank, error)
    for outcome in sorted(outcomes, key=lambda o: ROLE_ORDER.index(o.role)):
        if outcome is first and shown:
            continue  # the headline said it all
        lines.append(rank_line(outcome, outcome is first, compact=True))
    return lines


def headline(stuck: list[RankOutcome], failed: list[RankOutcome], waiting: list[RankOutcome], timeout_s: float,
             whole_job: bool = False) -> str:
    """The first line. `whole_job`: every rank of the job runs under this launcher (one machine)."""
    ops = sorted({o.op for o in waiting})
    limit = f"collective_timeout={timeout_s:g}s"
    if stuck:
        return (f"accel launch: hang: {names(stuck)} never reached the collective that {names(waiting)} waited in "
                f"({', '.join(ops)}) for {limit}; the job was stopped")
    if failed:
        return (f"accel launch: {names(failed)} failed while {names(waiting)} waited in {', '.join(ops)} for {limit}; "
                "the job was stopped")
    if len(ops) > 1:
        each = "; ".join(f"rank {o.rank}: {o.op}" for o in waiting)
        return (f"accel launch: hang: the ranks waited in different collectives ({each}) for {limit}: their code "
                "took different paths (a collective called on some ranks only); the job was stopped")
    op = ops[0] if ops else "a collective"
    if whole_job:  # nobody is missing: the collective itself never completed (seen on a one-rank NCCL job whose
        # stream was held by a long kernel: NCCL's watchdog timed it out)
        return (f"accel launch: hang: {names(waiting)} waited in {op} for {limit} and every rank of the job was in it: "
                "the collective itself did not complete (its GPU busy with earlier work, a NCCL or network failure); "
                "the job was stopped")
    return (f"accel launch: hang: {names(waiting)} waited in {op} for {limit} and every rank of this machine was in "
            "it: the missing rank runs on another machine (see its output) or the network failed; the job was "
            "stopped")


def left_headline(left: list[RankOutcome], waiting: list[RankOutcome], timeout_s: float,
                  first: RankOutcome | None = None, error: HeldError | None = None) -> str:
    """A rank ended while (or before) the others waited in a collective. Exit code 0 is a hang (the others wait until
    they time out, or until their backend sees the connection close); another code is a failure, whose rank torchrun
    stopped the others for at once. `first`: the first failure, named with `error`, its exception."""
    codes = sorted({how_it_left(o.exitcode) for o in left})
    who = (f"{names(left)} {codes[0]}" if len(codes) == 1
           else " and ".join(f"rank {o.rank} {how_it_left(o.exitcode)}" for o in left))
    if first is not None:  # named with its exception (an accel one-line error: said on the line before)
        others = [o for o in left if o is not first]
        what = f"failed with {error.short()}" if error is not None else "failed with the error above"
        who = (f"rank {first.rank} (local rank {first.local_rank}, pid {first.pid}) {what} "
               f"({how_it_ended(first.exitcode)})" + (f" and {names(others)} also left" if others else ""))
    ops = ", ".join(sorted({o.op for o in waiting}))
    gone = max(o.ended_at or 0.0 for o in left)
    before = all(o.started is not None and o.started > gone for o in waiting)  # they started after it was gone
    limit = f"collective_timeout={timeout_s:g}s"
    timed_out = any(o.detail == "timed out" for o in waiting)
    failed = any(o.detail.startswith("failed") for o in waiting)  # gloo sees the connection close at once
    without = f"failed without {'it' if len(left) == 1 else 'them'}"
    if before:
        when = (f"before {names(waiting)} reached {ops}, which then "
                + (f"waited for {limit}" if timed_out else without if failed else "waited"))
    else:
        when = f"while {names(waiting)} waited in {ops}" + (f" for {limit}" if timed_out else f", which {without}"
                                                           if failed else "")
    hang = "hang: " if all(o.exitcode == 0 for o in left) else ""
    return f"accel launch: {hang}{who} {when}; the job was stopped"


def how_it_left(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exited (exit code {exitcode})"
    return f"was killed by signal {-exitcode}{signal_name(-exitcode)}"


# what a worker's end by a signal says about its cause (a worker the launcher stopped is named as such elsewhere)
_CRASHES = {
    "SIGSEGV": "it crashed (a segmentation fault in native code: a C/C++ extension, a CUDA kernel or driver, a library "
               "built for another torch; Python's own frames, if it printed them, are in its output above)",
    "SIGBUS": "it crashed (a bus error in native code: often a memory-mapped file that shrank or was on a full disk, "
              "or a full /dev/shm, where DataLoader workers share tensors)",
    "SIGILL": "it crashed (an illegal instruction in native code: a library built for another CPU, e.g. with "
              "AVX-512, or a failed check compiled as a trap)",
    "SIGFPE": "it crashed (an arithmetic fault in native code, e.g. an integer division by zero in a C/C++ "
              "extension)",
    "SIGABRT": "it aborted itself (abort() in native code: a C++ std::terminate after an uncaught C++ exception, or a "
               "failed assertion; the reason is the last thing it printed above)",
    "SIGKILL": "SIGKILL cannot be caught and no worker sends it to itself: most often the kernel's out-of-memory "
               "killer (check `dmesg` or `journalctl -k` for 'Out of memory', or the scheduler's memory limit: "
               "SLURM's --mem, the container's), else another process",
    "SIGPIPE": "it wrote to a pipe nobody reads any more (its output piped into a command that ended)",
    "SIGXCPU": "it ran past its CPU-time limit (ulimit -t, or the scheduler's)",
    "SIGXFSZ": "it wrote past its file-size limit (ulimit -f)",
}


def signal_meaning(signum: int) -> str:
    """Why a worker ended by signal `signum` (one clause): its own crash or abort, the OOM killer, or another
    process than accel launch."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = ""
    return _CRASHES.get(name, "sent by another process than accel launch (a scheduler, a `kill`, a closed terminal)")


def rank_line(outcome: RankOutcome, first: bool, compact: bool = False) -> str:
    """The rank's line; `compact`: no stack follows (where a waiting rank waited is said in the line)."""
    label = f"rank {outcome.rank} (local rank {outcome.local_rank}, pid {outcome.pid})"
    ended = how_it_ended(outcome.exitcode) + (", first failure" if first else "")
    stack = "; its stack, most recent call last:" if outcome.frames and not compact else ""
    if compact and outcome.role == "waiting":
        return f"accel launch: {label} waited in {outcome.op} and {outcome.detail} ({ended}){where(outcome.frames)}"
    if outcome.role == "left":
        how = f"exited with code {outcome.exitcode}" if outcome.exitcode >= 0 else how_it_left(outcome.exitcode)
        why = (": its script returned or called sys.exit(0)" if outcome.exitcode == 0
               else ": see its output above for why" if outcome.exitcode > 0
               else f": {signal_meaning(-outcome.exitcode)}")
        return f"accel launch: {label} {how}{' (first failure)' if first else ''} outside any collective{why}"
    if outcome.role == "stopped":
        return f"accel launch: {label} was stopped outside any collective ({ended}){stack}"
    if outcome.role == "stuck":
        said = f"is stuck outside the collective ({ended})"
    elif outcome.role == "waiting":
        said = f"waited in {outcome.op} and {outcome.detail} ({ended})"
    else:
        said = f"failed ({ended})" + (f": {signal_meaning(-outcome.exitcode)}" if outcome.exitcode < 0 else "")
    if outcome.role == "stuck" and outcome.detail:
        return f"accel launch: {label} {said}; {outcome.detail}"
    return f"accel launch: {label} {said}{stack}"


def where(frames: list[Frame]) -> str:
    """", at <file>:<line>: <source>" of the innermost frame of the script's own code, or ""."""
    own = [frame for frame in frames if not is_library(frame.filename)]
    if not own:
        return ""
    frame = own[-1]
    source = linecache.getline(frame.filename, frame.lineno).strip()
    return f", at {display_path(frame.filename)}:{frame.lineno}" + (f": {source}" if source else "")


def how_it_ended(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit code {exitcode}"
    return f"ended by signal {-exitcode}{signal_name(-exitcode)}"


def signal_name(signum: int) -> str:
    """" (SIGTERM)", or "" for a number that names no signal."""
    try:
        return f" ({signal.Signals(signum).name})"
    except ValueError:
        return ""


def names(outcomes: list[RankOutcome]) -> str:
    ranks = [str(o.rank) for o in outcomes]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(ranks) if ranks else "no rank"


def stack_lines(frames: list[Frame]) -> list[str]:
    """Frames as a traceback, the script's frames in full and each run of library frames as its innermost one (where
    it waits); library frames before the script's first one (runpy, the launcher) are left out."""
    frames = list(frames)
    while len(frames) > 1 and is_library(frames[0].filename) and not all(is_library(f.filename) for f in frames):
        frames.pop(0)
    lines = []
    for library, group in itertools.groupby(frames, key=lambda f: is_library(f.filename)):
        run = list(group)
        hidden = len(run) - 1 if library else 0
        for frame in run[-1:] if library else run:
            more = f"  (+{hidden} library frame{'s' if hidden > 1 else ''})" if hidden else ""
            lines.append(f'    File "{display_path(frame.filename)}", line {frame.lineno}, in {frame.name}{more}')
            source = linecache.getline(frame.filename, frame.lineno).strip()
            if source:
                lines.append(f"      {source}")
    return lines


def is_library(filename: str) -> bool:
    return filename.startswith("<") or str(Path(filename)).startswith(_LIBRARY_DIRS)


def display_path(filename: str) -> str:
    """Short but unambiguous: relative to the current folder, or from the package down for installed code."""
    marker = "site-packages" + os.sep
    if marker in filename:
        return filename.split(marker, 1)[1]
    with contextlib.suppress(ValueError):
        return str(Path(filename).relative_to(Path.cwd()))
    return filename
