"""Worker for tests/multiproc/ecosystem/test_deepspeed_dummy.py: Accelerate's DeepSpeed-config loop, with DummyOptim and
DummyScheduler standing for the JSON's `optimizer` / `scheduler` sections (built by accel at prepare()). The JSON
comes from `--ds_config` (DeepSpeedPlugin(hf_ds_config=...)) or, without it, from `accel launch
--deepspeed_config_file` (Accelerate's automatic plugin: `Accelerator()`).

Writes OUT/weights.safetensors (full, gathered) and OUT/record.json (each rank's lrs, the built classes, the stage).
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, DeepSpeedPlugin
from accel.utils import DummyOptim, DummyScheduler, set_seed

EPOCHS = 2
BATCH = 4
OPTIM = {"lr": 1e-2, "weight_decay": 0.01, "betas": (0.9, 0.98), "eps": 1e-7}  # the DummyOptim's arguments
WARMUP = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(2))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_problem():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g)
    set_seed(0)
    return x, y, Net()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ds_config", default=None, help="the DeepSpeed JSON (default: the one accel launch names)")
    args = parser.parse_args()
    out = Path(args.out)

    plugin = DeepSpeedPlugin(hf_ds_config=args.ds_config) if args.ds_config else None
    accelerator = Accelerator(deepspeed_plugin=plugin)
    x, y, model = make_problem()
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    total_num_steps = EPOCHS * len(loader)  # written for the whole dataset, as in Accelerate's examples
    optimizer = DummyOptim(model.parameters(), **OPTIM)
    scheduler = DummyScheduler(optimizer, total_num_steps=total_num_steps, warmup_num_steps=WARMUP)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    lrs = []
    for _ in range(EPOCHS):
        for inputs, targets in loader:
            lrs.append(optimizer.param_groups[0]["lr"])  # the lr this step uses
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    record = {
        "lrs": lrs,
        "last_lr": scheduler.get_last_lr()[0],
        "optimizer": type(optimizer.optimizer).__name__,
        "defaults": {k: optimizer.optimizer.defaults[k] for k in OPTIM},
        "scheduler": type(scheduler.scheduler).__name__,
        "zero_stage": accelerator.config.parallelism.zero_stage,
        "unwrapped": type(accelerator.unwrap_model(model)).__name__,
        "json_sections": sorted(accelerator.state.deepspeed_plugin.deepspeed_config),  # what HF Trainer reads
    }
    weights = accelerator.get_state_dict(model)
    records = accelerator.gather_for_metrics([record], use_gather_object=True)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "weights.safetensors"))
        (out / "record.json").write_text(json.dumps(records))
    accelerator.end_training()


if __name__ == "__main__":
    main()
