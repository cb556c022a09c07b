"""`accelerate.commands.*` (accel/commands): Accelerate's command API over accel's CLI. The parsers take Accelerate's
documented command lines into the namespaces the real Accelerate 1.15 parsers make (compared in a subprocess, so the
shim can never stand in for the reference); the functions run accel's commands (launch, config, env, estimate,
merge) and refuse what accel has not (tpu-config) in one line."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

from accel.cli._common import UsageError
from accel.commands import accelerate_cli
from accel.commands import env as env_cmd
from accel.commands import estimate as estimate_cmd
from accel.commands import launch as launch_cmd
from accel.commands import merge as merge_cmd
from accel.commands import to_fsdp2 as to_fsdp2_cmd
from accel.commands import tpu as tpu_cmd
from accel.commands.config import config_args, config_command_parser
from accel.commands.config.default import write_basic_config
from accel.config import ConfigError

REPO = Path(__file__).resolve().parents[3]

# Accelerate's documented `accelerate launch` command lines (docs: basic launches, FSDP, DeepSpeed, multi-node)
LAUNCH_LINES = [
    ["--multi_gpu", "--num_processes", "4", "train.py", "--lr", "1e-3"],
    ["--cpu", "--num-processes", "2", "--mixed_precision", "bf16", "train.py"],
    ["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--fsdp_offload_params", "true",
     "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "train.py"],
    ["--use_deepspeed", "--zero_stage", "2", "--gradient_accumulation_steps", "4", "--offload_optimizer_device", "cpu",
     "--gradient_clipping", "1.0", "train.py"],
    ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29501",
     "--rdzv_backend", "c10d", "-m", "pkg.train", "--epochs", "3"],
    ["--config_file", "c.yaml", "--dynamo_backend", "inductor", "--num_cpu_threads_per_process", "2", "train.py"],
]
OTHER_LINES = {"merge": [["ckpt/pytorch_model_fsdp_0", "out"], ["ckpt", "out", "--unsafe_serialization",
                                                                   "--remove_checkpoint_dir"]],
               "env": [[], ["--config_file", "c.yaml"]],
               "estimate": [["bert-base-cased"], ["gpt2", "--dtypes", "float32", "float16", "--trust_remote_code"]]}
_REAL = """
import json, sys
from accelerate.commands.launch import launch_command_parser
from accelerate.commands.merge import merge_command_parser
from accelerate.commands.env import env_command_parser
from accelerate.commands.estimate import estimate_command_parser
parsers = {"launch": launch_command_parser, "merge": merge_command_parser, "env": env_command_parser,
           "estimate": estimate_command_parser}
out = {name: [{k: v for k, v in vars(parsers[name]().parse_args(line)).items() if k != "func"} for line in lines]
       for name, lines in json.loads(sys.argv[1]).items()}
print(json.dumps(out, default=repr))
"""


@pytest.fixture(scope="module")
def real_namespaces():
    """The namespaces the real Accelerate makes of the same command lines (a subprocess without the shim)."""
    from accel.shim import real_accelerate_dir

    if real_accelerate_dir() is None:
        pytest.skip("the real accelerate package (a test extra) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _REAL, json.dumps({"launch": LAUNCH_LINES, **OTHER_LINES})],
                          capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _public(namespace: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(namespace).items() if k != "func"}


def _comparable(value):
    return list(value) if isinstance(value, tuple) else value


# -------------------------------------------------------------------------------------------------------------
# parsers: the real Accelerate's namespaces
# -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("index", range(len(LAUNCH_LINES)))
def test_launch_parser_namespace_matches_accelerate(real_namespaces, index):
    ours = _public(launch_cmd.launch_command_parser().parse_args(LAUNCH_LINES[index]))
    real = real_namespaces["launch"][index]
    missing = set(real) - set(ours)
    assert not missing, missing  # every attribute Accelerate's namespace has, accel's has
    assert ours["nondefault"] == ast.literal_eval(real.pop("nondefault"))  # which flags the line set
    differing = {k: (ours[k], v) for k, v in real.items() if json.loads(json.dumps(_comparable(ours[k]),
                                                                                  default=repr)) != v}
    assert not differing, differing


@pytest.mark.parametrize("name,index", [(n, i) for n, lines in OTHER_LINES.items() for i in range(len(lines))])
def test_other_parsers_take_accelerates_arguments(real_namespaces, name, index):
    parser = {"merge": merge_cmd.merge_command_parser, "env": env_cmd.env_command_parser,
              "estimate": estimate_cmd.estimate_command_parser}[name]()
    ours = _public(parser.parse_args(OTHER_LINES[name][index]))
    real = real_namespaces[name][index]
    if "nondefault" in real:  # Accelerate's parsers that record which arguments were given
        real["nondefault"] = ast.literal_eval(real["nondefault"])
    assert {k: ours.get(k, "<missing>") for k in real} == real


def test_launch_help_lists_each_flag_once_and_errors_are_one_line(capsys):
    parser = launch_cmd.launch_command_parser()
    text = parser.format_help()
    assert "--num_processes N" in text and "--num-processes N" not in text  # the alias is taken, not listed
    assert parser.parse_args(["--num-processes", "3", "x.py"]).num_processes == 3
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--num_processes", "two", "x.py"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num_processes" in err[0] and "'two'" in err[0]


# -------------------------------------------------------------------------------------------------------------
# launch: accel launch runs, with only the flags given
# -------------------------------------------------------------------------------------------------------------

def test_to_argv_passes_only_what_was_given():
    parser = launch_cmd.launch_command_parser()
    args = parser.parse_args(["--cpu", "--num_processes", "2", "--fsdp_sharding_strategy", "FULL_SHARD",
                              "t.py", "--x", "1"])
    assert args.multi_gpu is False and args.rdzv_backend == "static"  # Accelerate's defaults in the namespace
    # FULL_SHARD equals Accelerate's default but was typed: it is passed; the untouched defaults are not
    assert launch_cmd.to_argv(args) == ["--cpu", "--num_processes", "2", "--fsdp_sharding_strategy", "FULL_SHARD",
                                        "t.py", "--x", "1"]
    args.training_script, args.mixed_precision = "other.py", "bf16"  # changed after parsing, as scripts do
    assert launch_cmd.to_argv(args) == ["--cpu", "--mixed_precision", "bf16", "--num_processes", "2",
                                        "--fsdp_sharding_strategy", "FULL_SHARD", "other.py", "--x", "1"]


def test_launch_command_runs_accel_launch(tmp_path, monkeypatch):
    out = tmp_path / "seen.json"
    script = tmp_path / "probe.py"
    script.write_text("import json, os, sys\n"
                      f"json.dump({{'argv': sys.argv[1:], 'config': json.loads(os.environ['ACCEL_LAUNCH_CONFIG'])}}, "
                      f"open({str(out)!r}, 'w'))\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    args = launch_cmd.launch_command_parser().parse_args(["--cpu", "--mixed_precision", "bf16",
                                                          "--gradient_accumulation_steps", "3", str(script), "--lr",
                                                          "0.1"])
    launch_cmd.launch_command(args)
    seen = json.loads(out.read_text())
    assert seen["argv"] == ["--lr", "0.1"]
    config = seen["config"]
    assert (config["use_cpu"], config["mixed_precision"], config["gradient_accumulation_steps"]) == (True, "bf16", 3)

    failing = tmp_path / "fail.py"
    failing.write_text("raise SystemExit(3)\n")
    with pytest.raises(subprocess.CalledProcessError) as exc:
        launch_cmd.launch_command(launch_cmd.launch_command_parser().parse_args(["--cpu", str(failing)]))
    assert exc.value.returncode == 3
    # a bad value fails here, before any process, with accel's one-line error
    with pytest.raises(ConfigError, match="mixed_precision"):
        launch_cmd.launch_command(launch_cmd.launch_command_parser().parse_args(["--mixed_precision", "fp12",
                                                                                 str(script)]))
    with pytest.raises(UsageError, match="--tpu"):
        launch_cmd.launch_command(launch_cmd.launch_command_parser().parse_args(["--tpu", str(script)]))


def test_validate_launch_command_fills_from_the_config_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("num_processes: 2\nmixed_precision: bf16\nuse_cpu: true\n")
    parser = launch_cmd.launch_command_parser()
    args, defaults, mp_from_file = launch_cmd._validate_launch_command(
        parser.parse_args(["--config_file", str(config), "t.py"]))
    assert (args.num_processes, args.mixed_precision, args.cpu, mp_from_file) == (2, "bf16", True, True)
    assert isinstance(defaults, config_args.ClusterConfig) and defaults.num_processes == 2
    args, _, mp_from_file = launch_cmd._validate_launch_command(
        parser.parse_args(["--config_file", str(config), "--mixed_precision", "fp16", "--num_processes", "1", "t.py"]))
    assert (args.num_processes, args.mixed_precision, mp_from_file) == (1, "fp16", False)


# -------------------------------------------------------------------------------------------------------------
# config, env, estimate, merge, tpu, to-fsdp2, the accelerate command
# -------------------------------------------------------------------------------------------------------------

def test_config_functions_write_and_read_accels_file(tmp_path):
    path = tmp_path / "cfg" / "default_config.yaml"
    assert write_basic_config(mixed_precision="bf16", save_location=str(path)) == str(path)
    assert write_basic_config(save_location=str(path)) is False  # an existing file is left alone, as in Accelerate
    loaded = config_args.load_config_from_file(str(path))
    assert isinstance(loaded, config_args.ClusterConfig)
    assert (loaded.mixed_precision, loaded.num_processes, loaded.distributed_type) == ("bf16", 1, "NO")
    loaded.to_yaml_file(str(tmp_path / "copy.yaml"))
    assert config_args.load_config_from_file(str(tmp_path / "copy.yaml")).to_dict() == loaded.to_dict()

    other = tmp_path / "other.yaml"
    args = config_command_parser().parse_args(["default", "--config_file", str(other), "--mixed_precision", "fp16"])
    assert args.func(args) == 0 and config_args.load_config_from_file(str(other)).mixed_precision == "fp16"

    bad = tmp_path / "bad.yaml"
    bad.write_text("num_processes: 2\nnot_a_key: 1\n")
    with pytest.raises(ValueError, match="not_a_key"):
        config_args.load_config_from_file(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        config_args.load_config_from_file(str(tmp_path / "missing.yaml"))


def test_env_command_prints_accels_report_and_returns_accelerates_keys(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("num_processes: 3\nuse_cpu: true\n")
    with patch("accel.commands.env.which", return_value=None):
        info = env_cmd.env_command(env_cmd.env_command_parser().parse_args(["--config_file", str(config)]))
    printed = capsys.readouterr().out
    assert "- accel version:" in printed and "num_processes: 3" in printed
    assert info["`accelerate` bash location"] == "Not found"
    assert info["PyTorch version"] == torch.__version__
    assert info["`Accelerate` configs"]["num_processes"] == 3


def test_estimate_gather_data_from_a_local_config(tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100, "n_positions": 64}
    (tmp_path / "config.json").write_text(json.dumps(values))
    args = estimate_cmd.estimate_command_parser().parse_args([str(tmp_path), "--dtypes", "float32", "float16", "int4"])
    rows = estimate_cmd.gather_data(args)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values))
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # tied ones once
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    assert [row[0] for row in rows] == ["float32", "float16", "int4"]
    assert rows[0][2] == total and rows[1][2] == total / 2 and rows[2][2] == total / 8
    assert rows[0][1] >= block  # the largest layer is at least one transformer block
    assert rows[0][3]["model"] == sum(p.numel() * 4 for p in model.parameters())
    assert max(rows[0][3].values()) >= 4 * rows[0][3]["model"]  # weights, gradients and two Adam moments
    assert set(rows[2][3].values()) == {-1}  # no training estimate in int4
    estimate_cmd.estimate_command(args)
    assert "Training using Adam" in capsys.readouterr().out
    with pytest.raises(OSError, match="gated"):
        with patch("accel.commands.estimate.verify_on_hub", return_value="gated"):
            estimate_cmd.gather_data(estimate_cmd.estimate_command_parser().parse_args(["org/private-model"]))
    assert estimate_cmd.add_timm_hub_prefix("timm/resnet50.a1_in1k") == "hf-hub:timm/resnet50.a1_in1k"
    assert estimate_cmd.add_timm_hub_prefix("resnet50") == "resnet50"


def test_merge_command_merges_a_dcp_folder(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "pytorch_model_fsdp_0"), no_dist=True)
    merge_cmd.merge_command(merge_cmd.merge_command_parser().parse_args([str(tmp_path / "pytorch_model_fsdp_0"),
                                                                         str(tmp_path / "out")]))
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert merged.keys() == model.state_dict().keys()
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="not found"):
        merge_cmd.merge_command(merge_cmd.merge_command_parser().parse_args([str(tmp_path / "nope"), "o"]))


def test_tpu_config_is_refused_in_one_line(capsys):
    args = tpu_cmd.tpu_command_parser().parse_args(["--command", "ls", "--tpu_zone", "z", "--tpu_name", "n",
                                                    "--debug"])
    with pytest.raises(UsageError, match="TPUs"):
        tpu_cmd.tpu_command_launcher(args)
    assert accelerate_cli.main(["tpu-config", "--debug"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("accelerate tpu-config: error: TPUs")


def test_to_fsdp2_converts_fsdp1_keys(tmp_path):
    source = tmp_path / "fsdp1.yaml"
    source.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n"
                      "  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
                      "  fsdp_backward_prefetch: BACKWARD_PRE\n  fsdp_use_orig_params: true\n"
                      "  fsdp_offload_params: false\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n")
    args = to_fsdp2_cmd.to_fsdp2_command_parser().parse_args(["--config_file", str(source), "--output_file",
                                                              str(tmp_path / "fsdp2.yaml")])
    to_fsdp2_cmd.to_fsdp2_command(args)
    converted = to_fsdp2_cmd.load_config(str(tmp_path / "fsdp2.yaml"))
    assert converted["fsdp_config"] == {"fsdp_reshard_after_forward": False, "fsdp_offload_params": False,
                                        "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_version": 2}
    config_args.load_config_from_file(str(tmp_path / "fsdp2.yaml"))  # accel's reader takes the result
    with pytest.raises(FileExistsError):
        to_fsdp2_cmd.to_fsdp2_command(args)


def test_module_mains_report_user_errors_in_one_line(capsys, tmp_path, monkeypatch):
    """`python -m accel.commands.X` (Accelerate's `python -m accelerate.commands.X`): one line, exit 2."""
    cases = [(launch_cmd, ["--mixed_precision", "fp12", "t.py"], "accelerate launch: error: ", "mixed_precision"),
             (merge_cmd, [str(tmp_path / "nope"), "o"], "accel merge-weights: error: ", "not found"),
             (tpu_cmd, ["--debug"], "accelerate tpu-config: error: ", "TPUs"),
             (estimate_cmd, [str(tmp_path / "nope.json")], "accelerate estimate-memory: error: ", "nope.json")]
    for module, argv, prefix, needle in cases:
        monkeypatch.setattr(sys, "argv", ["x", *argv])
        assert module.main() == 2, module.__name__
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(prefix) and needle in err[0], err


def test_accelerate_cli_main_is_accels_cli(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert accelerate_cli.main(["merge-weights", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("accel merge-weights: error: checkpoint folder")
    assert accelerate_cli.main(["env"]) == 0
    assert "- accel version:" in capsys.readouterr().out


def test_shim_resolves_the_command_modules():
    code = ("import accelerate.commands.launch as L, accelerate.commands.config.config_args as C, "
            "accelerate.commands.merge as M, accel.commands.launch as AL; "
            "from accelerate.utils import merge_fsdp_weights; "
            "print(L is AL, C.__name__, M.merge_command.__module__, merge_fsdp_weights.__module__)")
    from accel.shim import PATH

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": PATH}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "accel.commands.config.config_args", "accel.commands.merge",
                                   "accel.checkpoint.merge"]
