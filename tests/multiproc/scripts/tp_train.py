"""Worker for tests/multiproc/parallelism/test_tensor.py: an MLP trained under tensor parallelism (tp_size from the
launch flags), alone or with data parallelism on a 2-D mesh. Writes weights.safetensors and record.json."""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, DataLoaderConfiguration, ParallelismConfig
from accel.utils import gather_object, set_seed

from _jobs import main_with_jobs

# the order the test rebuilds: randperm(seed + epoch) (the default follows the global RNG, as Accelerate)
SEEDED = DataLoaderConfiguration(use_seedable_sampler=True)


def make_problem():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return x, y, model


def run(argv: list[str] | None) -> Accelerator:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp_size", type=int, required=True)
    parser.add_argument("--user_plan", action="store_true")
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--load", action="store_true", help="load_state(OUT/ckpt) and write loaded_tp<N>.safetensors")
    args = parser.parse_args(argv)

    x, y, model = make_problem()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    plan = {"0": "colwise", "2": "rowwise"} if args.user_plan else None
    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=args.tp_size, tp_plan=plan, zero_stage=args.zero_stage),
                              dataloader_config=SEEDED)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.load:
        accelerator.load_state(str(Path(args.out) / "ckpt"))
        weights = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            save_file({k: v.contiguous() for k, v in weights.items()},
                      str(Path(args.out) / f"loaded_tp{args.tp_size}.safetensors"))
        return accelerator

    losses, norms = [], []
    for _ in range(2):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).tolist())
    record = {"losses": losses, "norms": norms, "batches": len(loader),
              "metric_rows": accelerator.gather_for_metrics(targets).shape[0],  # TP ranks of a replica count once
              "local_weight_shape": list(accelerator.unwrap_model(model)[0].weight.to_local().shape)}
    weights = accelerator.get_state_dict(model)
    accelerator.save_state(str(Path(args.out) / "ckpt"))
    records = gather_object([record])  # every process's, TP/PP ranks included
    if accelerator.is_main_process:
        out = Path(args.out)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "weights.safetensors"))
        (out / "record.json").write_text(json.dumps(records))
    return accelerator


if __name__ == "__main__":
    main_with_jobs(run)
