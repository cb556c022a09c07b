"""Worker for test_peft.py: LoRA (peft's get_peft_model) on a tiny LlamaForCausalLM built from a LlamaConfig (no
download), trained under the launched layout (DDP, ZeRO-3, TP 2, TP 2 x DP 2: `accel launch` flags, a bare
`Accelerator()`). Writes OUT/record.json (per-step losses, the trained model's logits on a probe batch),
OUT/final.safetensors (get_state_dict: every weight, gathered) and OUT/adapter (Accelerate's documented
save_pretrained pattern), for the test to compare with one plain-PyTorch process and to reload with
PeftModel.from_pretrained."""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LR = 0.2
STEPS, BATCH, SEQ, VOCAB = 4, 4, 16, 64  # BATCH: the global batch of one step
# column-wise (q, v, up), row-wise (o, down) and the gathered head (lm_head: colwise_rep) in Llama's own plan
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head"]


def make_base():
    from transformers import LlamaConfig, LlamaForCausalLM

    from accel.utils import set_seed

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=32,
                         attn_implementation="eager")
    set_seed(0)
    return LlamaForCausalLM(config)


def make_problem():
    """The LoRA model (random B as well as A, so the adapter changes the output from step 0), the tokens of every
    step in order, and a probe batch for the logits."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_base(), LoraConfig(r=4, lora_alpha=1, target_modules=TARGETS,
                                                   init_lora_weights=False))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    probe = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return model, tokens, probe


def make_optimizer(params):
    """Plain SGD: a gradient off by any factor shows in the weights (Adam's per-element normalisation would hide
    the scale and turn fp32 reduction-order noise in near-zero gradients into whole steps)."""
    return torch.optim.SGD(params, lr=LR)


def main() -> None:
    from accel import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    model, tokens, probe = make_problem()
    optimizer = make_optimizer(model.parameters())  # frozen base weights get no gradient: never stepped
    accelerator = Accelerator()
    tp = accelerator.parallelism_config.tp_size
    dp = accelerator.num_processes // tp
    loader = DataLoader(TensorDataset(tokens), batch_size=BATCH // dp)  # per-process batch: a dp rank's share
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        # tp ranks hold the same loss, dp ranks the loss of their share (equal token counts): the mean is the step's
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe.to(accelerator.device)).logits
    state = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(out / "adapter", is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save, state_dict=state)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "final.safetensors"))
        (out / "record.json").write_text(json.dumps({"losses": losses, "logits": logits.float().cpu().tolist(),
                                                     "tp": tp, "dp": dp, "steps": len(losses)}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
