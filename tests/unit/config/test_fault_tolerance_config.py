"""The `fault_tolerance` config section, its `accel launch` flags and `accel config` questions: values
and cross-key rules refused in one line naming the key, the bad value and what is allowed (CLI exit 2); a missing
torchft named by its extra; how the launcher cuts the processes into replica groups."""

from __future__ import annotations

import sys

import pytest

from accel.cli import fault_tolerance as ft_launch
from accel.cli.launch import flag_overrides, launch_parser
from accel.config import ConfigError, config_from_dict, read_config_file, resolve_config


def test_defaults_and_a_file_section(tmp_path):
    cfg = config_from_dict({})
    assert not cfg.fault_tolerance.enabled and cfg.fault_tolerance.group_size == 2
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 4\nfault_tolerance:\n  enabled: true\n  group_size: 4\n  min_replicas: 2\n"
                    "  lighthouse: http://10.0.0.1:29510\n  sync_steps: 8\n")
    cfg = resolve_config(path)
    ft = cfg.fault_tolerance
    assert (ft.enabled, ft.group_size, ft.min_replicas, ft.lighthouse, ft.sync_steps) == \
        (True, 4, 2, "http://10.0.0.1:29510", 8)
    assert config_from_dict(cfg.to_dict()) == cfg  # what workers receive round-trips
    assert read_config_file(path)["fault_tolerance"]["group_size"] == 4


@pytest.mark.parametrize("section,message", [
    ({"group_sise": 2}, "unknown key 'fault_tolerance.group_sise'; did you mean 'group_size'?"),
    ({"group_size": 0}, "key 'fault_tolerance.group_size': bad value 0; allowed: an integer >= 1"),
    ({"min_replicas": "2"}, "key 'fault_tolerance.min_replicas': bad value '2'; allowed: an integer >= 1"),
    ({"lighthouse": "nowhere"}, "key 'fault_tolerance.lighthouse': bad value 'nowhere'; allowed: \"start\" or "
                                "host:port"),
    ({"semi_sync_method": "async"}, "key 'fault_tolerance.semi_sync_method': bad value 'async'; allowed: one of "
                                    "local_sgd, diloco (or null)"),
    ({"timeout": 0}, "key 'fault_tolerance.timeout': bad value 0; allowed: a finite number of seconds from 1 to"),
    ({"enabled": True, "group_size": 3}, "key 'fault_tolerance.group_size': 3 groups do not divide "
                                         "num_processes=4; allowed: a divisor of num_processes"),
    ({"enabled": True, "min_replicas": 3}, "key 'fault_tolerance.min_replicas': bad value 3; allowed: an integer "
                                           "from 1 to group_size=2"),
    ({"enabled": True, "replica_id": 2}, "key 'fault_tolerance.replica_id': bad value 2; allowed: an integer from 0 "
                                         "to 1 (group_size=2)"),
])
def test_bad_values_are_one_line_errors(section, message):
    with pytest.raises(ConfigError, match=None) as info:
        config_from_dict({"num_processes": 4, "fault_tolerance": section})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_what_does_not_compose_yet_is_refused_by_name():
    assert config_from_dict({"num_processes": 2, "fault_tolerance": {"enabled": True, "semi_sync_method": "DiLoCo"}}
                            ).fault_tolerance.semi_sync_method == "diloco"
    with pytest.raises(ConfigError, match=r"key 'fault_tolerance.enabled': fault tolerance with zero_stage=1, "
                                          r"tp_size=2 is not available yet"):
        config_from_dict({"num_processes": 4, "parallelism": {"zero_stage": 1, "tp_size": 2},
                          "fault_tolerance": {"enabled": True}})
    hsdp = config_from_dict({"num_processes": 4, "parallelism": {"zero_stage": 3},
                             "fault_tolerance": {"enabled": True}})
    assert hsdp.parallelism.zero_stage == 3  # ZeRO-3 inside each group: HSDP
    with pytest.raises(ConfigError, match="groups cannot be spread over num_machines=2"):
        config_from_dict({"num_processes": 6, "num_machines": 2, "main_process_ip": "10.0.0.1",
                          "fault_tolerance": {"enabled": True, "group_size": 3}})


def test_without_torchft_one_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # what `import torchft` sees when it is not installed
    with pytest.raises(ConfigError) as info:
        config_from_dict({"num_processes": 2, "fault_tolerance": {"enabled": True}})
    assert "fault tolerance needs torchft, which is not installed; install it with pip install 'accel-train[ft]'" \
        in str(info.value)
    from accel.fault_tolerance import require_torchft

    with pytest.raises(ImportError, match=r"pip install 'accel-train\[ft\]'"):
        require_torchft()


def test_flags_fill_the_section():
    args = launch_parser().parse_args(["--fault_tolerance", "--ft-group-size", "4", "--ft_min_replicas", "2",
                                       "--ft_lighthouse", "head:29510", "--ft_semi_sync_method", "local_sgd",
                                       "--ft_sync_steps", "8", "--ft_timeout", "30", "train.py"])
    assert flag_overrides(args)["fault_tolerance"] == {
        "enabled": True, "group_size": 4, "min_replicas": 2, "lighthouse": "head:29510",
        "semi_sync_method": "local_sgd", "sync_steps": 8, "timeout": 30.0}


def test_every_key_of_the_section_has_its_flag_generated_from_the_schema():
    """The flags come from FaultToleranceConfig's field specs (declared once): a key added there is a flag, with its
    help and default; a value given to each sets that key."""
    import dataclasses

    from accel.config.schema import FaultToleranceConfig

    fields = {f.name: f for f in dataclasses.fields(FaultToleranceConfig)}
    values = {"group_size": "4", "replica_id": "1", "min_replicas": "2", "lighthouse": "head:29510",
              "lighthouse_port": "29511", "semi_sync_method": "diloco", "sync_steps": "8", "outer_lr": "0.5",
              "timeout": "30", "quorum_timeout": "7", "heartbeat_timeout": "2", "start_timeout": "9",
              "check_every": "5"}
    assert set(values) | {"enabled"} == set(fields)  # a new key: give it a value here
    argv = ["--fault_tolerance", *[a for key, value in values.items() for a in (f"--ft_{key}", value)], "train.py"]
    section = flag_overrides(launch_parser().parse_args(argv))["fault_tolerance"]
    assert section == {"enabled": True, **{k: fields[k].metadata["kind"](v) for k, v in values.items()}}
    help_text = " ".join(launch_parser().format_help().split())
    for name, spec in fields.items():
        assert " ".join(spec.metadata["help"].split()) in help_text, name


@pytest.mark.parametrize("flags,message", [
    (["--ft_group_size", "3"], "accel launch: error: "),
    (["--ft_lighthouse", "not an address"], "key 'fault_tolerance.lighthouse': bad value 'not an address'"),
    (["--zero_stage", "1"], "fault tolerance with zero_stage=1 is not available yet"),
])
def test_launch_refuses_in_one_line_with_exit_2(run_accel, tmp_path, flags, message):
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    result = run_accel("launch", "--cpu", "--num_processes", "4", "--fault_tolerance", *flags, script)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "never" not in result.stdout


def test_dry_run_shows_the_lighthouse_and_one_launcher_per_group(run_accel, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    result = run_accel("launch", "--cpu", "--num_processes", "4", "--fault_tolerance", "--max_restarts", "3",
                       "--dry_run", script, "--lr", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "torchft lighthouse in this launcher: bind [::]:0, min_replicas 1" in out
    for replica in (0, 1):
        assert f"# replica group {replica}: 2 process(es)" in out
        assert f"ACCEL_FT_REPLICA_ID={replica} " in out
    assert out.count("--num_processes 2 --num_machines 1 --machine_rank 0 --max_restarts 3") == 2
    assert out.count(f"{script} --lr 1") == 2


def test_groups_are_placed_whole_on_machines():
    cfg = config_from_dict({"num_processes": 8, "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1",
                            "fault_tolerance": {"enabled": True, "group_size": 4}})
    assert ft_launch.runs_groups(cfg) and ft_launch.groups_here(cfg) == [2, 3]
    assert ft_launch.lighthouse_bind(cfg) == ("[::]:29510", "10.0.0.1:29510")
    group = ft_launch.group_config(cfg, 3, "10.0.0.1:29510")
    assert (group.num_processes, group.num_machines, group.machine_rank) == (2, 1, 0)
    assert (group.fault_tolerance.replica_id, group.fault_tolerance.lighthouse) == (3, "10.0.0.1:29510")
    assert not ft_launch.runs_groups(group)  # a group's launcher runs its own torchrun
    assert config_from_dict(group.to_dict()) == group  # what its config file holds is valid


def test_accel_config_asks_for_fault_tolerance(run_accel, tmp_path):
    target = tmp_path / "ft.yaml"
    answers = ["1", "yes", "4", *[""] * 7, "yes", "4", "5", "3", ""]  # min_replicas 5 of 4 groups: asked again
    result = run_accel("config", "--config_file", target, input="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stderr
    assert "Fault tolerance without restarts" in result.stdout
    assert "key 'fault_tolerance.min_replicas': bad value 5; allowed: an integer from 1 to group_size=4" \
           in result.stdout
    ft = resolve_config(target).fault_tolerance
    assert (ft.enabled, ft.group_size, ft.min_replicas, ft.lighthouse) == (True, 4, 3, "start")

