"""accel/cli/job_reaper.py without a launch: ending process groups, and the sentinel that ends them when its launcher dies
(the end-to-end checks are tests/multiproc/launching/test_job_lifetime.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from accel.cli import job_reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups as Linux shows them")


def _group(ignore_sigterm: bool = False) -> subprocess.Popen:
    """A process leading its own group, with a child of its own (as a worker and its `sleep`)."""
    code = ("import signal, subprocess, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_sigterm else "")
            + "subprocess.Popen(['sleep', '60'])\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(_members(proc.pid)) < 2:  # the child started
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc


def _members(group: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == group:
                found.append(int(name))
    return found


def test_end_groups_terms_then_kills_what_ignores_sigterm():
    polite, stubborn = _group(), _group(ignore_sigterm=True)
    try:
        assert job_reaper.running_groups([polite.pid, stubborn.pid]) == {polite.pid, stubborn.pid}
        started = time.monotonic()
        assert job_reaper.end_groups([polite.pid, stubborn.pid], grace=0.5) == {polite.pid, stubborn.pid}
        assert 0.4 < time.monotonic() - started < 5  # the stubborn group waited for its grace, then SIGKILL
        assert _members(polite.pid) == [] and _members(stubborn.pid) == []
        assert polite.wait(5) == -signal.SIGTERM and stubborn.wait(5) == -signal.SIGKILL
        assert job_reaper.end_groups([polite.pid]) == set()  # nothing left: no signal, no wait
    finally:
        for proc in (polite, stubborn):
            proc.kill()
            proc.wait()


def test_the_sentinel_ends_the_registered_groups_when_its_pipe_ends_without_them_out():
    kept, ended = _group(), _group()
    sentinel = job_reaper.Sentinel()
    sentinel.start()
    try:
        sentinel.add(kept.pid)
        sentinel.add(ended.pid)
        sentinel.remove(kept.pid)
        sentinel._proc.send_signal(signal.SIGTERM)  # ignored: only the pipe's end counts
        os.close(sentinel._write)  # what the launcher's death does to the pipe
        job_reaper._SENTINEL_FDS.discard(sentinel._write)
        sentinel._write = None
        assert sentinel._proc.wait(10) == 0
        assert ended.wait(5) == -signal.SIGKILL and _members(ended.pid) == []
        assert kept.poll() is None and len(_members(kept.pid)) == 2
    finally:
        sentinel.close()
        for proc in (kept, ended):
            os.killpg(proc.pid, signal.SIGKILL) if _members(proc.pid) else None
            proc.wait()
