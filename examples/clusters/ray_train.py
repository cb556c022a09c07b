"""Ray Train: a `TorchTrainer` whose function builds an `Accelerator` and runs the unchanged accel loop.

Ray starts the workers, sets RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK and ACCELERATE_TORCH_DEVICE, forms the process
group, then calls `train_loop` in every worker: there is no `accel launch`, so every setting comes from the
`Accelerator(...)` arguments (or from a config file named by ACCEL_CONFIG_FILE in Ray's runtime_env).

    python examples/clusters/ray_train.py --workers 2            # Ray Train, 2 CPU workers on a local Ray cluster
    accel launch --cpu -n 2 examples/clusters/ray_train.py       # the same loop under accel launch: the same losses

`--losses FILE` writes the main process's losses (one per step, averaged over the processes) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from accel import Accelerator, ParallelismConfig


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(64, 1, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def train_loop(config: dict) -> list[float]:
    """The training loop, the same under Ray and under `accel launch`."""
    parallelism = ParallelismConfig(zero_stage=config["zero_stage"]) if config.get("zero_stage") else None
    # given here, a setting wins over `accel launch`'s flags and the config file (as in Accelerate); None leaves it
    accelerator = Accelerator(mixed_precision=config.get("mixed_precision"), parallelism_config=parallelism)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    for _ in range(config.get("epochs", 2)):
        if losses and accelerator.preemption_requested:
            break
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            if accelerator.preemption_requested:  # a signal, or under Ray Train a drained node: save_state() here
                break
    if accelerator.is_main_process and config.get("losses"):
        with open(config["losses"], "w") as f:
            json.dump({"losses": losses, "num_processes": accelerator.num_processes,
                       "device": str(accelerator.device), "zero_stage": accelerator.config.parallelism.zero_stage,
                       "mixed_precision": accelerator.mixed_precision,
                       "ACCELERATE_TORCH_DEVICE": os.environ.get("ACCELERATE_TORCH_DEVICE")}, f)
    accelerator.end_training()
    return losses


def run_on_ray(config: dict, workers: int, storage: str | None) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if os.environ.get("RAY_ADDRESS"):  # a cluster's (a RayJob's entrypoint, `ray job submit`): join it as it is
        ray.init()
    else:  # a local Ray cluster on this machine, one CPU per worker
        ray.init(num_cpus=workers, include_dashboard=False)
    try:
        trainer = TorchTrainer(train_loop, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                               run_config=RunConfig(name="accel-ray-example", storage_path=storage))
        trainer.fit()
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=0, help="run under Ray Train with this many workers")
    parser.add_argument("--storage", help="Ray Train's storage_path (default: Ray's, ~/ray_results)")
    parser.add_argument("--losses", help="write the losses here (JSON)")
    parser.add_argument("--mixed_precision", help="Accelerator(mixed_precision=...) (default: the config's)")
    parser.add_argument("--zero_stage", type=int, help="Accelerator(parallelism_config=ParallelismConfig(zero_stage=...))")
    args = parser.parse_args()
    config = {"losses": args.losses, "mixed_precision": args.mixed_precision, "zero_stage": args.zero_stage}
    if args.workers:
        run_on_ray(config, args.workers, args.storage)
    else:
        train_loop(config)


if __name__ == "__main__":
    main()
