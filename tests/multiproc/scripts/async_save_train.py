"""Worker for tests/multiproc/checkpoints/test_async_save_multiproc.py: asynchronous save_state while training goes on.

Each job trains an MLP (under the launch's backend: DDP, or ParallelismConfig zero_stage / tp_size from the flags),
then at step 3 saves the same state twice, synchronously to OUT/sync and asynchronously to OUT/async, trains 3 more
steps at once while the background copy (made 0.5 s late here) and write run (the first step waits for the copy; the
live tensors then change under the write), waits, and loads OUT/async back: the loaded weights must be the step-3
ones. Writes OUT/at_save.safetensors, OUT/loaded.safetensors and OUT/record.json
(blocked seconds, the waits' results). With --fail, the main process's publication of the asynchronous save fails
(a full disk, simulated): every rank records the error `wait_for_checkpoint` raised.

Checkpoint integrity in the same launch: with --integrity, a synchronous save to OUT/ckpt, one byte of a state file
flipped (load_state must refuse it in one line, the weights unchanged), then restored (it loads); with --load_from
DIR and --optimizer sgd, loading an AdamW checkpoint into SGD must be refused in one line, the weights unchanged.
"""

import argparse
import errno
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, ParallelismConfig
from accel.checkpoint import layout
from accel.utils import set_seed

from _jobs import main_with_jobs


def run(argv: list[str] | None) -> Accelerator:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp_size", type=int, default=1)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--mode", choices=["thread", "process"], default="thread")
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--integrity", action="store_true")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--load_from", default=None)
    args = parser.parse_args(argv)
    out = Path(args.out)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    parallelism = ParallelismConfig(tp_size=args.tp_size, zero_stage=args.zero_stage)
    accelerator = Accelerator(parallelism_config=parallelism)
    accelerator.config.checkpoint_async = args.mode  # as `checkpoint_async: <mode>` in the config would
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    def step(inputs, targets):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    batches = iter(loader)
    for _ in range(3):
        step(*next(batches))
    at_save = accelerator.get_state_dict(model)
    record: dict = {}
    if args.load_from or args.integrity:
        record = integrity(accelerator, model, out, args.load_from)
    elif args.fail:
        real = layout.write_manifest

        def full_disk(folder, content):
            if accelerator.is_main_process:
                raise OSError(errno.ENOSPC, "No space left on device", str(folder / layout.MANIFEST))
            real(folder, content)

        layout.write_manifest = full_disk
        accelerator.save_state(str(out / "async"), async_save=True)
        try:
            accelerator.wait_for_checkpoint()
            record["error"] = None
        except layout.CheckpointError as exc:
            record["error"] = str(exc)
        layout.write_manifest = real
    else:
        from accel.checkpoint import async_save

        accelerator.save_state(str(out / "sync"))
        late_staging()
        start, waited = time.perf_counter(), async_save.staging_waited()
        accelerator.save_state(str(out / "async"))  # asynchronous: checkpoint_async from the config
        record["blocked_s"] = time.perf_counter() - start
        record["staging_in_progress"] = bool(async_save._STAGING)
        for _ in range(3):  # at once: the first step must wait for the background copy, then the live parameters
            step(*next(batches))  # and optimizer state change while the write goes on
        record["staging_waited_s"] = async_save.staging_waited() - waited
        record["published"] = accelerator.wait_for_checkpoint()
        record["second_wait"] = accelerator.wait_for_checkpoint()
        accelerator.load_state(str(out / "async"))
        loaded = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            save_file({k: v.contiguous() for k, v in loaded.items()}, str(out / "loaded.safetensors"))
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in at_save.items()}, str(out / "at_save.safetensors"))
    (out / f"record_{accelerator.process_index}.json").write_text(json.dumps(record))
    return accelerator


def late_staging(seconds: float = 0.5) -> None:
    """The background copy of the tensors starts `seconds` late: a step that did not wait for it would change the
    parameters before they were copied (the checkpoint would hold a later step's)."""
    from torch.distributed.checkpoint.staging import DefaultStager

    real = DefaultStager.stage

    def late(self, state_dict, **kwargs):
        time.sleep(seconds)
        return real(self, state_dict, **kwargs)

    DefaultStager.stage = late


def integrity(accelerator: Accelerator, model, out: Path, load_from: str | None) -> dict:
    """The errors of loads that must be refused, and whether the live weights stayed as they were."""
    before = accelerator.get_state_dict(model)
    record: dict = {}

    def refused(folder: Path, key: str) -> None:
        try:
            accelerator.load_state(str(folder))
            record[key] = None
        except layout.CheckpointError as exc:
            record[key] = str(exc)
        now = accelerator.get_state_dict(model)
        record[f"{key}_unchanged"] = all(torch.equal(before[k], now[k]) for k in before)

    if load_from is not None:
        refused(Path(load_from), "other_optimizer")
        return record
    accelerator.save_state(str(out / "ckpt"), async_save=False)
    victim = max((out / "ckpt" / "state").glob("*.safetensors"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # one bit of the last tensor's data
        victim.write_bytes(bytes(data[:-3]) + bytes([data[-3] ^ 0x10]) + bytes(data[-2:]))
    accelerator.wait_for_everyone()
    record["victim"] = str(victim)
    refused(out / "ckpt", "flipped_bit")
    if accelerator.is_main_process:
        victim.write_bytes(bytes(data))
    accelerator.wait_for_everyone()
    accelerator.load_state(str(out / "ckpt"))
    record["restored_loads"] = True
    return record


if __name__ == "__main__":
    main_with_jobs(run)
