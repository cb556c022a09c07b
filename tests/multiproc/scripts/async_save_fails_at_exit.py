"""Worker for tests/multiproc/checkpoints/test_failed_save_exit_code.py: an asynchronous save_state that fails after the
script ended, with no wait left to raise it.

Trains one step, saves OUT/ckpt synchronously (the previous checkpoint), then asynchronously again with the main
process's publication failing (a full disk, simulated as the other failure tests do: `layout.write_manifest` raises
ENOSPC), and returns without end_training or wait_for_checkpoint: the failure is only found at interpreter exit.
`--mode process` writes in torch's checkpoint process (under ZeRO-3: a save DDP's main process makes alone runs
as `thread`). `--raise_after`: the main process then fails on its own (an uncaught exception: its exit code stays 1).
"""

import argparse
import errno

import torch

from accel import Accelerator, ParallelismConfig
from accel.checkpoint import layout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["thread", "process"], default="thread")
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--raise_after", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(zero_stage=args.zero_stage))
    accelerator.config.checkpoint_async = args.mode  # as `checkpoint_async: <mode>` in the config would
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, 6)).pow(2).sum())
    optimizer.step()
    accelerator.save_state(f"{args.out}/ckpt", async_save=False)

    def full_disk(folder, content):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / layout.MANIFEST))

    if accelerator.is_main_process:
        layout.write_manifest = full_disk
    accelerator.save_state(f"{args.out}/ckpt")  # asynchronous (checkpoint_async); the script ends at once
    if args.raise_after and accelerator.is_main_process:
        raise RuntimeError("the script's own error")


if __name__ == "__main__":
    main()
