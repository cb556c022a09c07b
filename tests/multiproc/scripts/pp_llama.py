"""Worker for test_pipeline.py: a tiny transformers LlamaForCausalLM (built from a LlamaConfig, no download)
cut into 2 pipeline stages by accel, with no stage code: its own forward (rotary tables, causal mask) runs on
each stage. Trains 3 AdamW steps; rank 0 also trains a plain copy on one process and writes both losses and
the largest weight difference to result.json."""

import argparse
import json
from pathlib import Path

import torch

from accel import Accelerator, ParallelismConfig
from accel.utils import set_seed

VOCAB = 64


def loss_fn(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=32,
                         attn_implementation="eager", use_cache=False)
    set_seed(0)
    model = LlamaForCausalLM(config)
    reference = LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, VOCAB, (3, 4, 17), generator=torch.Generator().manual_seed(3))  # 3 steps of batch 4

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=2))
    model, optimizer = accelerator.prepare(model, optimizer, loss_fn=loss_fn)  # ModelOutput -> its logits
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for batch in tokens:
        loss = model(batch[:, :-1], target=batch[:, 1:])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        ref_loss = loss_fn(reference(batch[:, :-1]).logits, batch[:, 1:])
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.item())
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        expected = reference.state_dict()
        diff = max((weights[k] - expected[k]).abs().max().item() for k in expected)
        result = {"losses": losses, "ref_losses": ref_losses, "max_weight_diff": diff,
                  "names_match": sorted(weights) == sorted(expected)}
        Path(args.out, "result.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
