"""What a failed launch prints: the launcher's summary line first, naming the rank that failed and its
exception; that rank's traceback once (the worker leaves it to the launcher: accel/core/uncaught.py); one line for
each rank that only waited for it, without its traceback; no torchrun log lines. A restart is announced the same way,
and a rank torchrun's agent stopped for it is named as stopped by accel launch, not as killed by another process.

One launch (scripts/failing_zero3.py, ZeRO-3, --max_restarts 1): attempt 0 fails on rank 1 while rank 0 sleeps (the
agent stops rank 0 and restarts), attempt 1 fails on rank 1 while rank 0 waits in FSDP's all-gather. Ctrl-C's one line
is tests/multiproc/launching/test_exit_codes.py::test_sigint_to_the_launcher_is_130."""

from __future__ import annotations

import re

import pytest

from _launch import SCRIPTS, accel_launch

pytestmark = pytest.mark.multiproc

TRACEBACK = "[rank1]: Traceback (most recent call last):"


def test_the_cause_once_first_and_one_line_per_waiting_rank(isolated_env):
    proc = accel_launch(isolated_env, "--cpu", "--num_processes", 2, "--zero_stage", 3, "--max_restarts", 1,
                        SCRIPTS / "failing_zero3.py", expect=1, timeout=120)
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("accel launch: 2 processes (MULTI_CPU, gloo), ZeRO-3"), proc.stderr
    # the restart: one line, rank 0 stopped by accel launch because rank 1 failed; then rank 1's traceback
    assert lines[1] == ("accel launch: rank 1 exited with code 1: ValueError: attempt 0 fails on rank 1; rank 0 was "
                        "stopped by accel launch (signal 15, SIGTERM) after rank 1 failed; restarting the worker group "
                        "(restart 1 of 1, ACCEL_RESTART_COUNT=1 in the new workers)"), proc.stderr
    assert lines[2] == TRACEBACK and lines[5] == "[rank1]: ValueError: attempt 0 fails on rank 1", proc.stderr
    # the final failure: the summary line names rank 1 and its exception, then its traceback, then rank 0 in one line
    assert re.fullmatch(r"accel launch: rank 1 \(local rank 1, pid \d+\) failed with ValueError: bad batch on rank 1 "
                        r"\(exit code 1\) (while|before) rank 0 (waited in|reached) all_gather\w*.*; the job was "
                        r"stopped", lines[6]), proc.stderr
    assert lines[7] == TRACEBACK and lines[10] == "[rank1]: ValueError: bad batch on rank 1", proc.stderr
    assert 'raise ValueError("bad batch on rank 1")' in lines[9]
    assert len(lines) == 12, proc.stderr  # nothing after rank 0's line
    forward = 'loss = model(torch.ones(4, 8)).sum()'
    line = 1 + [text.strip() for text in (SCRIPTS / "failing_zero3.py").read_text().splitlines()].index(forward)
    assert re.fullmatch(r"accel launch: rank 0 \(local rank 0, pid \d+\) waited in all_gather\w* and .*, at "
                        rf".*failing_zero3\.py:{line}: {re.escape(forward)}", lines[11]), proc.stderr
    # nothing of rank 0's traceback (from inside FSDP), nor torchrun's log lines
    assert not any(line.startswith("[rank0]") or re.match(r"[IWE]\d{4} ", line) for line in lines), proc.stderr
    assert "another process" not in proc.stderr and "Traceback" not in proc.stdout
