"""A config key is declared once, by its spec in the schema: `accel launch`'s flag, `accel env`'s copy of it, the
`accel config` question and the reference pages are generated from it. These fail when one of them drifts."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from accel.cli import config as config_cmd
from accel.cli import config_flags
from accel.cli.accelerate_flags import ACCEPTED
from accel.cli.main import _subparsers, build_parser

ROOT = Path(__file__).resolve().parents[3]

# every config flag `accel launch` had before the flags were generated, and the kind of value it takes: their names,
# dash spellings and types stay (scripts and Accelerate's `accelerate launch` command lines use them)
KNOWN_FLAGS = {
    **dict.fromkeys(("num_processes", "num_machines", "machine_rank", "main_process_port",
                     "gradient_accumulation_steps", "zero_stage", "tp_size", "pp_size", "sp_size", "cp_size",
                     "ep_size", "pp_microbatches",
                     "throughput_log_every", "ft_group_size", "ft_replica_id", "ft_min_replicas",
                     "ft_lighthouse_port", "ft_sync_steps", "ft_check_every"), "int"),
    **dict.fromkeys(("collective_timeout", "grace_period", "ft_timeout", "ft_quorum_timeout",
                     "ft_heartbeat_timeout", "ft_start_timeout", "ft_outer_lr"), "number"),
    **dict.fromkeys(("main_process_ip", "mixed_precision", "gpu_ids", "rdzv_backend", "cp_comm_strategy",
                     "pp_schedule", "activation_checkpointing", "dynamo_backend", "dynamo_mode", "preemption_signal",
                     "checkpoint_async", "ft_lighthouse", "ft_semi_sync_method"), "text"),
    **dict.fromkeys(("dynamo_use_fullgraph", "dynamo_use_dynamic", "dynamo_use_regional_compilation", "requeue",
                     "throughput_monitor", "fault_tolerance"), "switch"),
}


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return _subparsers(build_parser())


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions if action.option_strings}


def _kind(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.type is int:
        return "int"
    if action.type is None:
        return "text"
    assert action.type("2.5") == 2.5 and action.type("3") == 3, action  # float, or seconds (whole ones stay int)
    return "number"


def test_every_config_key_has_a_generated_flag_or_says_why_not(parsers):
    keys = config_flags.config_keys()
    assert set(config_flags.NO_FLAG) <= set(keys), set(config_flags.NO_FLAG) - set(keys)
    assert all(why.strip() for why in config_flags.NO_FLAG.values())
    launch = _actions(parsers["launch"])
    for key in keys:
        if key in config_flags.NO_FLAG:
            assert config_flags.flag_name(key) not in launch or config_flags.flag_name(key) in ACCEPTED, key
            continue
        flag = config_flags.flag_name(key)
        action = launch.get(flag)
        assert action is not None, f"config key {key}: no --{flag} on accel launch (or list it in NO_FLAG)"
        spec = config_flags.field_spec(key)
        assert action.default is None and action.help.replace("%%", "%").startswith(spec["help"]), key
        assert f"--{flag}" in action.option_strings
        if "_" in flag:
            assert f"--{flag.replace('_', '-')}" in action.option_strings
        expected = ("switch" if spec["kind"] is bool else "int" if spec["kind"] is int
                    else "number" if spec["kind"] is float else "text")
        assert _kind(action) == expected, key
        assert config_flags.FLAG_KEYS[flag] == key


def test_flags_named_in_the_no_flag_reasons_exist(parsers):
    """A key set by another flag (`--cpu`, Accelerate's `--offload_optimizer_device`, ...) names a real one."""
    import re

    launch = _actions(parsers["launch"])
    for key, why in config_flags.NO_FLAG.items():
        for flag in re.findall(r"--(\w+)", why):
            assert flag in launch, (key, flag)
            assert flag in ACCEPTED or flag in ("cpu", "multi_gpu", "deepspeed_config_file", "pp_schedule"), flag


def test_every_flag_that_existed_keeps_its_name_spellings_and_type(parsers):
    launch, env = _actions(parsers["launch"]), _actions(parsers["env"])
    for flag, kind in KNOWN_FLAGS.items():
        action = launch[flag]
        assert action.option_strings == [f"--{flag}", *([f"--{flag.replace('_', '-')}"] if "_" in flag else [])]
        assert _kind(action) == kind, flag
        assert flag in env or flag.startswith("ft_") or flag == "fault_tolerance", flag


def test_accel_env_takes_every_config_flag_of_launch(parsers):
    env = _actions(parsers["env"])
    for flag in config_flags.FLAG_KEYS:
        assert flag in env, flag


def test_every_question_takes_its_prompt_choices_and_bounds_from_the_spec():
    saved = [question for question in config_cmd.QUESTIONS if question.saved]
    for question in saved:
        spec = config_flags.field_spec(question.key)
        assert question.prompt == spec["ask"], question.key
        assert question.choices == tuple(spec["choices"]), question.key
        assert (question.lo, question.hi) == (spec["lo"], spec["hi"]), question.key
        kind = ("bool" if spec["kind"] is bool else "choice" if spec["choices"] else "int" if spec["kind"] is int
                else "str")
        assert question.kind == kind, question.key
    with_a_question = [key for key in config_flags.config_keys() if config_flags.field_spec(key)["ask"]]
    assert sorted(with_a_question) == sorted(question.key for question in saved)


def test_a_key_without_a_question_or_flag_is_refused_by_the_generators():
    with pytest.raises(ValueError, match="no question"):
        config_cmd.asked("parallelism.tp_plan")
    with pytest.raises(ValueError, match="has no flag"):
        config_flags.add(argparse.ArgumentParser(), "use_cpu")


def test_the_generated_reference_is_up_to_date():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.stale() == [], "stale generated pages: run `python docs/gen_reference.py`"
    page = gen.config_reference()
    for key, flag in config_flags.KEY_FLAGS.items():
        assert f"| `{key}`<br>`--{flag}` |" in page, key
    for key in config_flags.NO_FLAG:
        assert f"| `{key}` | " in page, key
