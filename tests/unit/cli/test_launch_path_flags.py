"""Path-valued flags of `accel launch` and flags whose empty value fell back to a default silently: each
mistake is one line naming the flag, the value and what is allowed, exit code 2, and nothing is started
(the script would write a marker file)."""

from __future__ import annotations

import os

import pytest

from accel.cli import multinode
from accel.cli.main import main


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG", "ACCEL_SSH_COMMAND", "ACCEL_ENV_FILE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "home").mkdir()
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "s.py").write_text("open('STARTED', 'w').close()\n")
    return tmp_path


def refused(capsys, *argv: str) -> str:
    code = main(["launch", "--cpu", *argv, "s.py"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("accel launch: error: "), err
    assert not os.path.exists("STARTED")
    return err.strip()


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_log_dir_under_a_file(workdir, capsys, processes):
    err = refused(capsys, "--num_processes", processes, "--log_dir", "afile/logs")
    assert err == (f"accel launch: error: --log_dir afile/logs: {workdir / 'afile'} is a file; allowed: a folder "
                   "(created when missing) that is not under a file")


def test_a_log_dir_that_is_a_file(workdir, capsys):
    assert refused(capsys, "--num_processes", "2", "--log_dir", "afile") == (
        "accel launch: error: --log_dir afile: it is a file; allowed: a folder (created when missing)")


def test_a_log_dir_that_cannot_be_created(workdir, capsys):
    err = refused(capsys, "--num_processes", "2", "--log_dir", "/proc/1/accel-logs")
    assert err.startswith("accel launch: error: --log_dir /proc/1/accel-logs: ")  # not writable, or cannot create it
    assert err.endswith("; allowed: a folder this user can create and write")


@pytest.mark.parametrize("flag", ["--log_dir", "--config_file", "--hostfile", "--deepspeed_config_file",
                                  "--deepspeed_hostfile", "--ssh_command"])
def test_an_empty_value_is_refused_not_taken_for_the_default(workdir, capsys, flag):
    err = refused(capsys, "--num_processes", "2", flag, "")
    assert err.startswith(f"accel launch: error: {flag} '': empty; allowed: "), err


def test_an_accel_env_folder_is_refused(workdir, capsys):
    (workdir / ".accel_env").mkdir()
    (workdir / "hosts").write_text("localhost slots=2\n")
    err = refused(capsys, "--num_processes", "2", "--hostfile", "hosts", "--dry_run")
    assert err == (f"accel launch: error: {workdir / '.accel_env'}: is a folder; allowed: a file of KEY=VALUE lines "
                   "(or none)")


def test_an_empty_accel_env_file_name_means_the_default(workdir):
    (workdir / ".accel_env").write_text("NCCL_X=1\n")
    assert multinode.forwarded_env({"ACCEL_ENV_FILE": ""}, str(workdir), str(workdir / "home")) == {"NCCL_X": "1"}
    assert multinode.environ_file_name({"ACCEL_ENV_FILE": ""}) == ".accel_env"
