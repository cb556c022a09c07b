"""A GPT-style model trained with the pipeline loop, which runs unchanged on every config:

    accel launch examples/pipeline.py                                            # one process
    accel launch --cpu --num_processes 2 examples/pipeline.py                    # DDP
    accel launch --cpu --num_processes 2 --pp_size 2 examples/pipeline.py       # 2 pipeline stages (1F1B)
    accel launch --cpu --num_processes 2 --pp_size 2 --pp_schedule GPipe --pp_microbatches 8 examples/pipeline.py

The loss function is given once, to `prepare`; `loss = model(x, target=y)` then returns the batch loss (under
pipeline parallelism it runs forward and backward over the micro-batches, and `accelerator.backward` is a
no-op). The model learns to continue a repeating token pattern (synthetic data, no download).
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, num_heads=4, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        length = x.shape[1]
        causal = torch.triu(torch.full((length, length), float("-inf"), device=x.device), diagonal=1)
        h = self.norm(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 64, layers: int = 4, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    period = torch.randint(0, 16, (7,))
    starts = torch.randint(0, 7, (512,))
    tokens = period[(starts[:, None] + torch.arange(33)) % 7]
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size, shuffle=True)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=next_token_loss)

    for epoch in range(args.epochs):
        model.train()
        total, count = torch.zeros((), device=accelerator.device), 0
        for inputs, targets in loader:
            loss = model(inputs, target=targets)  # the one line that differs from a DDP loop
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.detach()
            count += 1
        mean_loss = accelerator.reduce(total / count, reduction="mean")
        model.eval()
        with torch.no_grad():
            predicted = model(inputs).argmax(-1)  # forward only: the logits, on every process
        accuracy = accelerator.reduce((predicted == targets).float().mean(), reduction="mean")
        accelerator.print(f"epoch {epoch}: loss {mean_loss.item():.4f}, next-token accuracy {accuracy.item():.2f} on "
                          f"{accelerator.num_processes} process(es), pp_size {accelerator.config.parallelism.pp_size}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
