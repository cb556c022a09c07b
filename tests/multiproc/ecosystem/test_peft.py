"""PEFT (LoRA through peft's get_peft_model) on a tiny Llama under DDP, ZeRO-3, TP 2 and TP 2 x DP 2, against one
plain-PyTorch process (fp32, SGD): per-step losses and trained adapter weights within atol 1e-5, every base weight
bit-equal to its start, and the adapter saved with Accelerate's documented save_pretrained pattern reloads in
PeftModel.from_pretrained with the same logits (atol 1e-5). A LoRA GPT-2 (Conv1D layers, the fused q/k/v c_attn,
a modules_to_save head) trains beside it, checked alike. One launch per layout runs all the checks."""

import json

import pytest
import torch
from _launch import SCRIPTS, accel_launch, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

ATOL = 1e-5
LAYOUTS = {  # id -> (processes, launch flags)
    "ddp2": (2, []),
    "zero3": (2, ["--zero_stage", "3"]),
    "tp2": (2, ["--tp_size", "2"]),
    "tp2xdp2": (4, ["--tp_size", "2"]),
}


@pytest.fixture(scope="module")
def reference():
    """One process, plain PyTorch: the same model, optimizer and batches of the global size, in order."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    worker = worker_module("peft_lora")
    model, tokens, probe = worker.make_problem()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = worker.make_optimizer(model.parameters())
    losses = []
    for batch in tokens.split(worker.BATCH):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    gpt2 = worker.make_gpt2()
    gpt2_initial = {k: v.clone() for k, v in gpt2.state_dict().items()}
    optimizer = worker.make_optimizer(gpt2.parameters())
    gpt2_losses = []
    for batch in (tokens % worker.GPT2_VOCAB).split(worker.BATCH):
        loss = gpt2(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        gpt2_losses.append(loss.item())
    gpt2_run = (gpt2_initial, gpt2.state_dict(), gpt2_losses)
    return worker, initial, model.state_dict(), losses, logits, probe, gpt2_run


def check_weights(final: dict, initial: dict, trained: dict, *trainable: str) -> None:
    """Every weight whose name holds one of `trainable` trained as one process trains it (and changed), every other
    one bit-equal to its start."""
    assert final.keys() == initial.keys()
    for key, value in final.items():
        if any(part in key for part in trainable):
            assert torch.allclose(value, trained[key], atol=ATOL, rtol=0), (key, (value - trained[key]).abs().max())
            assert not torch.equal(value, initial[key]), key
        else:
            assert torch.equal(value, initial[key]), key


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_trains_saves_and_reloads_as_one_process(isolated_env, tmp_path, reference, layout):
    from peft import PeftModel

    worker, initial, trained, ref_losses, ref_logits, probe, gpt2_run = reference
    processes, flags = LAYOUTS[layout]
    env = {**isolated_env, "HF_HUB_OFFLINE": "1"}
    proc = accel_launch(env, "--cpu", "--num_processes", processes, *flags, SCRIPTS / "peft_lora.py",
                        "--out", str(tmp_path))
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["steps"] == len(ref_losses) and record["dp"] * record["tp"] == processes
    if "--tp_size" in flags:  # Llama's own plan, written for the bare model, matched through PEFT's prefix
        assert "tensor parallel plan (the model's own tp plan, tp_size=2)" in proc.stdout
        assert "base_model.model.model.layers.1.self_attn.q_proj: colwise" in proc.stdout
        assert "base_model.model.model.layers.0.mlp.down_proj: rowwise" in proc.stdout
        assert "base_model.model.lm_head: colwise_rep" in proc.stdout
    assert torch.allclose(torch.tensor(record["losses"]), torch.tensor(ref_losses), atol=ATOL, rtol=0), (
        record["losses"], ref_losses)

    final = load_file(str(tmp_path / "final.safetensors"))
    assert len([k for k in final if "lora_" in k]) == 2 * (5 * 2 + 1)  # A, B of 5 targets x 2 layers, and lm_head
    check_weights(final, initial, trained, "lora_")

    # GPT-2: LoRA on Conv1D layers and on the fused q/k/v (split into whole heads), a modules_to_save lm_head
    gpt2_initial, gpt2_trained, gpt2_losses = gpt2_run
    if "--tp_size" in flags:
        assert "base_model.model.transformer.h.0.attn.c_attn: fused_qkv" in proc.stdout
        assert "base_model.model.lm_head: colwise_rep" in proc.stdout
    assert torch.allclose(torch.tensor(record["gpt2_losses"]), torch.tensor(gpt2_losses), atol=ATOL, rtol=0)
    gpt2_final = load_file(str(tmp_path / "gpt2.safetensors"))
    check_weights(gpt2_final, gpt2_initial, gpt2_trained, "lora_", "modules_to_save.")  # the head's trained copy

    reloaded = PeftModel.from_pretrained(worker.make_base(), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=probe).logits
    assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0), (logits - ref_logits).abs().max()
    assert torch.allclose(torch.tensor(record["logits"]), ref_logits, atol=ATOL, rtol=0)
