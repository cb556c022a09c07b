"""Worker for test_tensor.py: a tiny transformers LlamaForCausalLM (built from a LlamaConfig, no download)
trained under tensor parallelism with the model's own plan; writes weights.safetensors and losses.json."""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from accel import Accelerator, ParallelismConfig
from accel.utils import set_seed


LR = 1e-3


def make_problem():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=64, max_position_embeddings=32, attn_implementation="eager")
    set_seed(0)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 64, (6, 4, 16), generator=torch.Generator().manual_seed(3))  # 6 steps of batch 4
    return model, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp_size", type=int, default=2)
    args = parser.parse_args()
    model, tokens = make_problem()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=args.tp_size))
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for batch in tokens:
        batch = batch.to(accelerator.device)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach().float()[None]).tolist())
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(Path(args.out) / "weights.safetensors"))
        (Path(args.out) / "losses.json").write_text(json.dumps(losses))
    accelerator.end_training()


if __name__ == "__main__":
    main()
