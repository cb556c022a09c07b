"""`accel launch --hostfile` on loopback: two "hosts" (localhost and 127.0.0.1), reached through a fake ssh
that runs the command here, one process each."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from _launch import accel_launch

pytestmark = pytest.mark.multiproc

# Stands in for ssh: drop the host, run the remote command line here. Like ssh, it stays the parent (no exec),
# so signalling it does not reach the remote launcher; only the end of its stdin does, as through sshd.
FAKE_SSH = """#!/bin/sh
shift
/bin/sh -c "$*"
"""

WORKER = """import os, sys, time
import torch
import torch.distributed as dist

out = sys.argv[1]
rank = os.environ["RANK"]
with open(os.path.join(out, f"pid{rank}"), "w") as fh:
    fh.write(str(os.getpid()))
if rank == "1" and "--fail-host-1" in sys.argv:
    sys.exit(3)  # before joining: rank 0 waits for it in init_process_group until stopped
dist.init_process_group("gloo")
value = torch.tensor([float(rank) + 1.0])
dist.all_reduce(value)
with open(os.path.join(out, f"rank{rank}.txt"), "w") as fh:
    fh.write(f"{dist.get_world_size()} {value.item()} {os.environ['LOCAL_RANK']} {os.environ['MASTER_ADDR']}")
dist.destroy_process_group()
"""


@pytest.fixture
def cluster(tmp_path: Path, isolated_env: dict, free_port: int):
    ssh = tmp_path / "fake_ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    (tmp_path / "hosts").write_text("# two names for this machine\nlocalhost slots=1\n\n127.0.0.1 slots=1\n")
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {**isolated_env, "ACCEL_SSH_COMMAND": str(ssh)}
    common = ["--hostfile", tmp_path / "hosts", "--cpu", "--main_process_port", free_port, tmp_path / "worker.py", out]
    return env, common, out


def test_two_hosts_run_one_job(cluster):
    env, common, out = cluster
    result = accel_launch(env, *common, timeout=60)
    assert "accel launch: 2 machine(s) over " in result.stderr and "localhost, 127.0.0.1" in result.stderr
    for rank in (0, 1):
        world, total, local_rank, master = (out / f"rank{rank}.txt").read_text().split()
        assert (world, total, local_rank, master) == ("2", "3.0", "0", "localhost")  # one per host, connected


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_failing_host_stops_the_other_and_is_named(cluster):
    env, common, out = cluster
    # without the head stopping it, rank 0 would wait in init_process_group far beyond this timeout
    result = accel_launch(env, *common, "--fail-host-1", timeout=60, expect=3)
    last = result.stderr.splitlines()[-1]
    assert last == ("accel launch: host 127.0.0.1 (machine_rank 1) failed first: it exited with code 3; "
                    "stopped localhost")
    waiting = int((out / "pid0").read_text())  # rank 0, left waiting for rank 1 in init_process_group
    deadline = time.monotonic() + 5
    while _alive(waiting) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(waiting)
    assert not (out / "rank0.txt").exists()
