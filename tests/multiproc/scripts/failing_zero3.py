"""A ZeRO-3 job whose rank 1 raises, run with --max_restarts 1
(tests/multiproc/launching/test_launch_failure_output.py).

Attempt 0: rank 1 raises right after `prepare` while rank 0 sleeps outside any collective, so torchrun's agent stops
rank 0 (SIGTERM) and restarts the group. Attempt 1: rank 1 raises at step 1 while rank 0 goes on into the model's
forward, where FSDP's all-gather fails without rank 1 (or is still waiting when the agent stops it)."""

import os
import time

import torch

from accel import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
attempt = int(os.environ["ACCEL_RESTART_COUNT"])
rank = accelerator.process_index
if attempt == 0:
    if rank == 1:
        raise ValueError("attempt 0 fails on rank 1")
    time.sleep(120)  # outside any collective: the agent stops it (the test fails on its timeout otherwise)
for step in range(3):
    if step == 1 and rank == 1:
        raise ValueError("bad batch on rank 1")
    loss = model(torch.ones(4, 8)).sum()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
