"""A failed asynchronous save never looks like success to a job runner, on 2 real processes.

* The script ends without waiting for its asynchronous save, whose publication fails (a full disk, simulated): every
  process whose save failed prints one line naming the folder and the cause and exits with async_save.EXIT_CODE
  (74); `accel launch` exits 74; the temporary folder is gone and the previous checkpoint is intact. Under DDP in a
  thread (the main process saves alone, rank 1 follows it) and under ZeRO-3 in torch's checkpoint process
  (`checkpoint_async: process`).
* The preemption grace save fails the same way: `accel launch` exits 74, not 75 ("saved, run again").

The waits that raise the failure into the script (the next save_state, load_state, wait_for_checkpoint, end_training)
are tested on one process in tests/unit/checkpoint/test_async_save.py and on 2 in test_async_save_multiproc.py."""

from __future__ import annotations

import json
import re
import signal
import sys

import pytest
import warm_python
from _launch import SCRIPTS, accel_launch

from accel.checkpoint import layout
from accel.checkpoint.async_save import EXIT_CODE
from accel.runtime.preemption import EXIT_CODE as PREEMPTED

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("case", [["--mode", "thread"], ["--mode", "process", "--zero_stage", "3"]],
                         ids=["ddp_thread", "zero3_process"])
def test_a_save_failing_after_the_script_ended_exits_74(isolated_env, tmp_path, case):
    out = tmp_path / "run"
    proc = accel_launch(isolated_env, "--cpu", "--num_processes", 2, SCRIPTS / "async_save_fails_at_exit.py",
                        "--out", out, *case, expect=EXIT_CODE, timeout=120)
    cause = f"accel: error: {out / 'ckpt'}: could not be saved"
    lines = [line for line in proc.stderr.splitlines() if line.startswith(cause)]
    assert lines and all("No space left on device" in line and line.endswith(f"; exit code {EXIT_CODE}")
                         for line in lines), proc.stderr
    assert f"exited with code {EXIT_CODE}" in proc.stderr
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")], proc.stderr
    layout.read_manifest(out / "ckpt")  # the previous checkpoint, complete


def test_a_workers_own_exception_stays_exit_code_1(isolated_env, tmp_path):
    """In a worker forked by accel launch too (it reports the exception itself, without sys.last_value)."""
    out = tmp_path / "run"
    proc = warm_python.run([sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2",
                           str(SCRIPTS / "async_save_fails_at_exit.py"), "--out", str(out), "--raise_after"],
                          cwd=tmp_path, env={**isolated_env, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert proc.returncode in (1, EXIT_CODE), proc.stderr  # the first to end: rank 0 (1) or rank 1 (74)
    assert re.search(r"accel launch: rank 0 \(local rank 0, pid \d+\) exited with code 1\b", proc.stderr), proc.stderr
    assert "RuntimeError: the script's own error" in proc.stderr
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")], proc.stderr


def test_a_failed_grace_save_is_not_exit_code_75(isolated_env, tmp_path):
    from test_preemption import MARKER_STEP, finish, markers, start, wait_for

    out = tmp_path / "preempted"
    proc, err = start(isolated_env, out, "--marker_step", str(MARKER_STEP), "--failing_save")
    wait_for(lambda: markers(out), proc, err)
    proc.send_signal(signal.SIGTERM)
    rc, stderr = finish(proc, err)
    assert rc == EXIT_CODE, stderr
    assert f"exit code {PREEMPTED} (run the same command again" not in stderr
    assert re.search(rf"accel launch: the workers were asked to save and stop, but rank [01] failed: exit code "
                     rf"{EXIT_CODE}, not {PREEMPTED} \(their grace save may be missing", stderr), stderr
    assert f"accel: error: {out / 'checkpoints' / 'checkpoint_0'}: could not be saved" in stderr
    assert json.loads((out / "preempted_rank0.json").read_text())["step"] == MARKER_STEP  # it did see the request
    assert not [p for p in (out / "checkpoints").iterdir()], stderr  # no checkpoint, no temporary folder
