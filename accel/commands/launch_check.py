"""What `accelerate test` runs where no real Accelerate is installed (Accelerate's own test_utils/scripts/test_script.py
is Accelerate's, so it is not here): `accel launch [--config_file F] launch_check.py`, checking that this machine runs
distributed training as the config says. The processes start and meet; gather and reduce give the right values; a
prepared DataLoader gives each process its own batches, together all the data once; a few SGD steps of a linear
model give one process's losses on the same data (float32 without accumulation) and lower its loss on all of it."""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator

BATCH = 4  # per process
STEPS = 5
LR = 0.2


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"accelerate test: failed: {what}")


def main() -> None:
    accelerator = Accelerator()
    n, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    accelerator.print(f"accelerate test (accel's check): {n} process(es), {accelerator.distributed_type}, "
                      f"mixed precision {accelerator.mixed_precision}")

    ranks = accelerator.gather(torch.tensor([rank], device=device)).tolist()
    _check(ranks == list(range(n)), f"gather of the process indices gave {ranks}")
    total = accelerator.reduce(torch.tensor([rank + 1.0], device=device), reduction="sum").item()
    _check(total == n * (n + 1) / 2, f"sum of 1..{n} over the processes gave {total}")

    items = torch.arange(8 * n, dtype=torch.float32).unsqueeze(1)
    loader = accelerator.prepare(DataLoader(TensorDataset(items), batch_size=2))
    mine = torch.cat([batch for (batch,) in loader]).to(device)
    seen = sorted(accelerator.gather(mine).flatten().tolist())
    _check(seen == items.flatten().tolist(), "the processes' batches are not all the data once")

    torch.manual_seed(0)
    x = torch.randn(STEPS * n * BATCH, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.1
    reference = torch.nn.Linear(4, 1)
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(reference.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, train = accelerator.prepare(model, optimizer, DataLoader(TensorDataset(x, y), batch_size=BATCH))

    def loss_on_all() -> float:  # every process runs the same forward (collectives under ZeRO-3/TP line up)
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x.to(device)).float(), y.to(device)).item()

    before, losses = loss_on_all(), []
    for inputs, targets in train:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach().float(), reduction="mean").item())
    _check(len(losses) == STEPS and all(math.isfinite(v) for v in losses), f"losses {losses}")
    exact = accelerator.mixed_precision == "no" and accelerator.gradient_accumulation_steps == 1
    if exact:  # one process, the same global batches: batch k of every process together, in order
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
        expected = []
        for step in range(STEPS):
            rows = slice(step * n * BATCH, (step + 1) * n * BATCH)
            ref_loss = torch.nn.functional.mse_loss(reference(x[rows]), y[rows])
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            expected.append(ref_loss.item())
        _check(all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(losses, expected, strict=True)),
               f"losses {losses}, one process gives {expected}")
    after = loss_on_all()
    _check(after < before, f"training did not lower the loss on all the data: {before} before, {after} after")
    accelerator.print(f"losses {[round(v, 6) for v in losses]}" + (" (as on one process)" if exact else "")
                      + f"; on all the data {before:.4f} before, {after:.4f} after")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
