"""Worker for the bit-exact resume test: dropout, a shuffled loader, AdamW and an LR scheduler.

--mode full    trains uninterrupted and writes full.safetensors
--mode first   trains until --stop_step, calls save_state() (automatic naming) and stops
--mode second  load_state() from the latest checkpoint, skips the batches already done, finishes the run
               and writes resumed.safetensors
--mode load    load_state() only and writes loaded.safetensors (first also writes at_stop.safetensors)

`--jobs FILE` runs several of these in one launch (scripts/_jobs.py): each job sets its seed afresh.
"""

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from _jobs import main_with_jobs

from accel import Accelerator, ProjectConfiguration
from accel.utils import set_seed


class Progress:
    """Registered for checkpointing: how many optimizer steps were done."""

    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def run(argv: list[str] | None) -> Accelerator:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["full", "first", "second", "load"], required=True)
    parser.add_argument("--stop_step", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--mixed_precision", default=None)
    args = parser.parse_args(argv)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    set_seed(0)
    g = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g))
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)

    project = ProjectConfiguration(project_dir=args.out, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=project, mixed_precision=args.mixed_precision)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    start_epoch, skip = 0, 0
    if args.mode in ("second", "load"):
        accelerator.load_state()
        start_epoch, skip = divmod(progress.steps, len(loader))
    if args.mode == "load":
        write_weights(accelerator, model, Path(args.out) / "loaded.safetensors")
        return accelerator

    for epoch in range(start_epoch, args.epochs):
        active = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for inputs, targets in active:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.steps += 1
            if args.mode == "first" and progress.steps == args.stop_step:
                write_weights(accelerator, model, Path(args.out) / "at_stop.safetensors")
                accelerator.save_state()
                accelerator.save_state()  # two checkpoints: the latest one is loaded
                return accelerator

    write_weights(accelerator, model, Path(args.out) / f"{'full' if args.mode == 'full' else 'resumed'}.safetensors")
    if args.mode == "full":  # Hugging Face layout, sharded, written once by the main process
        accelerator.save_model(model, Path(args.out) / "hf_model", max_shard_size="1KB")
    return accelerator


def write_weights(accelerator, model, path: Path) -> None:
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path))


if __name__ == "__main__":
    main_with_jobs(run)
