"""docs/troubleshooting.md "Exit codes": each code the table documents is what
`accel launch` returns.

Most codes are already asserted by the tests of their feature, listed in COVERED (not launched again here); this file
launches only what no other test returns: a worker killed by SIGKILL (137), the launcher interrupted by SIGINT (130),
torchrun itself failing (1, without processes) and ssh failing to reach a host (255, without ssh)."""

from __future__ import annotations

import ast
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_python

from accel.cli import multinode
from accel.cli import output as output_cmd
from accel.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parents[1] / "scripts" / "hang_worker.py"

# the documented code column -> the tests that assert the launcher returns it (FILE::TEST, FILE under tests/); 128 + N:
# 139 (SIGSEGV), 134 (SIGABRT), 137 (SIGKILL), 143 (SIGTERM, twice), 130 (SIGINT)
LAUNCHING, CHECKPOINTS, TRAINING = "multiproc/launching", "multiproc/checkpoints", "multiproc/training"
COVERED = {
    "0": [f"{LAUNCHING}/test_launch.py::test_two_processes_get_ranks_the_config_and_untouched_args"],
    "1": [f"{LAUNCHING}/test_quiet_output.py::test_quiet_output_log_dir_and_rank_filter",  # a worker's exception
          f"{CHECKPOINTS}/test_main_process_save.py::test_collective_save_called_on_the_main_process_alone_says_so",
          f"{LAUNCHING}/test_exit_codes.py::test_torchrun_failing_is_1_in_one_line"],
    "2": ["unit/cli/test_launch_path_flags.py::test_a_log_dir_under_a_file",
          "unit/cli/test_launch_path_flags.py::test_an_empty_value_is_refused_not_taken_for_the_default",
          "unit/cli/test_cli_launch.py::test_the_scripts_arguments_are_never_read_as_torchruns"],
    "74": [f"{CHECKPOINTS}/test_failed_save_exit_code.py::test_a_save_failing_after_the_script_ended_exits_74",
           f"{CHECKPOINTS}/test_failed_save_exit_code.py::test_a_failed_grace_save_is_not_exit_code_75",
           "unit/checkpoint/test_async_save.py::"
           "test_a_failed_asynchronous_save_never_exits_0_and_leaves_no_temporary_folder"],
    "75": [f"{LAUNCHING}/test_preemption.py::test_sigterm_mid_epoch_saves_and_the_next_launch_resumes_bit_exactly"],
    "76": [f"{TRAINING}/test_fault_tolerance.py::test_a_late_group_is_waited_for_and_diverged_groups_are_stopped"],
    "128 + N": [f"{LAUNCHING}/test_worker_signals.py::test_a_segfault_while_the_other_rank_waits_is_a_crash",
                f"{LAUNCHING}/test_worker_signals.py::test_an_abort_outside_any_collective_is_the_workers_own",
                f"{LAUNCHING}/test_exit_codes.py::test_a_worker_killed_by_sigkill_is_137",
                f"{LAUNCHING}/test_preemption.py::test_a_second_signal_stops_the_workers",  # 143
                f"{LAUNCHING}/test_hang_report.py::"
                "test_the_job_stops_soon_after_the_timeout_with_the_stuck_ranks_exit_code",
                f"{LAUNCHING}/test_exit_codes.py::test_sigint_to_the_launcher_is_130"],
    "255": [f"{LAUNCHING}/test_exit_codes.py::test_a_host_ssh_cannot_reach_is_255"],
    "another": [f"{LAUNCHING}/test_launch.py::test_failing_worker_stops_the_group_and_sets_the_exit_code",  # 3
                f"{LAUNCHING}/test_launch.py::test_one_process_runs_without_torchrun_and_keeps_the_exit_code",  # 5
                f"{LAUNCHING}/test_multinode_launch.py::test_a_failing_host_stops_the_other_and_is_named"],  # 3
}


def readme_codes() -> list[str]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Code")]
    return [row.split("|")[1].strip().strip("`") for row in rows]


def test_every_documented_code_is_tested():
    assert readme_codes() == list(COVERED)
    for code, tests in COVERED.items():
        for test in tests:
            path, name = test.split("::")
            tree = ast.parse((ROOT / "tests" / path).read_text())
            assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, (code, test)


def launch(tmp_path, *worker_args: str) -> warm_python.Popen:
    from conftest import make_isolated_env

    env = {**make_isolated_env(tmp_path), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return warm_python.Popen([sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2",
                             "--collective_timeout", "30", str(WORKER), *worker_args],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.multiproc
def test_a_worker_killed_by_sigkill_is_137(tmp_path):
    proc = launch(tmp_path, "--signal", "SIGKILL", "--sleep", "0.5", "--late")
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    assert re.search(r"accel launch: rank 1 \(local rank 1, pid \d+\) was killed by signal 9 \(SIGKILL\)"
                     r"( \(first failure\))?: SIGKILL cannot be caught .* out-of-memory killer \(check `dmesg`",
                     stderr), stderr


@pytest.mark.multiproc
def test_sigint_to_the_launcher_is_130(tmp_path):
    proc = launch(tmp_path, "--sleep", "60")  # rank 1 sleeps, rank 0 waits in an all_reduce
    deadline, seen = time.monotonic() + 60, ""
    try:
        while "entering the all_reduce" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([proc.stdout], [], [], 0.5)[0]:
                seen += proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    # one line after the start line: no worker's KeyboardInterrupt traceback, no torchrun log line
    lines = stderr.splitlines()
    assert lines[1:] == ["accel launch: stopped by signal 2 (SIGINT); the workers were stopped"], stderr
    assert lines[0].startswith("accel launch: 2 processes"), stderr


def test_torchrun_failing_is_1_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    (tmp_path / "s.py").write_text("")

    def rendezvous_fails(argv):
        raise RuntimeError("The rendezvous timed out\n  after 900 seconds\n")

    monkeypatch.setattr(output_cmd, "run_agent", rendezvous_fails)
    assert main(["launch", "--cpu", "--num_processes", "2", "s.py"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "accel launch: error: torchrun failed: RuntimeError: The rendezvous timed out after 900 seconds"


def test_a_host_ssh_cannot_reach_is_255(capsys):
    """Two "hosts" without ssh: node-b exits 255 as ssh does when it cannot connect; node-a runs until the head closes
    its stdin, as a launcher started by --hostfile does."""
    machines = [multinode.Machine("node-a", (0,)), multinode.Machine("node-b", (0,))]
    code = multinode.run_hosts(machines, [[sys.executable, "-c", "import sys; sys.stdin.read()"],
                                          [sys.executable, "-c", "raise SystemExit(255)"]])
    assert code == 255
    assert capsys.readouterr().err.strip() == ("accel launch: host node-b (machine_rank 1) failed first: it exited "
                                               "with code 255 (ssh could not reach it, or the connection dropped); "
                                               "stopped node-a")


@pytest.mark.multiproc
@pytest.mark.parametrize("signum,group", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)])
def test_a_launch_waiting_for_machine_0_says_so_and_stops_at_once(tmp_path, signum, group):
    """Stale torchrun variables in the shell (RANK=1 WORLD_SIZE=2, machine 0 never comes): the launcher says it waits
    for machine 0, where and how long; SIGTERM or SIGINT end the wait within a second (TCPStore's connect never
    returns to Python: the signal was taken only when it gave up, minutes later), 128 + the signal, one line. A
    replica group's launcher (fault tolerance) says nothing of the stop: its head says how the job ended."""
    from conftest import get_free_port, make_isolated_env

    from accel.cli.fault_tolerance import GROUP_ENV

    (tmp_path / "s.py").write_text("")
    env = {**make_isolated_env(tmp_path), "TMPDIR": str(tmp_path), "RANK": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(get_free_port()), **({GROUP_ENV: "0"} if group else {})}
    proc = warm_python.Popen([sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "s.py"], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, seen = time.monotonic() + 60, ""
    try:
        while "waiting for machine 0" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([proc.stderr], [], [], 0.5)[0]:
                seen += proc.stderr.readline()
        assert f"machine 1 of 2: waiting for machine 0 at 127.0.0.1:{env['MASTER_PORT']} (up to " in seen, seen
        proc.send_signal(signum)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, stderr
    assert took < 2, took
    name = signal.Signals(signum).name
    said = (f"accel launch: stopped by signal {int(signum)} ({name}) while waiting in the rendezvous; no worker was "
            "started")
    assert (said not in stderr and "stopped by signal" not in stderr) if group else said in stderr, stderr
