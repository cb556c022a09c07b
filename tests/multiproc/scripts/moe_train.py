"""Worker for test_expert.py: an Accelerate-style loop over a tiny MoE model (transformers Mixtral or Qwen2-MoE with
the router's auxiliary loss in the loss, or a MoE block of our own with an `accel_expert_plan`: ModuleList or
stacked experts) under expert parallelism (--ep_size), alone or with data parallelism and ZeRO. Writes result.json
(per-step losses, clipped norms, auxiliary losses, the most expert elements one process holds) and
result.safetensors (the gathered weights); --save_model writes save_model's folder; with --save_at K it saves the
state after step K, with --resume it loads that state and runs the remaining steps.

The one-process reference of test_expert.py uses make_model/make_samples with plain PyTorch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _jobs import main_with_jobs
from safetensors.torch import save_file

from accel import Accelerator, ParallelismConfig
from accel.parallel.expert import ExpertPlan
from accel.utils import set_seed

VOCAB, STEPS, SAMPLES, LENGTH, HIDDEN = 128, 4, 32, 8, 32


class Router(torch.nn.Module):
    """Top-2 of a softmax over 4 experts, weights renormalised (returns (weights, index) as the plan asks)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, 4, bias=False)

    def forward(self, tokens):
        probs = self.proj(tokens).softmax(-1)
        weights, index = probs.topk(2, dim=-1)
        return weights / weights.sum(-1, keepdim=True), index


class OwnMoE(torch.nn.Module):
    """A MoE block of our own: ModuleList experts, written the plain way (loop over the experts)."""

    accel_expert_plan = ExpertPlan(router="router", experts="experts")

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(HIDDEN, 64), torch.nn.GELU(), torch.nn.Linear(64, HIDDEN))
            for _ in range(4))

    def forward(self, x):
        tokens = x.reshape(-1, HIDDEN)
        weights, index = self.router(tokens)
        out = torch.zeros_like(tokens)
        for j, expert in enumerate(self.experts):
            rows, slot = torch.where(index == j)
            out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class StackedExperts(torch.nn.Module):
    """4 experts as two parameters stacked on dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(4, HIDDEN, 64) / HIDDEN ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(4, 64, HIDDEN) / 8)


def run_stacked(experts, j: int, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ experts.w1[j]) @ experts.w2[j]


class StackedMoE(torch.nn.Module):
    """A MoE block of our own with stacked experts: the plan names the parameters and how to run expert j."""

    accel_expert_plan = ExpertPlan(router="router", experts="experts", params=("w1", "w2"), call=run_stacked)

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = StackedExperts()

    def forward(self, x):
        tokens = x.reshape(-1, HIDDEN)
        weights, index = self.router(tokens)
        out = torch.zeros_like(tokens)
        for j in range(4):
            rows, slot = torch.where(index == j)
            out = out.index_add(0, rows, run_stacked(self.experts, j, tokens[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class OwnLM(torch.nn.Module):
    def __init__(self, block=OwnMoE) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(block() for _ in range(2))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(torch.nn.functional.layer_norm(x, (HIDDEN,)))
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits, "aux_loss": None}


def make_model(kind: str):
    set_seed(0)
    if kind in ("own", "stacked"):
        return OwnLM(OwnMoE if kind == "own" else StackedMoE)
    common = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, vocab_size=VOCAB, output_router_logits=True,
                  router_aux_loss_coef=0.1, use_cache=False, attn_implementation="eager")
    if kind.startswith("mixtral-"):  # no router auxiliary loss, SDPA attention (pipeline runs: loss_fn on logits)
        common.update(output_router_logits=False, router_aux_loss_coef=0.0, attn_implementation="sdpa")
    if kind == "mixtral-deep":  # 4 layers: 2 stages per process (Interleaved1F1B, pp 2)
        common.update(num_hidden_layers=4)
    if kind == "qwen2moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                                **common)
        return Qwen2MoeForCausalLM(config)
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(num_local_experts=4, **common))


def shifted_loss(logits, targets):
    """What transformers' causal LM loss is on input_ids[:, :-1] -> labels[:, 1:] (the pipeline's loss_fn)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_samples() -> list:
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row, "labels": row.clone()} for row in tokens]


def expert_numel(model: torch.nn.Module) -> int:
    """The expert parameters' elements this process holds (a DTensor's local shard)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for name, p in model.named_parameters() if ".experts." in name)


def aux_of(outputs) -> float:
    aux = outputs.get("aux_loss") if isinstance(outputs, dict) else getattr(outputs, "aux_loss", None)
    return 0.0 if aux is None else float(aux.detach())


def run(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="mixtral",
                        choices=["mixtral", "mixtral-plain", "mixtral-deep", "qwen2moe", "own", "stacked"])
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--ep_size", type=int, default=1)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--tp_size", type=int, default=1)
    parser.add_argument("--sp_size", type=int, default=1)
    parser.add_argument("--cp_size", type=int, default=1)
    parser.add_argument("--pp_size", type=int, default=1)
    parser.add_argument("--pp_schedule", default="1F1B")
    parser.add_argument("--dp_replicate_size", type=int, default=None)
    parser.add_argument("--dp_shard_size", type=int, default=None)
    parser.add_argument("--offload", action="store_true", help="ZeRO-3's CPU offload of parameters and optimizer")
    parser.add_argument("--fused", action="store_true", help="torch's fused AdamW (as transformers' Trainer picks)")
    parser.add_argument("--save_pretrained", action="store_true",
                        help="record what the unwrapped model's save_pretrained without a state_dict says")
    parser.add_argument("--save_at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--save_model", action="store_true")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--mixed_precision", default="no")
    parser.add_argument("--checkpointing", default="no")
    parser.add_argument("--halves", action="store_true",
                        help="each batch as two halves, a forward and a synced backward each, one optimizer step")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(args.model)
    loader = torch.utils.data.DataLoader(make_samples(), batch_size=args.batch_size, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=args.fused or None)
    layout = ParallelismConfig(ep_size=args.ep_size, tp_size=args.tp_size, zero_stage=args.zero_stage,
                               sp_size=args.sp_size, cp_size=args.cp_size, pp_size=args.pp_size,
                               pp_schedule=args.pp_schedule,
                               dp_replicate_size=args.dp_replicate_size, dp_shard_size=args.dp_shard_size,
                               activation_checkpointing=args.checkpointing, offload_params=args.offload,
                               offload_optimizer=args.offload)
    accelerator = Accelerator(parallelism_config=layout,
                              gradient_accumulation_steps=args.accum, mixed_precision=args.mixed_precision)
    if args.pp_size > 1:  # the loss on the last stage, per micro-batch: the causal LM's shifted cross-entropy
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=shifted_loss)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    start = 0
    if args.resume:
        accelerator.load_state(str(out / "state"))
        start = args.save_at
        loader = accelerator.skip_first_batches(loader, start)
    losses, norms, auxes = [], [], []
    model.train()
    for step, batch in enumerate(loader, start=start):
        if step >= STEPS:
            break
        with accelerator.accumulate(model):  # with --accum N, expert gradients too are reduced every N-th step
            if args.halves:  # two synced backward calls in one step: each must reduce only its own gradients
                parts = []
                for i in range(2):
                    parts.append(model(**{k: v[i:i + 1] for k, v in batch.items()}))
                    accelerator.backward(parts[-1]["loss"] * 0.5)
                outputs = {"loss": (parts[0]["loss"] + parts[1]["loss"]) / 2,
                           "aux_loss": (parts[0]["aux_loss"] + parts[1]["aux_loss"]) / 2}
            elif args.pp_size > 1:  # the schedule runs forward and backward; the loss on every rank
                outputs = {"loss": model(batch["input_ids"][:, :-1], target=batch["labels"][:, 1:])}
                accelerator.backward(outputs["loss"])
            else:
                outputs = model(**batch)
                accelerator.backward(outputs["loss"])
            loss = outputs["loss"]
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        auxes.append(accelerator.reduce(torch.tensor(aux_of(outputs)), "mean").item())
        if args.save_at and not args.resume and step + 1 == args.save_at:
            accelerator.save_state(str(out / "state"))
    weights = accelerator.get_state_dict(model)
    held = accelerator.gather(torch.tensor([expert_numel(accelerator.unwrap_model(model))])).max().item()
    refusal = None
    if args.save_pretrained:
        try:
            accelerator.unwrap_model(model).save_pretrained(str(out / "unwrapped"))
        except ValueError as error:
            refusal = str(error)
    if args.save_model:
        accelerator.save_model(model, str(out / "model"))
    if accelerator.is_main_process:
        name = "resumed" if args.resume else "result"
        save_file({k: v.detach().clone().contiguous() for k, v in weights.items()}, str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps({"losses": losses, "norms": norms, "aux": auxes,
                                                         "expert_numel": held, "save_pretrained": refusal}))
    return accelerator


if __name__ == "__main__":
    main_with_jobs(run)
