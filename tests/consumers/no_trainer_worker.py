"""The transformers `*_no_trainer` loop in the shape of examples/pytorch/text-classification/run_glue_no_trainer.py:
a tiny `BertForSequenceClassification` from a config, the in-memory word tokenizer, sentence pairs in a
`datasets.Dataset` tokenized under `main_process_first`, `DataCollatorWithPadding`, AdamW with the no-decay groups,
a linear schedule with warm-up, gradient accumulation by hand as the script does it (loss divided, a step
where `step % gradient_accumulation_steps == 0` or on the epoch's last batch), evaluation with
`gather_for_metrics` each epoch, `save_state` on every process (`checkpointing_steps` "epoch" or a number), and
`--resume_from_checkpoint` (epoch_N: the next epoch; step_N: `skip_first_batches` into the epoch).

Each scenario trains once from scratch, then once per resume point from that run's checkpoints (in a fresh output
folder):
  epochs   checkpointing_steps "epoch", 3 epochs; resumed from epoch_0
  steps    checkpointing_steps 2, 2 epochs; resumed mid-epoch (step_4) and at an epoch's last batch (step_<steps per
           epoch>: the checkpoint of the epoch's last step, resumed into the next epoch)
  accum    gradient accumulation 2, checkpointing_steps 1, 2 epochs; resumed mid-epoch (step_2)

Rank 0 writes <out>/records.json (per scenario and run: each step's loss (gathered mean) and learning rate, each
epoch's eval accuracy) and <out>/<scenario>_<run>.safetensors (the final weights)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from _common import TOPICS, Sentences, run_scenarios, tokenizer, vocab_size

SETTINGS = {
    "epochs": dict(checkpointing_steps="epoch", num_train_epochs=3),
    "steps": dict(checkpointing_steps="2", num_train_epochs=2),
    "accum": dict(checkpointing_steps="1", num_train_epochs=2, gradient_accumulation_steps=2),
}


def raw_data(n: int, seed: int) -> dict:
    s = Sentences(seed)
    first, second, labels = [], [], []
    for i in range(n):
        t = s.topic()
        same = i % 2 == 0
        first.append(s.sentence(t))
        second.append(s.sentence(t if same else (t + 1) % len(TOPICS)))
        labels.append(int(same))
    return {"sentence1": first, "sentence2": second, "label": labels}


def main(output_dir: Path, resume_from_checkpoint=None, checkpointing_steps=None, num_train_epochs=2,
         gradient_accumulation_steps=1, per_device_train_batch_size=4, per_device_eval_batch_size=4,
         learning_rate=2e-3, weight_decay=0.01, num_warmup_steps=2, seed=42):
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding, get_scheduler

    accelerator = Accelerator()  # the script accumulates by hand (loss / gradient_accumulation_steps)
    set_seed(seed)
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    raw_datasets = {"train": Dataset.from_dict(raw_data(48, 1)), "validation": Dataset.from_dict(raw_data(21, 2))}
    tok = tokenizer(bert=True)
    config = BertConfig(vocab_size=vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config)

    def preprocess_function(examples):
        result = tok(examples["sentence1"], examples["sentence2"], padding=False, max_length=64, truncation=True)
        result["labels"] = examples["label"]
        return result

    with accelerator.main_process_first():
        processed = {k: d.map(preprocess_function, batched=True, remove_columns=d.column_names)
                     for k, d in raw_datasets.items()}
    train_dataset, eval_dataset = processed["train"], processed["validation"]

    data_collator = DataCollatorWithPadding(tok, pad_to_multiple_of=None)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=data_collator,
                                  batch_size=per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=data_collator, batch_size=per_device_eval_batch_size)

    # Optimizer: split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=learning_rate)

    # Scheduler and math around the number of training steps.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / gradient_accumulation_steps)
    max_train_steps = num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(name="linear", optimizer=optimizer,
                                 num_warmup_steps=num_warmup_steps * accelerator.num_processes,
                                 num_training_steps=max_train_steps * accelerator.num_processes)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    # We need to recalculate our total training steps as the size of the training dataloader may have changed
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / gradient_accumulation_steps)
    max_train_steps = num_train_epochs * num_update_steps_per_epoch
    num_train_epochs = math.ceil(max_train_steps / num_update_steps_per_epoch)

    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    completed_steps = 0
    starting_epoch = 0
    resume_step = None
    # Potentially load in the weights and states from a previous save
    if resume_from_checkpoint:
        checkpoint_path = resume_from_checkpoint
        path = os.path.basename(resume_from_checkpoint)
        accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
        accelerator.load_state(checkpoint_path)
        # Extract `epoch_{i}` or `step_{i}`
        training_difference = os.path.splitext(path)[0]

        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            # need to multiply `gradient_accumulation_steps` to reflect real steps
            resume_step = int(training_difference.replace("step_", "")) * gradient_accumulation_steps
            starting_epoch = resume_step // len(train_dataloader)
            completed_steps = resume_step // gradient_accumulation_steps
            resume_step -= starting_epoch * len(train_dataloader)

    log, evals = [], []
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        if resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # We skip the first `n` batches in the dataloader when resuming from a checkpoint
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            log.append({"step": completed_steps, "epoch": epoch, "batch": step,
                        "loss": accelerator.gather(loss.detach()).mean().item(),
                        "lr": lr_scheduler.get_last_lr()[0]})
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1

            if isinstance(checkpointing_steps, int):
                if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                    output_dir_step = f"step_{completed_steps}"
                    accelerator.save_state(os.path.join(output_dir, output_dir_step))

            if completed_steps >= max_train_steps:
                break

        model.eval()
        samples_seen = 0
        correct = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            samples_seen += references.shape[0]
            correct += int((predictions == references).sum())
        evals.append({"epoch": epoch, "accuracy": correct / samples_seen, "samples": samples_seen})
        accelerator.print(f"epoch {epoch}: accuracy {correct / samples_seen}")

        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(output_dir, f"epoch_{epoch}"))

    accelerator.wait_for_everyone()
    weights = dict(accelerator.unwrap_model(model).state_dict())
    record = {"log": log, "eval": evals, "steps_per_epoch": len(train_dataloader),
              "checkpoints": sorted(d for d in os.listdir(output_dir) if d.startswith(("step_", "epoch_")))}
    accelerator.free_memory()  # the script ends with end_training(); here the next run follows in this process
    return record, weights


def resume_points(name: str, steps_per_epoch: int) -> list:
    if name == "epochs":
        return ["epoch_0"]
    if name == "steps":
        return ["step_4", f"step_{steps_per_epoch}"]
    return ["step_2"]


def scenario(name: str):
    def run(out: Path):
        full, full_weights = main(out / "full", **SETTINGS[name])
        records, weights = {"full": full}, {"_full": full_weights}
        for point in resume_points(name, full["steps_per_epoch"]):
            records[point], weights[f"_{point}"] = main(out / point, resume_from_checkpoint=str(out / "full" / point),
                                                        **SETTINGS[name])
        return records, weights

    return run


if __name__ == "__main__":
    run_scenarios({name: scenario(name) for name in SETTINGS}, __doc__)
