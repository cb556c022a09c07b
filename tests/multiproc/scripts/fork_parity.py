"""What a launched worker leaves behind and prints, forked or fresh (tests/multiproc/launching/test_job_lifetime.py).

Each rank: starts a `sleep 1000` child and writes [its pid, the child's pid] to OUT/pids_rank<R>.json (the job's end
must end the child), logs through a `MemoryHandler` that only flushes when logging shuts down at exit, uses a
multiprocessing Pool and Process, saves once with the launch's `--checkpoint_async` (process), prints from an atexit
handler, and writes what it sees of its interpreter at its start and end to OUT/state_rank<R>.json (logging
unconfigured, signal handlers, threads, faulthandler, excepthook, warnings filters, atexit handlers, umask, cwd,
multiprocessing's view).
"""

import argparse
import atexit
import faulthandler
import json
import logging
import logging.handlers
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import warnings

import torch

from accel import Accelerator


def say(line: str) -> None:
    """One line in one write: the two ranks share the launcher's stdout, and print's separate writes of the text and
    its newline interleave with the other rank's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def square(x):
    return x * x


def child_says(queue):
    queue.put("child process ran")


def interpreter_state() -> dict:
    root = logging.getLogger()
    handlers = {}
    for sig in sorted(signal.valid_signals()):
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        handlers[signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(int(sig))] = (
            handler if isinstance(handler, int) else getattr(handler, "__qualname__", repr(handler)))
    umask = os.umask(0)
    os.umask(umask)
    return {
        "root_handlers": [type(h).__name__ for h in root.handlers],
        "root_level": root.level,
        "logger_names_with_handlers": sorted(name for name, lg in logging.Logger.manager.loggerDict.items()
                                             if isinstance(lg, logging.Logger) and lg.handlers),
        "signals": {k: str(v) for k, v in handlers.items()},
        "threads": sorted(t.name for t in threading.enumerate()),
        "faulthandler": faulthandler.is_enabled(),
        "excepthook": getattr(sys.excepthook, "__module__", "") + "." + getattr(sys.excepthook, "__qualname__", ""),
        "warnings_filters": [f"{action} {getattr(category, '__name__', category)} {getattr(module, 'pattern', module)}"
                             for action, _, category, module, _ in warnings.filters],
        "umask": umask,
        "cwd": os.getcwd(),
        "mp_process": multiprocessing.current_process().name,
        "mp_children": len(multiprocessing.active_children()),
        "mp_start_method": multiprocessing.get_start_method(allow_none=True),
        "atexit_handlers": atexit._ncallbacks(),
        "env_keys": sorted(k for k in os.environ if not k.startswith(("TORCHELASTIC_", "ACCEL_HANG", "ACCEL_PREEMP"))),
        "stdin_isatty": sys.stdin is not None and sys.stdin.isatty(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    log = logging.getLogger("parity")
    log.setLevel(logging.INFO)
    log.propagate = False
    target = logging.StreamHandler(sys.stdout)
    target.setFormatter(logging.Formatter("log %(levelname)s %(message)s"))
    log.addHandler(logging.handlers.MemoryHandler(capacity=1000, flushLevel=logging.CRITICAL, target=target))

    start = interpreter_state()  # what the script starts with
    accelerator = Accelerator()
    rank = accelerator.process_index
    child = subprocess.Popen(["sleep", "1000"])
    with open(os.path.join(args.out, f"pids_rank{rank}.json"), "w") as fh:
        json.dump([os.getpid(), child.pid], fh)
    log.info("rank %d started", rank)

    with multiprocessing.Pool(2) as pool:
        say(f"rank {rank} pool {pool.map(square, [1, 2, 3])}")
    queue = multiprocessing.Queue()
    proc = multiprocessing.Process(target=child_says, args=(queue,))
    proc.start()
    say(f"rank {rank} {queue.get(timeout=60)}")
    proc.join()

    model = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(os.path.join(args.out, "ckpt"))
    accelerator.wait_for_everyone()
    log.info("rank %d saved", rank)
    with open(os.path.join(args.out, f"state_rank{rank}.json"), "w") as fh:  # at the end: torch._dynamo is loaded
        json.dump({"start": start, "end": interpreter_state()}, fh, indent=1, sort_keys=True)  # in fresh ones too
    atexit.register(lambda: say(f"rank {rank} atexit"))
    say(f"rank {rank} end")


if __name__ == "__main__":
    main()
