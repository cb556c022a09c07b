"""Cluster launches without starting anything: hostfiles, --include/--exclude, --num_machines/--num_processes,
SLURM's host lists and variables, and the commands the head sends to each host."""

from __future__ import annotations

import argparse
import shlex

import pytest

from accel.cli import multinode
from accel.cli._common import UsageError
from accel.cli.launch import launch_parser
from accel.cli.main import build_parser
from accel.cli.multinode import (
    Machine,
    filter_hosts,
    forwarded_env,
    parse_hostfile,
    plan_machines,
    slurm_overrides,
)
from accel.runtime.cluster_env import expand_hostlist

POOL = {"w0": 4, "w1": 4, "w2": 2}


# ------------------------------------------------------------------------------------------- hostfile

def test_hostfile_keeps_order_and_skips_comments_and_blank_lines():
    text = "# cluster\n\nw1 slots=2   # fast one\n  w0\tslots=8\n10.0.0.3 slots=1\n"
    assert list(parse_hostfile(text, "hf").items()) == [("w1", 2), ("w0", 8), ("10.0.0.3", 1)]


@pytest.mark.parametrize("text, line, needle", [
    ("w0 slots=2\nw1\n", 2, "'w1' is not a host line; allowed: 'HOST slots=N'"),
    ("w0 slots=two\n", 1, "is not a host line"),
    ("w0 slots=2 extra\n", 1, "is not a host line"),
    ("# c\nw0 slots=0\n", 2, "slots=0; allowed: slots=1 or more"),
    ("w0 slots=1\nw0 slots=2\n", 2, "'w0' is listed twice"),
    ("a@b slots=1\n", 1, "contains '@' or ','"),
])
def test_bad_hostfile_lines_name_file_and_line(text, line, needle):
    with pytest.raises(UsageError) as err:
        parse_hostfile(text, "my_hosts")
    message = str(err.value)
    assert message.startswith(f"hostfile my_hosts:{line}: ") and needle in message and "\n" not in message


def test_empty_hostfile_and_missing_file():
    with pytest.raises(UsageError, match="no hosts in it"):
        parse_hostfile("# nothing\n\n", "hf")
    with pytest.raises(UsageError, match="--hostfile /no/such/file: cannot read it"):
        multinode.read_hostfile("/no/such/file")


# ------------------------------------------------------------------------------- include / exclude / limits

def test_include_exclude_deepspeed_syntax():
    assert filter_hosts(POOL, None, None) == {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3], "w2": [0, 1]}
    # hostfile order is kept whatever the order of the spec; a bare host means all its slots
    assert filter_hosts(POOL, "w2@w0:3,1", None) == {"w0": [1, 3], "w2": [0, 1]}
    assert filter_hosts(POOL, None, "w1@w0:0") == {"w0": [1, 2, 3], "w2": [0, 1]}
    assert filter_hosts(POOL, None, "w2:0,1") == {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}
    assert filter_hosts({"fe80::1": 2, "w": 1}, "fe80::1", None) == {"fe80::1": [0, 1]}  # whole host wins over ':'


@pytest.mark.parametrize("include, exclude, needle", [
    ("w0", "w1", "--include and --exclude exclude each other"),
    ("w9", None, "--include 'w9': host 'w9' is not in the hostfile; hosts there: w0, w1, w2"),
    ("w2:5", None, "host 'w2' has no slot 5; it has slots=2 (0 to 1)"),
    ("w0:a", None, "bad slot list 'a' for host 'w0'"),
    ("w0@@w1", None, "empty host between '@'"),
    (None, "w0@w1@w2", "--exclude 'w0@w1@w2' leaves no host to run on"),
])
def test_include_exclude_errors(include, exclude, needle):
    with pytest.raises(UsageError, match=None) as err:
        filter_hosts(POOL, include, exclude)
    assert needle in str(err.value)


def test_num_machines_takes_the_first_hosts_and_num_processes_the_first_slots():
    assert plan_machines(POOL, num_machines=2) == [Machine("w0", (0, 1, 2, 3)), Machine("w1", (0, 1, 2, 3))]
    # num_processes is the total (as everywhere in accel): 6 over 3 machines -> the first 2 slots of each
    assert plan_machines(POOL, num_processes=6) == [Machine(h, (0, 1)) for h in ("w0", "w1", "w2")]
    assert plan_machines(POOL, num_machines=2, num_processes=2) == [Machine("w0", (0,)), Machine("w1", (0,))]
    picked = plan_machines(POOL, include="w0:1,3@w1:0,2")
    assert [m.gpu_ids for m in picked] == ["1,3", "0,2"]  # slots are GPU ids on that host
    assert plan_machines(POOL, include="w2")[0].gpu_ids is None  # the first N: no --gpu_ids needed


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "different numbers of slots (w0: 4, w1: 4, w2: 2)"),
    ({"num_machines": 4}, "--num_machines 4: the hostfile offers 3 host(s)"),
    ({"num_machines": 0}, "allowed: 1 to 3"),
    ({"num_processes": 7}, "--num_processes 7 is not a positive multiple of the 3 machine(s)"),
    ({"num_processes": 12}, "means 4 per machine but w2 has 2 slot(s); allowed: at most 6"),
])
def test_plan_errors(kwargs, needle):
    with pytest.raises(UsageError) as err:
        plan_machines(POOL, **kwargs)
    assert needle in str(err.value)


# ------------------------------------------------------------------------------------------------- SLURM

@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("gpu[1-2],login,cpu[3]", ["gpu1", "gpu2", "login", "cpu3"]),
    ("r[1-2]n[1-2]-ib", ["r1n1-ib", "r1n2-ib", "r2n1-ib", "r2n2-ib"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node1]", "node[a-b]", "node[3-1]", "a,,b", "node[]", "n[1-2-3]"])
def test_expand_hostlist_rejects_malformed_lists(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


SRUN = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77", "SLURM_NNODES": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
        "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "node[01-04]"}


def test_slurm_step_gives_rank_count_and_main_address():
    assert slurm_overrides(SRUN, {}) == {"num_machines": 4, "machine_rank": 2, "main_process_ip": "node01"}
    # the step's own node list and counts win over the job's
    step = {**SRUN, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[03-04]",
            "SLURM_PROCID": "1"}
    assert slurm_overrides(step, {}) == {"num_machines": 2, "machine_rank": 1, "main_process_ip": "node03"}


def test_slurm_values_yield_to_flags_and_stay_out_of_batch_scripts_and_single_nodes():
    assert slurm_overrides(SRUN, {"machine_rank": 0, "main_process_ip": "10.0.0.1"}) == {"num_machines": 4}
    assert slurm_overrides(SRUN, {"machine_rank": 0, "main_process_ip": "x", "num_machines": 4}) == {}
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert slurm_overrides(batch, {}) == {}  # sbatch's script / salloc's shell: not an srun step
    assert slurm_overrides({**SRUN, "SLURM_NNODES": "1", "SLURM_NTASKS": "1"}, {}) == {}


def test_slurm_errors_are_one_line():
    with pytest.raises(UsageError, match=r"SLURM started 8 tasks on 4 nodes \(\$SLURM_NTASKS\); .*--ntasks-per-node=1"):
        slurm_overrides({**SRUN, "SLURM_NTASKS": "8"}, {})
    with pytest.raises(UsageError, match=r"\$SLURM_JOB_NODELIST='node\[1-' is not a SLURM host list"):
        slurm_overrides({**SRUN, "SLURM_JOB_NODELIST": "node[1-"}, {})
    with pytest.raises(UsageError, match="main_process_ip could not be read"):
        slurm_overrides({k: v for k, v in SRUN.items() if k != "SLURM_JOB_NODELIST"}, {})


def test_slurm_values_reach_the_config_through_the_launch_flags(monkeypatch):
    from accel.cli.launch import flag_overrides

    args = build_parser().parse_args(["launch", "--cpu", "--num_processes", "8", "x.py"])
    for name, value in SRUN.items():
        monkeypatch.setenv(name, value)
    raw = flag_overrides(args)
    assert (raw["num_machines"], raw["machine_rank"], raw["main_process_ip"]) == (4, 2, "node01")


# ----------------------------------------------------------------------------------- what the hosts run

def test_forwarded_env_prefixes_and_env_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".accel_env").write_text("# mine\nHF_HOME=/data/hf\nNCCL_DEBUG=WARN\n")
    (cwd / ".accel_env").write_text("NCCL_DEBUG=INFO\n\n")
    environ = {"PYTHONPATH": "/src", "NCCL_IB_HCA": "mlx5", "OMP_NUM_THREADS": "4", "HOME": "/h", "PATH": "/bin",
               "CUDA_VISIBLE_DEVICES": "0", "ACCEL_LAUNCH_CONFIG": "{}", "ACCEL_SSH_COMMAND": "ssh", "SECRET": "x"}
    env = forwarded_env(environ, str(cwd), str(home))
    assert env == {"PYTHONPATH": "/src", "NCCL_IB_HCA": "mlx5", "OMP_NUM_THREADS": "4", "HF_HOME": "/data/hf",
                   "NCCL_DEBUG": "INFO"}
    (cwd / ".accel_env").write_text("NCCL_DEBUG=INFO\nexport X\n")
    with pytest.raises(UsageError, match=r"\.accel_env:2: 'export X' is not a variable; allowed: KEY=VALUE"):
        forwarded_env(environ, str(cwd), str(home))


def _launch_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", *argv])


def test_each_host_gets_its_rank_the_shared_flags_and_the_script_untouched():
    args = _launch_args("--hostfile", "hf", "--include", "w0@w1:1,3", "--cpu", "--mixed_precision", "bf16",
                        "--max_restarts", "1", "--log_dir", "logs", "--num_processes", "4", "train.py", "--lr", "1")
    shared = multinode.passed_on_flags(args, launch_parser())
    assert shared == ["--cpu", "--mixed_precision", "bf16", "--max_restarts", "1", "--log_dir", "logs"]
    machines = [Machine("w0", (0, 1)), Machine("w1", (1, 3))]
    argv = multinode.machine_argv(machines, 1, 29555, "w0", shared, "/cfg.yaml", ["train.py", "--lr", "1"])
    assert argv == [*shared, "--config_file", "/cfg.yaml", "--num_machines", "2", "--num_processes", "4",
                    "--machine_rank", "1", "--main_process_ip", "w0", "--main_process_port", "29555",
                    "--gpu_ids", "1,3", "train.py", "--lr", "1"]
    module = multinode.machine_argv(machines, 0, 1, "w0", [], None, ["-m", "pkg.train", "-x"])
    assert module[-3:] == ["--module", "pkg.train", "-x"] and "--gpu_ids" not in module


def test_remote_command_is_one_shell_line_that_round_trips():
    command = multinode.remote_command(["--cpu", "my script.py", "--name", "a'b"], {"PYTHONPATH": "/a b"},
                                       "/work dir", python="/venv/bin/python")
    words = shlex.split(command)
    assert words[:4] == ["cd", "/work dir", "&&", "exec"]
    assert words[4:7] == ["env", "PYTHONPATH=/a b", f"{multinode.HEAD_WATCH_ENV}=1"]
    assert words[7:] == ["/venv/bin/python", "-u", "-m", "accel.cli.main", "launch", "--cpu", "my script.py",
                         "--name", "a'b"]


def test_ssh_command_flag_env_and_default():
    assert multinode.ssh_command(_launch_args("--ssh_command", "ssh -p 2222", "x.py"), {}) == ["ssh", "-p", "2222"]
    assert multinode.ssh_command(_launch_args("x.py"), {"ACCEL_SSH_COMMAND": "/bin/fake"}) == ["/bin/fake"]
    assert multinode.ssh_command(_launch_args("x.py"), {}) == ["ssh", "-o", "BatchMode=yes"]
    with pytest.raises(UsageError, match="--ssh_command is empty"):
        multinode.ssh_command(_launch_args("--ssh_command", " ", "x.py"), {})


# --------------------------------------------------------------------------------------- through the CLI

def test_cli_errors_are_one_line_with_exit_2(run_accel, tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "hosts").write_text("w0 slots=1\nw1 slots=one\n")
    result = run_accel("launch", "--hostfile", "hosts", "--cpu", "train.py")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("accel launch: error: hostfile hosts:2: 'w1 slots=one' is not a host line; allowed: "
                             "'HOST slots=N', e.g. 'worker-0 slots=4'\n")
    (tmp_path / "hosts").write_text("w0 slots=1\nw1 slots=1\n")
    result = run_accel("launch", "--hostfile", "hosts", "--machine_rank", "1", "--cpu", "train.py")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--machine_rank cannot be given" in \
        result.stderr


def test_dry_run_prints_one_ssh_command_per_host(run_accel, tmp_path):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    result = run_accel("launch", "--hostfile", "hosts", "--ssh_command", "ssh -p 2222", "--cpu", "--dry_run",
                       "--main_process_port", "29999", "train.py", "--epochs", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        words = shlex.split(line)
        assert words[:4] == ["ssh", "-p", "2222", f"w{rank}"]
        remote = shlex.split(words[4])
        assert remote[remote.index("--machine_rank") + 1] == str(rank)
        assert remote[remote.index("--main_process_ip") + 1] == "w0"
        assert remote[remote.index("--num_processes") + 1] == "4"
        assert remote[-3:] == ["train.py", "--epochs", "1"] and "--dry_run" not in remote
