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
  fails its last lines are printed before the failure summary.
* One process with `--log_dir` runs under torchrun's agent too (it is the agent that writes the files).
* Warnings every rank repeats are printed by rank 0 only: see accel/core/rank_warnings.py (done in the workers).

torchrun's agent runs with `RankLogsSpecs`, a `LogsSpecs` (torchrun's own extension point for where worker
output goes), through torchrun's `parse_args` / `config_from_args` / `elastic_launch`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from accel.cli._common import UsageError, add_flag

LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
RANK_LINE_PREFIX = "[rank${rank}]:"
FAILURE_TAIL_LINES = 20


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
                env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
            return dest

        def report_hidden_failures(self, failures) -> None:
            """The last stderr lines of each failed rank whose output the console did not show."""
            for rank in sorted(failures):
                path = self.hidden_stderr.get(rank)
                if path is None or not os.path.isfile(path):
                    continue
                with open(path, errors="replace") as fh:
                    lines = fh.readlines()[-FAILURE_TAIL_LINES:]
                where = "" if self.temporary else f" (all of it: {path})"  # a temporary one is removed
                sys.stderr.write(f"accel launch: last stderr lines of rank {rank}, hidden by --local_ranks_filter"
                                 f"{where}:\n")
                prefix = f"[rank{rank}]:"  # torch.distributed's excepthook already puts it before tracebacks
                sys.stderr.writelines(line if line.startswith(prefix) else prefix + line for line in lines)
                if lines and not lines[-1].endswith("\n"):
                    sys.stderr.write("\n")
            sys.stderr.flush()

        def cleanup(self) -> None:
            if self.temporary and self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)

    return RankLogsSpecs


def run_agent(torchrun_argv: list[str]) -> None:
    """torchrun's `main(argv)` with accel's `RankLogsSpecs` in place of its default logs layout. Raises what
    torchrun raises (ChildFailedError, SignalException, SystemExit for bad torchrun arguments, ...)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

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
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as exc:  # its failures read their error files already
        specs.report_hidden_failures(exc.failures)
        raise
    finally:
        specs.cleanup()
