"""Worker for tests/multiproc/launching/test_job_lifetime.py: what must not outlive the job.

Each rank starts a `sleep 1000` child and writes [its pid, the child's pid] to OUT/pids_rank<R>_attempt<A>.json
(A: ACCEL_RESTART_COUNT), then:

--mode train  trains (DDP), appending the step to OUT/steps_rank<R> after each (the checkpoint marker a requeued job
              would find), until stopped (120 s at most)
--mode fail   an attempt after the first writes the previous attempt's pids still alive to
              OUT/survivors_rank<R>_attempt<A>.json; then rank 1 exits 1 and rank 0 waits to be stopped
"""

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from accel import Accelerator


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("train", "fail"), required=True)
    args = parser.parse_args()
    out = Path(args.out)
    attempt = int(os.environ.get("ACCEL_RESTART_COUNT", "0"))

    accelerator = Accelerator()
    rank = accelerator.process_index
    if args.mode == "fail" and attempt > 0:
        before = []
        for r in range(accelerator.num_processes):
            before += json.loads((out / f"pids_rank{r}_attempt{attempt - 1}.json").read_text())
        (out / f"survivors_rank{rank}_attempt{attempt}.json").write_text(json.dumps([p for p in before if alive(p)]))
    child = subprocess.Popen(["sleep", "1000"])
    (out / f"pids_rank{rank}_attempt{attempt}.json").write_text(json.dumps([os.getpid(), child.pid]))
    accelerator.wait_for_everyone()

    if args.mode == "fail":
        if rank == 1:
            raise SystemExit(1)
        time.sleep(120)
        return

    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    deadline = time.monotonic() + 120
    step = 0
    while time.monotonic() < deadline:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        with open(out / f"steps_rank{rank}", "a") as fh:
            fh.write(f"{step}\n")
        time.sleep(0.02)


if __name__ == "__main__":
    main()
