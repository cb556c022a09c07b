"""transformers' big-model loading (``from_pretrained(device_map=..., offload_folder=...)``) through the Accelerate shim
gives what the real Accelerate gives.

One script runs every case and prints one JSON line; it runs twice in subprocesses, once with the real Accelerate and
once with ``PYTHONPATH=$(python -m accel.shim)`` (accel), in the same working directory so that relative folders mean
the same. Each case reports ``hf_device_map`` and the logits of one batch; both must be equal (atol 0: the hooks only
move tensors, the arithmetic is the same), and so must the set of files written to the offload folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

_SAVE = textwrap.dedent("""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    llama.save_pretrained("llama", max_shard_size="60KB")   # 422 KB of float32 in several shards
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    gpt2.save_pretrained("gpt2", max_shard_size="60KB")     # tied embedding and head
""")

_CASES = textwrap.dedent("""
    import json, os, shutil, sys, torch
    if sys.argv[1:] == ["save"]:
        exec(SAVE)
    import accelerate
    from transformers import AutoModelForCausalLM

    root = os.getcwd()
    cases = {
        "llama_auto_disk_rel": ("llama", dict(device_map="auto", max_memory={"cpu": "200KB"}, offload_folder="off")),
        "llama_auto_disk_abs": (os.path.join(root, "llama"),
                                dict(device_map="auto", max_memory={"cpu": "200KB"},
                                     offload_folder=os.path.join(root, "off"))),
        "llama_sequential_rel": ("llama", dict(device_map="sequential", max_memory={"cpu": "150KB"},
                                               offload_folder="off")),
        "llama_dict_rel": ("llama", dict(device_map={"model.embed_tokens": "cpu", "model.layers.0": "disk",
                                                     "model.layers.1": "cpu", "model.norm": "disk",
                                                     "model.rotary_emb": "cpu", "lm_head": "disk"},
                                         offload_folder="off")),
        "gpt2_auto_disk_rel": ("gpt2", dict(device_map="auto", max_memory={"cpu": "120KB"}, offload_folder="off")),
        "gpt2_dict_abs": (os.path.join(root, "gpt2"),
                          dict(device_map={"transformer.wte": "cpu", "transformer.wpe": "disk",
                                           "transformer.h": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"},
                               offload_folder=os.path.join(root, "off"))),
    }
    ids = torch.tensor([[1, 5, 9, 200, 3, 17]])
    out = {"impl": accelerate.__file__}
    for name, (folder, kwargs) in cases.items():
        shutil.rmtree("off", ignore_errors=True)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
            with torch.no_grad():
                logits = model(ids).logits
            written = sorted(os.listdir("off")) if os.path.isdir("off") else []
            out[name] = {"map": {k: str(v) for k, v in model.hf_device_map.items()},
                         "logits": logits.flatten().tolist(), "offload_files": written}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out))
""").replace("SAVE", repr(_SAVE))


def _run(code: str, cwd: Path, shim: bool, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("PYTHONPATH", None)
    if shim:
        from accel.shim import PATH

        env["PYTHONPATH"] = PATH
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _has_real_accelerate() -> bool:
    from accel.shim import real_accelerate_dir

    return real_accelerate_dir() is not None


@pytest.mark.skipif(not _has_real_accelerate(), reason="the reference is the real Accelerate, not installed here")
def test_from_pretrained_device_maps_match_real_accelerate(tmp_path):
    real = json.loads(_run(_CASES, tmp_path, False, "save").strip().splitlines()[-1])  # saves the models first
    assert len(list((tmp_path / "llama").glob("*.safetensors"))) > 2
    ours = json.loads(_run(_CASES, tmp_path, shim=True).strip().splitlines()[-1])
    assert "accel" in ours.pop("impl") and "site-packages" in real.pop("impl")
    assert set(real) == set(ours)
    for case, expected in real.items():
        assert "error" not in expected, (case, expected)
        got = ours[case]
        assert "error" not in got, (case, got["error"])
        assert got["map"] == expected["map"], case
        assert got["logits"] == expected["logits"], case
        assert got["offload_files"] == expected["offload_files"], case
    disk_cases = [c for c, r in real.items() if "disk" in r["map"].values()]
    assert len(disk_cases) == len(real), disk_cases  # the comparison covers disk offload, not only CPU placement
