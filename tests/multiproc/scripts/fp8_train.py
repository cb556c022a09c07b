"""Worker for test_fp8.py: a tiny Llama (dimensions multiples of 16) trained with mixed_precision fp8 (torchao's
float8 training, emulated on the CPU) under several backends in one launch; rank 0 writes OUT/records.json with
each backend's per-step losses, which layers are Float8Linear and whether FSDP2 all-gathers them in float8."""

import argparse
import json
from pathlib import Path

import torch

from accel import Accelerator, ParallelismConfig
from accel.utils import set_seed

STEPS, GLOBAL_BATCH, SEQ, VOCAB, LR = 4, 4, 16, 128, 1e-3
BACKENDS = {"ddp": {}, "zero3": {"zero_stage": 3}, "tp2": {"tp_size": 2}, "pp2": {"pp_size": 2, "pp_microbatches": 2}}


def build() -> torch.nn.Module:
    import transformers as tf

    set_seed(0)
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                            tie_word_embeddings=False)
    return tf.LlamaForCausalLM(config)


def batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def loss_fn(outputs, target):
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def reference(mixed_precision: str) -> list[float]:
    """Plain PyTorch on one process: bf16 autocast (the fp8 run's other ops) or fp32."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision == "bf16"):
            loss = loss_fn(model(input_ids=batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run(backend: str) -> dict:
    acc = Accelerator(mixed_precision="fp8", parallelism_config=ParallelismConfig(**BACKENDS[backend]))
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = acc.prepare(model, optimizer, loss_fn=loss_fn)
    dp, rank = acc.backend.data_parallel_size, acc.backend.data_parallel_rank
    part = GLOBAL_BATCH // dp
    losses = []
    for batch in batches():
        local = batch[rank * part:(rank + 1) * part].to(acc.device)
        loss = model(local, target=local)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(acc.reduce(loss.detach().float(), "mean").item())
    inner = acc.unwrap_model(model)
    float8 = sorted(name for name, m in inner.named_modules() if type(m).__name__ == "Float8Linear")
    gathers = {getattr(m, "config", None).enable_fsdp_float8_all_gather for m in inner.modules()
               if type(m).__name__ == "Float8Linear"}
    gathers_float8 = any(type(p).__name__ == "DTensor" and "Float8" in type(p.to_local()).__name__
                         for m in inner.modules() if type(m).__name__ == "Float8Linear" for p in m.parameters())
    acc.free_memory()
    return {"losses": losses, "float8": float8, "fsdp_float8_all_gather": sorted(gathers),
            "float8_weights": gathers_float8, "is_main": acc.is_main_process}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args()
    records = {name: run(name) for name in args.backends.split(",")}
    if all(r.pop("is_main") for r in records.values()):
        (Path(args.out) / "records.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
