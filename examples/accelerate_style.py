"""A training script written for Hugging Face Accelerate, moved to accel by changing the imports only.

It follows the shape of Accelerate's own examples: set_seed, main_process_first around data preparation,
gradient accumulation with `accumulate`, clipping, evaluation with `gather_for_metrics`, and
`unwrap_model` at the end, experiment tracking with `log_with`/`init_trackers`/`log`. Synthetic classification data,
no download. The main process logs loss and learning rate per optimizer step, and accuracy per epoch, to
runs/accelerate_style/run-<NNN>/metrics.jsonl, a new run-<NNN> each time (`--project_dir` moves it;
`--log_with tensorboard` writes TensorBoard events in runs/accelerate_style/).

    accel launch --cpu --num_processes 2 examples/accelerate_style.py --gradient_accumulation_steps 2
    accel launch --cpu --num_processes 2 --mixed_precision bf16 examples/accelerate_style.py
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator  # was: from accelerate import Accelerator
from accel.utils import set_seed  # was: from accelerate.utils import set_seed


def make_dataset(n: int, generator: torch.Generator) -> TensorDataset:
    x = torch.randn(n, 16, generator=generator)
    labels = (x[:, :8].sum(dim=1) > x[:, 8:].sum(dim=1)).long()
    return TensorDataset(x, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--mixed_precision", default=None)
    parser.add_argument("--log_with", default="jsonl")
    parser.add_argument("--project_dir", default="runs")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision, log_with=args.log_with,
                              project_dir=args.project_dir)
    accelerator.init_trackers("accelerate_style", config=vars(args))
    set_seed(42)
    with accelerator.main_process_first():
        generator = torch.Generator().manual_seed(0)
        train_set, eval_set = make_dataset(512, generator), make_dataset(203, generator)  # 203: uneven on purpose
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(eval_set, batch_size=32)

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps = args.epochs * len(train_loader) // args.gradient_accumulation_steps
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=steps)

    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for inputs, labels in train_loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(inputs), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)
                step += 1

        model.eval()
        correct, total = 0, 0
        for inputs, labels in eval_loader:
            with torch.no_grad():
                predictions = model(inputs).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, labels))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f} on {total} eval samples")
        accelerator.log({"accuracy": correct / total, "epoch": epoch}, step=step)

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        n_params = sum(p.numel() for p in unwrapped.parameters())
        print(f"finished on {accelerator.num_processes} process(es), {accelerator.distributed_type}, "
              f"mixed_precision={accelerator.mixed_precision}, {n_params} parameters")
    accelerator.end_training()


if __name__ == "__main__":
    main()
