"""Worker for tests/multiproc/parallelism/test_pipeline.py: an nn.Sequential or a GPT-style toy trained under pipeline
parallelism (with DP, ZeRO-1 or TP per the flags). Writes weights.safetensors (full weights, original names),
record.json (per-rank losses, norms, eval outputs) and, with --save, a save_state checkpoint. `--jobs FILE`:
several runs in one launch (scripts/_jobs.py)."""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, DistributedDataParallelKwargs, ParallelismConfig
from accel.utils import gather_object, set_seed

from _jobs import main_with_jobs

VOCAB, WIDTH, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up_proj = nn.Linear(d, 4 * d)
        self.down_proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down_proj(torch.relu(self.up_proj(self.norm(x)))))


class TinyGPT(nn.Module):
    """embedding (+ positions) -> blocks -> norm -> head, the head tied to the embedding unless told not."""

    def __init__(self, layers: int = 4, tied: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, idx):
        x = self.embed_tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def make_model(kind: str, dropout: float = 0.0) -> nn.Module:
    set_seed(0)
    if kind == "seq":
        return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))
    return TinyGPT(tied=kind == "gpt", dropout=dropout)


def make_data(kind: str, n: int = 64):
    g = torch.Generator().manual_seed(1)
    if kind == "seq":
        return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn_for(kind: str):
    if kind == "seq":
        return nn.functional.mse_loss
    return lambda logits, targets: nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def counting_allreduce(counter: list, accelerator):
    """A DDP communication hook: DDP's averaging all-reduce over the data-parallel group, counted."""
    import torch.distributed as dist

    def hook(state, bucket):
        counter[0] += 1
        group = accelerator().topology.group("dp", "cpu")
        tensor = bucket.buffer().div_(dist.get_world_size(group))
        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])

    return hook


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default=None, help="the save_state folder (default: OUT/ckpt)")
    parser.add_argument("--model", default="seq", choices=["seq", "gpt", "gpt-untied"])
    parser.add_argument("--pp_size", type=int, default=2)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages_per_rank", type=int, default=None)
    parser.add_argument("--tp_size", type=int, default=1)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--split_points", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device")
    parser.add_argument("--count_reductions", action="store_true", help="count DDP gradient reductions")
    parser.add_argument("--separate_prepare", action="store_true", help="prepare(model), then prepare(optimizer, ...)")
    parser.add_argument("--outside_loss", action="store_true", help="misuse: backward of a loss computed outside")
    return parser.parse_args(argv)


def run(argv: list[str] | None) -> Accelerator:
    args = parse(argv)
    if args.meta:
        with torch.device("meta"):
            model = make_model(args.model, args.dropout)
    else:
        model = make_model(args.model, args.dropout)
    x, y = make_data(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch)
    parallelism = ParallelismConfig(pp_size=args.pp_size, pp_schedule=args.schedule, pp_microbatches=args.microbatches,
                                    pp_stages_per_rank=args.stages_per_rank,
                                    tp_size=args.tp_size, zero_stage=args.zero_stage,
                                    pp_split_points=args.split_points.split(",") if args.split_points else None)
    reductions = [0]
    handlers = [DistributedDataParallelKwargs(comm_hook=counting_allreduce(reductions, lambda: accelerator))] \
        if args.count_reductions else None
    accelerator = Accelerator(parallelism_config=parallelism, gradient_accumulation_steps=args.accum,
                              kwargs_handlers=handlers)
    if args.separate_prepare:
        model = accelerator.prepare(model, loss_fn=loss_fn_for(args.model))
        optimizer, loader = accelerator.prepare(optimizer, loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=loss_fn_for(args.model))
    out = Path(args.out)
    ckpt = Path(args.ckpt) if args.ckpt else out / "ckpt"
    if args.outside_loss:
        inputs, targets = next(iter(loader))
        accelerator.backward(loss_fn_for(args.model)(model(inputs), targets))
    if args.load:
        accelerator.load_state(str(ckpt))
    else:
        model.train()
        losses, norms = [], []
        for step, (inputs, targets) in enumerate(loader):
            if step == args.steps * args.accum:
                break
            with accelerator.accumulate(model):
                loss = model(inputs, target=targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        if args.save:
            accelerator.save_state(str(ckpt))
            accelerator.save_model(model, str(out / "model"))
    model.eval()
    probe = x[:args.batch]
    outputs = model(probe)
    with torch.no_grad():
        eval_loss = model(probe, target=y[:args.batch]).item()
    record = {"losses": [] if args.load else losses, "norms": [] if args.load else norms,
              "eval_outputs": outputs.tolist(), "eval_loss": eval_loss, "rank": accelerator.process_index,
              "param_names": sorted(n for n, _ in model.named_parameters()), "reductions": reductions[0],
              "metric_rows": accelerator.gather_for_metrics(outputs).shape[0]}  # stages of a replica count once
    weights = accelerator.get_state_dict(model)
    records = gather_object([record])  # every process's, TP/PP ranks included
    if accelerator.is_main_process:
        save_file({k: v.clone().contiguous() for k, v in weights.items()},  # tied weights: one copy each
                  str(out / ("loaded.safetensors" if args.load else "weights.safetensors")))
        (out / ("loaded.json" if args.load else "record.json")).write_text(json.dumps(records))
    return accelerator


if __name__ == "__main__":
    main_with_jobs(run)
