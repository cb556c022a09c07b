"""TRL's trainers, unchanged, on a tiny Llama built from a config (saved locally, passed as a path), the in-memory word
tokenizer and in-memory `datasets.Dataset`s, logging every step.

Scenarios (`--scenarios`, comma-separated):
  sft   SFTTrainer on a "text" dataset (padding, no packing), 2 epochs, an eval dataset evaluated every 4 steps
  sft_completion  SFTTrainer on prompt/completion pairs (loss on the completion only), gradient accumulation 2
  dpo   DPOTrainer on prompt/chosen/rejected (sigmoid loss; the reference model is TRL's frozen copy)
  grpo  GRPOTrainer with two reward functions (sampled completions: the global RNG drives generation), 4 generations
        per prompt, beta 0.04 (a reference model, its KL logged)

Rank 0 writes <out>/records.json (per scenario: every logged entry's numbers) and <out>/<scenario>.safetensors (the
final weights)."""

from __future__ import annotations

from pathlib import Path

import torch
from _common import TOPICS, Sentences, numbers, run_scenarios, shared_folder, tokenizer, vocab_size

COMMON = dict(logging_steps=1, save_strategy="no", report_to=[], seed=42, use_cpu=True, disable_tqdm=True,
              learning_rate=1e-3, per_device_train_batch_size=4, per_device_eval_batch_size=4)


def model(out: Path):
    """The tiny Llama and its tokenizer saved to a local folder (by the main process), passed to TRL as a path, as a
    hub id would be: DPO and GRPO load their reference model from it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)

    def write(folder: Path) -> None:
        LlamaForCausalLM(config).save_pretrained(folder)
        tok.save_pretrained(folder)

    return shared_folder(out / "tiny-llama", write), tok


def result(trainer) -> tuple:
    log = [numbers(e) for e in trainer.state.log_history]
    state = trainer.accelerator.get_state_dict(trainer.model)
    return {"log": log}, {"": state}


def sft(out: Path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    s = Sentences(3)
    texts = [s.sentence(s.topic(), 4, 12) for _ in range(40)]
    held_out = [s.sentence(s.topic(), 4, 12) for _ in range(12)]
    net, tok = model(out)
    args = SFTConfig(str(out), num_train_epochs=2, max_length=24, eval_strategy="steps", eval_steps=4, **COMMON)
    trainer = SFTTrainer(model=net, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         eval_dataset=Dataset.from_dict({"text": held_out}), processing_class=tok)
    trainer.train()
    return result(trainer)


def sft_completion(out: Path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    s = Sentences(4)
    topics = [s.topic() for _ in range(32)]
    data = {"prompt": [s.sentence(t, 2, 4) for t in topics], "completion": [" " + s.sentence(t) for t in topics]}
    net, tok = model(out)
    args = SFTConfig(str(out), max_steps=6, max_length=24, gradient_accumulation_steps=2, **COMMON)
    trainer = SFTTrainer(model=net, args=args, train_dataset=Dataset.from_dict(data), processing_class=tok)
    trainer.train()
    return result(trainer)


def dpo(out: Path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    s = Sentences(5)
    prompts, chosen, rejected = [], [], []
    for _ in range(32):
        t = s.topic()
        prompts.append(s.sentence(t, 2, 4))
        chosen.append(" " + s.sentence(t))
        rejected.append(" " + s.sentence((t + 1) % len(TOPICS)))
    net, tok = model(out)
    args = DPOConfig(str(out), max_steps=6, max_length=24, beta=0.1, **COMMON)
    trainer = DPOTrainer(model=net, args=args, processing_class=tok,
                         train_dataset=Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected}))
    trainer.train()
    return result(trainer)


def on_topic(completions, **kwargs):
    """Reward: the share of a completion's words that are animals."""
    return [sum(w in TOPICS[0] for w in c.split()) / max(1, len(c.split())) for c in completions]


def short(completions, **kwargs):
    return [-0.1 * len(c.split()) for c in completions]


def grpo(out: Path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    s = Sentences(6)
    prompts = [s.sentence(s.topic(), 2, 4) for _ in range(16)]
    net, tok = model(out)
    tok.padding_side = "left"
    args = GRPOConfig(str(out), max_steps=3, num_generations=4, max_completion_length=6, beta=0.04,
                      generation_batch_size=8, **{**COMMON, "learning_rate": 1e-2})
    trainer = GRPOTrainer(model=net, reward_funcs=[on_topic, short], args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    return result(trainer)


if __name__ == "__main__":
    run_scenarios({"sft": sft, "sft_completion": sft_completion, "dpo": dpo, "grpo": grpo}, __doc__)
