"""`accel launch` without starting workers: torchrun argv, flag precedence, worker env, and every user error."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from accel.cli import launch
from accel.cli._common import UsageError
from accel.cli.main import build_parser
from accel.config import LAUNCH_ENV, AccelConfig, ConfigError, config_from_dict

PROBE = "probe.py"


def parse(*argv: str):
    return build_parser().parse_args(["launch", *argv])


def cfg_of(**values) -> AccelConfig:
    return config_from_dict(values, "test")


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def script(tmp_path):
    path = tmp_path / PROBE
    path.write_text("import sys\nsys.exit(0)\n")
    return path


# ----------------------------------------------------------------------------------------------------------
# build_torchrun_args / worker_env
# ----------------------------------------------------------------------------------------------------------

def test_one_machine_uses_local_c10d_on_the_given_or_a_kernel_picked_port():
    cfg = cfg_of(num_processes=4, use_cpu=True)
    argv = launch.build_torchrun_args(cfg, ["train.py", "--lr", "1"], 2, 0)
    assert argv[-3:] == ["train.py", "--lr", "1"]
    assert option(argv, "--nnodes") == "1" and option(argv, "--nproc_per_node") == "4"
    assert option(argv, "--max_restarts") == "2"
    assert option(argv, "--rdzv_backend") == "c10d"
    assert option(argv, "--rdzv_endpoint") == "127.0.0.1:0"  # port 0: the agent binds a free port itself
    assert "--node_rank" not in argv
    assert launch.rendezvous_port(cfg) == 0
    cfg = cfg_of(num_processes=2, main_process_port=29123)
    assert launch.rendezvous_port(cfg) == 29123
    assert option(launch.build_torchrun_args(cfg, ["t.py"]), "--rdzv_endpoint") == "127.0.0.1:29123"


def test_two_machines_static_passes_machine_rank_as_node_rank():
    cfg = cfg_of(num_processes=8, num_machines=2, machine_rank=1, main_process_ip="10.0.0.5")
    argv = launch.build_torchrun_args(cfg, ["-m", "pkg.train", "--epochs", "3"], 0, launch.rendezvous_port(cfg))
    assert option(argv, "--nnodes") == "2" and option(argv, "--nproc_per_node") == "4"
    assert option(argv, "--rdzv_backend") == "static"
    assert option(argv, "--node_rank") == "1"
    assert option(argv, "--master_addr") == "10.0.0.5"
    assert option(argv, "--master_port") == "29500"  # default port for several machines
    assert argv[-5:] == ["--module", "--", "pkg.train", "--epochs", "3"]
    assert "--rdzv_endpoint" not in argv


def test_two_machines_c10d_uses_an_endpoint_and_an_id_every_machine_derives_alike():
    common = dict(num_processes=4, num_machines=2, main_process_ip="10.0.0.5", main_process_port=29400,
                  rdzv_backend="c10d")
    argv0 = launch.build_torchrun_args(cfg_of(machine_rank=0, **common), ["t.py"], 0, 29400)
    argv1 = launch.build_torchrun_args(cfg_of(machine_rank=1, **common), ["t.py"], 0, 29400)
    assert option(argv0, "--rdzv_backend") == "c10d"
    assert option(argv0, "--rdzv_endpoint") == "10.0.0.5:29400"
    assert option(argv0, "--rdzv_id") == option(argv1, "--rdzv_id")
    assert option(argv0, "--rdzv_id") != option(launch.build_torchrun_args(
        cfg_of(machine_rank=0, **{**common, "main_process_port": 29401}), ["t.py"], 0, 29401), "--rdzv_id")
    assert option(argv0, "--rdzv_conf") == "is_host=1" and option(argv1, "--rdzv_conf") == "is_host=0"
    assert "--node_rank" not in argv0 and "--master_addr" not in argv0


def test_worker_env_is_one_config_variable_plus_cuda_visible_devices():
    cfg = cfg_of(num_processes=2, gpu_ids="1,3", mixed_precision="bf16")
    env = launch.worker_env(cfg)
    assert set(env) == {LAUNCH_ENV, "CUDA_VISIBLE_DEVICES"}
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert config_from_dict(json.loads(env[LAUNCH_ENV])) == cfg
    assert set(launch.worker_env(cfg_of(gpu_ids="1,3", use_cpu=True))) == {LAUNCH_ENV}
    assert set(launch.worker_env(cfg_of())) == {LAUNCH_ENV}


# ----------------------------------------------------------------------------------------------------------
# flags
# ----------------------------------------------------------------------------------------------------------

def test_only_given_flags_override_and_they_beat_the_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("num_processes: 4\nmixed_precision: fp16\ngradient_accumulation_steps: 8\n"
                        "parallelism:\n  zero_stage: 1\n  tp_size: 2\n")
    args = parse("--config_file", str(cfg_file), "--mixed-precision", "bf16", "--zero_stage", "3", "--cpu",
                 "train.py", "--mixed_precision", "fp8")
    overrides = launch.flag_overrides(args)
    assert overrides == {"mixed_precision": "bf16", "parallelism": {"zero_stage": 3}, "use_cpu": True,
                         "distributed_type": None}
    cfg = launch.resolve_launch_config(args.config_file, overrides)
    assert (cfg.mixed_precision, cfg.parallelism.zero_stage, cfg.use_cpu) == ("bf16", 3, True)  # flags
    assert (cfg.num_processes, cfg.gradient_accumulation_steps, cfg.parallelism.tp_size) == (4, 8, 2)  # file
    assert args.script == "train.py" and args.script_args == ["--mixed_precision", "fp8"]  # untouched


def test_everything_after_the_script_is_the_scripts(tmp_path):
    args = parse("--num_processes", "2", "s.py", "--num_processes", "7", "--m", "-m", "x", "--", "--cpu")
    assert args.num_processes == 2 and args.module is False and args.cpu is None
    assert args.script_args == ["--num_processes", "7", "--m", "-m", "x", "--", "--cpu"]
    args = parse("-m", "pkg.mod", "--cpu")
    assert args.module is True and args.script == "pkg.mod" and args.script_args == ["--cpu"]
    assert launch.flag_overrides(parse("s.py")) == {}


def test_multi_gpu_flag_and_a_single_process_file_do_not_contradict(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg_file = tmp_path / "accelerate_single.yaml"
    cfg_file.write_text("distributed_type: 'NO'\nnum_processes: 1\nuse_cpu: true\n")
    cfg = launch.resolve_launch_config(str(cfg_file), launch.flag_overrides(parse("--num_processes", "2", "s.py")))
    assert cfg.num_processes == 2 and cfg.distributed_type is None  # derived again at launch
    cfg = launch.resolve_launch_config(str(cfg_file), launch.flag_overrides(parse("--multi_gpu", "s.py")))
    assert cfg.distributed_type == "MULTI_GPU" and cfg.use_cpu is False
    with pytest.raises(ConfigError):
        launch.resolve_launch_config(str(cfg_file), {"distributed_type": "MULTI_GPU"})


def test_gpu_checks(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch._check_hardware(cfg_of(num_processes=2)).distributed_type == "MULTI_GPU"
    assert launch._check_hardware(cfg_of(num_processes=2, use_cpu=True)).distributed_type == "MULTI_CPU"
    with pytest.raises(UsageError, match="only 2 GPU"):
        launch._check_hardware(cfg_of(num_processes=3))
    assert launch._check_hardware(cfg_of(num_processes=4, num_machines=2, main_process_ip="h")).num_processes == 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert launch._check_hardware(cfg_of(num_processes=2)).distributed_type == "MULTI_CPU"
    with pytest.raises(UsageError, match="use --cpu"):
        launch._check_hardware(cfg_of(num_processes=2, distributed_type="MULTI_GPU"))


def test_port_in_use_detects_a_listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert launch.port_in_use(sock.getsockname()[1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert not launch.port_in_use(port)


# ----------------------------------------------------------------------------------------------------------
# user errors through the real command line: exit 2, one line, no traceback, nothing started
# ----------------------------------------------------------------------------------------------------------

def assert_one_line_error(result, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("accel launch: error: "), lines[0]
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_missing_script(run_accel):
    assert_one_line_error(run_accel("launch", "--cpu", "no_such_script.py"), "no_such_script.py", "not found")


def test_no_script_and_module_without_name(run_accel):
    assert_one_line_error(run_accel("launch", "--cpu"), "no script")
    assert_one_line_error(run_accel("launch", "--cpu", "-m"), "-m", "module")


def test_cpu_with_multi_gpu(run_accel, script):
    assert_one_line_error(run_accel("launch", "--cpu", "--multi_gpu", script), "--cpu", "--multi_gpu")


def test_multi_gpu_without_cuda(run_accel, script):
    result = run_accel("launch", "--multi_gpu", "--num_processes", "2", script, env={"CUDA_VISIBLE_DEVICES": ""},
                       timeout=120)
    assert_one_line_error(result, "no CUDA device", "--cpu")


def test_bad_mixed_precision(run_accel, script):
    assert_one_line_error(run_accel("launch", "--mixed_precision", "fp32", script),
                          "accel launch flags", "mixed_precision", "fp32", "bf16")


def test_bad_config_key_with_did_you_mean(run_accel, script, tmp_path):
    cfg_file = tmp_path / "typo.yaml"
    cfg_file.write_text("num_proceses: 2\n")
    assert_one_line_error(run_accel("launch", "--config_file", cfg_file, script),
                          str(cfg_file), "num_proceses", "did you mean 'num_processes'")


def test_config_from_env_variable_is_used(run_accel, script, tmp_path):
    cfg_file = tmp_path / "env.yaml"
    cfg_file.write_text("gradient_accumulation_steps: 0\n")
    result = run_accel("launch", script, env={"ACCEL_CONFIG_FILE": str(cfg_file)})
    assert_one_line_error(result, str(cfg_file), "gradient_accumulation_steps")


def test_cross_field_error(run_accel, script):
    assert_one_line_error(run_accel("launch", "--cpu", "--num_processes", "3", "--num_machines", "2",
                                    "--main_process_ip", "127.0.0.1", script), "num_processes", "divisible")


def test_unavailable_backend_is_refused_before_starting(run_accel, script, tmp_path):
    cfg_file = tmp_path / "pp_offload.yaml"
    cfg_file.write_text("parallelism:\n  zero_stage: 3\n  offload_params: true\n")
    assert_one_line_error(run_accel("launch", "--config_file", str(cfg_file), "--cpu", "--num_processes", "2",
                                    "--pp_size", "2", script),
                          "pipeline parallelism (pp_size=2) with CPU offload is not available yet")


def test_tensor_parallel_with_zero_stage_1_is_refused_before_starting(run_accel, script):
    assert_one_line_error(run_accel("launch", "--cpu", "--num_processes", "4", "--tp_size", "2", "--zero_stage", "1",
                                    script), "tensor parallelism (tp_size=2) with ZeRO stage 1", "not available yet")


@pytest.mark.parametrize("config,needle", [
    ("parallelism:\n  zero_stage: 1\n  offload_optimizer: true\n",
     "offload_optimizer/offload_params need zero_stage 2 or 3 (FSDP2's CPU offload), got zero_stage=1"),
    ("parallelism:\n  pp_size: 2\n  pp_schedule: GPipe\n  pp_stages_per_rank: 2\n",
     "pp_schedule GPipe runs one stage per process, got pp_stages_per_rank=2"),
], ids=["offload-needs-stage-2", "single-stage-schedule"])
def test_combination_rules_are_checked_before_any_process_starts(run_accel, script, tmp_path, config, needle):
    """Rules that only a worker knew (every worker then refused the config) are checked by `accel launch` and
    `accel env` alike."""
    cfg_file = tmp_path / "combination.yaml"
    cfg_file.write_text(config)
    assert_one_line_error(run_accel("launch", "--config_file", str(cfg_file), "--cpu", "--num_processes", "2",
                                    script), needle)
    env = run_accel("env", "--config_file", str(cfg_file), "--cpu", "--num_processes", "2")  # launch's flags
    assert env.returncode == 2 and needle in env.stderr.strip().splitlines()[-1]


def test_port_in_use(run_accel, script):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_accel("launch", "--cpu", "--num_processes", "2", "--main_process_port", port, script)
    assert_one_line_error(result, str(port), "main_process_port", "in use")


def test_unknown_flag_and_bad_int(run_accel, script):
    assert_one_line_error(run_accel("launch", "--num_gpus", "2", script), "--num_gpus")
    assert_one_line_error(run_accel("launch", "--num_processes", "two", script), "--num_processes", "two")


def test_launcher_does_not_import_torch_before_it_needs_it(isolated_env, tmp_path):
    import subprocess

    code = ("import sys; from accel.cli.main import main; from accel.cli import launch; "
            "launch._exec_single = lambda cfg, argv: print('torch' in sys.modules) or 0; "
            "sys.exit(main(['launch', '--cpu', sys.argv[1]]))")
    script = tmp_path / "s.py"
    script.write_text("")
    result = subprocess.run([sys.executable, "-c", code, str(script)], capture_output=True, text=True,
                            timeout=60, env=isolated_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("flag,value,needle", [
    ("--pp_schedule", "Foo", "'parallelism.pp_schedule': bad value 'Foo'; allowed: one of GPipe, 1F1B"),
    ("--pp_microbatches", "0", "'parallelism.pp_microbatches': bad value 0; allowed: an integer >= 1"),
])
def test_bad_pipeline_flags_are_one_line_errors(run_accel, script, flag, value, needle):
    assert_one_line_error(run_accel("launch", "--cpu", "--num_processes", "2", "--pp_size", "2", flag, value, script),
                          needle)


# ----------------------------------------------------------------------------------------------------------
# long sequences: --sp_size, --cp_size, --cp_comm_strategy
# ----------------------------------------------------------------------------------------------------------

def test_sequence_flags_override_the_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("num_processes: 4\nparallelism:\n  cp_size: 2\n  cp_comm_strategy: ring\n")
    args = parse("--config_file", str(cfg_file), "--cp_size", "4", "--cpu", "train.py")
    overrides = launch.flag_overrides(args)
    assert overrides["parallelism"] == {"cp_size": 4}
    cfg = launch.resolve_launch_config(args.config_file, overrides)
    assert (cfg.parallelism.cp_size, cfg.parallelism.cp_comm_strategy) == (4, "ring")  # flag, file
    args = parse("--config_file", str(cfg_file), "--cp_size", "1", "--sp_size", "2", "--cp-comm-strategy", "allgather",
                 "train.py")
    assert launch.flag_overrides(args)["parallelism"] == {"sp_size": 2, "cp_size": 1, "cp_comm_strategy": "allgather"}
    cfg = launch.resolve_launch_config(args.config_file, launch.flag_overrides(args))
    par = cfg.parallelism
    assert (par.sp_size, par.cp_size, par.cp_comm_strategy) == (2, 1, "allgather")


def test_sequence_flags_in_a_dry_run(run_accel, script):
    result = run_accel("launch", "--dry_run", "--cpu", "--num_processes", "4", "--sp_size", "2", "--zero_stage", "3",
                       script)
    assert result.returncode == 0, result.stderr
    sent = json.loads(result.stdout.split("ACCEL_LAUNCH_CONFIG=", 1)[1].split("'")[1])
    assert (sent["parallelism"]["sp_size"], sent["parallelism"]["zero_stage"]) == (2, 3)
    assert "sp_size: 2  # accel launch flags" in result.stdout


@pytest.mark.parametrize("flags,needle", [
    (["--num_processes", "4", "--sp_size", "2", "--cp_size", "2"],
     "parallelism: cp_size=2 and sp_size=2: context and sequence parallelism both split the sequence, use one of "
     "them; allowed: cp_size 1 or sp_size 1"),
    (["--num_processes", "3", "--sp_size", "2"],
     "key 'num_processes': 3 is not divisible by tp_size x pp_size x sp_size = 2"),
    (["--num_processes", "2", "--cp_size", "2", "--cp_comm_strategy", "p2p"],
     "key 'parallelism.cp_comm_strategy': bad value 'p2p'; allowed: one of allgather, ring"),
    (["--num_processes", "2", "--sp_size", "0"], "key 'parallelism.sp_size': bad value 0; allowed: an integer >= 1"),
], ids=["cp-and-sp", "sp-does-not-divide", "bad-strategy", "sp-zero"])
def test_sequence_flags_one_line_errors(run_accel, script, flags, needle):
    assert_one_line_error(run_accel("launch", "--cpu", *flags, script), needle)


def test_the_scripts_arguments_are_never_read_as_torchruns():
    """`--signal` is an ambiguous abbreviation of torchrun's --signals_to_handle: torchrun's parser refused the launch
    (`accel launch train.py --signal X` exited 2) before the script's arguments were put after `--`."""
    from accel.cli import checks

    cfg = cfg_of(num_processes=2, use_cpu=True)
    for script in (["train.py"], ["-m", "pkg.train"]):
        argv = launch.build_torchrun_args(cfg, [*script, "--signal", "SIGSEGV", "--", "x"], 0, 0)
        checks.check_torchrun_argv(argv)
        from torch.distributed import run as torchrun

        parsed = torchrun.parse_args(argv)
        assert parsed.training_script == script[-1] and parsed.module == (script[0] == "-m")
        assert parsed.training_script_args == ["--signal", "SIGSEGV", "--", "x"]
