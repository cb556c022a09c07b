"""Worker for tests/multiproc/training/test_same_numbers.py, written for Accelerate: run as it is on the real
Accelerate, and on accel through the shim. A net with dropout, a shuffled loader, accumulation and a scheduler; it
prints one JSON line (main process) with every step's gathered loss and a digest of the final weights, so the two can be
compared number for number. `--save DIR` also saves the state after epoch 1's fourth batch; `--load DIR` builds
everything from another seed, loads that state and finishes the run: accel promises that equals the uninterrupted run
bit for bit (Accelerate's does not: its resumed loader draws from the global RNG again).
"""

import argparse
import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.utils import set_seed


def build(seed: int):
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
    return model, optimizer, scheduler, DataLoader(data, batch_size=4, shuffle=True)


def step(accelerator, model, optimizer, scheduler, batch):
    inputs, targets = batch
    with accelerator.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return accelerator.gather(loss.detach()[None]).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", default="", help="save_state after epoch 1's 4th batch (an accumulation boundary)")
    parser.add_argument("--load", default="", help="start from another seed, load this state and finish the run")
    args = parser.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, scheduler, loader = accelerator.prepare(*build(123 if args.load else 0))
    losses, cut = [], None
    if args.load:
        accelerator.load_state(args.load)
    for epoch in range(1, 3) if args.load else range(3):
        part = accelerator.skip_first_batches(loader, 4) if args.load and epoch == 1 else loader
        for i, batch in enumerate(part):
            losses.append(step(accelerator, model, optimizer, scheduler, batch))
            if args.save and epoch == 1 and i == 3:
                accelerator.save_state(args.save)
                cut = len(losses)
    record = {"num_processes": accelerator.num_processes, "losses": losses, "cut": cut,
              "weights": [float(p.detach().double().sum()) for p in accelerator.unwrap_model(model).parameters()]}
    if accelerator.is_main_process:
        print("RECORD " + json.dumps(record))
    sys.stdout.flush()
    accelerator.end_training()


if __name__ == "__main__":
    main()
