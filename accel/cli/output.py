"""What a multi-process `accel launch` prints: thread count, per-rank log files, which ranks reach the console.

* `OMP_NUM_THREADS`: unless the user set it, every worker gets `cores // processes on this machine` (at least
  1), where cores are the CPUs this launcher may run on. torchrun's 4-line banner (which sets 1) is gone; on a
  CPU launch, where the thread count is the speed, one line says what was chosen. GPU launches say nothing.
* `--log_dir DIR`: each rank's stdout and stderr ALSO go to `DIR/rank<R>.stdout.log` / `DIR/rank<R>.stderr.log`
  (R the global rank; `.attempt<N>` before `.stdout` after a restart), torchrun's `--log_dir --tee 3` with
  files named by global rank instead of `<run id>_<random>/attempt_<N>/<local rank>/`. Teed console lines
  start with `[rank<R>]:` (torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, unless set).
* `--local_ranks_filter 0[,1...]` (torchrun's flag): only these local ranks (on every machine) reach the
  console. The others' output still goes to `--log_dir` when given. Errors are never lost: without
  `--log_dir`, a hidden rank's stderr goes to a temporary file (removed after the run), and when that rank
  fails its last lines are printed after the launcher's summary line, before its traceback.
* One process with `--log_dir` runs under torchrun's agent too (it is the agent that writes the files).
* Warnings every rank repeats are printed by rank 0 only: see accel/core/rank_warnings.py (done in the workers).
* A worker's uncaught exception is not printed by the worker: it goes to torchrun's error file
  (accel/core/uncaught.py), and the launcher prints it once, after its summary line (failure_report.py): the
  traceback as `[rank<R>]: ` lines (torch's own prefix), an accel one-line error as `accel: error: <message>`. With
  `--log_dir` it is also appended to that rank's `rank<R>.stderr.log`. torchrun's log lines that only repeat what
  accel's lines say (a worker failed, the workers are being stopped, a signal arrived) are left out.
  `ACCEL_FULL_TRACEBACKS=1` shows everything: each worker prints its own traceback, torchrun's lines stay.

torchrun's agent runs with `RankLogsSpecs`, a `LogsSpecs` (torchrun's own extension point for where worker
output goes), through torchrun's `parse_args` / `config_from_args` / `elastic_launch`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from accel.cli._common import UsageError, add_flag
from accel.core import uncaught

LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
RANK_LINE_PREFIX = "[rank${rank}]:"
FAILURE_TAIL_LINES = 20
MESSAGE_CHARS = 300  # an exception's text in the launcher's own lines (the traceback below has all of it)
# torchrun's log lines that accel's own lines say better: (logger, message template)
TORCHRUN_LINES_SAID = {
    ("torch.distributed.elastic.agent.server.api", "Received %s death signal, shutting down workers"),
    ("torch.distributed.elastic.multiprocessing.api", "Sending process %s closing signal %s"),
    ("torch.distributed.elastic.multiprocessing.api", "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"),
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`accel launch`'s output flags."""
    group = parser.add_argument_group("output")
    add_flag(group, "log_dir", metavar="DIR", default=None,
             help="also write each rank's stdout/stderr to DIR/rank<R>.stdout.log / .stderr.log")
    add_flag(group, "local_ranks_filter", metavar="RANKS", default=None,
             help="show only these local ranks' output on the console, e.g. 0 or 0,1 (a failing hidden rank's "
                  "last stderr lines are still printed)")


def parse_ranks_filter(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        ranks = []
    if not ranks or ranks[0] < 0:
        raise UsageError(f"--local_ranks_filter {text!r}: allowed: comma-separated local ranks (0 or more), e.g. 0 "
                         "or 0,1")
    return ranks


def needs_agent(args: argparse.Namespace) -> bool:
    """Output options that only torchrun's agent provides (so even one process runs under it)."""
    return bool(getattr(args, "log_dir", None))


def torchrun_flags(args: argparse.Namespace) -> list[str]:
    """`--log_dir`/`--local_ranks_filter` as torchrun's flags (checked here: one-line errors)."""
    argv: list[str] = []
    log_dir = getattr(args, "log_dir", None)
    if log_dir:
        check_log_dir(log_dir, create=not getattr(args, "dry_run", False))
        argv += ["--log_dir", os.path.abspath(log_dir), "--tee", "3"]
    ranks = parse_ranks_filter(getattr(args, "local_ranks_filter", None))
    if ranks is not None:
        argv += ["--local_ranks_filter", ",".join(map(str, ranks))]
    return argv


def check_log_dir(log_dir: str, create: bool) -> None:
    """`--log_dir` must be a folder or creatable as one: not a file, not under a file, writable; with `create` it is
    made now, so that a folder that cannot be made is one line before any process starts (not a traceback in
    torchrun's agent)."""
    path = os.path.abspath(log_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--log_dir {log_dir}: it is a file; allowed: a folder (created when missing)")
    existing = path
    while not os.path.lexists(existing):  # the nearest part of the path that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--log_dir {log_dir}: {existing} is a file; allowed: a folder (created when missing) that is "
                         "not under a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        which = "it is" if existing == path else f"{existing} is"
        raise UsageError(f"--log_dir {log_dir}: {which} not writable by this user; allowed: a folder this user can "
                         "create and write")
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--log_dir {log_dir}: cannot create it ({exc.strerror or exc}); allowed: a folder this "
                             "user can create and write") from None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_worker_threads(processes_here: int, on_cpu: bool, environ=os.environ) -> int | None:
    """Set OMP_NUM_THREADS for the workers (cores // processes here, >= 1) unless the user set it; torchrun
    then prints no banner. Says so in one line on CPU launches. Returns the count set, or None."""
    if "OMP_NUM_THREADS" in environ or processes_here < 2:
        return None
    cores = usable_cores()
    threads = max(1, cores // processes_here)
    environ["OMP_NUM_THREADS"] = str(threads)
    if on_cpu:
        sys.stderr.write(f"accel launch: {processes_here} processes on {cores} cores: OMP_NUM_THREADS={threads} each "
                         "(set OMP_NUM_THREADS to choose)\n")
        sys.stderr.flush()
    return threads


def _rank_logs_specs_class():
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map

    class RankLogsSpecs(LogsSpecs):
        """Worker output as `--log_dir`/`--tee`/`--local_ranks_filter` ask, in flat files named by global rank;
        a hidden rank's stderr is always written somewhere (a temporary folder without `--log_dir`)."""

        def __init__(self, log_dir=None, redirects=Std.NONE, tee=Std.NONE, local_ranks_filter=None) -> None:
            super().__init__(log_dir, redirects, tee, local_ranks_filter)
            self._folder: str | None = log_dir or None
            self.temporary = not log_dir
            self.hidden_stderr: dict[int, str] = {}  # global rank -> its stderr file (not shown on the console)

        @property
        def root_log_dir(self) -> str:
            return self._folder or ""

        def folder(self) -> str:
            """`--log_dir` (created when missing), else a temporary folder made at the first use."""
            if self._folder is None:
                self._folder = tempfile.mkdtemp(prefix="accel-logs-")
            elif not self.temporary:
                os.makedirs(self._folder, exist_ok=True)
            return self._folder

        def reify(self, envs):
            count = len(envs)
            redirects, tees = to_map(self._redirects, count), to_map(self._tee, count)
            shown = self._local_ranks_filter
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank = int(env.get("RANK", local_rank))
                attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
                base = os.path.join(self.folder(), f"rank{rank}" + (f".attempt{attempt}" if attempt != "0" else ""))
                hidden = bool(shown) and local_rank not in shown
                to_file = redirects[local_rank] | tees[local_rank] | (Std.ERR if hidden else Std.NONE)
                console = "" if not hidden else os.devnull  # "": the agent's own stdout/stderr
                dest.stdouts[local_rank] = base + ".stdout.log" if to_file & Std.OUT else console
                dest.stderrs[local_rank] = base + ".stderr.log" if to_file & Std.ERR else console
                if hidden:
                    self.hidden_stderr[rank] = dest.stderrs[local_rank]
                else:
                    if tees[local_rank] & Std.OUT:
                        dest.tee_stdouts[local_rank] = dest.stdouts[local_rank]
                    if tees[local_rank] & Std.ERR:
                        dest.tee_stderrs[local_rank] = dest.stderrs[local_rank]
                dest.error_files[local_rank] = base + ".error.json"
                with contextlib.suppress(FileNotFoundError):  # an earlier run's (same --log_dir): never this one's
                    os.remove(dest.error_files[local_rank])
                env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
            return dest

        def hidden_lines(self, failures) -> list[str]:
            """The last stderr lines of each failed rank whose output the console did not show (without their
            newlines)."""
            out: list[str] = []
            for rank in sorted(failures):
                path = self.hidden_stderr.get(rank)
                if path is None or not os.path.isfile(path):
                    continue
                with open(path, errors="replace") as fh:
                    lines = fh.readlines()[-FAILURE_TAIL_LINES:]
                where = "" if self.temporary else f" (all of it: {path})"  # a temporary one is removed
                out.append(f"accel launch: last stderr lines of rank {rank}, hidden by --local_ranks_filter{where}:")
                prefix = f"[rank{rank}]:"  # torch.distributed's excepthook already puts it before tracebacks
                out += [(line if line.startswith(prefix) else prefix + line).rstrip("\n") for line in lines]
            return out

        def cleanup(self) -> None:
            if self.temporary and self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)

    return RankLogsSpecs


def _method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up, as torch's rendezvous logs it: read from the frames, where
    torch's own `get_method_name` calls `inspect.stack()` twice, which reads the source of every frame and searches
    sys.modules for each (0.3-0.7 s per launch once torch._dynamo is imported, nine calls per rendezvous)."""
    frame = sys._getframe(0)
    for _ in range(depth):
        if frame.f_back is None:
            return "no_method_name"
        frame = frame.f_back
    return frame.f_code.co_name


def _cheap_method_names() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = _method_name


def run_agent(torchrun_argv: list[str]) -> None:
    """torchrun's `main(argv)` with accel's `RankLogsSpecs` in place of its default logs layout. Raises what
    torchrun raises (ChildFailedError, SignalException, SystemExit for bad torchrun arguments, ...)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    uncaught.not_a_worker()  # (its environment gets the workers' run folder)
    _cheap_method_names()
    args = torchrun.parse_args(torchrun_argv)
    if args.log_dir and args.tee != "0":
        os.environ.setdefault(LINE_PREFIX_ENV, RANK_LINE_PREFIX)
    if args.master_port is None:  # as torchrun.run: only read by static rendezvous
        args.master_port = 29500
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    given = config.logs_specs
    assert given is not None  # torchrun's config_from_args always sets it
    specs = _rank_logs_specs_class()(args.log_dir, given._redirects, given._tee, given._local_ranks_filter)
    config.logs_specs = specs
    try:
        with quiet_torchrun_lines():
            elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as exc:  # its failures read their error files already
        # printed by the launcher after its summary line (launch.py)
        exc.accel_hidden_lines = specs.hidden_lines(exc.failures)  # type: ignore[attr-defined]
        keep_in_logs(exc.failures)
        raise
    finally:
        specs.cleanup()


# -------------------------------------------------------------------------------------------------------
# the workers' exceptions (accel/core/uncaught.py writes them to torchrun's error file)
# -------------------------------------------------------------------------------------------------------

@dataclass
class HeldError:
    """A worker's uncaught exception as its error file tells it."""

    message: str  # "ValueError: its text", on one line
    line: str  # the exception's own text, on one line
    traceback: str  # as Python prints it
    one_line: bool  # an accel one-line error: `accel: error: <line>` is all there is to show
    printed: bool  # the worker printed it itself (ACCEL_FULL_TRACEBACKS=1, or a hook of the script's own)
    time_ns: int | None = None  # when the worker reported it

    def short(self) -> str:
        """`message`, cut to MESSAGE_CHARS for the launcher's own lines."""
        text = self.line if self.one_line else self.message
        return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 3].rstrip() + "..."


def held_error(failure) -> HeldError | None:
    """The exception in a torchrun `ProcessFailure`'s error file, or None (no file: a signal, `sys.exit`, a worker
    that failed before `import accel`)."""
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    extra = message.get("extraInfo")
    if not isinstance(extra, dict):
        extra = {}
    ours = extra.get(uncaught.INFO_KEY)
    stack = extra.get("py_callstack")
    if not isinstance(stack, str):
        stack = ""
    text = " ".join(message["message"].split())
    if not isinstance(ours, dict):  # torch's own `record` (and no hook of accel's after it): the worker printed it
        return HeldError(text, text, stack, one_line=False, printed=True)
    when = ours.get("time_ns")
    return HeldError(text, " ".join(str(ours.get("line", "")).split()), stack, bool(ours.get("one_line")),
                     bool(ours.get("printed")), when if isinstance(when, int) else None)


def held_errors(failures: dict) -> dict[int, HeldError]:
    """Global rank -> its exception, for the failed ranks that left one."""
    errors = {rank: held_error(failure) for rank, failure in failures.items()}
    return {rank: error for rank, error in errors.items() if error is not None}


def error_lines(rank: int, error: HeldError | None) -> list[str]:
    """What the launcher prints of a rank's exception: the traceback as `[rank<R>]: ` lines (torch's prefix), or an
    accel one-line error's line; nothing when the worker printed it itself."""
    if error is None or error.printed:
        return []
    if error.one_line:
        return [f"accel: error: {error.line}"]
    prefix = f"[rank{rank}]: "
    return [prefix + line if line else "" for line in error.traceback.rstrip("\n").split("\n")]


def keep_in_logs(failures: dict) -> None:
    """With --log_dir, append each failed rank's exception (which it did not print) to its `rank<R>.stderr.log`, so
    the file holds what a worker that prints its own traceback would have left there."""
    for failure in failures.values():
        error = held_error(failure)
        path = str(getattr(failure, "error_file", ""))
        if error is None or error.printed or not path.endswith(".error.json"):
            continue
        log = path[: -len(".error.json")] + ".stderr.log"
        if not os.path.isfile(log):  # on the console only (no --log_dir)
            continue
        text = f"accel: error: {error.line}\n" if error.one_line else error.traceback
        with contextlib.suppress(OSError), open(log, "a") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")


class _SaidByAccel(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return (record.name, record.msg) not in TORCHRUN_LINES_SAID


@contextlib.contextmanager
def quiet_torchrun_lines():
    """Leave out torchrun's log lines that accel's own lines say (TORCHRUN_LINES_SAID), unless
    ACCEL_FULL_TRACEBACKS asks for everything."""
    if uncaught.full():
        yield
        return
    said = _SaidByAccel()
    loggers = [logging.getLogger(name) for name in sorted({name for name, _ in TORCHRUN_LINES_SAID})]
    for logger in loggers:
        logger.addFilter(said)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(said)
