"""Accuracy of `accel estimate-memory --batch_size/--seq_len`: activation bytes estimated on fake tensors vs the
same training step run for real on CPU (one process).

    python benchmarks/bench_activations.py  # tiny Llama and GPT-2, 2 sizes, fp32/bf16, no/full checkpointing (~75 s)

For each model and micro-batch, `accel.planning.estimate.activation_bytes` runs forward + backward on a fake copy
(FakeTensorMode, no memory); the real column runs the same step on real tensors under the same tracker (torch's
MemTracker: peak over the step of the bytes that are not parameters, buffers or gradients). `saved` is an
independent lower bound: the bytes of the unique storages saved for backward at the end of the real forward
(`torch.autograd.graph.saved_tensors_hooks`), which excludes temporaries, logits' gradient and the loss.
Asserts nothing.
"""

from __future__ import annotations

import itertools
import time

import torch


def models():
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    small = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000)
    wide = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=2000)
    configs = {"llama-4x128": LlamaConfig(**small), "llama-6x256": LlamaConfig(**wide),
               "gpt2-4x128": GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=512),
               "gpt2-6x256": GPT2Config(n_layer=6, n_embd=256, n_head=8, vocab_size=2000, n_positions=512)}
    for name, config in configs.items():
        config.use_cache = False
        torch.manual_seed(0)
        yield name, AutoModelForCausalLM.from_config(config)


def saved_bytes(model, batch_size: int, seq_len: int) -> int:
    """Unique storages saved for backward by one real forward (the activations autograd keeps)."""
    from accel.planning.estimate import _inputs, _loss

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, _inputs(model, batch_size, seq_len))
    total = sum(seen.values())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def main() -> None:
    from accel.planning.estimate import activation_bytes

    print(f"{'model':<12} {'B x S':>8} {'mp':>4} {'ckpt':>5} {'fake (MiB)':>11} {'real (MiB)':>11} {'error':>7} "
          f"{'saved (MiB)':>12} {'fake s':>7}")
    for name, model in models():
        for (batch_size, seq_len), precision, ckpt in itertools.product(((2, 128), (4, 256)), ("no", "bf16"),
                                                                      ("no", "full")):
                start = time.perf_counter()
                fake = activation_bytes(model, batch_size, seq_len, precision, ckpt)
                seconds = time.perf_counter() - start
                real = activation_bytes(model, batch_size, seq_len, precision, ckpt, fake=False)
                saved = saved_bytes(model, batch_size, seq_len) if ckpt == precision == "no" else None
                print(f"{name:<12} {f'{batch_size}x{seq_len}':>8} {precision:>4} {ckpt:>5} {fake / 2**20:>11.2f} "
                      f"{real / 2**20:>11.2f} {(fake - real) / real:>+7.1%} "
                      f"{'' if saved is None else f'{saved / 2**20:.2f}':>12} {seconds:>7.2f}")


if __name__ == "__main__":
    main()
