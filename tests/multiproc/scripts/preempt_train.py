"""Worker for the preemption tests: the documented pattern, `if accelerator.preemption_requested: save_state; stop`.

Every run resumes from the latest checkpoint when there is one (load_state + skip_first_batches, as resume_train.py),
trains to the end and writes final.safetensors, unless the job is asked to stop:

--marker_step K  after step K each rank writes marker_rank<R> (the test then signals the launcher) and waits there,
                 reading preemption_requested, until it turns True (at most 60 s: the test fails then)
--stubborn       after the marker, never read it again and sleep (a save that takes too long): only a second signal
                 or the grace period stops the job
--failing_save   the grace save is asynchronous and its publication fails (a full disk, simulated), and the script
                 returns without end_training: the failure is found only at exit

When preemption_requested turns True, each rank writes preempted_rank<R>.json (the step), saves the state and exits 0.
"""

import argparse
import errno
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, ProjectConfiguration
from accel.checkpoint import layout
from accel.utils import set_seed

from resume_train import Progress  # registered for checkpointing: how many optimizer steps were done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--marker_step", type=int, default=0)
    parser.add_argument("--stubborn", action="store_true")
    parser.add_argument("--failing_save", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    set_seed(0)
    g = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g))
    loader = DataLoader(dataset, batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)

    project = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=project)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    rank = accelerator.process_index

    if (out / "checkpoints").is_dir():
        accelerator.load_state()
    start_epoch, skip = divmod(progress.steps, len(loader))
    for epoch in range(start_epoch, args.epochs):
        active = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for inputs, targets in active:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.steps += 1
            if progress.steps == args.marker_step:
                (out / f"marker_rank{rank}").write_text(str(os.getpid()))
                if args.stubborn:
                    while True:
                        time.sleep(0.1)
                waited = time.monotonic()
                while not accelerator.preemption_requested:  # what the test waits for: the request
                    if time.monotonic() - waited > 60:
                        raise SystemExit("no preemption request within 60 s")
                    time.sleep(0.05)
            if accelerator.preemption_requested:  # the documented pattern, once per step on every rank
                (out / f"preempted_rank{rank}.json").write_text(json.dumps({"step": progress.steps,
                                                                           "epoch": epoch}))
                if args.failing_save:
                    if accelerator.is_main_process:
                        layout.write_manifest = full_disk
                    accelerator.save_state(async_save=True)
                    return
                accelerator.save_state()
                accelerator.end_training()
                return

    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "final.safetensors"))
    accelerator.end_training()


def full_disk(folder, content):
    raise OSError(errno.ENOSPC, "No space left on device", str(folder / layout.MANIFEST))


if __name__ == "__main__":
    main()
