"""Worker for tests/multiproc/parallelism/test_ddp.py: trains a small MLP under Accelerator and records what it saw.

Writes, from the main process: weights.safetensors (final unwrapped weights) and record.json (per-step
losses gathered from all ranks, learning rates, gradient-sync observations, gather_for_metrics results).
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs
from accel.utils import set_seed

# the order the test rebuilds: randperm(seed + epoch) (the default follows the global RNG, as Accelerate)
SEEDED = DataLoaderConfiguration(use_seedable_sampler=True)


def make_problem():
    """Data and model; the test builds the same ones for its single-process reference."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    y = torch.randn(64, 1, generator=g)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return x, y, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    x, y, model = make_problem()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)

    ddp_options = DistributedDataParallelKwargs(bucket_cap_mb=1, gradient_as_bucket_view=True)
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, kwargs_handlers=[ddp_options],
                              dataloader_config=SEEDED)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses, lrs, grads_equal_when = [], [], {"sync": [], "nosync": []}
    for _ in range(args.epochs):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                grad = accelerator.unwrap_model(model)[0].weight.grad.detach().clone()
                gathered = accelerator.gather(grad[None])
                equal = bool(torch.equal(gathered[0], gathered[-1]))
                grads_equal_when["sync" if accelerator.sync_gradients else "nosync"].append(equal)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).tolist())
            lrs.append(scheduler.get_last_lr()[0])

    # gather_for_metrics on a size that does not split evenly over the processes
    eval_set = TensorDataset(torch.arange(13, dtype=torch.float32)[:, None])
    eval_loader = accelerator.prepare_data_loader(DataLoader(eval_set, batch_size=4))
    seen, seen_objects = [], []
    for (batch,) in eval_loader:
        seen.append(accelerator.gather_for_metrics(batch))
        seen_objects.extend(accelerator.gather_for_metrics([f"item{int(v)}" for v in batch], use_gather_object=True))

    if accelerator.is_main_process:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        save_file(state, str(out / "weights.safetensors"))
        record = {
            "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "device": str(accelerator.device),
            "losses": losses,
            "lrs": lrs,
            "grads_equal_when": grads_equal_when,
            "metrics": torch.cat(seen).flatten().tolist(),
            "metric_objects": seen_objects,
            "batches_per_epoch": len(loader),
            "ddp_bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None),
            "ddp_gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None),
        }
        (out / "record.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main()
