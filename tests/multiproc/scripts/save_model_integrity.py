"""save_model from a DDP job, then load_checkpoint_in_model on every rank (checksums verified); `load` mode after
the test damaged a shard: every rank reports the one-line CheckpointError and an unchanged model.

Usage: save_model_integrity.py OUT save|load"""

import json
import sys
from pathlib import Path

import torch

from accel import Accelerator, load_checkpoint_in_model
from accel.checkpoint.layout import CheckpointError


def build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


out, mode = Path(sys.argv[1]), sys.argv[2]
accelerator = Accelerator()
rank = accelerator.process_index
fresh = build()
report: dict = {"rank": rank}
if mode == "save":
    torch.manual_seed(0)
    model = accelerator.prepare(build())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(4, 8, device=accelerator.device)).sum()
    accelerator.backward(loss)
    optimizer.step()
    accelerator.save_model(model, str(out / "model"), max_shard_size="400B")
    missing, unexpected = load_checkpoint_in_model(fresh, str(out / "model"), strict=True)
    trained = accelerator.unwrap_model(model).state_dict()
    report["equal"] = all(torch.equal(trained[k].cpu(), v) for k, v in fresh.state_dict().items())
    report["keys"] = [missing, unexpected]
else:
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    try:
        load_checkpoint_in_model(fresh, str(out / "model"))
        report["error"] = None
    except CheckpointError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["unchanged"] = all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
(out / f"{mode}_{rank}.json").write_text(json.dumps(report))
accelerator.wait_for_everyone()
