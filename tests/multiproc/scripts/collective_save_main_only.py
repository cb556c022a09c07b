"""save_state under ZeRO-3 called on the main process alone: each process holds a part of the state, so the save
is collective; the main process must say so in one line (ACCEL_SAVE_STATE_TIMEOUT shortens the wait), not hang."""

import sys

import torch

from accel import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(3):
    accelerator.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()
    if accelerator.is_main_process and step == 0:
        accelerator.save_state(sys.argv[1])
