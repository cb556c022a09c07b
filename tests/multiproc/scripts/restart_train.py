"""Worker for test_restart_resume.py: the resume pattern for `accel launch --max_restarts N`.

Dropout, a shuffled loader, AdamW and an LR scheduler; a checkpoint every --every steps; the loss of every step
logged with the jsonl tracker. Every attempt calls `init_trackers` then `load_state()`: on the first there is no
checkpoint (FileNotFoundError: start fresh), after a restart it loads the latest complete one (and so continues
its run's log from there) and skips the batches already done in its epoch.

--out DIR      project_dir; rank 0 writes final.safetensors there, each rank attempt<i>_rank<r>.json
--kill_at N    on the first attempt rank 1 SIGKILLs itself inside step N's save_state, as it takes its RNG states
               (under DDP the main process writes the tensors; rank 1 has joined the save and is waited for),
               before the checkpoint is complete (N must be a checkpoint step)
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, ProjectConfiguration
from accel.checkpoint import rng_states
from accel.utils import set_seed

from resume_train import Progress  # registered for checkpointing: optimizer steps done, so a restart knows where it is


def die_inside_the_next_save() -> None:
    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    rng_states.rng_snapshot = die  # called once this rank joined the save, before the manifest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill_at", type=int, default=0)
    args = parser.parse_args()
    restart = int(os.environ["ACCEL_RESTART_COUNT"])  # set when accel is imported
    Path(args.out).mkdir(parents=True, exist_ok=True)

    set_seed(0)
    g = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 1, generator=g))
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)

    project = ProjectConfiguration(project_dir=args.out, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=project, log_with="jsonl")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.init_trackers("train")

    checkpoints = Path(args.out) / "checkpoints"
    found = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []
    try:
        accelerator.load_state()  # after a restart: the latest complete checkpoint
    except FileNotFoundError:
        pass  # first attempt: nothing saved yet, start fresh
    start_epoch, skip = divmod(progress.steps, len(loader))
    record = {"ACCEL_RESTART_COUNT": os.environ["ACCEL_RESTART_COUNT"],
              "TORCHELASTIC_RESTART_COUNT": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
              "restart_count": accelerator.state.restart_count, "found": found, "resumed_at": progress.steps}
    Path(args.out, f"attempt{restart}_rank{accelerator.process_index}.json").write_text(json.dumps(record))

    for epoch in range(start_epoch, args.epochs):
        batches = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for inputs, targets in batches:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.steps += 1
            accelerator.log({"loss": loss.item()}, step=progress.steps)
            if progress.steps % args.every == 0:
                if progress.steps == args.kill_at and restart == 0 and accelerator.process_index == 1:
                    die_inside_the_next_save()
                accelerator.save_state()

    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(Path(args.out) / "final.safetensors"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
