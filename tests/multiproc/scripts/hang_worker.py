"""A job that hangs (tests/multiproc/test_hang_report.py): rank 1 sleeps instead of joining the all_reduce that rank 0
waits in. That all_reduce runs on a group made after PartialState's (as DeviceMesh makes TP/ZeRO groups), so the
test also shows that collective_timeout reaches such groups (torch gives them 30 minutes on gloo otherwise)."""

import argparse
import time

import torch
import torch.distributed as dist

from accel import PartialState


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=60.0)
    args = parser.parse_args()
    state = PartialState(cpu=True)
    group = dist.new_group(list(range(state.num_processes)))
    total = torch.ones(1)
    dist.all_reduce(total, group=group)  # every rank reaches this one: the group works
    print(f"rank {state.process_index}: entering the all_reduce at {time.time():.3f}", flush=True)
    if state.process_index == 1:
        time.sleep(args.sleep)  # the stuck rank
    dist.all_reduce(total, group=group)  # rank 0 waits here for rank 1
    print(f"rank {state.process_index}: past the all_reduce", flush=True)


if __name__ == "__main__":
    main()
