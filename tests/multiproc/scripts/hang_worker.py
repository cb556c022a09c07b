"""A job that hangs (tests/multiproc/launching/test_hang_report.py): rank 1 sleeps instead of joining the all_reduce
that rank 0 waits in. That all_reduce runs on a group made after PartialState's (as DeviceMesh makes TP/ZeRO groups), so
the test also shows that collective_timeout reaches such groups (torch gives them 30 minutes on gloo otherwise).

`--exit CODE`: rank 1 exits with CODE after the sleep instead (a rank that leaves while rank 0 waits); with `--late`,
rank 0 enters the all_reduce only once rank 1's process is gone (reaped by torchrun's agent). `--signal NAME`: rank 1
ends itself by that signal after the sleep instead (`abort`: os.abort(), as C++'s std::terminate does), a worker's
own crash."""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from accel import PartialState


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=60.0)
    parser.add_argument("--exit", type=int, default=None, help="rank 1 exits with this code after the sleep")
    parser.add_argument("--late", action="store_true", help="rank 0 enters the all_reduce once rank 1 is gone")
    parser.add_argument("--signal", default=None, help="rank 1 ends itself by this signal after the sleep")
    args = parser.parse_args()
    state = PartialState(cpu=True)
    group = dist.new_group(list(range(state.num_processes)))
    pids = torch.zeros(state.num_processes, dtype=torch.int64, device=state.device)
    pids[state.process_index] = os.getpid()
    dist.all_reduce(pids, group=group)  # every rank reaches this one: the group works
    if state.process_index == 1 and args.signal is not None:
        time.sleep(args.sleep)
        print(f"rank 1: ending itself by {args.signal}", flush=True)
        if args.signal == "abort":
            os.abort()
        os.kill(os.getpid(), getattr(signal, args.signal))
    if state.process_index == 1 and args.exit is not None:
        time.sleep(args.sleep)
        print(f"rank 1: exiting with code {args.exit}", flush=True)
        sys.exit(args.exit)  # the rank that leaves (0: as if its script returned)
    if state.process_index == 0 and args.late:
        wait_until_gone(int(pids[1]))
    print(f"rank {state.process_index}: entering the all_reduce at {time.time():.3f}", flush=True)
    if state.process_index == 1:
        time.sleep(args.sleep)  # the stuck rank
    total = torch.ones(1, device=state.device)
    dist.all_reduce(total, group=group)  # rank 0 waits here for rank 1
    print(f"rank {state.process_index}: past the all_reduce", flush=True)


def wait_until_gone(pid: int, limit_s: float = 30.0) -> None:
    """Until the process is reaped (a zombie still answers signal 0), then a little longer."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    time.sleep(0.3)


if __name__ == "__main__":
    main()
