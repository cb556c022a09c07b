"""A script written for Hugging Face Accelerate (`from accelerate import Accelerator`), unchanged: trains a linear
model and writes, per rank, which `accelerate` it imported, the version the `accelerate` distribution answers, and
its losses (--out FOLDER/rank<R>.json)."""

import argparse
import importlib.metadata
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import accelerate
from accelerate import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

accelerator = Accelerator()
torch.manual_seed(0)
x = torch.randn(64, 4)
y = x.sum(dim=1, keepdim=True)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(x, y), batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for _ in range(3):
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
Path(args.out, f"rank{accelerator.process_index}.json").write_text(json.dumps({
    "accelerate": accelerate.__file__, "distribution": importlib.metadata.version("accelerate"),
    "num_processes": accelerator.num_processes, "losses": losses}))
