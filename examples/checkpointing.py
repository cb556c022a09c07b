"""Checkpoint and resume: run it, interrupt it (Ctrl-C) or let it finish, then run it again to resume.

    accel launch --cpu --num_processes 2 examples/checkpointing.py --project_dir runs/demo
    accel launch --cpu --num_processes 2 examples/checkpointing.py --project_dir runs/demo   # resumes

A checkpoint is saved every `--save_every` steps under PROJECT_DIR/checkpoints/checkpoint_<i> (the last 2
are kept). On start, the latest complete checkpoint is loaded and the batches already done are skipped,
so a resumed run ends with exactly the weights of an uninterrupted one. The final weights are written in
Hugging Face's safetensors layout to PROJECT_DIR/model.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, ProjectConfiguration
from accel.utils import broadcast_object_list, set_seed


class Progress:
    """Optimizer steps done so far; saved with the checkpoint via register_for_checkpointing."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project_dir", default=None, help="default: a fresh temporary folder")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save_every", type=int, default=5)
    args = parser.parse_args()

    set_seed(0)
    x = torch.randn(256, 10)
    y = (x[:, :5].sum(dim=1, keepdim=True) > 0).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)

    accelerator = Accelerator()
    new_dir = tempfile.mkdtemp() if accelerator.is_main_process and not args.project_dir else None
    project_dir = args.project_dir or broadcast_object_list([new_dir])[0]  # rank 0's folder for all
    accelerator.project_configuration = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True,
                                                             total_limit=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    checkpoints = Path(project_dir) / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.glob("checkpoint_*/accel_checkpoint.json")):
        accelerator.load_state()
        accelerator.print(f"resumed from step {progress.steps}")
    start_epoch, done_in_epoch = divmod(progress.steps, len(loader))

    for epoch in range(start_epoch, args.epochs):
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if epoch == start_epoch else loader
        for inputs, targets in batches:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.steps += 1
            if progress.steps % args.save_every == 0:
                accelerator.save_state()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}")

    accelerator.save_model(model, Path(project_dir) / "model")
    accelerator.print(f"done: {progress.steps} steps on {accelerator.num_processes} process(es); "
                      f"checkpoints and model in {project_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
