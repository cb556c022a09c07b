"""transformers' `Trainer` scenarios, one after another in one launch; the same file runs on the real Accelerate
(plain launch) and on accel (through the shim), so it imports only `accelerate` (via transformers).

Scenarios (`--scenarios`, comma-separated):
  basic      the design documents' example: a small net, `compute_loss` overridden (nll_loss), a collate function
             building {"x", "labels"}, evaluation each epoch, 2 epochs
  gpt2       tiny GPT-2 (n_embd 32, 2 layers, tied head, dropout 0.1): gradient accumulation 2, evaluation every 2
             steps, `save_steps` 2, then a second Trainer resumed from checkpoint-2 (`resume_from_checkpoint`), then
             `trainer.save_model` -> `from_pretrained`
  llama      tiny tied Llama in bf16: `save_model` -> `from_pretrained`
  gpt2_full_shard      the gpt2 scenario with Trainer's own `fsdp="full_shard"` (ZeRO-3, GPT2Block the wrap unit)
  llama_shard_grad_op  the llama scenario with `fsdp=True, fsdp_config={"reshard_after_forward": False}` (ZeRO-2),
                       also checkpointed and resumed
  (the last two on accel only: Accelerate cannot shard on CPU)

Rank 0 writes `<out>/records.json` (per scenario: the logged steps, what the Trainer saw, the tie and logits
checks) and `<out>/<scenario>.safetensors` (the final full weights; `<scenario>_resumed.safetensors` for the
resumed run)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

LOGGED = ("loss", "grad_norm", "learning_rate", "eval_loss", "epoch", "step")


class BasicNet(nn.Module):
    """The design documents' `BasicNet`, at test size: log-probabilities over 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=-1)


def basic_data(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    xs, ys = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    return [(xs[i], int(ys[i])) for i in range(n)]


def collate_fn(examples):
    return {"x": torch.stack([e[0] for e in examples]), "labels": torch.tensor([e[1] for e in examples])}


def token_data(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1)  # dropout: the masks follow the global RNG on both
    return GPT2LMHeadModel(config)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def arguments(folder: Path, **overrides):
    from transformers import TrainingArguments

    base = dict(use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=42, disable_tqdm=True,
                per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=5e-3,
                dataloader_drop_last=True)
    return TrainingArguments(str(folder), **{**base, **overrides})


def logged(trainer) -> list:
    return [{k: v for k, v in entry.items() if k in LOGGED} for entry in trainer.state.log_history
            if "loss" in entry or "eval_loss" in entry]


def full_weights(trainer) -> dict:
    """The gathered full state dict (every process calls it), as independent contiguous CPU tensors."""
    state = trainer.accelerator.get_state_dict(trainer.model)
    return {k: v.detach().float().cpu().clone().contiguous() for k, v in state.items()}


def common(trainer) -> dict:
    import accelerate

    state = trainer.accelerator.state
    return {"impl": "accel" if accelerate.Accelerator.__module__.startswith("accel.") else "accelerate",
            "world": trainer.args.world_size, "distributed_type": str(trainer.accelerator.distributed_type),
            "is_fsdp_enabled": trainer.is_fsdp_enabled,
            "fsdp_version": getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None),
            "sharded": any(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
            "zero_stage": getattr(getattr(state, "parallelism_config", None), "zero_stage", None)}


def ties(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def save_and_reload(trainer, folder: Path, build) -> dict:
    """`trainer.save_model` (every process), then on rank 0 `from_pretrained`: its weights tied, its logits those
    of a fresh model holding the trained (gathered) weights."""
    from transformers import AutoModelForCausalLM

    trainer.save_model(str(folder))
    weights = full_weights(trainer)
    result = {"tied_live": ties(trainer.accelerator.unwrap_model(trainer.model))}
    if trainer.args.process_index == 0:
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        reference = build()
        reference.load_state_dict(weights)
        probe = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            mine, theirs = loaded.eval()(input_ids=probe).logits, reference.eval()(input_ids=probe).logits
        result.update(tied_loaded=ties(loaded), logits_max_diff=float((mine - theirs).abs().max()),
                      saved_files=sorted(os.listdir(folder)))
    trainer.accelerator.wait_for_everyone()
    return result


def run_basic(out: Path) -> tuple[dict, dict]:
    from transformers import Trainer

    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(inputs["x"])
            loss = F.nll_loss(outputs, inputs["labels"])
            return (loss, outputs) if return_outputs else loss

    torch.manual_seed(0)
    args = arguments(out / "basic", num_train_epochs=2, eval_strategy="epoch", remove_unused_columns=False,
                     per_device_train_batch_size=8, per_device_eval_batch_size=8, label_names=["labels"],
                     prediction_loss_only=True)
    trainer = MyTrainer(BasicNet(), args, train_dataset=basic_data(64, 1), eval_dataset=basic_data(32, 2),
                        data_collator=collate_fn)
    trainer.train()
    return {**common(trainer), "log": logged(trainer)}, {"": full_weights(trainer)}


def run_causal(out: Path, name: str, build, **overrides) -> tuple[dict, dict]:
    from transformers import Trainer

    folder = out / name
    args = dict(max_steps=4, gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2,
                save_strategy="steps", save_steps=2)
    args.update(overrides)
    resume = args.get("save_strategy") == "steps"
    trainer = Trainer(build(), arguments(folder / "run", **args), train_dataset=token_data(64, 3),
                      eval_dataset=token_data(16, 4))
    trainer.train()
    record = {**common(trainer), "log": logged(trainer)}
    weights = {"": full_weights(trainer)}
    if resume:
        checkpoint = folder / "run" / "checkpoint-2"
        record["checkpoint_files"] = sorted(os.listdir(checkpoint))
        again = Trainer(build(), arguments(folder / "resumed", **args), train_dataset=token_data(64, 3),
                        eval_dataset=token_data(16, 4))
        again.train(resume_from_checkpoint=str(checkpoint))
        record["resumed_log"] = logged(again)
        weights["_resumed"] = full_weights(again)
    record.update(save_and_reload(trainer, folder / "saved", build))
    return record, weights


SCENARIOS = {
    "basic": run_basic,
    "gpt2": lambda out: run_causal(out, "gpt2", gpt2),
    "llama": lambda out: run_causal(out, "llama", llama, bf16=True, gradient_accumulation_steps=1, eval_strategy="no",
                                    save_strategy="no"),
    # accel only: Trainer's own FSDP arguments, which accel maps onto ZeRO 3 and 2
    "gpt2_full_shard": lambda out: run_causal(out, "gpt2_full_shard", gpt2, fsdp="full_shard",
                                              fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]}),
    "llama_shard_grad_op": lambda out: run_causal(out, "llama_shard_grad_op", llama, bf16=True,
                                                  gradient_accumulation_steps=1, eval_strategy="no", fsdp=True,
                                                  fsdp_config={"reshard_after_forward": False}),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="basic,gpt2,llama")
    cli = parser.parse_args()
    out = Path(cli.out)
    records = {}
    for name in cli.scenarios.split(","):
        record, weights = SCENARIOS[name](out)
        records[name] = record
        if int(os.environ.get("RANK", "0")) == 0:
            for suffix, tensors in weights.items():
                save_file(tensors, str(out / f"{name}{suffix}.safetensors"))
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "records.json").write_text(json.dumps(records, indent=1))
        print("trainer_worker: done", ", ".join(records))


if __name__ == "__main__":
    main()
