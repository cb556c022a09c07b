"""`accel launch`'s side of preemption: SIGTERM (and `preemption_signal`) asks the workers to save and stop.

Around torchrun's agent, `PreemptionWatch` takes SIGTERM and the configured signal from torchrun (they are left out of
torchrun's `--signals_to_handle`, its list of the signals it turns into "stop the workers"; `torchrun_flags`):

1. The first one, once a worker has read `accelerator.preemption_requested` (it leaves `listening_rank<R>` in the
   folder): the request file is written (accel/runtime/preemption.py: every rank's property turns True at the same
   step), one line says so, and the workers keep running. Without a listening worker it stops them as in 2.
2. A second signal, or `grace_period` seconds after the first: the workers are stopped as torchrun stops them (the
   SignalException torchrun's handler raises: SIGTERM to the workers, SIGKILL 30 s later); exit code 128 + the
   signal's number. First the `stop` mark goes into the folder: a worker that takes SIGTERM itself (it
   may have got the same signal from the scheduler, see accel/runtime/preemption.py) then stops at once. The mark is
   also left around every other stop of the workers by torchrun's agent (job_reaper.py).
3. The workers all exit 0 and at least one saw the request (this launcher's, or another machine's, which reached
   them through the all_reduce): the exit code is `EXIT_CODE` (75); with `requeue` under SLURM, machine_rank 0
   first runs `scontrol requeue <job id>`.

A launcher started by `--hostfile` (its head stops it by SIGTERM) stops its workers at the first SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from accel.runtime import preemption

TORCH_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's default --signals_to_handle
REQUEUE_TIMEOUT_S = 60


def handled_signals(preemption_signal: str | None) -> list[signal.Signals]:
    """The signals that ask the workers to stop: SIGTERM, and `preemption_signal` when given."""
    found = [signal.SIGTERM]
    if preemption_signal is not None and getattr(signal, preemption_signal) not in found:
        found.append(getattr(signal, preemption_signal))
    return found


def torchrun_flags(preemption_signal: str | None, preemptible: bool = True) -> list[str]:
    """torchrun's `--signals_to_handle` without the signals `PreemptionWatch` takes (nothing when it takes none)."""
    if not preemptible:
        return []
    ours = {sig.name for sig in handled_signals(preemption_signal)}
    return ["--signals_to_handle", ",".join(name for name in TORCH_DEFAULT_SIGNALS if name not in ours)]


class PreemptionWatch:
    """The request folder of one `accel launch`, the signal handlers around the agent, and the exit code after."""

    def __init__(self, run_dir: str | os.PathLike, preemption_signal: str | None, grace_period: float,
                 requeue: bool = False, enabled: bool = True, machine_rank: int = 0) -> None:
        self.folder = Path(run_dir) / "preemption"
        self.signals = handled_signals(preemption_signal)
        self.grace_period = grace_period
        self.requeue = requeue
        self.enabled = enabled
        self.machine_rank = machine_rank
        self.requested_by: int | None = None  # the signal that asked the workers to stop
        self.stopped_by: int | None = None  # the signal that stopped them (None: not stopped by a signal)
        self.expired = False  # the grace period ran out
        self._timer: threading.Timer | None = None
        self._active = False
        self._main_thread = 0

    # -- before and while the workers run ---------------------------------------------------------------------
    def worker_env(self) -> dict[str, str]:
        if not self.enabled:
            return {}
        self.folder.mkdir(parents=True, exist_ok=True)
        return {preemption.DIR_ENV: str(self.folder)}

    @contextlib.contextmanager
    def around_agent(self):
        """Our handlers for SIGTERM and the preemption signal while the block runs (torchrun, given `torchrun_flags`,
        handles the others)."""
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            yield self
            return
        before = {sig: signal.signal(sig, self._on_signal) for sig in self.signals}
        self._active = True
        self._main_thread = threading.get_ident()  # where the timer's signal goes (it interrupts the agent's sleep)
        try:
            yield self
        finally:
            self._active = False
            if self._timer is not None:
                self._timer.cancel()
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def listening(self) -> bool:
        return any(self.folder.glob("listening_rank*"))

    def stop_mark(self, stopping: bool) -> None:
        """Leave (`stopping`) or take away the `stop` mark: while it is there, a worker takes a signal as "stop now",
        not as a preemption request (torchrun stops workers with SIGTERM). job_reaper.py calls it around each
        stop of the worker group."""
        if not self.enabled:
            return
        path = preemption.stop_path(self.folder)
        with contextlib.suppress(OSError):
            if stopping:
                path.touch()
            else:
                path.unlink(missing_ok=True)

    def _on_signal(self, signum: int, frame) -> None:
        if self.requested_by is None and self.listening():
            self.requested_by = signum
            preemption.request_path(self.folder).write_text(signal.Signals(signum).name + "\n")
            name = signal.Signals(signum).name
            preemption.say(f"accel launch: got {name}: asked the workers to save and stop (accelerator."
                           f"preemption_requested); they are stopped in {self.grace_period:g} s or at a second signal")
            self._timer = threading.Timer(self.grace_period, self._expire)
            self._timer.daemon = True
            self._timer.start()
            return
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.stopped_by = signum
        self.stop_mark(True)  # before torchrun's SIGTERM reaches a worker that takes signals itself
        # torchrun's handler raises the same; its agent then stops the workers with SIGTERM whatever stopped us
        raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum).name}",
                              sigval=signal.SIGTERM)

    def _expire(self) -> None:
        if not self._active:
            return
        self.expired = True
        signal.pthread_kill(self._main_thread, self.requested_by or signal.SIGTERM)

    # -- after the agent returned ------------------------------------------------------------------------------
    def seen(self) -> bool:
        """Some worker of this machine saw the request (preemption_requested returned True)."""
        return any(self.folder.glob("seen_rank*"))

    def stopped_message(self) -> str | None:
        """The line that says why the workers were stopped by a signal, or None when no signal of ours stopped them."""
        if self.stopped_by is None:
            return None
        name = signal.Signals(self.stopped_by).name
        if self.expired:
            return (f"accel launch: the workers did not stop within the grace period ({self.grace_period:g} s) after "
                    f"{signal.Signals(self.requested_by or self.stopped_by).name}; they were stopped")
        if self.requested_by is not None:
            return f"accel launch: stopped by a second signal ({name}); the workers were stopped"
        return f"accel launch: stopped by signal {int(self.stopped_by)} ({name}); the workers were stopped"

    def stopped_code(self) -> int:
        """128 + the signal that stopped the workers (the grace period's end counts as the request's signal)."""
        return 128 + int(self.stopped_by or signal.SIGTERM)

    def finish(self, environ=os.environ, quiet: bool = False) -> int:
        """The exit code once every worker exited 0: EXIT_CODE when they stopped for a request (after `scontrol
        requeue` with `requeue`), else 0. The request may have come through another machine's launcher: the workers
        here saw it through the all_reduce. `quiet`: no line (a replica group's head says it for every group)."""
        if not self.seen():
            return 0
        if not quiet:
            sys.stderr.write(f"accel launch: the workers stopped at the preemption request; exit code "
                             f"{preemption.EXIT_CODE} (run the same command again to resume)\n")
        if self.requeue and self.machine_rank == 0:
            requeue_slurm_job(environ)
        sys.stderr.flush()
        return preemption.EXIT_CODE


def slurm_job_id(environ) -> str | None:
    """The id `scontrol requeue` takes: an array task's `<array job>_<task>`, else SLURM_JOB_ID."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or None


def requeue_slurm_job(environ=os.environ, run=None) -> bool:
    """`scontrol requeue <job id>` (`run`: subprocess.run); one line either way. False when not under SLURM or it
    failed."""
    run = run or subprocess.run
    job = slurm_job_id(environ)
    if job is None:
        sys.stderr.write("accel launch: warning: --requeue: not under SLURM (no SLURM_JOB_ID); nothing requeued\n")
        return False
    command = ["scontrol", "requeue", job]
    try:
        done = run(command, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        sys.stderr.write(f"accel launch: warning: --requeue: {' '.join(command)} failed: {exc}\n")
        return False
    if done.returncode != 0:
        why = " ".join((done.stderr or done.stdout or "").split()) or f"exit code {done.returncode}"
        sys.stderr.write(f"accel launch: warning: --requeue: {' '.join(command)} failed: {why}\n")
        return False
    sys.stderr.write(f"accel launch: requeued SLURM job {job} ({' '.join(command)})\n")
    return True
