"""The training loops that bench_step.py alternates, one builder per loop: the raw PyTorch loop of each layout and
the same loop written for accel, Accelerate and Lightning Fabric. Every builder takes the same model (initial
weights), data set and batch size and returns a `step()` that fetches a batch and runs zero_grad, forward,
backward and the SGD step. Imported by the worker only (it imports torch; Accelerate and Fabric are imported by
their own builders, in jobs of their own, so accel's `accelerate` shim never meets the real package)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

LR = 1e-3
MICROBATCHES = 2  # PP 2: accel's default (pp_microbatches = pp_size), passed to both loops
# name -> (width, blocks); each block is Linear(width, 4 width), GELU, Linear(4 width, width), added to its input
SIZES = {"1M": (256, 2), "10M": (576, 4)}
DATA_PARALLEL = {"ddp": True, "zero3": True, "tp2": False, "pp2": False}  # else both ranks see the same batches


class ResidualMLP(nn.Module):
    """Residual MLP blocks in an `nn.ModuleList`: the unit that FSDP2 wraps, the pair of Linears that tensor
    parallelism splits (columns, then rows) and the list that the pipeline cuts in two."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def endless(loader, sampler=None):
    """Batches forever, epoch after epoch (set_epoch on a DistributedSampler as a raw loop must)."""
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def sgd_step(model, optimizer, batches, backward):
    def step():
        inputs, targets = next(batches)
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        backward(loss)
        optimizer.step()

    return step


# ------------------------------------------------------------------------------------------------------------
# raw PyTorch
# ------------------------------------------------------------------------------------------------------------

def raw_batches(layout: str, dataset, batch: int):
    """DistributedSampler over the data-parallel ranks; one replica (TP, PP): every rank the same shuffled order."""
    if DATA_PARALLEL[layout]:
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    else:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return endless(DataLoader(dataset, batch_size=batch, sampler=sampler), sampler)


def raw_loop(layout: str, base: nn.Module, dataset, batch: int):
    """The plain PyTorch loop of `layout`: DDP; fully_shard of each block then the root (ZeRO-3); ColwiseParallel
    and RowwiseParallel on each block's Linears (TP 2); PipelineStage + Schedule1F1B (PP 2)."""
    model = copy.deepcopy(base)
    batches = raw_batches(layout, dataset, batch)
    if layout == "pp2":
        return raw_pipeline(model, batches)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif layout == "zero3":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
    elif layout == "tp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return sgd_step(model, optimizer, batches, lambda loss: loss.backward())


def raw_pipeline(model: ResidualMLP, batches):
    """Two stages of equal parameter count (the first and second half of the blocks), one per rank, 1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    per_stage = len(model.blocks) // world
    model.blocks = nn.ModuleList(list(model.blocks)[rank * per_stage:(rank + 1) * per_stage])
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    last = rank == world - 1

    def step():
        inputs, targets = next(batches)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets, losses=[])
        else:
            schedule.step()
        optimizer.step()

    return step


# ------------------------------------------------------------------------------------------------------------
# accel, Accelerate, Fabric
# ------------------------------------------------------------------------------------------------------------

class AccelLoop:
    """accel: `Accelerator()` takes the layout from `accel launch`'s flags; PP 2 passes the loss to prepare and
    runs `loss = model(x, target=y)` (the documented pipeline loop)."""

    def __init__(self, layout: str) -> None:
        from accel import Accelerator

        self.layout = layout
        self.accelerator = Accelerator()
        self.describe = str(self.accelerator.distributed_type)

    def build(self, base: nn.Module, dataset, batch: int):
        accelerator = self.accelerator
        model = copy.deepcopy(base)
        extra = {"loss_fn": F.mse_loss} if self.layout == "pp2" else {}
        model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR),
                                                       DataLoader(dataset, batch_size=batch, shuffle=True), **extra)
        batches = endless(loader)
        if self.layout != "pp2":
            return sgd_step(model, optimizer, batches, accelerator.backward)

        def step():
            inputs, targets = next(batches)
            optimizer.zero_grad()
            loss = model(inputs, target=targets)
            accelerator.backward(loss)
            optimizer.step()

        return step

    def release(self) -> None:
        self.accelerator.free_memory()

    def close(self) -> None:
        self.accelerator.end_training()  # drops accel's DDP reducers; the group is the raw init's to destroy


class AccelerateLoop:
    """Hugging Face Accelerate: `Accelerator(cpu=True)` under torchrun (its MULTI_CPU: DDP over gloo)."""

    def __init__(self, layout: str) -> None:
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        self.describe = str(self.accelerator.distributed_type)

    def build(self, base: nn.Module, dataset, batch: int):
        model = copy.deepcopy(base)
        model, optimizer, loader = self.accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR),
                                                            DataLoader(dataset, batch_size=batch, shuffle=True))
        return sgd_step(model, optimizer, endless(loader), self.accelerator.backward)

    def release(self) -> None:
        self.accelerator.free_memory()

    def close(self) -> None:
        pass


class FabricLoop:
    """Lightning Fabric under torchrun: strategy "ddp"; ZeRO-3 and TP 2 as its ModelParallelStrategy (FSDP2 and
    DTensor tensor parallelism, through a parallelize function that does what the raw loop does)."""

    def __init__(self, layout: str) -> None:
        from lightning_fabric import Fabric

        strategy: object = "ddp"
        if layout in ("zero3", "tp2"):
            from lightning_fabric.strategies import ModelParallelStrategy

            world = dist.get_world_size()
            dp, tp = (world, 1) if layout == "zero3" else (1, world)
            strategy = ModelParallelStrategy(parallelize_fn=fabric_parallelize, data_parallel_size=dp,
                                             tensor_parallel_size=tp)
        self.fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                             precision="32-true")
        self.fabric.launch()
        self.describe = type(self.fabric.strategy).__name__

    def build(self, base: nn.Module, dataset, batch: int):
        fabric = self.fabric
        model = copy.deepcopy(base)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
        loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=batch, shuffle=True))
        return sgd_step(model, optimizer, endless(loader), fabric.backward)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def fabric_parallelize(model: ResidualMLP, mesh):
    """ModelParallelStrategy's parallelize_fn: TP over the "tensor_parallel" dimension, then fully_shard over
    "data_parallel", each only where that dimension has more than one rank."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mesh["tensor_parallel"].size() > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if mesh["data_parallel"].size() > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["data_parallel"], reshard_after_forward=True)
        fully_shard(model, mesh=mesh["data_parallel"], reshard_after_forward=True)
    return model


class RawLoop:
    """A second raw loop in the peer's place: the A/A control, whose ratio is this machine's noise floor."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.describe = "CONTROL: a second raw loop in the peer's place (A/A)"

    def build(self, base: nn.Module, dataset, batch: int):
        return raw_loop(self.layout, base, dataset, batch)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


PEER_LOOPS = {"accel": AccelLoop, "accelerate": AccelerateLoop, "fabric": FabricLoop, "control": RawLoop}
