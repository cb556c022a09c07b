"""Workers forked from the launcher instead of started as fresh interpreters (CPU launches).

Every fresh worker spends about 3.5 s of CPU importing torch and torch._dynamo (torch's optimizers import it) before
the script's first line; a 2-process launch spent 9 of its 11 CPU seconds there. torchrun's agent runs in this
process and has imported torch already, so on a CPU launch accel imports torch._dynamo once here and forks each
worker from this process: the worker starts with torch loaded, copy-on-write.

The seam is torch's own: torchrun's `SubprocessContext` asks `get_subprocess_handler` for each worker; in its place
`ForkingSubprocessHandler` returns a `ForkedProcess`, which answers as the `subprocess.Popen` it replaces does (pid,
poll, wait, returncode, send_signal), so the agent, its log files and tees, restarts, accel's hang report and the
preemption watch work on it unchanged. The forked child then makes itself what `python -u SCRIPT ARGS` would be:
its own session (it exits at once if its launcher died before that: job_reaper.py ends the sessions it knows),
stdout/stderr on the agent's files (unbuffered), the worker's environment, Python's default signal handlers and no
faulthandler of the agent's, fresh `random`/NumPy seeds, `sys.argv` and `sys.path[0]` of the script, the script run
as `__main__`, and at the end what the interpreter does at exit (join non-daemon threads, `atexit` handlers, flush).

What the agent did to the interpreter while it ran is undone, what importing modules did is kept (a fresh worker
imports the same modules and gets the same):

* `atexit`: from this module's import on (in the launcher, before torch is imported), each registration made
  outside an import is noted; the child unregisters those (the agent's) and keeps the others (logging's shutdown,
  multiprocessing's `_exit_function`, torch's, a `.pth` file's), so a buffered log handler is flushed at exit and
  multiprocessing ends its daemonic children (`--checkpoint_async process`'s saver) as in a fresh interpreter. The
  agent's `weakref.finalize` objects do not run at the worker's exit;
* logging: no root handler (level WARNING); each logger as it was once torch was imported here, before the agent
  ran; the agent's handlers are neither flushed nor closed at the worker's exit;
* multiprocessing: a main process of its own (name, authkey), no children, finalizers, start method or resource
  tracker of the agent's;
* warnings: the filters as they were before the agent ran, and every "already shown" registry starts over.

The one difference left: what the launcher imported (torch, torch._dynamo, torchrun's agent, accel's CLI; with
their import-time filters, exit handlers and inductor's cache folder variable) is in `sys.modules` before the
script's first line.

Only where it is safe: CPU launches (a launcher that has touched CUDA must not fork), `python` entry points (not
`--no_python`, not numactl-wrapped), on Linux only. `ACCEL_FRESH_WORKERS=1` starts fresh interpreters anyway.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

FRESH_ENV = "ACCEL_FRESH_WORKERS"


def wanted(on_cpu: bool) -> bool:
    """Fork the workers of this launch? (CPU launch, a platform with fork, not turned off)."""
    # Linux only: on macOS a process that loaded system frameworks (torch does) may crash in a forked child, which is
    # why Python's multiprocessing spawns there
    return on_cpu and sys.platform.startswith("linux") and os.environ.get(FRESH_ENV, "0") in ("", "0")


def preload() -> None:
    """What every worker imports anyway, imported once here before the forks (torch is loaded by the agent)."""
    import torch._dynamo  # noqa: F401


class ForkedProcess:
    """The part of `subprocess.Popen` torchrun's agent and accel's launcher use, for a forked child. A thread waits
    for the child, so `ended_at` is when it ended (not when the agent next looked): which of two ranks that ended
    within one poll of the agent failed first is then known (`by_end`)."""

    def __init__(self, pid: int, args: tuple) -> None:
        import threading

        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self.ended_at: float | None = None
        self._reaper = threading.Thread(target=self._reap, name=f"accel-reap-{pid}", daemon=True)
        self._reaper.start()
        ENDED[pid] = self

    def _reap(self) -> None:
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(self.pid, 0)
            self._ended(status)

    def _ended(self, status: int) -> None:
        if self.returncode is None:
            self.ended_at = time.time()
            self.returncode = os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        """The exit code once the child ended. Looks itself too: the waiting thread may not have run yet (it needs
        the interpreter's lock), and a worker that ended must not be missed by the agent's poll that sees another."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # the waiting thread reaped it: it records the end in a moment
                self._reaper.join(1.0)
            else:
                if pid == self.pid:
                    self._ended(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._reaper.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


ENDED: dict[int, ForkedProcess] = {}  # pid -> the forked worker (this launcher's)


def fork_session(run, env: dict[str, str], args: tuple) -> ForkedProcess:
    """Fork a child that leads a session of its own, with `env` as its environment and Python's default signal
    handlers, runs `run()` and exits with what it returns, as an interpreter exits (non-daemon threads joined, exit
    handlers run; the parent's own run-time ones dropped): what `subprocess.Popen(args, env=env,
    start_new_session=True)` of a command that does the same would be, without a fresh interpreter's imports.
    Fault tolerance's head starts its replica groups' launchers this way (fault_tolerance.py)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            import atexit
            import gc
            import threading

            gc.freeze()  # the parent's objects stay as they are: never collected (nor finalized) here
            os.setsid()
            os.environ.clear()
            os.environ.update(env)
            _default_signals()
            ENDED.clear()  # the parent's children are not this process's
            _drop_runtime_exits()
            try:
                code = run()
            except SystemExit as exc:
                code = _exit_code(exc.code)
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001 - said as the interpreter says it, exit 1
            import traceback

            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
    return ForkedProcess(pid, args)


def _drop_runtime_exits() -> None:
    """In a child forked by `fork_session`: the exit handlers and finalizers the parent registered while it ran are
    its own; the child keeps recording its own (its forked workers drop them in turn)."""
    import atexit
    import weakref

    unregister = _ATEXIT.get("unregister", atexit.unregister)
    finalize = weakref.finalize
    if any(func == finalize._exitfunc for func in _RUNTIME_EXITS):  # type: ignore[attr-defined]
        finalize._registered_with_atexit = False  # type: ignore[attr-defined]  # registered again at first use
    for func in _RUNTIME_EXITS:
        unregister(func)
    _RUNTIME_EXITS.clear()
    for info in list(finalize._registry.values()):  # type: ignore[attr-defined]
        info.atexit = False


def by_end(failures: dict) -> list[int] | None:
    """The global ranks of torchrun's `failures` (rank -> ProcessFailure) in the order their forked workers ended,
    or None when they were not all forked here."""
    ended = {rank: ENDED[f.pid].ended_at for rank, f in failures.items() if f.pid in ENDED}
    if len(ended) != len(failures) or any(at is None for at in ended.values()):
        return None
    return sorted(ended, key=lambda rank: ended[rank])  # type: ignore[arg-type, return-value]


def python_target(args: tuple) -> tuple[str, str, list[str]] | None:
    """("path" or "module", target, script arguments) of a `python -u [-m] TARGET ARGS` command, else None."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
        return None
    if args[2] == "-m":
        return ("module", args[3], list(args[4:])) if len(args) > 3 else None
    return "path", args[2], list(args[3:])


@contextlib.contextmanager
def forking_workers():
    """Within the block, torchrun's agent forks `python` workers from this process (see the module docstring)."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    class ForkingSubprocessHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]):
            target = python_target(args)
            if target is None:
                return super()._popen(args, env)
            for stream in (sys.stdout, sys.stderr, self._stdout, self._stderr):
                if stream is not None:
                    stream.flush()
            launcher = os.getpid()
            pid = os.fork()
            if pid == 0:  # the worker: never returns into the agent's code
                code = 1
                try:
                    code = _run_worker(target, env, self._stdout, self._stderr, launcher)
                except BaseException:  # noqa: BLE001 - a failure before the script: said, exit 1
                    import traceback

                    with contextlib.suppress(Exception):
                        traceback.print_exc()
                finally:
                    os._exit(code)
            return ForkedProcess(pid, args)

    def handler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=None):
        return ForkingSubprocessHandler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)

    preload()
    _LAUNCHER_STATE.update(_launcher_state())
    original = api.get_subprocess_handler
    api.get_subprocess_handler = handler
    try:
        yield
    finally:
        api.get_subprocess_handler = original


def _run_worker(target: tuple[str, str, list[str]], env: dict[str, str], stdout, stderr, launcher: int) -> int:
    """In the forked child: become `python -u TARGET ARGS` and run it; returns the exit code."""
    import gc

    gc.freeze()  # the agent's objects stay as they are: never collected (nor finalized) in the worker
    os.setsid()  # as torchrun's Popen(start_new_session=True): the agent signals the worker's process group
    if os.getppid() != launcher:  # the launcher died before the group existed (its sentinel ended the groups it had)
        return 128 + signal.SIGKILL
    for fd, stream in ((1, stdout), (2, stderr)):
        if stream is not None:
            os.dup2(stream.fileno(), fd)
    sys.stdout = _unbuffered(1, sys.stdout)  # sys.__stdout__ (the agent's, buffered) writes to fd 1 too
    sys.stderr = _unbuffered(2, sys.stderr)
    os.environ.clear()
    os.environ.update(env)
    _fresh_faulthandler()
    _default_signals()
    _fresh_interpreter_state()  # before what accel's import does again below (the rank's warnings filters)
    _fresh_seeds()
    _threads_from_env()
    from accel.core.rank_warnings import warn_once_per_job
    from accel.core.restarts import export_restart_count

    export_restart_count()  # what `import accel` does from the environment (done in the launcher): again, with this one
    warn_once_per_job()
    kind, name, script_args = target
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(name))
    sys.path[:] = [first, *entries, *(p for p in sys.path[1:] if p not in entries)]
    sys.argv = [name, *script_args]
    import atexit
    import importlib
    import runpy
    import threading

    importlib.invalidate_caches()
    code = 0
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(name, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 - printed as the interpreter prints it, then exit 1 (130: Ctrl-C)
        exc.__traceback__ = _script_frames(exc.__traceback__)  # torch's rank-prefixing hook reads it from exc
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit: join non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


# -- what a fresh interpreter starts with: noted in the launcher, put back in the forked child ------------------

_LAUNCHER_STATE: dict = {}  # logging's loggers and the warnings filters once torch is imported, before the agent runs
_RUNTIME_EXITS: list = []  # what the launcher registered with atexit outside any import: the agent's, not the worker's
_ATEXIT: dict = {}  # the real atexit.register / unregister


def _record_runtime_exits() -> None:
    """From here on, note each `atexit.register` made outside an import. What modules register while they are
    imported (logging's shutdown, multiprocessing's `_exit_function`, torch's DataLoader exit flag, a `.pth` file's
    at startup, ...) a fresh worker registers too when it imports them; what the agent registers while it runs is
    its own, and the forked worker drops it."""
    import atexit

    real_register, real_unregister = atexit.register, atexit.unregister

    def register(func, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
        if frame is None:  # not within an import
            _RUNTIME_EXITS.append(func)
        return real_register(func, *args, **kwargs)

    def unregister(func) -> None:
        _RUNTIME_EXITS[:] = [known for known in _RUNTIME_EXITS if known != func]
        real_unregister(func)

    _ATEXIT.update(register=real_register, unregister=real_unregister)
    atexit.register, atexit.unregister = register, unregister  # type: ignore[assignment]


def _launcher_state() -> dict:
    import logging
    import warnings

    loggers = {name: (list(logger.handlers), logger.level, logger.propagate, logger.disabled)
               for name, logger in logging.Logger.manager.loggerDict.items() if isinstance(logger, logging.Logger)}
    return {"loggers": loggers, "warnings": list(warnings.filters)}


def _fresh_interpreter_state() -> None:
    """In the forked child, before the script: what the agent changed at run time, as a fresh interpreter has it."""
    _fresh_exit_handlers()
    _fresh_logging()
    _fresh_multiprocessing()
    import warnings

    if "warnings" in _LAUNCHER_STATE:
        warnings.filters[:] = _LAUNCHER_STATE["warnings"]  # type: ignore[index]
    warnings.onceregistry.clear()  # type: ignore[attr-defined]
    warnings._filters_mutated()  # type: ignore[attr-defined]  # every module's "already shown" registry starts over


def _fresh_exit_handlers() -> None:
    """The exit handlers a fresh interpreter has after importing what is imported here: the agent's are dropped
    (and its `weakref.finalize` objects do not run at the worker's exit)."""
    import atexit

    if _ATEXIT:
        atexit.register, atexit.unregister = _ATEXIT["register"], _ATEXIT["unregister"]
    _drop_runtime_exits()


def _fresh_logging() -> None:
    """Logging unconfigured, as a fresh interpreter has it: no root handlers (level WARNING), each logger as it was
    when the launcher had imported torch (a handler set at import stays), the agent's handlers neither flushed nor
    closed at the worker's exit."""
    logging = sys.modules.get("logging")
    if logging is None:
        return
    saved = _LAUNCHER_STATE.get("loggers", {})
    root = logging.root
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    kept: set[int] = set()
    manager = logging.Logger.manager
    manager.disable = 0
    for name, logger in list(manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger):
            continue
        handlers, level, propagate, disabled = saved.get(name, ([], logging.NOTSET, True, False))
        logger.handlers[:] = handlers
        logger.level, logger.propagate, logger.disabled = level, propagate, disabled
        kept.update(map(id, handlers))
    logging._handlerList[:] = [ref for ref in logging._handlerList if ref() is not None and id(ref()) in kept]
    manager._clear_cache()


def _fresh_multiprocessing() -> None:
    """multiprocessing as in a fresh main process: its own identity and authkey, no children, no finalizers of the
    agent's (they would run at the worker's exit), no start method chosen, no resource tracker of the agent's."""
    process = sys.modules.get("multiprocessing.process")
    if process is None:
        return
    import itertools
    from multiprocessing import context, util

    main = process._current_process
    if type(main).__name__ == "_MainProcess":  # the launcher's; a new one draws its own authkey
        process._current_process = type(main)()  # type: ignore[attr-defined]
    process._parent_process = None  # type: ignore[attr-defined]
    process._children = set()  # type: ignore[attr-defined]
    process._process_counter = itertools.count(1)  # type: ignore[attr-defined]
    util._finalizer_registry.clear()  # type: ignore[attr-defined]
    util._exiting = False  # type: ignore[attr-defined]
    util._run_after_forkers()  # type: ignore[attr-defined]
    context._default_context._actual_context = None  # type: ignore[attr-defined]
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    if tracker is not None and getattr(tracker, "_fd", None) is not None:
        with contextlib.suppress(OSError):
            os.close(tracker._fd)
        tracker._fd = tracker._pid = None


def _script_frames(tb):
    """The traceback from the script's first frame on, as the interpreter shows it (not this module's, runpy's)."""
    import runpy

    skipped = {__file__, "<frozen runpy>", getattr(runpy, "__file__", None)}
    while tb is not None and tb.tb_frame.f_code.co_filename in skipped:
        tb = tb.tb_next
    return tb


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _unbuffered(fd: int, like):
    """A text stream on `fd` as `python -u` makes it (write-through)."""
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding=getattr(like, "encoding", None) or "utf-8",
                            errors=getattr(like, "errors", None) or "strict", write_through=True)


def _default_signals() -> None:
    """Python's handlers as a fresh interpreter has them: the agent's own (torchrun's SIGTERM/SIGINT/..., accel's
    preemption watch) are not the worker's. Ignored signals stay ignored, as they would across exec."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _fresh_faulthandler() -> None:
    """faulthandler as a fresh interpreter has it: on only with PYTHONFAULTHANDLER, no timer or signal of the
    agent's (a signal registered with faulthandler answers below Python's handlers)."""
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            faulthandler.unregister(sig)
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    else:
        faulthandler.disable()


def _fresh_seeds() -> None:
    """Seed `random` (and NumPy's global generator, if loaded) from the OS, as a fresh interpreter would: forked
    workers would otherwise all draw the agent's numbers. torch's default seed is a constant in both cases."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


def _threads_from_env() -> None:
    """OMP_NUM_THREADS as set for the workers: OpenMP read the agent's value when torch was loaded here."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


if sys.platform.startswith("linux"):
    _record_runtime_exits()  # in the launcher, before torch is imported
