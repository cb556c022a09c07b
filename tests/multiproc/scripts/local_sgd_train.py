"""Worker for tests/multiproc/training/test_local_sgd.py, written for Hugging Face Accelerate (run through the shim):
the loop of Accelerate's by_feature/local_sgd.py example on a small MLP. Each rank writes its final weights and the
sample indices it trained on, in order, to OUT/rank<R>.safetensors / OUT/rank<R>.json."""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from accelerate.utils import set_seed

from _jobs import main_with_jobs


def make_problem():
    """Data (with each sample's index) and model; the test builds the same ones for its reference."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 5, generator=g)
    y = torch.randn(48, 1, generator=g)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return torch.arange(len(x)), x, y, model


def run(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--local-sgd-steps", type=int, default=3)
    parser.add_argument("--disabled", action="store_true")
    args = parser.parse_args(argv)

    index, x, y, model = make_problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(index, x, y), batch_size=4, shuffle=False)
    accelerator = Accelerator(gradient_accumulation_steps=args.accum)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=args.local_sgd_steps,
                  enabled=not args.disabled) as local_sgd:
        for idx, inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
            seen.append(idx.tolist())
    rank = accelerator.process_index
    out = Path(args.out)
    weights = {k: v.detach().cpu().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    save_file(weights, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({"seen": seen, "enabled": local_sgd.enabled,
                                                      "num_steps": local_sgd.num_steps}))
    return accelerator


if __name__ == "__main__":
    main_with_jobs(run)
