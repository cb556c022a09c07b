"""Worker for test_sequence.py: an Accelerate-style loop (DataLoader of dict batches, the model's own loss) under
sequence parallelism (--sp_size, Ulysses) or context parallelism (--cp_size), alone or with data parallelism, ZeRO,
TP and activation checkpointing. Models: tiny transformers Llama (untied and tied), GPT-2, and a module of our own
that calls torch's scaled_dot_product_attention (trained with `loss_fn` and `model(x, target=y)`). Writes
result.json (per-step losses and clipped norms) and weights.safetensors; with --save_at K it saves the state after
step K, with --resume it loads that state and runs the remaining steps.

--loop picks how the batches reach the model (every loop trains on the same numbers, so one reference serves all):
dict (`model(**batch)`), tuple (`for (x,) in loader: model(input_ids=x, labels=x)`), list (`[input_ids,
attention_mask, labels]`, labels a separate tensor), namedtuple (`Batch(input_ids, position_ids, labels)`),
shift_labels (a dict with `shift_labels` the user shifted, besides labels), ids_as_labels (a dict batch,
`labels=batch["input_ids"]`) and user_loss (the loss computed outside the
model from its logits with accelerator.shift_labels and accelerator.reduce_sequence_loss). The warnings rank 0 saw
are written to result.json.

Run on one process with --batch_size b x dp and no parallelism, it is the reference of the same data."""

from __future__ import annotations

import argparse
import collections
import json
import warnings
from pathlib import Path

import torch
from _jobs import main_with_jobs
from safetensors.torch import save_file

from accel import Accelerator, ParallelismConfig
from accel.utils import set_seed

VOCAB, STEPS, SAMPLES = 64, 4, 16


class TinyAttentionLM(torch.nn.Module):
    """A causal LM of our own whose attention is torch's scaled_dot_product_attention (no position embedding)."""

    def __init__(self, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.layers = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)  # a key bias's gradient is 0 + rounding noise,
        # which AdamW scales up to full steps: no bias, so weights compare within the tolerance
        self.out = torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(2 * hidden, hidden))

    def forward(self, x):
        batch, length, hidden = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, hidden))
        return x + self.mlp(x)


def make_model(kind: str, attn: str, kv_heads: int = 2):
    set_seed(0)
    if kind == "sdpa":
        return TinyAttentionLM()
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                            eos_token_id=0, attn_implementation=attn, use_cache=False, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: its masks depend on the layout
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                         num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
                         tie_word_embeddings=kind == "llama_tied", attn_implementation=attn,
                         use_cache=False)  # without a cache transformers reads packed documents from position_ids
    return LlamaForCausalLM(config)


def make_samples(kind: str, mask: str, length: int) -> list:
    """SAMPLES token rows; `mask`: none, padding (right padding, labels -100 there) or packed (two documents per row,
    position_ids restarting)."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (SAMPLES, length), generator=generator)
    if kind == "sdpa":
        return [(row[:-1], row[1:]) for row in torch.randint(1, VOCAB, (SAMPLES, length + 1), generator=generator)]
    samples = []
    for i, row in enumerate(tokens):
        sample = {"input_ids": row, "labels": row.clone()}
        if mask == "padding":
            real = length - (i * 5) % (length // 2)
            sample["attention_mask"] = (torch.arange(length) < real).long()
            sample["labels"][real:] = -100
            sample["input_ids"] = row.masked_fill(torch.arange(length) >= real, 0)
        elif mask == "packed":
            cut = 3 + (i * 7) % (length - 6)
            sample["position_ids"] = torch.cat([torch.arange(cut), torch.arange(length - cut)])
            sample["labels"][cut - 1] = -100  # the first document's last token does not predict the second's first
        samples.append(sample)
    return samples


LOOPS = ["dict", "tuple", "list", "namedtuple", "shift_labels", "user_loss", "ids_as_labels", "pipeline"]
Batch = collections.namedtuple("Batch", ["input_ids", "position_ids", "labels"])


def collate(loop: str):
    """The DataLoader's collate_fn of a loop: the same tensors as the dict batch, in another container."""
    def to_batch(samples):
        batch = torch.utils.data.default_collate(samples)
        if loop in ("tuple", "user_loss"):
            return (batch["input_ids"],)
        if loop == "list":
            return [batch["input_ids"], batch.get("attention_mask", torch.ones_like(batch["input_ids"])),
                    batch["labels"]]
        if loop == "namedtuple":
            length = batch["input_ids"].shape[1]
            positions = batch.get("position_ids", torch.arange(length).expand_as(batch["input_ids"]))
            return Batch(batch["input_ids"], positions, batch["labels"])
        if loop == "shift_labels":  # shifted by the user (Accelerate's context-parallel guide): not shifted again
            batch["shift_labels"] = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        return batch
    return to_batch


def loop_loss(loop: str, model, batch, accelerator):
    """One step's loss, as each loop computes it."""
    if loop == "pipeline":  # the schedule's loss_fn on the last stage: labels shifted over the whole sequence
        return model(batch["input_ids"], target=accelerator.shift_labels(batch["labels"]))
    if loop == "tuple":
        (x,) = batch
        return model(input_ids=x, labels=x).loss
    if loop == "list":
        ids, mask, labels = batch
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss
    if loop == "namedtuple":
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels).loss
    if loop == "user_loss":  # transformers' *_no_trainer examples compute it from the logits
        (x,) = batch
        logits = model(input_ids=x).logits
        labels = accelerator.shift_labels(x)
        loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1),
                                                     ignore_index=-100, reduction="sum")
        return accelerator.reduce_sequence_loss(loss_sum, (labels != -100).sum())
    if loop == "ids_as_labels":  # a dict batch, the labels= keyword built from input_ids itself
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                     labels=batch["input_ids"]).loss
    return model(**batch).loss


def run(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama", choices=["llama", "llama_tied", "gpt2", "sdpa"])
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--mask", default="none", choices=["none", "padding", "packed"])
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--loop", default="dict", choices=LOOPS)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--sp_size", type=int, default=1)
    parser.add_argument("--cp_size", type=int, default=1)
    parser.add_argument("--tp_size", type=int, default=1)
    parser.add_argument("--pp_size", type=int, default=1)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--dp_replicate_size", type=int, default=None)
    parser.add_argument("--dp_shard_size", type=int, default=None)
    parser.add_argument("--checkpointing", default="no")
    parser.add_argument("--save_at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    model = make_model(args.model, args.attn, args.kv_heads)
    samples = make_samples(args.model, args.mask, args.length)
    loader = torch.utils.data.DataLoader(samples, batch_size=args.batch_size, shuffle=False,
                                         collate_fn=None if args.model == "sdpa" else collate(args.loop))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parallelism = ParallelismConfig(sp_size=args.sp_size, cp_size=args.cp_size, tp_size=args.tp_size,
                                    pp_size=args.pp_size,
                                    zero_stage=args.zero_stage, activation_checkpointing=args.checkpointing,
                                    dp_replicate_size=args.dp_replicate_size, dp_shard_size=args.dp_shard_size)
    accelerator = Accelerator(parallelism_config=parallelism)
    loss_fn = None
    if args.model == "sdpa" or args.loop == "pipeline":
        def loss_fn(logits, target):
            return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader, loss_fn=loss_fn)
    start = 0
    if args.resume:
        accelerator.load_state(str(out / "state"))
        start = args.save_at
        loader = accelerator.skip_first_batches(loader, start)
    losses, norms = [], []
    model.train()
    seen = warnings.catch_warnings(record=True)
    caught = seen.__enter__()
    warnings.simplefilter("always")
    for step, batch in enumerate(loader, start=start):
        if step >= STEPS:
            break
        if args.model == "sdpa":
            inputs, target = batch
            loss = model(inputs, target=target)
        else:
            loss = loop_loss(args.loop, model, batch, accelerator)
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        if args.save_at and not args.resume and step + 1 == args.save_at:
            accelerator.save_state(str(out / "state"))
    seen.__exit__(None, None, None)
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        name = "resumed" if args.resume else "result"
        save_file({k: v.detach().clone().contiguous() for k, v in weights.items()}, str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps({"losses": losses, "norms": norms, "warnings": [
            str(w.message) for w in caught if "sequence" in str(w.message)]}))
    return accelerator


if __name__ == "__main__":
    main_with_jobs(run)
