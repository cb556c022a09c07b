"""save_state under DDP on 2 processes, the way Accelerate allows it: on every process, and on the main process
alone (diffusers' example scripts), with save/load pre-hooks that save the model their own way on the main process
only and pop its weights (as diffusers' hooks do). Writes a JSON report to --out for tests/multiproc/checkpoints/test_main_process_save.py."""

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel import Accelerator
from accel.utils import set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--async_save", action="store_true")
args = parser.parse_args()
out = Path(args.out)

set_seed(0)
accelerator = Accelerator()
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 1))
user_module = model
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
seen = {"save": [], "load": []}


def save_hook(models, weights, output_dir):
    seen["save"].append([type(m).__name__ for m in models] + [all(m is user_module for m in models)])
    if accelerator.is_main_process:  # diffusers: the main process saves the model itself and pops its weights
        folder = Path(output_dir) / "unet"
        folder.mkdir()
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in models[0].state_dict().items()}, str(folder / "model.safetensors"))
        weights.pop()


def load_hook(models, input_dir):
    seen["load"].append([type(m).__name__ for m in models] + [all(m is user_module for m in models)])
    from safetensors.torch import load_file

    loaded = models.pop()
    loaded.load_state_dict(load_file(str(Path(input_dir) / "unet" / "model.safetensors")))


accelerator.register_save_state_pre_hook(save_hook)
accelerator.register_load_state_pre_hook(load_hook)
fixed = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * accelerator.process_index + i)),
          torch.randn(4, 1, generator=torch.Generator().manual_seed(7 + i))) for i in range(3)]


def train(steps, use_dropout=True):
    """`steps` steps on the same fixed batches (the global RNG draws the dropout masks)."""
    model.train(use_dropout)
    losses = []
    for x, y in fixed[:steps]:
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).tolist())
    return losses


kw = {"async_save": True} if args.async_save else {}
report = {"wrapped": isinstance(model, DistributedDataParallel)}
# 1. every process saves (dropout on: each rank's RNG matters), trains on, then resumes from the checkpoint
train(2)
every = out / "every"
accelerator.save_state(str(every), **kw)
report["after_every"] = train(3)
accelerator.load_state(str(every))
report["resumed_every"] = train(3)
# 2. the main process alone saves (no dropout: the other rank keeps its RNG, as with Accelerate)
main_only = out / "main_only"
if accelerator.is_main_process:
    accelerator.save_state(str(main_only), **kw)
report["after_main_only"] = train(3, use_dropout=False)
accelerator.load_state(str(main_only))
report["resumed_main_only"] = train(3, use_dropout=False)
# 3. save_model and save: on the main process alone (Accelerate has no barrier in them), then on every process
if accelerator.is_main_process:
    accelerator.save_model(model, str(out / "model_main_only"))
    accelerator.save({"w": torch.ones(2)}, str(out / "main_only.safetensors"), safe_serialization=True)
accelerator.save_model(model, str(out / "model_every"))
accelerator.save({"w": torch.ones(2)}, str(out / "every.safetensors"), safe_serialization=True)
report["saved_by_every"] = sorted(p.name for p in (out / "model_every").iterdir()) + [
    (out / "every.safetensors").is_file()]
accelerator.wait_for_everyone()
report["hooks"] = seen
report["files"] = {name: sorted(str(p.relative_to(out / name)) for p in (out / name).rglob("*") if p.is_file())
                   for name in ("every", "main_only")} if accelerator.is_main_process else None
(out / f"report_{accelerator.process_index}.json").write_text(json.dumps(report))
accelerator.end_training()
print("main_process_save: done", os.environ.get("RANK"))
