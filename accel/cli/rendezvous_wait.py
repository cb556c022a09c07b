"""While torchrun's agent waits in the rendezvous (for the other machines, or for machine 0's store), the launcher
says who it waits for and for how long, and SIGTERM/SIGINT/SIGHUP end it at once.

The wait is a C++ call (TCPStore's connect, which retries on EINTR) that never returns to Python, so a Python signal
handler (accel's preemption watch, Python's KeyboardInterrupt) would run only when it gives up, minutes later. The
signal module still writes each signal's number to a wakeup descriptor from its C handler; a thread watching that
descriptor ends the launcher (nothing has started yet: no worker to stop, nothing to save) with the signal's exit code
and one line. Meanwhile the Python handlers of those signals do nothing, so the thread alone decides.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Callable

from accel.cli.fault_tolerance import GROUP_ENV
from accel.config import AccelConfig

ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def waiting_line(cfg: AccelConfig, handler) -> str:
    """'machine R of N: waiting for ... at ADDR:PORT (up to S s)'."""
    where = f"{cfg.main_process_ip}:{cfg.main_process_port}" if cfg.main_process_ip else "the rendezvous"
    timeout = getattr(handler, "timeout", None)  # torchrun's static rendezvous: a timedelta
    settings = getattr(handler, "settings", None)  # the c10d (dynamic) rendezvous: settings.timeout.join
    if timeout is None and settings is not None:
        timeout = getattr(getattr(settings, "timeout", None), "join", None)
    seconds = getattr(timeout, "total_seconds", None)
    limit = f" (up to {seconds():g} s)" if seconds is not None else ""
    whom = "machine 0" if cfg.machine_rank else f"the other {cfg.num_machines - 1} machine(s)"
    return (f"accel launch: machine {cfg.machine_rank} of {cfg.num_machines}: waiting for {whom} at {where}{limit}; "
            "Ctrl-C or SIGTERM stops the wait")


@contextlib.contextmanager
def signals_end_the_wait(clean_up: Callable[[], None] = lambda: None):
    """Within: SIGTERM, SIGINT or SIGHUP end the process at once (after `clean_up`), with 128 + the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    handlers = {signum: signal.signal(signum, lambda *_: None) for signum in ENDING}
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            ready, _, _ = select.select([read], [], [], 0.2)
            if not ready or done.is_set():
                continue
            for signum in os.read(read, 64):
                if signum in ENDING:
                    name = signal.Signals(signum).name
                    if os.environ.get(GROUP_ENV) is None:  # a replica group's launcher: its head says how it ended
                        sys.stderr.write(f"accel launch: stopped by signal {signum} ({name}) while waiting in the "
                                         "rendezvous; no worker was started\n")
                        sys.stderr.flush()
                    with contextlib.suppress(Exception):
                        clean_up()
                    os._exit(128 + signum)

    thread = threading.Thread(target=watch, name="accel-rendezvous-signals", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        thread.join(timeout=1)
        os.close(read)
        os.close(write)


@contextlib.contextmanager
def around_agent(cfg: AccelConfig, clean_up: Callable[[], None] = lambda: None):
    """torchrun's agent's rendezvous, announced (several machines) and stopped by a signal at once."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    original = SimpleElasticAgent._rendezvous

    def rendezvous(agent, worker_group):
        with signals_end_the_wait(clean_up):
            if cfg.num_machines > 1:
                sys.stderr.write(waiting_line(cfg, worker_group.spec.rdzv_handler) + "\n")
                sys.stderr.flush()
            return original(agent, worker_group)

    SimpleElasticAgent._rendezvous = rendezvous  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimpleElasticAgent._rendezvous = original  # type: ignore[method-assign]
