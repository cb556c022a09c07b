"""ParallelismConfig takes Accelerate's fields (dp_replicate_size, dp_shard_size, tp_size, cp_size, ...): its
read-only members equal real Accelerate's for the same fields (exact: they are sizes and names), the sizes map
onto accel's own (dp_shard_size > 1: FSDP2, zero_stage 3 unless given; both > 1: HSDP), contradictions and
context/sequence parallelism are one-line errors, config files take the same keys with the same rules, and the
Topology lays out and names the mesh as Accelerate does (checked on a fake 8-process group)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from accel import Accelerator
from accel.backends import backend_name_for
from accel.parallel.data_parallel import DataParallelPlan
from accel.config import ConfigError, ParallelismConfig, resolve_config
from accel.config.schema import data_parallel_sizes
from accel.runtime.topology import Topology

ACCELERATE_CASES = [{}, {"dp_shard_size": 4}, {"dp_replicate_size": 4}, {"dp_replicate_size": 2, "dp_shard_size": 2},
                    {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, {"dp_shard_size": 2, "tp_size": 2},
                    {"cp_size": 2}, {"dp_shard_size": 2, "cp_size": 2},
                    {"dp_shard_size": 2, "tp_size": 2, "cp_size": 2}, {"sp_size": 4}, {"dp_shard_size": 2, "sp_size": 2},
                    {"dp_shard_size": 2, "tp_size": 2, "sp_size": 2}]
MEMBERS = ["dp_dim_names", "non_dp_dim_names", "dp_shard_cp_dim_names", "dp_cp_dim_names", "fsdp_dim_names",
           "active_mesh_dims", "total_size", "non_data_parallel_size", "data_parallel_size", "dp_replicate_enabled",
           "dp_shard_enabled", "tp_enabled", "cp_enabled", "sp_enabled"]


def _run(code: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_members_equal_real_accelerates():
    """Accelerate's own class (a subprocess without the shim) and accel's, on the same fields."""
    pytest.importorskip("accelerate.parallelism_config")
    theirs = json.loads(_run(f"""
        import json
        from accelerate.parallelism_config import ParallelismConfig
        print(json.dumps([{{m: getattr(ParallelismConfig(**case), m) for m in {MEMBERS!r}}} for case in {ACCELERATE_CASES!r}]))
    """))
    ours = [{m: getattr(ParallelismConfig(**case), m) for m in MEMBERS} for case in ACCELERATE_CASES]
    assert ours == theirs


def test_accelerate_module_path_through_the_shim():
    from accel.shim import PATH

    assert _run("""
        import accel
        from accelerate.parallelism_config import ParallelismConfig
        assert ParallelismConfig is accel.ParallelismConfig
        print(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_handler=object()).zero_stage)
    """, env={"PYTHONPATH": PATH, "PATH": ""}) == "3"


def test_sizes_map_onto_accels_fields():
    hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    assert (hsdp.zero_stage, backend_name_for(hsdp)) == (3, "zero")  # sharding: FSDP2's full sharding
    assert ParallelismConfig(dp_shard_size=2, zero_stage=2).zero_stage == 2  # parameters kept between fwd and bwd
    assert ParallelismConfig(dp_replicate_size=2).zero_stage == 0  # DDP
    assert ParallelismConfig(dp_replicate_size=2, dp_shard_size=1, zero_stage=1).zero_stage == 1  # DDP + ZeRO-1
    assert ParallelismConfig(dp_shard_size=2, tp_size=2, zero_stage=0).zero_stage == 0  # TP's dp is FSDP2 anyway
    legacy = ParallelismConfig()
    assert (legacy.zero_stage, legacy.dp_replicate_size, legacy.dp_shard_size) == (0, None, None)
    # Accelerate's None sizes and handlers: accepted; handlers are kept, not config keys
    plain = ParallelismConfig(tp_size=None, cp_size=None, sp_size=None, cp_handler="cp", tp_handler="tp")
    assert (plain.tp_size, plain.cp_size, plain.sp_size, plain.cp_handler, plain.tp_handler) == (1, 1, 1, "cp", "tp")


@pytest.mark.parametrize("fields,needle", [
    ({"cp_comm_strategy": "ringish"}, "key 'cp_comm_strategy': bad value 'ringish'; allowed: one of allgather, ring"),
    ({"sp_backend": "ulysses"}, "key 'sp_backend': bad value 'ulysses'; allowed: one of deepspeed"),
    ({"dp_shard_size": 2, "zero_stage": 0}, "dp_shard_size=2 (FSDP2) shards the model, which contradicts zero_stage=0"),
    ({"dp_replicate_size": 2, "dp_shard_size": 2, "zero_stage": 1},
     "dp_shard_size=2 (with dp_replicate_size=2: HSDP) shards the model, which contradicts zero_stage=1"),
    ({"dp_replicate_size": 2, "dp_shard_size": 1, "zero_stage": 3},
     "zero_stage=3 shards over dp_shard_size, which is 1"),
    ({"dp_replicate_size": 2, "dp_shard_size": 1, "tp_size": 2}, "tp_size=2 with dp_replicate_size=2 and dp_shard_size 1"),
    ({"dp_shard_size": 0}, "key 'dp_shard_size': bad value 0; allowed: an integer >= 1 (or null)"),
    ({"cp_backend": "ring"}, "key 'cp_backend': bad value 'ring'; allowed: one of torch"),
])
def test_refusals_are_one_line(fields, needle):
    with pytest.raises(ConfigError) as info:
        ParallelismConfig(**fields)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_world_size_rules():
    """The sizes multiply with tp and pp to the world size; left out, they are derived."""
    assert data_parallel_sizes(ParallelismConfig(), 8) == (8, 1)  # DDP: Accelerate's dp_replicate = world
    assert data_parallel_sizes(ParallelismConfig(zero_stage=3), 8) == (1, 8)
    assert data_parallel_sizes(ParallelismConfig(dp_replicate_size=2, zero_stage=3), 8) == (2, 4)
    assert data_parallel_sizes(ParallelismConfig(dp_replicate_size=2, tp_size=2), 8) == (2, 2)
    assert data_parallel_sizes(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, pp_size=2), 8) == (2, 2)
    with pytest.raises(ConfigError, match=r"dp_replicate_size=2 x dp_shard_size=2 x tp_size=1 x pp_size=1 = 4, "
                                          r"but 8 processes run; allowed: sizes whose product is 8"):
        data_parallel_sizes(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), 8)
    with pytest.raises(ConfigError, match=r"dp_shard_size=1 \(left out: 1\) .* = 2, but 4 processes run"):
        data_parallel_sizes(ParallelismConfig(dp_replicate_size=2), 4)  # DDP: the shard size stays 1
    with pytest.raises(ConfigError, match="zero_stage=3 shards over dp_shard_size, which is 1"):
        data_parallel_sizes(ParallelismConfig(dp_replicate_size=4, zero_stage=3), 4)
    with pytest.raises(ConfigError, match="tp_size=2 x pp_size=1 = 2 does not divide the world size 3"):
        Topology.for_config(3, ParallelismConfig(dp_shard_size=2, tp_size=2))


def test_config_file_takes_the_same_keys_and_rules(tmp_path):
    def load(text: str):
        path = tmp_path / "cfg.yaml"
        path.write_text("use_cpu: true\nnum_processes: 4\nparallelism:\n" + textwrap.indent(text, "  "))
        return resolve_config(path), str(path)

    cfg, _ = load("dp_replicate_size: 2\ndp_shard_size: 2\n")  # zero_stage left out (the packaged 0 is no request)
    par = cfg.parallelism
    assert (par.zero_stage, par.dp_replicate_size, par.dp_shard_size) == (3, 2, 2)
    assert load("dp_replicate_size: 2\ndp_shard_size: 2\nzero_stage: 2\n")[0].parallelism.zero_stage == 2
    for text, needle in [("dp_shard_size: 4\ncp_size: 2\n", "x sp_size/cp_size=2 = 8, but 4 processes run"),
                         ("dp_replicate_size: 2\ndp_shard_size: 2\nzero_stage: 1\n", "contradicts zero_stage=1"),
                         ("dp_replicate_size: 4\ndp_shard_size: 2\n", "= 8, but 4 processes run"),
                         ("dp_shard_size: two\n", "key 'parallelism.dp_shard_size': bad value 'two'")]:
        with pytest.raises(ConfigError) as info:
            load(text)
        assert str(info.value).startswith(str(tmp_path / "cfg.yaml")) and needle in str(info.value), str(info.value)


# What `accelerate config` writes for FSDP2 with "use the parallelism config" (accelerate/commands/config/cluster.py)
ACCELERATE_FSDP2_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: {reshard}
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 4
parallelism_config:
{section}rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def accelerate_yaml(tmp_path, sizes: dict, reshard: str = "true", **extra) -> str:
    section = "".join(f"  parallelism_config_{key}: {value}\n" for key, value in {**sizes, **extra}.items())
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_FSDP2_YAML.format(reshard=reshard, section=section))
    return str(path)


def test_accelerates_parallelism_config_section_maps_every_size(tmp_path):
    hsdp = resolve_config(accelerate_yaml(tmp_path, {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 1,
                                                     "cp_size": 1}))
    par = hsdp.parallelism
    assert (par.zero_stage, par.dp_replicate_size, par.dp_shard_size, par.tp_size, par.cp_size) == (3, 2, 2, 1, 1)
    topo = Topology.for_config(4, par)
    assert (topo.dp_replicate_size, topo.dp_shard_size, topo.accelerate_names) == (2, 2, True)  # HSDP
    assert DataParallelPlan.decide(par, topo).kind == "hsdp" and par.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    # the same as accel's own keys
    same = tmp_path / "accel.yaml"
    same.write_text("use_cpu: true\nnum_processes: 4\nparallelism:\n  dp_replicate_size: 2\n  dp_shard_size: 2\n")
    assert resolve_config(same).parallelism == par
    # reshard_after_forward false: HSDP keeping the parameters between forward and backward (zero_stage 2)
    zero2 = resolve_config(accelerate_yaml(tmp_path, {"dp_replicate_size": 2, "dp_shard_size": 2}, reshard="false"))
    assert (zero2.parallelism.zero_stage, zero2.parallelism.dp_replicate_size) == (2, 2)
    # FSDP x TP, and a launch flag over the file
    fsdp_tp = resolve_config(accelerate_yaml(tmp_path, {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 2}))
    assert data_parallel_sizes(fsdp_tp.parallelism, 4) == (1, 2) and fsdp_tp.parallelism.tp_size == 2
    flagged = resolve_config(accelerate_yaml(tmp_path, {"dp_replicate_size": 2, "dp_shard_size": 2}),
                             {"parallelism": {"zero_stage": 2}})
    assert (flagged.parallelism.zero_stage, flagged.parallelism.dp_shard_size) == (2, 2)
    # every size 1 (`accelerate config`'s defaults) describes no layout: accel's fields decide (FSDP over all 4)
    ones = resolve_config(accelerate_yaml(tmp_path, {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1,
                                                     "cp_size": 1}))
    assert (ones.parallelism.dp_replicate_size, ones.parallelism.dp_shard_size) == (None, None)
    assert data_parallel_sizes(ones.parallelism, 4) == (1, 4)
    # the context/sequence-parallel options are accepted (unused while their sizes are 1)
    options = resolve_config(accelerate_yaml(tmp_path, {"dp_shard_size": 4}, cp_backend="torch",
                                             cp_comm_strategy="allgather", sp_backend="deepspeed", sp_size=1,
                                             sp_seq_length="null", sp_seq_length_is_variable="true",
                                             sp_attn_implementation="sdpa"))
    assert (options.parallelism.dp_shard_size, options.parallelism.cp_backend, options.parallelism.sp_backend) == (
        4, "torch", "deepspeed")


@pytest.mark.parametrize("sizes,needle", [
    ({"dp_shard_size": 2, "cp_size": 4}, "dp_replicate_size=1 x dp_shard_size=2 x tp_size=1 x pp_size=1 x "
                                         "sp_size/cp_size=4 = 8, but 4 processes run"),
    ({"dp_shard_size": 2, "cp_comm_strategy": "ring-ish"},
     "key 'parallelism_config.parallelism_config_cp_comm_strategy': bad value 'ring-ish'; allowed: one of allgather, "
     "ring, alltoall"),
    ({"dp_shard_size": 0}, "key 'parallelism_config.parallelism_config_dp_shard_size': bad value 0; allowed: an "
                           "integer >= 1"),
    ({"dp_replicate_size": "two"}, "key 'parallelism_config.parallelism_config_dp_replicate_size': bad value 'two'"),
    ({"cp_backend": "ring"}, "key 'parallelism_config.parallelism_config_cp_backend': bad value 'ring'; allowed: "
                             "one of torch"),
    ({"dp_shard_sizes": 2}, "unknown key 'parallelism_config.parallelism_config_dp_shard_sizes'; did you mean "
                            "'parallelism_config_dp_shard_size'?"),
    ({"dp_replicate_size": 4, "dp_shard_size": 2}, "dp_replicate_size=4 x dp_shard_size=2 x tp_size=1 x pp_size=1 "
                                                   "= 8, but 4 processes run"),
    ({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, "= 8, but 4 processes run"),
])
def test_accelerates_parallelism_config_section_refusals_name_the_file_and_key(tmp_path, sizes, needle):
    path = accelerate_yaml(tmp_path, sizes)
    with pytest.raises(ConfigError) as info:
        resolve_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and needle in message and "\n" not in message, message


def test_topology_coordinates_and_data_parallel_kind():
    """Row-major (pp, dp_replicate, dp_shard, tp); dp = replica x shards + shard, the flattened group's rank."""
    hsdp_tp = Topology.for_config(8, ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2))
    assert hsdp_tp.sizes == {"pp": 1, "dp": 4, "tp": 2, "dp_replicate": 2, "dp_shard": 2}
    assert [hsdp_tp.coordinates(r) for r in (0, 3, 5, 6)] == [
        {"pp": 0, "dp": 0, "tp": 0, "dp_replicate": 0, "dp_shard": 0},
        {"pp": 0, "dp": 1, "tp": 1, "dp_replicate": 0, "dp_shard": 1},
        {"pp": 0, "dp": 2, "tp": 1, "dp_replicate": 1, "dp_shard": 0},
        {"pp": 0, "dp": 3, "tp": 0, "dp_replicate": 1, "dp_shard": 1}]
    assert hsdp_tp.accelerate_names and DataParallelPlan.decide(ParallelismConfig(zero_stage=3), hsdp_tp).kind == "hsdp"
    ddp = Topology.for_config(4, ParallelismConfig())
    assert (ddp.dp_replicate_size, ddp.dp_shard_size, ddp.accelerate_names) == (4, 1, False)
    assert DataParallelPlan.decide(ParallelismConfig(), ddp).kind == "ddp"
    par = ParallelismConfig(zero_stage=3)
    Topology.for_config(4, par)  # records the run's layout: Accelerate's members describe it
    assert (par.data_parallel_size, par.dp_shard_enabled, par.dp_replicate_enabled, par.dp_dim_names) == (
        4, True, False, ["dp_shard"])


def test_mesh_names_on_a_fake_eight_process_group():
    """init_device_mesh on torch's fake backend (one process standing for 8): the dims, the flattened ones and
    the mesh FSDP2 gets."""
    result = json.loads(_run("""
        import json
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from accel.config import ParallelismConfig
        from accel.runtime.topology import Topology

        dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
        out = {}
        for name, fields in [("hsdp_tp", dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2)),
                             ("pp_hsdp", dict(dp_replicate_size=2, dp_shard_size=2, pp_size=2)),
                             ("shard_only", dict(dp_shard_size=8)), ("legacy_zero3_tp", dict(zero_stage=3, tp_size=2))]:
            topo = Topology.for_config(8, ParallelismConfig(**fields))
            mesh = topo.mesh("cpu")
            out[name] = {"dims": list(mesh.mesh_dim_names), "flat": sorted(topo._flat),
                         "fsdp": list(topo.fsdp_mesh("cpu").mesh_dim_names),
                         "dp": [topo.submesh("dp", "cpu").size(), topo.submesh("dp", "cpu").get_local_rank()],
                         "dp_group": topo.group("dp", "cpu").size(), "coords": topo.coordinates(5)}
        print(json.dumps(out))
    """))
    assert result["hsdp_tp"] == {"dims": ["dp_replicate", "dp_shard", "tp"], "flat": ["dp", "dp_cp", "dp_shard_cp"],
                                 "fsdp": ["dp_replicate", "dp_shard"], "dp": [4, 2], "dp_group": 4,
                                 "coords": {"pp": 0, "dp": 2, "tp": 1, "dp_replicate": 1, "dp_shard": 0}}
    assert result["pp_hsdp"]["dims"] == ["pp", "dp_replicate", "dp_shard"]
    assert result["pp_hsdp"]["dp"] == [4, 1] and result["pp_hsdp"]["fsdp"] == ["dp_replicate", "dp_shard"]
    assert result["shard_only"]["dims"] == ["dp_shard"] and result["shard_only"]["fsdp"] == ["dp_shard"]
    assert result["shard_only"]["dp"] == [8, 5]
    assert result["legacy_zero3_tp"]["dims"] == ["dp", "tp"] and result["legacy_zero3_tp"]["flat"] == []
    assert result["legacy_zero3_tp"]["fsdp"] == ["dp"]


def test_one_process_accelerator():
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_replicate_size=1, dp_shard_size=1))
    assert accelerator.torch_device_mesh is None and accelerator.parallelism_config.data_parallel_size == 1
    with pytest.raises(ConfigError, match="dp_replicate_size=2 x dp_shard_size=2 .* = 4, but 1 processes run"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))


# -- long sequences: sequence (sp_size, Ulysses) and context (cp_size) parallelism -------------------------------------

def test_sequence_and_context_degrees_are_accepted_with_accelerates_members():
    cp = ParallelismConfig(dp_shard_size=2, cp_size=2)
    assert (cp.cp_enabled, cp.non_dp_dim_names, cp.dp_shard_cp_dim_names, cp.dp_cp_dim_names) == (
        True, ["cp"], ["dp_shard", "cp"], ["dp_shard", "cp"])
    assert (cp.total_size, cp.non_data_parallel_size, cp._get_mesh()) == (4, 2, (("dp_shard", "cp"), (2, 2)))
    sp = ParallelismConfig(tp_size=2, sp_size=2, sp_backend="deepspeed")  # Accelerate's backend name: accel's Ulysses
    assert (sp.sp_enabled, sp.non_dp_dim_names, sp.dp_cp_dim_names, sp._get_mesh()) == (
        True, ["tp", "sp"], [], (("sp", "tp"), (2, 2)))
    assert sp.requested_features() == ["tensor parallelism (tp_size=2)", "sequence parallelism (sp_size=2)"]
    assert ParallelismConfig(cp_size=4).requested_features() == ["context parallelism (cp_size=4)"]
    assert backend_name_for(cp) == "zero" and backend_name_for(ParallelismConfig(sp_size=2)) == "spmd"
    assert backend_name_for(sp) == "spmd"  # dimensions are parts of the step owner the other fields name


def test_cp_comm_strategy_takes_accelerates_names_its_handler_and_environment(monkeypatch):
    assert ParallelismConfig(cp_size=2).cp_comm_strategy == "allgather"
    assert ParallelismConfig(cp_size=2, cp_comm_strategy="ring").cp_comm_strategy == "ring"
    assert ParallelismConfig(cp_size=2, cp_comm_strategy="alltoall").cp_comm_strategy == "ring"  # torch's rotation

    class TorchContextParallelConfig:  # Accelerate's handler, as far as accel reads it
        cp_comm_strategy = "alltoall"

    assert ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig()).cp_comm_strategy == "ring"
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")  # what `accelerate launch` exports
    from_env = ParallelismConfig()
    assert (from_env.cp_size, from_env.cp_comm_strategy) == (2, "ring")
    assert ParallelismConfig(cp_comm_strategy="ring").cp_comm_strategy == "ring"


@pytest.mark.parametrize("fields,needle", [
    ({"cp_size": 2, "sp_size": 2}, "parallelism: cp_size=2 and sp_size=2: context and sequence parallelism both split "
                                   "the sequence, use one of them; allowed: cp_size 1 or sp_size 1"),
])
def test_what_does_not_compose_is_one_line(fields, needle):
    from accel.backends import check_available

    with pytest.raises(ConfigError) as info:
        check_available(ParallelismConfig(**fields))
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("fields,backend", [
    ({"sp_size": 2}, "spmd"), ({"cp_size": 2, "dp_replicate_size": 2}, "spmd"),
    ({"sp_size": 2, "zero_stage": 1}, "zero"),
    ({"cp_size": 2, "zero_stage": 2}, "zero"), ({"cp_size": 2, "dp_shard_size": 2}, "zero"),
    ({"sp_size": 2, "zero_stage": 3, "offload_optimizer": True, "offload_params": True}, "zero"),
    ({"sp_size": 2, "tp_size": 2}, "spmd"), ({"cp_size": 2, "tp_size": 2, "zero_stage": 3}, "zero"),
    ({"cp_size": 2, "dp_replicate_size": 2, "dp_shard_size": 2}, "zero"),  # HSDP over (dp_replicate, dp_shard_cp)
    ({"sp_size": 2, "dp_replicate_size": 2, "dp_shard_size": 2, "zero_stage": 3}, "zero"),
    ({"sp_size": 2, "pp_size": 2}, "pipeline"), ({"cp_size": 2, "pp_size": 2, "zero_stage": 3}, "pipeline"),
])
def test_what_composes(fields, backend):
    from accel.backends import check_available

    assert check_available(ParallelismConfig(**fields)) == backend


def test_launch_check_names_the_sequence_degree(tmp_path):
    from accel.backends.launchable import check_launchable
    from accel.config import config_from_dict

    ok = check_launchable(config_from_dict({"num_processes": 8, "use_cpu": True,
                                            "parallelism": {"sp_size": 2, "tp_size": 2, "zero_stage": 2}}, "t"), "t")
    assert data_parallel_sizes(ok.parallelism, 8) == (1, 2)  # dp 2 x sp 2 x tp 2
    with pytest.raises(ConfigError, match=r"^t: key 'num_processes': 6 is not divisible by tp_size x pp_size x "
                                          r"cp_size = 4; allowed: num_processes a multiple of 4, or a smaller "
                                          r"tp_size/pp_size/cp_size$"):
        check_launchable(config_from_dict({"num_processes": 6, "parallelism": {"cp_size": 4}}, "t"), "t")
    # 2 processes cannot hold cp 2 x sp 2 either: the combination is what is named
    with pytest.raises(ConfigError, match="cp_size=2 and sp_size=2: context and sequence parallelism"):
        check_launchable(config_from_dict({"num_processes": 2, "parallelism": {"cp_size": 2, "sp_size": 2}}, "t"))


def test_accelerates_section_maps_the_sequence_degrees(tmp_path):
    cp = resolve_config(accelerate_yaml(tmp_path, {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 1,
                                                   "cp_size": 2}, cp_comm_strategy="alltoall", cp_backend="torch"))
    par = cp.parallelism
    assert (par.cp_size, par.cp_comm_strategy, par.dp_shard_size, par.zero_stage) == (2, "ring", 2, 3)
    assert data_parallel_sizes(par, 4) == (1, 2)
    sp = resolve_config(accelerate_yaml(tmp_path, {"dp_replicate_size": 1, "dp_shard_size": 2, "sp_size": 2},
                                        sp_backend="deepspeed", sp_seq_length="null", sp_attn_implementation="sdpa"))
    assert (sp.parallelism.sp_size, sp.parallelism.sp_backend) == (2, "deepspeed")
    # the same as accel's own keys
    same = tmp_path / "accel.yaml"
    same.write_text("use_cpu: true\nnum_processes: 4\nparallelism:\n  dp_replicate_size: 1\n  dp_shard_size: 2\n"
                    "  cp_size: 2\n  cp_comm_strategy: ring\n  cp_backend: torch\n")
    assert resolve_config(same).parallelism == par


def test_topology_places_the_sequence_ranks_between_dp_and_tp():
    """Row-major (pp, dp, sp|cp, tp): the sequence ranks of one data-parallel rank share its batches; gradients are
    reduced over dp x cp (dp_cp)."""
    topo = Topology.for_config(8, ParallelismConfig(cp_size=2, tp_size=2))
    assert topo.sizes == {"pp": 1, "dp": 2, "cp": 2, "tp": 2, "dp_replicate": 1, "dp_shard": 2, "dp_cp": 4}
    assert [topo.coordinates(r)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [topo.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [topo.coordinates(r)["dp_cp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert topo.gradient_dim == "dp_cp" and topo.mesh_dims() == [("dp", 2), ("cp", 2), ("tp", 2)]
    ulysses = Topology.for_config(4, ParallelismConfig(sp_size=2))
    assert ulysses.dp_size == 2 and ulysses.seq_name == "sp" and ulysses.seq_rank(3) == 1
    with pytest.raises(ConfigError, match="sp_size=2"):
        Topology.for_config(3, ParallelismConfig(sp_size=2))
