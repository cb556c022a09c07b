"""`accel estimate-memory --ep_size`: expert parameters count 1/ep per rank, whole (DDP and FSDP2 leave them to
expert parallelism); the rest as before."""

from __future__ import annotations

import pytest

from accel.planning.estimate import EstimateError, ModelSpec, Param, spec_from_module, training

STATE = 4  # float32 bytes


def spec() -> ModelSpec:
    return ModelSpec("moe", [Param("embed.weight", (100, 8), 4, None),
                             Param("layers.0.mlp.experts.gate_up_proj", (4, 16, 8), 4, "layers.0"),
                             Param("layers.0.mlp.experts.down_proj", (4, 8, 8), 4, "layers.0")])


def test_experts_are_divided_by_ep():
    moe = spec()
    for p in moe.params[1:]:
        p.expert = True
    experts = 4 * 16 * 8 + 4 * 8 * 8
    whole = training(moe, num_processes=4)["layouts"]
    ep2 = training(moe, num_processes=4, ep=2)
    assert ep2["ep_size"] == 2
    assert ep2["layouts"]["ddp"]["params_bytes"] == whole["ddp"]["params_bytes"] - experts // 2 * STATE
    # ZeRO-3: the embedding sharded over dp 4, the stacked experts 1/2 per ep rank, sharded again over their 2
    # replicas (1/4)
    assert ep2["layouts"]["zero3"]["params_bytes"] == (800 // 4 + experts // 4) * STATE


def test_ep_must_divide_the_data_parallel_degree():
    with pytest.raises(EstimateError, match="--ep_size 3: does not divide the data-parallel degree 4"):
        training(spec(), num_processes=4, ep=3)


def test_mixtral_experts_are_recognised():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128)
    names = {p.name for p in spec_from_module(MixtralForCausalLM(config)).params if p.expert}
    assert names == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}


def own_modulelist() -> ModelSpec:
    """A ModuleList of 4 experts, each two [16, 8] / [8, 16] matrices (2-D: not stacked)."""
    params = [Param("embed.weight", (100, 8), 4, None)]
    for j in range(4):
        params += [Param(f"layers.0.mlp.experts.{j}.up.weight", (16, 8), 4, "layers.0"),
                   Param(f"layers.0.mlp.experts.{j}.down.weight", (8, 16), 4, "layers.0")]
    for p in params[1:]:
        p.expert = True
    return ModelSpec("own", params)


def test_modulelist_experts_are_resharded_under_zero3():
    """each ModuleList expert is an FSDP2 unit over its dp / ep replicas (before: whole on its ep rank)."""
    ep2 = training(own_modulelist(), num_processes=4, ep=2)["layouts"]
    experts = 4 * (16 * 8 + 8 * 16)
    assert ep2["zero3"]["params_bytes"] == (800 // 4 + experts // 4) * STATE
    assert ep2["ddp"]["params_bytes"] == (800 + experts // 2) * STATE


def test_sequence_ranks_are_expert_replicas():
    """dp 2 x sp 2 x ep 2 on 4 processes: the experts 1/2 per ep rank, sharded again over their 2 replicas (the
    sequence ranks) under ZeRO-3; the embedding over dp x sp = 4."""
    moe = spec()
    for p in moe.params[1:]:
        p.expert = True
    experts = 4 * 16 * 8 + 4 * 8 * 8
    result = training(moe, num_processes=4, sp=2, ep=2)
    assert result["ep_size"] == 2 and result["sp_size"] == 2
    assert result["layouts"]["zero3"]["params_bytes"] == (800 // 4 + experts // 4) * STATE


def test_zero1_shards_the_optimizer_over_the_expert_replicas():
    """ZeRO-1 x ep 2 on 4 processes: ZeroRedundancyOptimizer over the 2 ranks holding the same experts, the
    embedding (800) and this rank's experts (2 tensors of 256 and 128): the greedy partition's largest share."""
    moe = spec()
    for p in moe.params[1:]:
        p.expert = True
    zero1 = training(moe, num_processes=4, ep=2)["layouts"]["zero1"]
    experts = 4 * 16 * 8 + 4 * 8 * 8
    assert zero1["params_bytes"] == (800 + experts // 2) * STATE
    assert zero1["optimizer_bytes"] == (2 * 800 + 1) * STATE  # rank 0: the embedding's moments and step


def test_pipeline_stages_hold_their_layers_experts():
    """pp 2 x ep 2 on 4 processes (dp 2): each stage holds its layer's experts, 1/ep of them per rank; the fullest
    stage (the first: the embedding too) is reported."""
    params = [Param("embed.weight", (100, 8), 4, None)]
    for b in range(2):
        params += [Param(f"layers.{b}.mlp.experts.gate_up_proj", (4, 16, 8), 4, f"layers.{b}"),
                   Param(f"layers.{b}.mlp.experts.down_proj", (4, 8, 8), 4, f"layers.{b}")]
    for p in params[1:]:
        p.expert = True
    layer = 4 * 16 * 8 + 4 * 8 * 8
    result = training(ModelSpec("moe2", params), num_processes=4, pp=2, ep=2)
    assert result["ep_size"] == 2 and result["pp_size"] == 2 and result["dp_size"] == 2
    assert result["layouts"]["ddp"]["params_bytes"] == (800 + layer // 2) * STATE
