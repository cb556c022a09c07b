"""Smallest DDP job: prepare, two steps, and exit WITHOUT end_training (teardown happens at exit)."""

import torch

from accel import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for _ in range(2):
    loss = model(torch.randn(3, 4, device=accelerator.device)).sum()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
accelerator.print("done")
