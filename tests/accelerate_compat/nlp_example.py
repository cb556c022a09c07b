"""The shape of Accelerate's examples/nlp_example.py (BERT sequence classification, AdamW, linear warm-up,
gradient accumulation, gather_for_metrics), written for Accelerate and run unmodified through accel's shim:

    accel launch --accelerate_shim --cpu --num_processes 2 tests/accelerate_compat/nlp_example.py

No download: a tiny BERT built from its config and random token ids whose label is a function of the tokens (so
the model can learn it). Only `accelerate`, torch and transformers are imported."""

import argparse

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 32
VOCAB, SEQ = 128, 16


def get_dataloaders(accelerator: Accelerator, batch_size: int = 16):
    generator = torch.Generator().manual_seed(0)

    def split(n):
        ids = torch.randint(1, VOCAB, (n, SEQ), generator=generator)
        labels = (ids[:, 0] > VOCAB // 2).long()  # learnable from the first token
        return TensorDataset(ids, torch.ones_like(ids), labels)

    with accelerator.main_process_first():  # the example's tokenization step
        train, evaluation = split(256), split(100)
    train_dataloader = DataLoader(train, shuffle=True, batch_size=batch_size, drop_last=True)
    eval_dataloader = DataLoader(evaluation, shuffle=False, batch_size=EVAL_BATCH_SIZE, drop_last=False)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr, num_epochs, seed, batch_size = config["lr"], int(config["num_epochs"]), int(config["seed"]), int(config["batch_size"])
    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE and accelerator.distributed_type != DistributedType.XLA:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE
    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=64,
                                                     max_position_embeddings=SEQ, num_labels=2))
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=10,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    for epoch in range(num_epochs):
        model.train()
        for step, (input_ids, attention_mask, labels) in enumerate(train_dataloader):
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            loss = outputs.loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct, total = 0, 0
        for input_ids, attention_mask, labels in eval_dataloader:
            with torch.no_grad():
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            predictions, references = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f} on {total} eval samples, "
                          f"{accelerator.num_processes} processes, {accelerator.distributed_type}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    args = parser.parse_args()
    config = {"lr": 2e-3, "num_epochs": 3, "seed": 42, "batch_size": 32}
    training_function(config, args)


if __name__ == "__main__":
    main()
