"""Saves checkpoint_0, then is SIGKILLed in the middle of saving checkpoint_1 (after its tensors are on disk,
before the checkpoint is complete). Used by test_checkpoint.py::test_sigkill_during_save_state."""

import os
import signal
import sys

import torch

from accel import Accelerator, ProjectConfiguration
from accel.checkpoint import layout, rng_states

project_dir, kill_point = sys.argv[1], sys.argv[2]
accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
with torch.no_grad():
    model.weight.fill_(1.0)
accelerator.save_state()  # checkpoint_0: complete
with torch.no_grad():
    model.weight.fill_(2.0)


def die(*args, **kwargs):
    print("killing myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if kill_point == "rng":  # the tensors of checkpoint_1 are written, the RNG files and manifest are not
    rng_states._save_rng = die
else:  # everything is written; killed while the manifest is being written
    layout.write_manifest = die
accelerator.save_state()
print("not reached")
