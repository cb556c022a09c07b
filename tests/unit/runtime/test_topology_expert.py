"""Expert parallelism's config: the ep_size field, its one-line refusals, and the topology's ep/edp layout (pure
arithmetic: no process group)."""

from __future__ import annotations

import pytest

from accel.backends import BackendNotAvailable, check_available
from accel.config.errors import ConfigError
from accel.config.schema import ParallelismConfig
from accel.runtime.topology import Topology


def test_ep_ranks_are_data_parallel_neighbours():
    topology = Topology.for_config(8, ParallelismConfig(ep_size=2))
    assert topology.sizes["ep"] == 2 and topology.sizes["edp"] == 4 and topology.dp_size == 8
    coords = [topology.coordinates(r) for r in range(8)]
    assert [c["ep"] for c in coords] == [0, 1] * 4
    assert [c["edp"] for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_ep_must_divide_the_data_parallel_degree():
    with pytest.raises(ConfigError, match=r"parallelism.ep_size=3 .* data-parallel degree 4.*allowed: 1, 2, 4"):
        Topology.for_config(4, ParallelismConfig(ep_size=3))


def test_ep_size_defaults_to_one_and_is_named_in_features():
    assert ParallelismConfig().ep_size == 1
    assert "expert parallelism (ep_size=2)" in ParallelismConfig(ep_size=2).requested_features()
    assert "ep" not in Topology.for_config(2, ParallelismConfig()).sizes


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_with_experts_are_refused_naming_both(schedule):
    with pytest.raises(BackendNotAvailable, match=rf"ep_size=2\) with pp_schedule {schedule} .*allowed: pp_schedule"):
        check_available(ParallelismConfig(ep_size=2, pp_size=2, pp_schedule=schedule))


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B"])
def test_pipeline_with_experts_composes(schedule):
    """was refused (BackendNotAvailable naming ep and pp)."""
    check_available(ParallelismConfig(ep_size=2, pp_size=2, pp_schedule=schedule))
    check_available(ParallelismConfig(ep_size=2, pp_size=2, pp_schedule=schedule, zero_stage=3))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ddp_zero_and_tp_compose(stage):
    check_available(ParallelismConfig(ep_size=2, zero_stage=stage))
    if stage != 1:
        check_available(ParallelismConfig(ep_size=2, zero_stage=stage, tp_size=2))
    check_available(ParallelismConfig(ep_size=2, zero_stage=3, offload_params=True, offload_optimizer=True))


@pytest.mark.parametrize("fields", [{"sp_size": 2}, {"cp_size": 2}, {"sp_size": 2, "zero_stage": 3},
                                    {"dp_replicate_size": 2, "dp_shard_size": 2, "zero_stage": 3}])
def test_sequence_and_hsdp_compose(fields):
    """these were refused before (BackendNotAvailable naming ep and the other dimension)."""
    check_available(ParallelismConfig(ep_size=2, **fields))


def test_sequence_ranks_are_replicas_of_their_experts():
    """With sp/cp, a dp rank's sequence ranks hold the same experts: edp spans (dp / ep) x seq and expert gradients
    are divided by dp x seq; the ep group is the dp ranks with the same sequence coordinate."""
    topology = Topology.for_config(8, ParallelismConfig(ep_size=2, sp_size=2))
    assert topology.dp_size == 4 and topology.sizes["edp"] == 4 and topology.expert_divisor == 8
    coords = [topology.coordinates(r) for r in range(8)]  # rank = dp x 2 + sp
    assert [c["ep"] for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [c["edp"] for c in coords] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_hsdp_replicas_span_replicate_and_shard():
    topology = Topology.for_config(8, ParallelismConfig(ep_size=2, dp_replicate_size=2, dp_shard_size=4,
                                                        zero_stage=3))
    coords = [topology.coordinates(r) for r in range(8)]
    assert [c["ep"] for c in coords] == [0, 1] * 4 and [c["edp"] for c in coords] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert topology.expert_divisor == 8


def test_launch_flag_sets_the_field_and_is_checked_before_launch(tmp_path, monkeypatch):
    from accel.backends.launchable import check_launchable
    from accel.cli import launch
    from accel.cli.main import build_parser

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    args = build_parser().parse_args(["launch", "--cpu", "--num_processes", "4", "--ep_size", "2", "train.py"])
    assert launch.flag_overrides(args)["parallelism"] == {"ep_size": 2}
    cfg = launch.resolve_launch_config(args.config_file, launch.flag_overrides(args))
    assert cfg.parallelism.ep_size == 2
    cfg.parallelism.ep_size = 3
    with pytest.raises(ConfigError, match=r"parallelism.ep_size=3 does not divide the data-parallel degree 4"):
        check_launchable(cfg)


def _mixtral(experts: int = 4):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                                            num_experts_per_tok=2, vocab_size=128))


def test_experts_must_divide_by_ep_named_with_the_layer():
    from accel.parallel.expert import shard_experts

    with pytest.raises(ConfigError, match=r"ep_size=3: model.layers.0.mlp.experts has 4 experts, not divisible by 3"):
        shard_experts(_mixtral(), 3, 0, None)


def test_a_model_without_moe_layers_is_refused():
    import torch

    from accel.parallel.expert import shard_experts

    with pytest.raises(ConfigError, match="no MoE layer accel recognises"):
        shard_experts(torch.nn.Linear(2, 2), 2, 0, None)
