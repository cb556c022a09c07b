"""A tiny Hugging Face GPT-2 (built from a config: no download) trained the way users train one, on any config:

    accel launch examples/hf_gpt2.py                                                   # one process
    accel launch --cpu --num_processes 2 --zero_stage 3 examples/hf_gpt2.py            # ZeRO-3
    accel launch --cpu --num_processes 2 --tp_size 2 examples/hf_gpt2.py               # tensor parallel
    accel launch --cpu --num_processes 2 --pp_size 2 examples/hf_gpt2.py               # 2 pipeline stages
    accel launch --cpu --num_processes 2 --mixed_precision bf16 examples/hf_gpt2.py    # bf16

AdamW with a linear warm-up schedule, gradient accumulation, clipping, `gather_for_metrics`, `save_state` every
5 steps and a resume from the last one, then `save_model` and transformers' `from_pretrained` on that folder.
GPT-2 ties its output head to the token embedding: the tie holds on every backend (one parameter, saved once,
tied again by `from_pretrained`), and the example checks it. Needs transformers (`pip install transformers`).
"""

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator
from accel.utils import broadcast_object_list, set_seed

VOCAB = 1000


def loss_fn(outputs, targets):
    """Next-token loss; given to `prepare` so `model(x, target=y)` works on every backend, pipelines included."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), targets[:, 1:].reshape(-1))


def main() -> None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup
    except ImportError:
        raise SystemExit("examples/hf_gpt2.py needs transformers: pip install transformers") from None
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None, help="folder for checkpoints and the saved model (default: a temp dir)")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, VOCAB, (args.steps * 2 * 8, 16), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens), batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler, loss_fn=loss_fn)

    out = args.out or (tempfile.mkdtemp(prefix="hf_gpt2_") if accelerator.is_main_process else "")
    out = Path(broadcast_object_list([str(out)])[0])  # every process uses the main process's folder
    step, checkpoint = 0, None
    model.train()
    for (batch,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, target=batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            losses = accelerator.gather_for_metrics(loss.detach().float()[None])
            accelerator.print(f"step {step}: loss {losses.mean().item():.4f}, grad norm {norm.item():.3f}")
            if step % 5 == 0:
                checkpoint = out / f"step_{step}"
                accelerator.save_state(str(checkpoint))
            if step == args.steps:
                break
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))  # a resume, as after a restart
        accelerator.print(f"resumed from {checkpoint.name}")

    model.eval()
    sample = tokens[:2]
    with torch.no_grad():
        outputs = model(input_ids=sample.to(accelerator.device))
    logits = (outputs.logits if hasattr(outputs, "logits") else outputs).float().cpu()
    accelerator.save_model(model, str(out / "model"))
    if accelerator.is_main_process:
        loaded = GPT2LMHeadModel.from_pretrained(str(out / "model")).eval()
        assert loaded.lm_head.weight is loaded.transformer.wte.weight, "the saved model is not tied"
        with torch.no_grad():
            diff = (loaded(input_ids=sample).logits - logits).abs().max().item()
        tolerance = 1e-3 if accelerator.mixed_precision == "no" else 0.1  # bf16/fp16 logits vs fp32 ones
        assert diff < tolerance, f"from_pretrained gives other logits (max difference {diff})"
        print(f"from_pretrained: tied, logits match (max difference {diff:.1e})")
    accelerator.print(f"done on {accelerator.num_processes} process(es): {accelerator.distributed_type}")
    accelerator.end_training()
    if args.out is None and accelerator.is_main_process:  # the temp dir was this run's own: leave nothing behind
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
