"""The cause, once, first, without starting workers.

* A script that does not compile is refused before any process starts: exit 2, one line with file:line.
* An accel one-line error that reaches the top of a plain `python` script is that line alone (a refusal raised here,
  as accel/runtime/cluster_env.py raises them); ACCEL_FULL_TRACEBACKS=1 shows the traceback.
* In a worker of `accel launch` an uncaught exception is not printed: it goes to torchrun's error file, which the
  launcher reads (accel/cli/output.py) and prints once after its summary line (accel/cli/failure_report.py, accel/cli/hang_report.py).
* torchrun's log lines that repeat accel's own are left out.
The launches themselves: tests/multiproc/launching/test_launch_failure_output.py, test_exit_codes.py (Ctrl-C), test_quiet_output.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from accel.cli import checks, failure_report, hang_report, output
from accel.cli import launch as launch_cmd
from accel.cli._common import UsageError
from accel.cli.main import main
from accel.core import diagnostics as diag


# ----------------------------------------------------------------------------------------------------------
# a script that does not compile
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def nothing_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)

    def started(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(output, "run_agent", started)
    monkeypatch.setattr(launch_cmd, "_exec_single", started)


@pytest.mark.parametrize(("source", "line"), [
    ("import os\nx = (1,\nprint(x)\n", "bad.py:2: SyntaxError: '(' was never closed"),
    ("def f():\nreturn 1\n", "bad.py:2: IndentationError: expected an indented block after function definition "
                             "on line 1"),
    ("print('\xe9')\n".encode("latin-1"), "bad.py:1: SyntaxError: (unicode error) 'utf-8' codec can't decode byte "
                                          "0xe9 in position 0: unexpected end of data"),
])
@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_script_that_does_not_compile_is_one_line_and_exit_2(nothing_starts, tmp_path, capsys, source, line,
                                                                processes):
    script = tmp_path / "bad.py"
    script.write_bytes(source) if isinstance(source, bytes) else script.write_text(source)
    assert main(["launch", "--cpu", "--num_processes", processes, "bad.py"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"accel launch: error: {line}\n" and captured.out == ""


def test_the_dry_run_and_a_folders_main_are_checked_too(nothing_starts, tmp_path, capsys):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("if True\n    pass\n")
    assert main(["launch", "--cpu", "--dry_run", "app"]) == 2
    assert capsys.readouterr().err == (f"accel launch: error: {Path('app') / '__main__.py'}:1: SyntaxError: "
                                       "expected ':'\n")


def test_what_python_runs_without_compiling_it_is_left_to_python(tmp_path):
    """A declared encoding is honoured; a zip application, bytecode and a FIFO (never read: no hang) pass."""
    import importlib.util
    import os

    good = tmp_path / "latin.py"
    good.write_bytes("# -*- coding: latin-1 -*-\nprint('\xe9')\n".encode("latin-1"))
    checks.check_script(str(good))
    app = tmp_path / "app.pyz"
    with zipfile.ZipFile(app, "w") as zf:
        zf.writestr("__main__.py", "print('hi')\n")
    checks.check_script(str(app))
    pyc = tmp_path / "s.pyc"
    pyc.write_bytes(importlib.util.MAGIC_NUMBER + b"\x00" * 12 + b"not python")
    checks.check_script(str(pyc))
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    checks.check_script(str(fifo))
    with pytest.raises(UsageError, match=r"null bytes"):
        (tmp_path / "nul.py").write_bytes(b"print(1)\x00\n")
        checks.check_script(str(tmp_path / "nul.py"))


# ----------------------------------------------------------------------------------------------------------
# plain python: an accel one-line error alone
# ----------------------------------------------------------------------------------------------------------

REFUSAL = """import accel
from accel.runtime.cluster_env import ClusterEnvError


def form_group():  # as PartialState does under srun/mpirun without a launcher
    raise ClusterEnvError("srun step of 2 tasks ($SLURM_NTASKS) without a launcher: $SLURM_PROCID=5;\\n  allowed: "
                          "0 to 1")


form_group()
"""


def run_python(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess:
    from conftest import make_isolated_env

    (tmp_path / "s.py").write_text(source)
    fresh = Path(tempfile.mkdtemp(dir=tmp_path))  # its own HOME: a test may run several scripts
    return subprocess.run([sys.executable, "s.py"], cwd=tmp_path, env={**make_isolated_env(fresh), **env},
                          capture_output=True, text=True, timeout=60)


def test_a_cluster_refusal_under_plain_python_is_the_one_line_alone(tmp_path):
    proc = run_python(tmp_path, REFUSAL)
    assert proc.returncode == 1
    assert proc.stderr == ("accel: error: srun step of 2 tasks ($SLURM_NTASKS) without a launcher: $SLURM_PROCID=5; "
                           "allowed: 0 to 1\n")


def test_a_config_error_subclass_is_one_line_and_other_exceptions_keep_their_traceback(tmp_path):
    proc = run_python(tmp_path, "from accel.config import ConfigError\n\n\nclass Refusal(ConfigError):\n    pass\n\n\n"
                                "try:\n    raise Refusal('caught: never printed')\nexcept ValueError:\n    pass\n"
                                "raise Refusal('mixed_precision: bad value')\n")
    assert (proc.returncode, proc.stderr) == (1, "accel: error: mixed_precision: bad value\n")
    proc = run_python(tmp_path, "import accel\nraise ValueError('the script s own')\n")
    assert proc.stderr.startswith("Traceback (most recent call last):")
    assert "ValueError: the script s own" in proc.stderr


def test_full_tracebacks_show_the_refusals_traceback(tmp_path):
    proc = run_python(tmp_path, REFUSAL, ACCEL_FULL_TRACEBACKS="1")
    assert proc.stderr.startswith("Traceback (most recent call last):") and "in form_group" in proc.stderr
    assert "ClusterEnvError: srun step of 2 tasks" in proc.stderr


# ----------------------------------------------------------------------------------------------------------
# a worker of accel launch: the exception goes to the error file, for the launcher
# ----------------------------------------------------------------------------------------------------------

def worker_failure(tmp_path: Path, source: str, **env: str) -> tuple[subprocess.CompletedProcess, SimpleNamespace]:
    error_file = tmp_path / "rank1.error.json"
    error_file.unlink(missing_ok=True)
    proc = run_python(tmp_path, source, ACCEL_DIAGNOSTICS_DIR=str(tmp_path), TORCHELASTIC_ERROR_FILE=str(error_file),
                      RANK="1", **env)
    data = json.loads(error_file.read_text()) if error_file.exists() else {"message": "<NONE>"}
    return proc, SimpleNamespace(error_file_data=data, error_file=str(error_file), local_rank=1, pid=11, exitcode=1,
                                 timestamp=100)


def test_a_workers_exception_is_left_to_the_launcher(tmp_path):
    proc, failure = worker_failure(tmp_path, "import accel\n\n\ndef step():\n    raise ValueError('bad batch\\n  on "
                                             "rank 1')\n\n\nstep()\n")
    assert (proc.returncode, proc.stderr) == (1, "")  # nothing printed by the worker
    error = output.held_error(failure)
    assert error is not None and error.message == "ValueError: bad batch on rank 1" and not error.printed
    shown = output.error_lines(1, error)
    assert shown[0] == "[rank1]: Traceback (most recent call last):" and shown[-2:] == [
        "[rank1]: ValueError: bad batch", "[rank1]:   on rank 1"]
    assert "[rank1]:     raise ValueError('bad batch\\n  on rank 1')" in shown


def test_a_workers_one_line_error_and_full_tracebacks(tmp_path):
    proc, failure = worker_failure(tmp_path, "from accel.config import ConfigError\n"
                                             "raise ConfigError('sp_size=2: no')\n")
    error = output.held_error(failure)
    assert proc.stderr == "" and error is not None and error.one_line
    assert output.error_lines(1, error) == ["accel: error: sp_size=2: no"]
    proc, failure = worker_failure(tmp_path, "import accel\nraise KeyError('k')\n", ACCEL_FULL_TRACEBACKS="1")
    error = output.held_error(failure)
    assert "Traceback (most recent call last)" in proc.stderr  # printed by the worker, as Python prints it
    assert error is not None and error.printed and error.message == "KeyError: 'k'"
    assert output.error_lines(1, error) == []


# ----------------------------------------------------------------------------------------------------------
# the launcher's lines
# ----------------------------------------------------------------------------------------------------------

def failed(rank: int, exitcode: int, message: str | None = None, one_line: bool = False, at: int = 0):
    data: dict = {"message": "<NONE>"}
    if message is not None:
        stack = f"Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n{message}\n"
        data = {"message": {"message": message, "extraInfo": {
            "py_callstack": stack, "timestamp": "100",
            "accel": {"one_line": one_line, "line": message.split(": ", 1)[1], "printed": False,
                      "time_ns": 100 * 10**9 + at}}}}
    return SimpleNamespace(local_rank=rank, pid=1000 + rank, exitcode=exitcode, timestamp=100, error_file_data=data,
                           error_file="")


def test_the_summary_first_the_traceback_once_then_one_line_per_rank():
    failures = {0: failed(0, -15), 1: failed(1, 1, "ValueError: bad batch", at=5), 2: failed(2, 1, "ValueError: bad "
                "batch", at=7), 3: failed(3, 1, "RuntimeError: " + "x" * 400, at=9)}
    errors = output.held_errors(failures)
    stopped = {0}.__contains__
    first = failure_report.order(failures, errors, stopped)[0]
    assert first == 1
    lines = failure_report.failure_lines(failures, first, errors, stopped, hidden=["accel launch: last stderr ..."])
    assert lines[0] == ("accel launch: rank 1 (local rank 1, pid 1001) exited with code 1 (first failure): "
                        "ValueError: bad batch")
    assert lines[1] == "accel launch: last stderr ..."
    assert lines[2:5] == ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "train.py", line 9, in '
                          "<module>", "[rank1]: ValueError: bad batch"]
    assert lines[5] == ("accel launch: rank 0 (local rank 0, pid 1000) was stopped by accel launch (signal 15, "
                        "SIGTERM) after rank 1 failed")
    assert lines[6] == "accel launch: rank 2 (local rank 2, pid 1002) exited with code 1: the same error"
    assert lines[7].startswith("accel launch: rank 3 (local rank 3, pid 1003) exited with code 1: RuntimeError: xxx")
    assert lines[7].endswith("x...") and len(lines[7]) < 400 and len(lines) == 8


@pytest.mark.parametrize("words", failure_report.LOST_PEER)
def test_a_rank_that_only_lost_its_peer_is_not_the_first_failure(words):
    """Rank 1 exits 3 at once; rank 0's all_reduce then fails with the broken connection and can be seen to end
    first: the cause is rank 1."""
    failures = {0: failed(0, 1, f"RuntimeError: [pair.cc:534] Read error [127.0.0.1]:5: {words}", at=-5),
                1: failed(1, 3), 2: failed(2, 1, "RuntimeError: [pair.cc:534] Connection closed by peer", at=-9)}
    errors = output.held_errors(failures)
    assert failure_report.order(failures, errors, lambda rank: False) == [1, 2, 0]
    assert not failure_report.lost_peer(output.held_errors({3: failed(3, 1, "ValueError: bad batch")})[3])


def test_a_one_line_error_is_its_line_first():
    failures = {0: failed(0, 1, "ConfigError: sp_size=2: no", one_line=True, at=1),
                1: failed(1, 1, "ConfigError: sp_size=2: no", one_line=True, at=2)}
    errors = output.held_errors(failures)
    assert failure_report.failure_lines(failures, 0, errors, lambda rank: False) == [
        "accel: error: sp_size=2: no",
        "accel launch: rank 0 (local rank 0, pid 1000) exited with code 1 (first failure): the error above",
        "accel launch: rank 1 (local rank 1, pid 1001) exited with code 1: the same error"]


def test_a_restart_names_the_rank_the_agent_stopped_as_stopped_by_accel_launch():
    failures = {0: failed(0, -15), 1: failed(1, 1, "ValueError: bad batch")}
    lines = failure_report.restart_lines(failures, output.held_errors(failures), {0}.__contains__, "restarting")
    assert lines[0] == ("accel launch: rank 1 exited with code 1: ValueError: bad batch; rank 0 was stopped by accel "
                        "launch (signal 15, SIGTERM) after rank 1 failed; restarting")
    assert lines[1:] == ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "train.py", line 9, in '
                         "<module>", "[rank1]: ValueError: bad batch"]
    assert "another process" not in "\n".join(lines)


def test_a_failure_the_others_waited_for_in_a_collective(tmp_path, monkeypatch):
    """The hang report's failure case: the headline names the rank and its exception, its traceback follows, the
    waiting rank is one line saying where it waited (no stack), and the run folder is not named (nor kept)."""
    monkeypatch.setattr(hang_report.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    watch = hang_report.HangWatch(600)
    watch.folder = diag.attempt_folder(watch.run_dir, 0)
    watch.folder.mkdir()
    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as dist\n\n\ndist.all_reduce(t)  # rank 0 waits here\n")
    import torch.distributed.distributed_c10d as c10d

    record = {"kind": "error", "op": "all_reduce", "in_backward": False, "started_ns": None,
              "message": "Connection closed by peer", "timeout_s": 600,
              "frames": [[str(script), 4, "<module>"], [c10d.__file__, 1, "all_reduce"]]}
    diag.record_path(watch.folder, 0).write_text(json.dumps(record))
    watch.ends[watch.folder] = {1: hang_report.WorkerEnd(1, 1001, 1, 100.0, False)}
    failures = {0: failed(0, 1), 1: failed(1, 1, "ValueError: bad batch")}
    report = watch.report(failures, output.held_errors(failures))
    assert report is not None and report.first_rank == 1 and not report.keeps_folder
    assert report.lines[0] == ("accel launch: rank 1 (local rank 1, pid 1001) failed with ValueError: bad batch "
                               "(exit code 1) while rank 0 waited in all_reduce, which failed without it; the job was "
                               "stopped")
    assert report.lines[1:4] == ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "train.py", line 9, '
                                 "in <module>", "[rank1]: ValueError: bad batch"]
    where = hang_report.display_path(str(script))
    assert report.lines[4:] == [f"accel launch: rank 0 (local rank 0, pid 1000) waited in all_reduce and failed "
                                f"without rank 1 (exit code 1), at {where}:4: dist.all_reduce(t)  # rank 0 waits here"]


def test_torchruns_lines_that_accel_says_are_left_out(monkeypatch):
    api = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    api.addHandler(handler)
    try:
        with output.quiet_torchrun_lines():
            api.warning("Sending process %s closing signal %s", 12, "SIGTERM")
            api.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 12, "python")
            api.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 12, 15, 9)
        assert seen == ["Unable to shutdown process 12 via 15, forcefully exiting via 9"]
        monkeypatch.setenv("ACCEL_FULL_TRACEBACKS", "1")
        with output.quiet_torchrun_lines():
            api.warning("Sending process %s closing signal %s", 12, "SIGTERM")
        assert seen[1:] == ["Sending process 12 closing signal SIGTERM"]
    finally:
        api.removeHandler(handler)


def test_an_earlier_runs_error_file_is_never_read_as_this_ones(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import Std

    (tmp_path / "rank0.error.json").write_text('{"message": "stale"}')
    specs = output._rank_logs_specs_class()(str(tmp_path), Std.NONE, Std.ALL, None)
    specs.reify({0: {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}})
    assert not (tmp_path / "rank0.error.json").exists()
