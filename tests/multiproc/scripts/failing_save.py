"""Saves and loads that fail on rank 1 only. Used by test_checkpoint.py::test_a_failure_on_one_rank_is_one_line_
everywhere: every rank must print the same one-line error, nobody may hang, and the first checkpoint stays intact.

1. rank 1's disk is full inside DCP's writer (a collective step); 2. rank 1's disk is full while it writes its RNG
states (a local step: without agreeing, rank 0 would wait for it forever); 3. rank 1's RNG file is damaged, so
only rank 1's load checks fail."""

import contextlib
import errno
import io
import os
import sys
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from accel import Accelerator
from accel.checkpoint import CheckpointError

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.save_state(str(out / "ckpt"))
saved = {k: v.clone() for k, v in model.state_dict().items()}
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)


class FullDisk(io.FileIO):
    def write(self, _):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@contextlib.contextmanager
def full_disk_stream(self, path, mode):
    with FullDisk(path, "w") as stream:
        yield stream


def full_disk_save_file(tensors, filename, *_, **__):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)


def report(line: str) -> None:
    """One file per rank: two processes' prints interleave on the shared pipe."""
    with open(out / f"report_{rank}.txt", "a") as fh:
        fh.write(line + "\n")


def attempt(label, action):
    try:
        action()
        report(f"{label} no error")
    except CheckpointError as exc:
        report(f"{label} {exc}")


real_stream, real_save_file = FileSystem.create_stream, safetensors.torch.save_file
if rank == 1:
    FileSystem.create_stream = full_disk_stream
attempt("ERR1", lambda: accelerator.save_state(str(out / "ckpt")))
FileSystem.create_stream = real_stream
if rank == 1:
    safetensors.torch.save_file = full_disk_save_file
attempt("ERR2", lambda: accelerator.save_state(str(out / "ckpt")))
safetensors.torch.save_file = real_save_file
accelerator.load_state(str(out / "ckpt"))  # the first checkpoint survived both
report(f"LOADED {all(torch.equal(saved[k], v) for k, v in model.state_dict().items())}")
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)

if rank == 0:  # same size, so only the content check of rank 1's own RNG file fails
    rng = out / "ckpt" / "rng" / "rank_1.json"
    rng.write_bytes(b"[]".ljust(rng.stat().st_size))
accelerator.wait_for_everyone()
before = {k: v.clone() for k, v in model.state_dict().items()}
attempt("ERR3", lambda: accelerator.load_state(str(out / "ckpt")))
unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
report(f"END unchanged={unchanged} leftovers={leftovers} differs_from_saved="
       f"{not all(torch.equal(saved[k], v) for k, v in model.state_dict().items())}")
