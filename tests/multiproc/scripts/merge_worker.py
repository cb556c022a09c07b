"""Worker for tests/multiproc/checkpoints/test_merge_weights.py: a tiny LM with tied embedding/head under ZeRO-3 (FSDP2)
on 2 processes, trained a few steps, then saved sharded twice: accel's save_state (OUT/ckpt) and a plain DCP folder of
the model's sharded state dict as Accelerate's FSDP SHARDED_STATE_DICT writes it (OUT/pytorch_model_fsdp_0:
{"model": state_dict} in .distcp files + .metadata). The reference, the gathered full state dict, goes to
OUT/full.safetensors (every name, tied ones as copies), and one JSON line to OUT/record.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from accel import Accelerator, ParallelismConfig
from accel.utils import set_seed


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def main() -> None:
    out = Path(sys.argv[1])
    set_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(zero_stage=3))
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(3):
        ids = torch.randint(0, 32, (4, 8), generator=g)
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(out / "ckpt"))
    sharded = model.state_dict()
    dcp.save({"model": sharded}, checkpoint_id=str(out / "pytorch_model_fsdp_0"))
    full = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({k: v.detach().clone().contiguous() for k, v in full.items()}, str(out / "full.safetensors"))
        record = {"dtensor": type(next(iter(sharded.values()))).__name__, "keys": sorted(full),
                  "tied": model.head.weight is model.embed.weight if hasattr(model, "head") else None}
        (out / "record.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main()
