"""A plain PyTorch training loop made distributed by three lines (marked # accel).

    accel launch examples/quickstart.py                       # the embedded default: one process
    accel launch --cpu --num_processes 2 examples/quickstart.py   # two processes on gloo

It learns y = 3x - 1 + noise with a small MLP on synthetic data (no download). The main process logs the loss and
learning rate of every step to runs/quickstart/run-<NNN>/metrics.jsonl, a new run-<NNN> each time (one JSON object
per line; `--project_dir` moves it); `accel plot runs/quickstart -o curves.png` draws each run as its own line.
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator  # accel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--project_dir", default="runs",
                        help="logs go to PROJECT_DIR/quickstart/run-<NNN>/metrics.jsonl")
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(1024, 8)
    y = 3 * x.sum(dim=1, keepdim=True) - 1 + 0.01 * torch.randn(1024, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

    accelerator = Accelerator(log_with="jsonl", project_dir=args.project_dir)  # accel
    accelerator.init_trackers("quickstart", config=vars(args))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)  # accel

    step = 0
    for epoch in range(args.epochs):
        model.train()
        total, count = torch.zeros((), device=accelerator.device), 0
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)  # accel (instead of loss.backward())
            optimizer.step()
            scheduler.step()
            total += loss.detach()
            count += 1
            accelerator.log({"loss": loss.detach(), "lr": scheduler.get_last_lr()[0]}, step=step)  # this process's loss
            step += 1
        mean_loss = accelerator.reduce(total / count, reduction="mean")
        accelerator.print(f"epoch {epoch}: loss {mean_loss.item():.4f} on {accelerator.num_processes} process(es)")
    accelerator.end_training()


if __name__ == "__main__":
    main()
