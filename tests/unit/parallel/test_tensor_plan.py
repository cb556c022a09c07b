"""Tensor-parallel plans: automatic detection, wildcards, model plans, and the errors (no processes needed)."""

import pytest
import torch

from accel.parallel.tensor import automatic_plan, check_divisible, expand_plan, model_plan
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
    unfed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    assert automatic_plan(unfed) == {}
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

        def __init__(self, dense=True):
            super().__init__()
            self.config = Config()
            layer = torch.nn.Module()
            layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
            layer.self_attn.q_proj = torch.nn.Linear(4, 4)
            if dense:
                layer.mlp.down_proj = torch.nn.Linear(4, 4)
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([layer])
            self.lm_head = torch.nn.Linear(4, 8)

    assert model_plan(CausalLM()) == {"model.layers.*.self_attn.q_proj": "colwise",
                                      "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_rep"}
    # an entry of the model's own plan that matches none of its modules (a dense MLP's, in a model whose layers are
    # all MoE) is left out, not an error: the user cannot change that plan
    assert model_plan(CausalLM(dense=False)) == {"model.layers.*.self_attn.q_proj": "colwise", "lm_head": "colwise_rep"}


def test_moe_experts_are_one_entry():
    """Mixtral's own plan splits its stacked experts with three entries (two for the parameters, one for the
    module); accel's `experts` style takes them as one. The automatic plan finds the stacked experts too."""
    from types import SimpleNamespace

    from accel.parallel.tensor import plan_for

    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, num_local_experts=4, vocab_size=32)
    model = transformers.MixtralForCausalLM(config)
    plan = model_plan(model)
    assert plan["model.layers.*.mlp.experts"] == "experts"
    assert not any(key.startswith("model.layers.*.mlp.experts.") for key in plan)
    assert automatic_plan(model)["model.layers.0.mlp.experts"] == "experts"
    with pytest.raises(ConfigError, match="experts 'model.layers.0.mlp.experts' have intermediate size 8, not "
                                          "divisible by tp_size=3"):
        plan_for(model, SimpleNamespace(tp_plan={"model.layers.*.mlp.experts": "experts"}), 3, False)
    with pytest.raises(ConfigError, match="'model.layers.0.mlp.gate' \\(experts, from parallelism.tp_plan\\) is not "
                                          "a MoE layer's stacked experts"):
        plan_for(model, SimpleNamespace(tp_plan={"model.layers.*.mlp.gate": "experts"}), 2, False)


# -- real model shapes: transformers' Conv1D, GPT-2's fused q/k/v, tied weights ------------------------------

def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=32, n_positions=8)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_blocks_are_split_and_the_tie_kept():
    from accel.parallel.tensor_plan import keep_ties, kept_whole

    model = _tiny_gpt2()
    plan = automatic_plan(model)
    assert plan["transformer.h.0.attn.c_attn"] == "fused_qkv"  # whole heads of q, k and v per rank
    assert plan["transformer.h.0.attn.c_proj"] == "rowwise" and plan["transformer.h.1.mlp.c_fc"] == "colwise"
    assert plan["transformer.wte"] == "rowwise_rep" and plan["lm_head"] == "colwise_rep"  # both split by vocabulary
    assert keep_ties(model, plan) == (plan, {})
    check_divisible(model, plan, 4)
    with pytest.raises(ConfigError, match="'transformer.h.0.attn.c_attn' \\(fused_qkv\\) has 4 heads, not divisible"):
        check_divisible(model, plan, 8)
    whole = kept_whole(model, plan)
    assert whole["transformer.h.*.ln_1"] == "LayerNorm: a norm, replicated" and "transformer.wpe" in whole
    assert "lm_head" not in whole  # its weight is the (split) embedding's


def test_a_tie_is_completed_or_refused_with_both_names():
    from accel.parallel.tensor_plan import keep_ties

    model = _tiny_gpt2()
    plan, added = keep_ties(model, {"lm_head": "colwise_rep"})  # a model plan that names only the head
    assert plan["transformer.wte"] == "rowwise_rep" and added == {"transformer.wte": "lm_head.weight"}
    with pytest.raises(ConfigError, match="tied weights 'transformer.wte.weight' \\(split by 'colwise'\\) and "
                                          "'lm_head.weight' \\(split by 'colwise_rep'\\) cannot stay one parameter"):
        keep_ties(model, {"transformer.wte": "colwise", "lm_head": "colwise_rep"})  # embedding dim vs vocabulary


def test_unrecognised_attention_keeps_its_output_projection_whole():
    """A row-wise layer needs a split input: with no recognised column-wise sibling it stays whole."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.o_proj = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    assert automatic_plan(Attention()) == {}


def test_fused_order_round_trips():
    from accel.parallel import fused

    order = fused.permutation(12, 3, 2)  # q, k, v of 4 features each; rank 0 gets q0 q1 k0 k1 v0 v1
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    weight = torch.arange(24.0).reshape(2, 12)
    module = torch.nn.Module()
    fused.mark(module, 3, 2, {"weight": 1, "bias": 0})
    state = fused.to_model_order({"weight": weight[:, order], "bias": torch.arange(12.0)[order]}, module)
    assert torch.equal(state["weight"], weight) and torch.equal(state["bias"], torch.arange(12.0))
    assert fused.layouts(module) == {"weight": "fused 3 parts, reordered for tp_size=2",
                                     "bias": "fused 3 parts, reordered for tp_size=2"}


# -- wrapped models: PEFT, torch.compile, DataParallel; LoRA layers; where a bad entry came from ---------------

def _tiny_llama(**lora):
    """A tiny transformers Llama (its own base_model_tp_plan), LoRA-wrapped by peft when `lora` is given."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=32)
    model = transformers.LlamaForCausalLM(config)
    if not lora:
        return model
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=2, **lora))


def test_a_plan_for_the_bare_model_matches_through_wrapper_prefixes():
    from accel.parallel.tensor_plan import wrapper_prefix

    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    lora = _tiny_llama(target_modules=["q_proj", "o_proj"])
    assert wrapper_prefix(lora)[0] == "base_model.model."
    assert expand_plan(lora, plan) == {f"base_model.model.model.layers.{i}.self_attn.{p}": s
                                       for p, s in (("q_proj", "colwise"), ("o_proj", "rowwise")) for i in (0, 1)}
    # the full (wrapped) name works too, and a pattern that reaches inside a LoRA layer means the LoRA layer
    assert expand_plan(lora, {"base_model.model.model.layers.0.self_attn.q_proj.base_layer": "colwise"}) == {
        "base_model.model.model.layers.0.self_attn.q_proj": "colwise"}
    bare = _tiny_llama()
    for wrapped, prefix in ((torch.compile(bare), "_orig_mod."), (torch.nn.DataParallel(bare), "module.")):
        assert wrapper_prefix(wrapped) == (prefix, bare)
        assert sorted(expand_plan(wrapped, plan)) == sorted(f"{prefix}{k}" for k in expand_plan(bare, plan))
    # the model's own plan is read from the model inside the wrappers, in its own names
    assert model_plan(lora) == model_plan(bare) and "model.layers.*.self_attn.q_proj" in model_plan(lora)


def test_lora_layers_are_planned_as_the_layers_they_wrap_and_split_with_their_adapters():
    from accel.parallel.tensor_plan import kept_whole, torch_pieces

    lora = _tiny_llama(target_modules=["q_proj", "o_proj", "lm_head"])
    plan = automatic_plan(lora)
    attn = "base_model.model.model.layers.0.self_attn"
    assert plan[f"{attn}.q_proj"] == "colwise" and plan[f"{attn}.o_proj"] == "rowwise"
    assert plan["base_model.model.lm_head"] == "colwise_rep" and f"{attn}.q_proj.base_layer" not in plan
    check_divisible(lora, plan, 2)
    modules = dict(lora.named_modules())
    # column-wise: lora_B by its outputs (lora_A whole); row-wise: lora_A by its inputs (lora_B whole)
    assert torch_pieces(f"{attn}.q_proj", modules[f"{attn}.q_proj"], "colwise") == [
        (f"{attn}.q_proj.base_layer", "colwise"), (f"{attn}.q_proj.lora_B.default", "colwise")]
    assert torch_pieces(f"{attn}.o_proj", modules[f"{attn}.o_proj"], "rowwise") == [
        (f"{attn}.o_proj.base_layer", "rowwise"), (f"{attn}.o_proj.lora_A.default", "rowwise")]
    assert not any("lora" in k or "base_layer" in k for k in kept_whole(lora, plan))  # go with their layer


def test_a_lora_layer_accel_cannot_split_is_kept_whole_or_refused():
    from accel.parallel.tensor_plan import check_peft_layers

    lora = _tiny_llama(target_modules=["embed_tokens", "q_proj"])
    embed = "base_model.model.model.embed_tokens"
    plan, whole = check_peft_layers(lora, {embed: "rowwise_rep"})  # whole input and output: keeping it whole is exact
    assert plan == {} and "accel splits LoRA only around a Linear/Conv1D" in whole[embed]
    with pytest.raises(ConfigError, match=f"layer '{embed}' \\(colwise, from parallelism.tp_plan\\) is peft "
                                          "Embedding .*which accel cannot split; allowed: plain LoRA"):
        check_peft_layers(lora, {embed: "colwise"})


def test_plan_errors_name_where_the_plan_came_from():
    from types import SimpleNamespace

    from accel.parallel.tensor import plan_for

    lora = _tiny_llama(target_modules=["q_proj"])
    with pytest.raises(ConfigError, match="^parallelism.tp_plan: 'model.layers.*.self_attn.qq_proj' matches no "
                                          "module of the model; allowed: the name of a module as the bare "
                                          "LlamaForCausalLM names it \\(or with the wrappers' prefix "
                                          "'base_model.model.'\\), '\\*' matching any part; closest: "
                                          "'model.layers.\\*.self_attn.q_proj'"):
        plan_for(lora, SimpleNamespace(tp_plan={"model.layers.*.self_attn.qq_proj": "colwise"}), 2, False)
    with pytest.raises(ConfigError, match="^parallelism.tp_plan: 'model.norm': bad style 'diagonal'"):
        plan_for(lora, SimpleNamespace(tp_plan={"model.norm": "diagonal"}), 2, False)

    bare = _tiny_llama()
    bare.config.base_model_tp_plan = {**bare.config.base_model_tp_plan, "layers.*.mlp.nope": "colwise"}
    assert "model.layers.*.mlp.nope" not in str(plan_for(bare, SimpleNamespace(tp_plan=None), 2, False))
    bare.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "colwise"}
    with pytest.raises(ConfigError, match="has out_features=32, not divisible by tp_size=3 \\(allowed: a tp_size "
                                          "dividing 32; the entry is from the model's own plan \\(LlamaConfig"):
        plan_for(bare, SimpleNamespace(tp_plan=None), 3, False)
    with pytest.raises(ConfigError, match="the entry is from accel's built-in plan for Net\\)"):
        plan_for(Net(), SimpleNamespace(tp_plan=None), 3, False)


def test_a_bad_style_in_a_scripts_parallelism_config_is_refused_when_the_accelerator_is_built():
    """A plan given in the script (not the config file, which the pre-launch check reads) is refused by
    Accelerator(), on every rank alike, in one line, before prepare() meets the model."""
    from accel import Accelerator, ParallelismConfig
    from accel.config import ConfigError

    with pytest.raises(ConfigError, match=r"parallelism.tp_plan: '0': bad style 'diagonal'; allowed: colwise"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_plan={"0": "diagonal"}))
