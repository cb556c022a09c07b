"""`accelerate launch`'s flags on `accel launch`: the same resolved config as the equivalent Accelerate config file
(`--dry_run`), one-line refusals, the launch flags in torchrun's argv and the workers' environment, the DeepSpeed
multi-node flags on --hostfile, and one real 2-process launch."""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import subprocess
import sys

import pytest
import yaml

from accel.cli import accelerate_flags, launch
from accel.cli._common import UsageError
from accel.cli.main import _subparsers, build_parser
from accel.config import config_from_dict


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "train.py").write_text("import pathlib, sys\npathlib.Path(sys.argv[0]).with_name('ran').touch()\n")
    return tmp_path


def dry_run(run_accel, workdir, *args: str, script: str = "train.py") -> tuple[dict, list[str]]:
    """(the resolved config, the command's words) that `accel launch --dry_run ARGS train.py` prints."""
    result = run_accel("launch", "--dry_run", *args, script, cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert not (workdir / "ran").exists()
    config_text, _, command = result.stdout.partition("# the command accel launch runs")
    return yaml.safe_load(config_text), shlex.split(command.splitlines()[1])


def one_line_error(result, *needles: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accel launch: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0].removeprefix("accel launch: error: ")


# ----------------------------------------------------------------------------------------------------------
# every flag of Accelerate 1.15 is taken
# ----------------------------------------------------------------------------------------------------------

def test_every_accelerate_launch_flag_is_taken():
    accelerate_launch = pytest.importorskip("accelerate.commands.launch")
    theirs = {option for action in accelerate_launch.launch_command_parser()._actions
              for option in action.option_strings}
    ours = _subparsers(build_parser())["launch"]._option_string_actions
    assert len(theirs) > 150
    assert sorted(theirs - set(ours)) == []


# ----------------------------------------------------------------------------------------------------------
# flags mean what the same keys mean in a config file
# ----------------------------------------------------------------------------------------------------------

SAME_AS_FILE = [
    ("fsdp", ["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--fsdp_offload_params", "true",
              "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer", "--fsdp_activation_checkpointing", "true",
              "--fsdp_state_dict_type", "SHARDED_STATE_DICT", "--fsdp_version", "2"],
     "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_offload_params: true\n"
     "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  fsdp_activation_checkpointing: true\n"
     "  fsdp_state_dict_type: SHARDED_STATE_DICT\n  fsdp_version: 2\n"),
    ("fsdp-selector-only", ["--use_fsdp"], "distributed_type: FSDP\n"),
    ("fsdp-reshard-size-wrap", ["--use_fsdp", "--fsdp_reshard_after_forward", "false", "--fsdp_auto_wrap_policy",
                                "SIZE_BASED_WRAP", "--fsdp_min_num_params", "1000"],
     "distributed_type: FSDP\nfsdp_config:\n  fsdp_reshard_after_forward: false\n"
     "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 1000\n"),
    ("deepspeed", ["--use_deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "cpu",
                   "--offload_param_device", "cpu", "--gradient_clipping", "1.0", "--zero3_init_flag", "true"],
     "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n"
     "  offload_param_device: cpu\n  gradient_clipping: 1.0\n  zero3_init_flag: true\n"),
    ("deepspeed-selector-only", ["--use_deepspeed"], "distributed_type: DEEPSPEED\n"),
    ("deepspeed-json", ["--use_deepspeed", "--deepspeed_config_file", "ds.json"],
     "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"),
    ("hsdp", ["--use_fsdp", "--use_parallelism_config", "--parallelism_config_dp_replicate_size", "2",
              "--parallelism_config_dp_shard_size", "2"],
     "distributed_type: FSDP\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
     "  parallelism_config_dp_shard_size: 2\n"),
    ("fsdp-cp", ["--use_fsdp", "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2",
                 "--parallelism_config_cp_size", "2", "--parallelism_config_cp_backend", "torch",
                 "--parallelism_config_cp_comm_strategy", "alltoall"],
     "distributed_type: FSDP\nparallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
     "  parallelism_config_cp_size: 2\n  parallelism_config_cp_backend: torch\n"
     "  parallelism_config_cp_comm_strategy: alltoall\n"),
    ("fsdp-sp", ["--use_fsdp", "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2",
                 "--parallelism_config_sp_size", "2", "--parallelism_config_sp_backend", "deepspeed",
                 "--parallelism_config_sp_seq_length_is_variable", "true"],
     "distributed_type: FSDP\nparallelism_config:\n  parallelism_config_dp_shard_size: 2\n"
     "  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: deepspeed\n"
     "  parallelism_config_sp_seq_length_is_variable: true\n"),
]


@pytest.mark.parametrize("flags,text", [case[1:] for case in SAME_AS_FILE], ids=[case[0] for case in SAME_AS_FILE])
def test_flags_resolve_as_the_equivalent_accelerate_config_file(here, workdir, flags, text):
    (workdir / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}))
    (workdir / "accelerate.yaml").write_text(text)
    processes = "4" if "--parallelism_config_dp_shard_size" in flags else "2"  # dp 2 x (dp 2, cp 2 or sp 2)
    from_flags, command_of_flags = here("--cpu", "--num_processes", processes, *flags)
    from_file, command_of_file = here("--cpu", "--num_processes", processes, "--config_file", "accelerate.yaml")
    assert from_flags == from_file
    assert command_of_flags == command_of_file  # ACCEL_LAUNCH_CONFIG (the DeepSpeed JSON included) and torchrun's
    assert from_flags["parallelism"]["zero_stage"] > 0


def test_the_resolved_values(here):
    """What a few of them mean, spelled out (the test above only proves flags and files agree)."""
    par = here("--cpu", "--num_processes", "2", *SAME_AS_FILE[0][1])[0]["parallelism"]
    assert (par["zero_stage"], par["offload_params"], par["offload_optimizer"]) == (2, True, True)
    assert (par["activation_checkpointing"], par["zero_wrap_classes"]) == ("full", "LlamaDecoderLayer")
    par = here("--cpu", "--num_processes", "2", "--use_fsdp")[0]["parallelism"]
    assert par["zero_stage"] == 3
    par = here("--cpu", "--num_processes", "2", "--use_deepspeed")[0]["parallelism"]
    assert par["zero_stage"] == 2
    par = here("--cpu", "--num_processes", "2", *SAME_AS_FILE[2][1])[0]["parallelism"]
    assert (par["zero_stage"], par["zero_min_params"], par["zero_wrap_classes"]) == (2, 1000, None)
    par = here("--cpu", "--num_processes", "4", *SAME_AS_FILE[-2][1])[0]["parallelism"]
    assert (par["zero_stage"], par["dp_shard_size"], par["cp_size"], par["cp_comm_strategy"]) == (3, 2, 2, "ring")
    par = here("--cpu", "--num_processes", "4", *SAME_AS_FILE[-1][1])[0]["parallelism"]
    assert (par["zero_stage"], par["sp_size"], par["sp_backend"], par["cp_size"]) == (3, 2, "deepspeed", 1)
    # accel's own flags for the same keys agree with them, or the launch is refused
    config, _ = here("--cpu", "--num_processes", "4", "--cp_size", "2", "--cp_comm_strategy", "ring",
                     "--parallelism_config_cp_size", "2", "--parallelism_config_cp_comm_strategy", "alltoall")
    par = config["parallelism"]
    assert (par["cp_size"], par["cp_comm_strategy"]) == (2, "ring")


def dry_run_here(monkeypatch, capsys, workdir, *args: str) -> tuple[dict, list[str]]:
    """`dry_run`'s answer, from `accel.cli.main.main` in this process (no interpreter start, and no torch import,
    per call): the same environment as run_accel's subprocess (HOME in a temp dir, no ACCEL_/rank variables), the
    same cwd."""
    from accel.cli.main import main

    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCEL_RESTART_COUNT"):  # the last: set by `import accel`
        monkeypatch.setenv(name, "")  # recorded, so the test's end restores each as it was (or absent) ...
        monkeypatch.delenv(name)  # ... and absent while it runs
    home = workdir / "home-here"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(workdir)
    capsys.readouterr()
    assert main(["launch", "--dry_run", *args, "train.py"]) in (0, None)
    assert not (workdir / "ran").exists()
    config_text, _, command = capsys.readouterr().out.partition("# the command accel launch runs")
    return yaml.safe_load(config_text), shlex.split(command.splitlines()[1])


@pytest.fixture
def here(monkeypatch, capsys, workdir):
    """dry_run_here for this test's workdir."""
    return functools.partial(dry_run_here, monkeypatch, capsys, workdir)


def test_precedence_flags_over_files_and_the_selectors_default_stage(monkeypatch, capsys, workdir):
    (workdir / "ds3.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n")
    (workdir / "fsdp2.yaml").write_text("distributed_type: FSDP\nfsdp_config:\n"
                                        "  fsdp_sharding_strategy: SHARD_GRAD_OP\n")

    def stage_and_offload(*args):
        par = dry_run_here(monkeypatch, capsys, workdir, "--cpu", "--num_processes", "2", *args)[0]["parallelism"]
        return par["zero_stage"], par["offload_optimizer"]

    # --use_deepspeed on a DeepSpeed file keeps its stage, as Accelerate takes the file's zero_stage
    assert stage_and_offload("--config_file", "ds3.yaml", "--use_deepspeed", "--offload_optimizer_device", "cpu") \
        == (3, True)
    # --use_fsdp switches a DeepSpeed file to FSDP: FULL_SHARD unless a strategy is given
    assert stage_and_offload("--config_file", "ds3.yaml", "--use_fsdp") == (3, False)
    assert stage_and_offload("--config_file", "ds3.yaml", "--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP") \
        == (2, False)
    # an --fsdp_* flag alone leaves the file's strategy; accel's --zero_stage wins over a selector's default
    assert stage_and_offload("--config_file", "fsdp2.yaml", "--fsdp_offload_params", "true") == (2, True)
    assert stage_and_offload("--config_file", "fsdp2.yaml", "--use_fsdp") == (2, False)
    assert stage_and_offload("--use_fsdp", "--zero_stage", "2") == (2, False)



def test_the_selectors_read_a_files_stage_as_the_config_derives_it(workdir, monkeypatch):
    """`--use_deepspeed` / `--use_fsdp` keep a file's stage: the one the config itself would take (its zero_stage,
    else 3 for a dp_shard_size layout, else none), and none from a file of the other route."""
    monkeypatch.chdir(workdir)
    files = {"stage1.yaml": "parallelism:\n  zero_stage: 1\n", "sharded.yaml": "parallelism:\n  dp_shard_size: 2\n",
             "plain.yaml": "mixed_precision: bf16\n", "ds3.yaml": "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
             "  zero_stage: 3\n"}
    for name, text in files.items():
        (workdir / name).write_text(text)
    stages = {name: accelerate_flags._file_stage(name, "FSDP") for name in files}
    assert stages == {"stage1.yaml": 1, "sharded.yaml": 3, "plain.yaml": 0, "ds3.yaml": 0}
    assert accelerate_flags._file_stage("ds3.yaml", "DEEPSPEED") == 3

# ----------------------------------------------------------------------------------------------------------
# one-line errors: refused flags, bad values (as a file's), contradictions
# ----------------------------------------------------------------------------------------------------------

REFUSED = [
    (["--use_megatron_lm"], ["--use_megatron_lm", "Megatron-LM is not available yet in accel"]),
    (["--megatron_lm_tp_degree", "2"], ["--megatron_lm_tp_degree", "Megatron-LM", "--tp_size"]),
    (["--tpu"], ["--tpu", "TPUs"]),
    (["--vm", "a", "--vm", "b"], ["--vm", "TPUs"]),
    (["--env", "A=1"], ["--env", "TPU pod"]),
    (["--aws_access_key_id", "x"], ["--aws_access_key_id", "SageMaker"]),
    (["--mpirun_hostfile", "h"], ["--mpirun_hostfile", "not available yet in accel", "--hostfile"]),
    (["--deepspeed_moe_layer_cls_names", "MoeBlock"], ["--deepspeed_moe_layer_cls_names", "not available"]),
    (["--fp8_backend", "te"], ["--fp8_backend", "'te' is not supported by accel; allowed: AO"]),
    (["--fp8_format", "E4M3"], ["--fp8_format", "Transformer Engine", "not available yet in accel"]),
    (["--fp8_opt_level", "O1"], ["--fp8_opt_level", "MS-AMP"]),
    (["--offload_param_nvme_path", "/nvme"], ["--offload_param_nvme_path", "nvme", "--offload_param_device cpu"]),
    (["--deepspeed_multinode_launcher", "openmpi"], ["--deepspeed_multinode_launcher openmpi", "not available yet"]),
    (["--deepspeed_multinode_launcher", "slurm"], ["not available yet", "srun --ntasks-per-node=1 accel launch"]),
    (["--fsdp_activation_checkpointing_offload", "true"], ["--fsdp_activation_checkpointing_offload", "not available"]),
    (["--use_fsdp", "--use_deepspeed"], ["--use_deepspeed and --use_fsdp contradict"]),
    (["--zero_stage", "2", "--fsdp_sharding_strategy", "FULL_SHARD"], ["--zero_stage 2", "--fsdp_sharding_strategy"]),
    (["--sp_size", "2", "--parallelism_config_sp_size", "4"],
     ["--sp_size 2 and --parallelism_config_sp_size 4 disagree (sp_size 2 vs 4); allowed: give one of them"]),
    (["--num_processes", "4", "--parallelism_config_cp_size", "2", "--parallelism_config_sp_size", "2"],
     ["cp_size=2 and sp_size=2: context and sequence parallelism both split the sequence"]),
    (["-m", "--no_python"], ["--module and --no_python"]),
    (["--no_python"], ["--no_python: command not found on PATH: train.py", "./train.py"]),
    (["--num_cpu_threads_per_process", "0"], ["--num_cpu_threads_per_process", "'0'", "an integer >= 1"]),
    (["--fsdp_offload_params", "maybe"], ["--fsdp_offload_params", "'maybe'", "true or false"]),
    (["--monitor_interval", "0"], ["--monitor_interval", "a number of seconds > 0, at most 31536000"]),
    (["--monitor_interval", "inf"], ["--monitor_interval", "'inf'", "a number of seconds > 0"]),
    (["--tee", "5"], ["--tee", "'5'"]),
    (["--rdzv_conf", "is_host=1"], ["--rdzv_conf", "is_host"]),
    (["--rdzv_conf", "join_timeout"], ["--rdzv_conf", "key=value"]),
]


@pytest.mark.parametrize("args,needles", REFUSED, ids=[" ".join(case[0]) for case in REFUSED])
def test_refused_and_bad_flags_are_one_line_exit_2(run_accel, workdir, args, needles):
    one_line_error(run_accel("launch", "--cpu", *args, "train.py", cwd=workdir), *needles)
    assert not (workdir / "ran").exists()


@pytest.mark.parametrize("flag,value,section,key", [
    ("--fsdp_sharding_strategy", "FOO", "fsdp_config", "fsdp_sharding_strategy"),
    ("--fsdp_auto_wrap_policy", "BY_MAGIC", "fsdp_config", "fsdp_auto_wrap_policy"),
    ("--offload_optimizer_device", "disk", "deepspeed_config", "offload_optimizer_device"),
    ("--offload_optimizer_device", "nvme", "deepspeed_config", "offload_optimizer_device"),
    ("--parallelism_config_cp_size", "two", "parallelism_config", "parallelism_config_cp_size"),
    ("--parallelism_config_cp_backend", "ring", "parallelism_config", "parallelism_config_cp_backend"),
    ("--parallelism_config_cp_comm_strategy", "p2p", "parallelism_config", "parallelism_config_cp_comm_strategy"),
    ("--parallelism_config_sp_backend", "ulysses", "parallelism_config", "parallelism_config_sp_backend"),
])
def test_a_bad_value_reads_as_the_file_key_s_error_naming_the_flag(run_accel, workdir, flag, value, section, key):
    distributed_type = {"fsdp_config": "FSDP", "deepspeed_config": "DEEPSPEED"}.get(section, "MULTI_CPU")
    (workdir / "bad.yaml").write_text(f"distributed_type: {distributed_type}\n{section}:\n  {key}: {value}\n")
    from_flag = one_line_error(run_accel("launch", "--cpu", flag, value, "train.py", cwd=workdir), flag)
    from_file = one_line_error(run_accel("launch", "--cpu", "--config_file", "bad.yaml", "train.py", cwd=workdir),
                               f"key '{section}.{key}'")
    assert from_flag.partition(f"{flag}:")[2] == from_file.partition(f"key '{section}.{key}':")[2]


# ----------------------------------------------------------------------------------------------------------
# the launch: workers' environment, torchrun's flags, --no_python, the DeepSpeed multi-node flags
# ----------------------------------------------------------------------------------------------------------

def test_launch_flags_in_the_torchrun_command_and_the_workers_environment(run_accel, workdir):
    _, words = dry_run(run_accel, workdir, "--cpu", "--num_processes", "2", "--num_cpu_threads_per_process", "3",
                       "--debug", "--monitor_interval", "0.5", "--role", "trainer", "--rdzv_conf", "join_timeout=60",
                       "--log_dir", "logs", "-t", "1", "-q", "--same_network", "--quiet")
    env = dict(word.split("=", 1) for word in words[:3])
    assert (env["OMP_NUM_THREADS"], env["ACCELERATE_DEBUG_MODE"]) == ("3", "true")
    argv = words[words.index("torch.distributed.run") + 1:]

    def last(name):
        return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # torchrun takes the last one given

    assert (last("--monitor_interval"), last("--role"), last("--rdzv_conf"), last("--tee")) == \
        ("0.5", "trainer", "join_timeout=60", "1")
    _, words = dry_run(run_accel, workdir, "--num_cpu_threads_per_process", "2", "--debug")  # one process: exec'd
    assert words[0].startswith("ACCEL_LAUNCH_CONFIG=")
    assert words[1:] == ["OMP_NUM_THREADS=2", "ACCELERATE_DEBUG_MODE=true", sys.executable, "train.py"]


def test_rdzv_conf_joins_is_host_on_several_machines():
    cfg = config_from_dict({"num_processes": 4, "num_machines": 2, "machine_rank": 1, "rdzv_backend": "c10d",
                                 "main_process_ip": "10.0.0.5", "main_process_port": 29400}, "test")
    argv = launch.build_torchrun_args(cfg, ["t.py"], 0, 29400, "join_timeout=60")
    assert argv[argv.index("--rdzv_conf") + 1] == "is_host=0,join_timeout=60" and argv.count("--rdzv_conf") == 1


def test_no_python_runs_the_program_itself(run_accel, workdir):
    program = workdir / "run.sh"
    program.write_text("#!/bin/sh\necho \"ran with OMP_NUM_THREADS=$OMP_NUM_THREADS $1\"\n")
    program.chmod(0o755)
    _, words = dry_run(run_accel, workdir, "--cpu", "--num_processes", "2", "--no_python", script="./run.sh")
    assert "--no-python" in words and words[-1] == "./run.sh"
    _, words = dry_run(run_accel, workdir, "--cpu", "--no_python", script="./run.sh")
    assert words[1:] == ["./run.sh"]  # one process: the program itself, no python in front
    result = run_accel("launch", "--cpu", "--no_python", "--num_cpu_threads_per_process", "5", "./run.sh", "x",
                       cwd=workdir)
    assert result.returncode == 0 and result.stdout.strip() == "ran with OMP_NUM_THREADS=5 x", result.stderr
    program.chmod(0o644)
    one_line_error(run_accel("launch", "--cpu", "--no_python", "./run.sh", cwd=workdir), "not executable")


def test_deepspeed_multinode_flags_are_accel_s_hostfile_flags(run_accel, workdir):
    (workdir / "hosts").write_text("h1 slots=2\nh2 slots=2\nh3 slots=2\n")
    result = run_accel("launch", "--cpu", "--deepspeed_hostfile", "hosts", "--deepspeed_exclusion_filter", "h2",
                       "--deepspeed_multinode_launcher", "pdsh", "--use_deepspeed", "--dry_run", "train.py",
                       cwd=workdir)
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert [command[3] for command in commands] == ["h1", "h3"]  # ssh -o BatchMode=yes HOST 'remote command'
    remote = shlex.split(commands[0][-1])
    assert "--use_deepspeed" in remote and not any(word.startswith("--deepspeed_") for word in remote)
    one_line_error(run_accel("launch", "--cpu", "--deepspeed_hostfile", "hosts", "--hostfile", "other", "train.py",
                             cwd=workdir), "--deepspeed_hostfile and --hostfile")


def test_cpu_affinity_is_torchrun_s_numa_binding_on_gpus_only(monkeypatch):
    args = argparse.Namespace(enable_cpu_affinity=True)
    on_gpus = config_from_dict({"num_processes": 2, "distributed_type": "MULTI_GPU"}, "test")
    on_cpus = config_from_dict({"num_processes": 2, "use_cpu": True}, "test")
    assert accelerate_flags.torchrun_flags(args, on_cpus) == []
    monkeypatch.setattr(accelerate_flags.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert accelerate_flags.torchrun_flags(args, on_gpus) == ["--numa-binding", "node"]
    monkeypatch.setattr(accelerate_flags.shutil, "which", lambda name: None)
    with pytest.raises(UsageError, match="--enable_cpu_affinity: .*numactl"):
        accelerate_flags.torchrun_flags(args, on_gpus)


def test_env_takes_the_config_flags_too(run_accel, workdir):
    result = run_accel("env", "--cpu", "--num_processes", "2", "--use_fsdp", "--fsdp_reshard_after_forward", "false",
                       cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "zero_stage: 2" in result.stdout


# ----------------------------------------------------------------------------------------------------------
# one real launch: 2 processes, FSDP flags, the launch flags
# ----------------------------------------------------------------------------------------------------------

WORKER = """
import json, os, pathlib, sys
import torch
from torch.distributed.tensor import DTensor
from accel import Accelerator, PartialState

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x))

accelerator = Accelerator()
model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 1))
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
loss = model(torch.randn(4, 8, device=accelerator.device)).pow(2).mean()
accelerator.backward(loss)
optimizer.step()
par = accelerator.parallelism_config
pathlib.Path(sys.argv[1], f"rank{accelerator.process_index}.json").write_text(json.dumps({
    "rank": accelerator.process_index, "zero_stage": par.zero_stage, "wrap": par.zero_wrap_classes,
    "sharded": isinstance(next(model.parameters()), DTensor), "threads": os.environ.get("OMP_NUM_THREADS"),
    "torch_threads": torch.get_num_threads(), "debug": PartialState().debug, "role": os.environ.get("ROLE_NAME"),
}))
"""


@pytest.mark.multiproc
def test_two_processes_get_the_zero_stage_the_fsdp_flags_ask_for(tmp_path, isolated_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2", "--use_fsdp",
               "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--fsdp_transformer_layer_cls_to_wrap", "Block",
               "--num_cpu_threads_per_process", "2", "--debug", "--role", "trainer", "--monitor_interval", "0.05",
               "--rdzv_conf", "join_timeout=30", str(script), str(tmp_path)]
    proc = subprocess.run(command, cwd=tmp_path, env={**isolated_env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert (result["zero_stage"], result["wrap"], result["sharded"]) == (2, "Block", True)
        assert (result["threads"], result["torch_threads"]) == ("2", 2)  # the flag beat the environment's 1
        assert (result["debug"], result["role"]) == (True, "trainer")
