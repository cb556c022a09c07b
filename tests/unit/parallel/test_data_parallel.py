"""The data-parallel kind, decided once from the config and the topology (accel/parallel/data_parallel.py), and the
parts a topology asks for (accel/parallel/parts.py), in one process without a process group."""

from types import SimpleNamespace

import pytest

from accel.config import ParallelismConfig
from accel.parallel.data_parallel import DataParallelPlan
from accel.parallel.parts import build_parts
from accel.runtime.topology import Topology


@pytest.mark.parametrize("world,fields,kind", [
    (1, {}, "none"), (1, {"zero_stage": 3}, "none"), (4, {}, "ddp"), (4, {"zero_stage": 1}, "zero1"),
    (4, {"zero_stage": 2}, "fsdp"), (4, {"tp_size": 2}, "fsdp"), (2, {"sp_size": 2}, "ddp"),
    (4, {"dp_replicate_size": 2, "dp_shard_size": 2}, "hsdp"), (8, {"dp_replicate_size": 2, "tp_size": 2}, "hsdp"),
])
def test_kind(world, fields, kind):
    par = ParallelismConfig(**fields)
    assert DataParallelPlan.decide(par, Topology.for_config(world, par)).kind == kind


def test_offload_and_resharding_follow_the_kind():
    par = ParallelismConfig(zero_stage=3, offload_params=True)
    plan = DataParallelPlan.decide(par, Topology.for_config(2, par))
    assert (plan.fsdp, plan.offload, plan.reshard_after_forward, plan.zero, plan.replicated) == (
        True, True, True, True, False)
    alone = DataParallelPlan.decide(par, Topology.for_config(1, par))
    assert (alone.kind, alone.offload, alone.zero) == ("none", False, True)


def test_fault_tolerance_decides_ddp_or_fsdp_inside_the_group():
    par = ParallelismConfig(zero_stage=2)
    ft = SimpleNamespace(enabled=True, semi_sync_method=None)
    assert DataParallelPlan.decide(par, Topology.for_config(2, par), ft).kind == "fsdp"
    assert DataParallelPlan.decide(par, Topology.for_config(1, par), ft).kind == "ddp"
    semi = SimpleNamespace(enabled=True, semi_sync_method="diloco")
    assert DataParallelPlan.decide(par, Topology.for_config(2, par), semi).kind == "ddp"


@pytest.mark.parametrize("world,fields,names", [
    (4, {}, []), (4, {"tp_size": 2}, ["tensor"]), (4, {"cp_size": 2, "ep_size": 2}, ["sequence", "expert"]),
    (8, {"tp_size": 2, "sp_size": 2, "ep_size": 2}, ["tensor", "sequence", "expert"]),
])
def test_parts_follow_the_topology_in_order(world, fields, names):
    par = ParallelismConfig(**fields)
    topology = Topology.for_config(world, par)
    parts = build_parts(topology, SimpleNamespace(), par, DataParallelPlan.decide(par, topology))
    assert [part.name for part in parts] == names
