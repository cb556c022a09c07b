"""Worker for tests/multiproc/parallelism/test_zero.py: the DDP loop unchanged, under ZeRO stage 1/2/3 (+ offload).

--mode train  trains, records losses / clipped norms / per-rank bytes, writes weights.safetensors (full,
              gathered) and a checkpoint (save_state) to OUT/ckpt
--mode load   builds the same objects, load_state(OUT/ckpt), writes loaded.safetensors
--mode meta   builds the model on the meta device; prepare shards and materializes it; trains a few steps
--mode fp16   fp16 with loss scaling; rank 1's loss is inf at step 1: every rank must skip that step
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, DataLoaderConfiguration, GradScalerKwargs, ParallelismConfig
from accel.utils import set_seed

from _jobs import main_with_jobs

# the order the test rebuilds: randperm(seed + epoch) (the default follows the global RNG, as Accelerate)
SEEDED = DataLoaderConfiguration(use_seedable_sampler=True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class BufferedNet(Net):
    """Net with a buffer its forward uses (all ones: the same numbers), as BatchNorm's statistics are."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(16))
        self.scale: torch.Tensor

    def reset_parameters(self):  # what a meta-device model's materialization calls for its buffers too
        self.scale.fill_(1.0)

    def forward(self, x):
        x = self.embed(x) * self.scale
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_problem():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g)
    set_seed(0)
    return x, y, Net()


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def optimizer_state_tensors(optimizer):
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    return [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim > 0]


def run(argv: list[str] | None) -> Accelerator:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=None, help="default: from the launched config")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--no_clip", action="store_true", help="leave clipping to the config's gradient_clipping")
    parser.add_argument("--separate", action="store_true", help="prepare optimizer+scheduler first, the model after")
    parser.add_argument("--mode", choices=["train", "load", "meta", "fp16"], default="train")
    args = parser.parse_args(argv)
    out = Path(args.out)

    x, y, model = make_problem()
    if args.mode == "meta":
        with torch.device("meta"):
            model = BufferedNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    if args.stage is None:  # everything from the config (e.g. accel launch --deepspeed_config_file ds.json)
        accelerator = Accelerator(dataloader_config=SEEDED)
    else:
        parallelism = ParallelismConfig(zero_stage=args.stage, offload_optimizer=args.offload,
                                        offload_params=args.offload)
        accelerator = Accelerator(parallelism_config=parallelism, gradient_accumulation_steps=args.accum,
                                  mixed_precision="fp16" if args.mode == "fp16" else None,
                                  kwargs_handlers=[GradScalerKwargs(init_scale=256)], dataloader_config=SEEDED)
    if args.separate:  # the optimizer must follow the model's sharded parameters prepared later
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        model = accelerator.prepare(model)
        loader = accelerator.prepare(loader)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    if args.mode == "load":
        accelerator.load_state(str(out / "ckpt"))
        weights = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"loaded_{accelerator.num_processes}.safetensors"))
        return accelerator

    if args.mode == "meta":
        report = {"meta_after_prepare": any(p.is_meta for p in model.parameters()),
                  "param_bytes": local_bytes(model.parameters()),
                  # where forward reads the buffers: the job's device, also under offload (under the
                  # collective-device check a host tensor reports "cpu", the pretended accelerator "cpu:0")
                  "buffer_devices": sorted({str(b.device) for b in model.buffers()}),
                  "device": str(accelerator.device)}
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        report["final_loss"] = loss.item()
        reports = accelerator.gather_for_metrics([report], use_gather_object=True)
        if accelerator.is_main_process:
            (out / "meta.json").write_text(json.dumps(reports))
        return accelerator

    if args.mode == "fp16":
        report = {"skipped": [], "changed": [], "scaler": type(accelerator.scaler).__name__}
        for step, (inputs, targets) in enumerate(loader):
            before = [p.detach().clone() for p in model.parameters()]
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            if step == 1 and accelerator.process_index == 1:
                loss = loss * float("inf")
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1e6)
            optimizer.step()
            optimizer.zero_grad()
            report["skipped"].append(accelerator.optimizer_step_was_skipped)
            report["changed"].append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
            if step == 3:
                break
        reports = accelerator.gather_for_metrics([report], use_gather_object=True)
        if accelerator.is_main_process:
            (out / "fp16.json").write_text(json.dumps(reports))
        return accelerator

    losses, norms = [], []
    for _ in range(2):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients and not args.no_clip:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).tolist())

    record = {
        "losses": losses,
        "norms": norms,
        "lr": scheduler.get_last_lr()[0],
        "param_bytes": local_bytes(model.parameters()),
        "optimizer_bytes": local_bytes(optimizer_state_tensors(optimizer.optimizer)),
        "unwrapped": type(accelerator.unwrap_model(model)).__name__,
        "zero_stage": accelerator.config.parallelism.zero_stage,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
    }
    weights = accelerator.get_state_dict(model)
    all_records = accelerator.gather_for_metrics([record], use_gather_object=True)
    accelerator.save_state(str(out / "ckpt"))
    accelerator.save_model(model, out / "hf_model")
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "weights.safetensors"))
        (out / "record.json").write_text(json.dumps(all_records))
    return accelerator


if __name__ == "__main__":
    main_with_jobs(run)
