"""mixed_precision fp8 at config time and in one process: refused in one line without torchao (naming the extra),
Accelerate's `fp8_config` (AO accepted; TE/MS-AMP refused) and `AORecipeKwargs` (its layer filter is used). The
backends (DDP, ZeRO-3, TP 2, PP 2) are checked against a bf16 run in tests/multiproc/parallelism/test_fp8.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from accel import Accelerator
from accel.config import ConfigError, resolve_config
from accel.utils import AORecipeKwargs


def test_fp8_without_torchao_is_refused_at_config_time(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("mixed_precision: fp8\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        resolve_config(config)
    message = str(info.value)
    assert "key 'mixed_precision': fp8 needs torchao" in message and "pip install 'accel-train[fp8]'" in message
    assert "\n" not in message


def test_accelerates_fp8_config_section(tmp_path):
    pytest.importorskip("torchao")
    config = tmp_path / "c.yaml"
    config.write_text("mixed_precision: fp8\nfp8_config:\n  backend: AO\n  fp8_format: HYBRID\n")
    assert resolve_config(config).mixed_precision == "fp8"
    config.write_text("mixed_precision: fp8\nfp8_config:\n  backend: TE\n")
    with pytest.raises(ConfigError, match=r"key 'fp8_config.backend': 'TE' is not supported by accel; allowed: AO"):
        resolve_config(config)
    config.write_text("fp8_config:\n  backend: AO\n  amax_hist: 3\n")
    with pytest.raises(ConfigError, match="fp8_config.amax_hist"):
        resolve_config(config)


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        vocab_size=128, max_position_embeddings=16, use_cache=False))


def test_recipe_kwargs_choose_the_layers_and_the_config():
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig

    only_mlp = AORecipeKwargs(config=Float8LinearConfig(emulate=True, pad_inner_dim=True),
                              module_filter_func=lambda module, name: "mlp" in name)
    accelerator = Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[only_mlp])
    model = accelerator.prepare(_llama())
    converted = {n: m for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert sorted(converted) == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj",
                                 "model.layers.0.mlp.up_proj"]
    assert all(m.config.pad_inner_dim for m in converted.values())  # the user's config, as given
    tokens = torch.randint(0, 128, (2, 8))
    loss = model(input_ids=tokens, labels=tokens).loss
    accelerator.backward(loss)
    assert torch.isfinite(loss) and model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_a_model_with_no_qualifying_layer_is_warned_about():
    """GPT-2's projections are transformers' Conv1D, not nn.Linear; its only Linear is the head (the last one)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                                                 n_positions=16))
    accelerator = Accelerator(cpu=True, mixed_precision="fp8")
    with pytest.warns(UserWarning, match="no layer of GPT2LMHeadModel qualifies for float8.*it trains in bf16"):
        accelerator.prepare(model)
