"""A worker's own crash is named as one, not as a kill "by another process than accel launch".

Two real 2-process launches (scripts/hang_worker.py --signal): rank 1 segfaults while rank 0 waits in an all_reduce
(the hang report's "left" path), and rank 1 aborts (os.abort(), as C++'s std::terminate does) while rank 0 is outside
any collective (the launcher's own failure lines). The wording of every signal is checked without launches below."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python

from accel.cli import hang_report
from accel.cli import launch as launch_cmd

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "hang_worker.py"


def launch(tmp_path, *worker_args: str) -> subprocess.CompletedProcess:
    from conftest import make_isolated_env

    env = {**make_isolated_env(tmp_path), "TMPDIR": str(tmp_path)}
    return warm_python.run([sys.executable, "-m", "accel.cli.main", "launch", "--cpu", "--num_processes", "2",
                            "--collective_timeout", "20", str(WORKER), *worker_args],
                           cwd=tmp_path, env=env, timeout=90)


def ours(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("accel launch: ")]


@pytest.mark.multiproc
def test_a_segfault_while_the_other_rank_waits_is_a_crash(tmp_path):
    proc = launch(tmp_path, "--signal", "SIGSEGV", "--sleep", "1")
    assert proc.returncode == 128 + signal.SIGSEGV, proc.stderr
    lines = ours(proc)
    assert any(line.startswith("accel launch: rank 1 was killed by signal 11 (SIGSEGV) while rank 0 waited in "
                               "all_reduce") for line in lines), lines
    rank1 = next(line for line in lines if line.startswith("accel launch: rank 1 (local rank 1"))
    assert "(first failure) outside any collective: it crashed (a segmentation fault in native code" in rank1, rank1
    assert not any("another process" in line for line in lines), lines


@pytest.mark.multiproc
def test_an_abort_outside_any_collective_is_the_workers_own(tmp_path):
    proc = launch(tmp_path, "--signal", "abort", "--sleep", "0.5", "--late")
    assert proc.returncode == 128 + signal.SIGABRT, proc.stderr
    lines = ours(proc)
    rank1 = next(line for line in lines if line.startswith("accel launch: rank 1 (local rank 1"))
    assert re.search(r"was killed by signal 6 \(SIGABRT\)( \(first failure\))?: it aborted itself \(abort\(\) in "
                     "native code", rank1), lines
    for line in lines:  # rank 0, if named, was stopped by the launcher because rank 1 failed
        if line.startswith("accel launch: rank 0 (local rank 0"):
            assert "was stopped by accel launch (signal 15, SIGTERM) after rank 1 failed" in line, lines
    assert not any("another process" in line for line in lines), lines


@pytest.mark.parametrize(("sig", "says"), [
    (signal.SIGSEGV, "it crashed (a segmentation fault in native code"),
    (signal.SIGBUS, "it crashed (a bus error in native code"),
    (signal.SIGILL, "it crashed (an illegal instruction in native code"),
    (signal.SIGFPE, "it crashed (an arithmetic fault in native code"),
    (signal.SIGABRT, "it aborted itself (abort() in native code"),
    (signal.SIGKILL, "check `dmesg`"),
    (signal.SIGTERM, "sent by another process than accel launch"),
    (signal.SIGINT, "sent by another process than accel launch"),
    (signal.SIGHUP, "sent by another process than accel launch"),
])
def test_each_signal_says_what_it_means(sig, says):
    """The launcher's failure line, the restart announcement and the hang report say the same."""
    ended = launch_cmd._ended(-int(sig))
    assert ended.startswith(f"was killed by signal {int(sig)} ({sig.name}): ") and says in ended
    left = hang_report.rank_line(hang_report.RankOutcome(1, 1, 99, -int(sig), "left"), True)
    assert says in left and "\n" not in left and "\n" not in ended
    if sig not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL):
        assert "another process" not in left + ended
