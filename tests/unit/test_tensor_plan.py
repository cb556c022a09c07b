"""Tensor-parallel plans: automatic detection, wildcards, model plans, and the errors (no processes needed)."""

import pytest
import torch

from accel.backends.tensor import automatic_plan, check_divisible, expand_plan, model_plan
from accel.config import ConfigError


class Attention(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.o_proj = torch.nn.Linear(dim, dim)


class Block(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.attn = Attention(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(2))


def test_automatic_plan_finds_attention_and_mlp_pairs():
    plan = automatic_plan(Net())
    assert plan["layers.0.attn.q_proj"] == "colwise" and plan["layers.1.attn.v_proj"] == "colwise"
    assert plan["layers.0.attn.o_proj"] == "rowwise"
    assert plan["layers.0.mlp.0"] == "colwise" and plan["layers.0.mlp.2"] == "rowwise"
    assert automatic_plan(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))) == {}
    lm = torch.nn.Module()
    lm.embed_tokens, lm.lm_head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10)
    assert automatic_plan(lm) == {"embed_tokens": "rowwise_rep", "lm_head": "colwise_rep"}


def test_wildcards_expand_and_bad_entries_are_named():
    plan = expand_plan(Net(), {"layers.*.mlp.0": "colwise", "layers.*.mlp.2": "rowwise"})
    assert plan == {"layers.0.mlp.0": "colwise", "layers.1.mlp.0": "colwise",
                    "layers.0.mlp.2": "rowwise", "layers.1.mlp.2": "rowwise"}
    with pytest.raises(ConfigError, match="'layers.*.nope' matches no module"):
        expand_plan(Net(), {"layers.*.nope": "colwise"})
    with pytest.raises(ConfigError, match="bad style 'diagonal'; allowed: colwise, rowwise"):
        expand_plan(Net(), {"layers.0.mlp.0": "diagonal"})


def test_indivisible_layer_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    check_divisible(model, {"0": "colwise", "2": "rowwise"}, 2)
    with pytest.raises(ConfigError, match="layer '0' \\(colwise\\) has out_features=6, not divisible by tp_size=4"):
        check_divisible(model, {"0": "colwise"}, 4)


def test_model_plan_from_a_transformers_style_config():
    class Config:
        base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}

    class CausalLM(torch.nn.Module):
        base_model_prefix = "model"
        _tp_plan = {"lm_head": "colwise_rep"}

        def __init__(self):
            super().__init__()
            self.config = Config()
            self.model = torch.nn.Module()
            self.lm_head = torch.nn.Linear(4, 8)

    assert model_plan(CausalLM()) == {"model.layers.*.self_attn.q_proj": "colwise",
                                      "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_rep"}
