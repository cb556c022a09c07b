"""Worker for test_peft.py: LoRA (peft's get_peft_model) on a tiny LlamaForCausalLM built from a LlamaConfig (no
download), trained under the launched layout (DDP, ZeRO-3, TP 2, TP 2 x DP 2: `accel launch` flags, a bare
`Accelerator()`), and beside it a LoRA GPT-2 (Conv1D, fused q/k/v, a modules_to_save head). Writes OUT/record.json
(per-step losses, the trained Llama's logits on a probe batch), OUT/final.safetensors and OUT/gpt2.safetensors
(get_state_dict: every weight, gathered) and OUT/adapter (Accelerate's documented save_pretrained pattern), for
the test to compare with one plain-PyTorch process and to reload with PeftModel.from_pretrained."""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LR = 0.2
STEPS, BATCH, SEQ, VOCAB, GPT2_VOCAB = 4, 4, 16, 64, 32  # BATCH: the global batch of one step
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


def make_gpt2():
    """GPT-2 (no dropout, untied head) with LoRA on its Conv1D layers, the fused q/k/v `c_attn` among them, and
    `lm_head` as a modules_to_save copy: accel's built-in plan, through PEFT's names."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from accel.utils import set_seed

    config = GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=GPT2_VOCAB, n_positions=SEQ,
                        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    set_seed(0)
    return get_peft_model(GPT2LMHeadModel(config), LoraConfig(
        r=2, lora_alpha=1, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, init_lora_weights=False,
        modules_to_save=["lm_head"]))


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
    gpt2 = make_gpt2()
    model, optimizer, loader, gpt2, gpt2_optimizer = accelerator.prepare(model, optimizer, loader, gpt2,
                                                                         make_optimizer(gpt2.parameters()))
    losses, gpt2_losses = [], []
    for (batch,) in loader:
        for net, opt, record, vocab in ((model, optimizer, losses, VOCAB), (gpt2, gpt2_optimizer, gpt2_losses,
                                                                            GPT2_VOCAB)):
            loss = net(input_ids=batch % vocab, labels=batch % vocab).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            # tp ranks hold the same loss, dp ranks that of their share (equal token counts): the mean is the step's
            record.append(accelerator.gather(loss.detach()[None]).mean().item())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe.to(accelerator.device)).logits
    state = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(out / "adapter", is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save, state_dict=state)
    gpt2_state = accelerator.get_state_dict(gpt2)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "final.safetensors"))
        save_file({k: v.contiguous() for k, v in gpt2_state.items()}, str(out / "gpt2.safetensors"))
        (out / "record.json").write_text(json.dumps({"losses": losses, "logits": logits.float().cpu().tolist(),
                                                     "gpt2_losses": gpt2_losses, "tp": tp, "dp": dp,
                                                     "steps": len(losses)}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
