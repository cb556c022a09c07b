"""Worker for test_sequence_resume.py: 4 AdamW steps over dict batches under data parallelism combined with
sequence (--sp_size) or context (--cp_size) parallelism, ZeRO-3 or plain DDP, on tiny transformers models (Llama
from seq_train.py, and a Mixtral MoE without ep). With --save_at K it saves the state after step K and runs on
(result.json, result.safetensors); with --resume it loads that state, skips K batches and runs the remaining
steps (resumed.json, resumed.safetensors): the two must be equal bit for bit.

The one-process reference of the test uses make_model/make_samples with plain PyTorch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import seq_train
import torch
from _jobs import main_with_jobs
from safetensors.torch import save_file

from accel import Accelerator, ParallelismConfig
from accel.utils import set_seed

STEPS, LENGTH = 4, 16


def make_model(kind: str):
    if kind == "llama":
        return seq_train.make_model("llama", "sdpa")
    from transformers import MixtralConfig, MixtralForCausalLM

    set_seed(0)
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           vocab_size=seq_train.VOCAB, max_position_embeddings=64, use_cache=False,
                           attn_implementation="sdpa")  # no router aux loss: the plain MoE
    return MixtralForCausalLM(config)


def make_samples() -> list:
    return seq_train.make_samples("llama", "none", LENGTH)


def run(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama", choices=["llama", "mixtral"])
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--sp_size", type=int, default=1)
    parser.add_argument("--cp_size", type=int, default=1)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--save_at", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    model = make_model(args.model)
    loader = torch.utils.data.DataLoader(make_samples(), batch_size=args.batch_size, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parallelism = ParallelismConfig(sp_size=args.sp_size, cp_size=args.cp_size, zero_stage=args.zero_stage)
    accelerator = Accelerator(parallelism_config=parallelism)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    start = 0
    if args.resume:
        accelerator.load_state(str(out / "state"))
        start = args.save_at
        loader = accelerator.skip_first_batches(loader, start)
    losses, norms = [], []
    model.train()
    for step, batch in enumerate(loader, start=start):
        if step >= STEPS:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        if not args.resume and step + 1 == args.save_at:
            accelerator.save_state(str(out / "state"))
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        name = "resumed" if args.resume else "result"
        save_file({k: v.detach().clone().contiguous() for k, v in weights.items()}, str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps({"losses": losses, "norms": norms}))
    return accelerator


if __name__ == "__main__":
    main_with_jobs(run)
