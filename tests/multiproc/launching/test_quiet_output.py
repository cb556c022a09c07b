"""What a 2-process `accel launch` prints: no torchrun banner, one thread line, per-rank log files, the console
limited to chosen ranks, warnings once per job, and a hidden rank's error still shown. One launch for all."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.multiproc

WORKER = """import os, sys, warnings
import torch
import torch.distributed as dist

import accel  # its import leaves the warnings every rank repeats to rank 0

rank = os.environ["RANK"]
print(f"stdout of rank {rank}")
print(f"stderr of rank {rank}", file=sys.stderr)
warnings.warn(f"same on every rank (from rank {rank})", FutureWarning)
warnings.warn(f"about rank {rank}'s own data")
dist.init_process_group("gloo")
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
dist.barrier()  # rank 1 has written everything before rank 0 fails
dist.destroy_process_group()
if rank == "0":
    raise RuntimeError("rank 0 fails on purpose")
"""


def test_quiet_output_log_dir_and_rank_filter(run_accel, isolated_env, tmp_path):
    isolated_env.pop("OMP_NUM_THREADS", None)  # the launcher chooses (run_accel shares this dict)
    (tmp_path / "worker.py").write_text(WORKER)
    logs = tmp_path / "logs"
    result = run_accel("launch", "--cpu", "--num_processes", "2", "--log_dir", "logs", "--local_ranks_filter", "1",
                       "worker.py", timeout=90)
    console = result.stdout + result.stderr
    assert result.returncode == 1, console

    # torchrun's OMP_NUM_THREADS banner is gone; accel says what it chose, once
    assert "*****" not in console and "Setting OMP_NUM_THREADS" not in console
    assert result.stderr.count("OMP_NUM_THREADS=") == 1
    assert "accel launch: 2 processes on " in result.stderr

    # one file per rank and stream, holding that rank's own output
    assert sorted(p.name for p in logs.glob("rank*.log")) == [
        "rank0.stderr.log", "rank0.stdout.log", "rank1.stderr.log", "rank1.stdout.log"]
    for rank in (0, 1):
        assert (logs / f"rank{rank}.stdout.log").read_text() == f"stdout of rank {rank}\n"
        err = (logs / f"rank{rank}.stderr.log").read_text()
        assert f"stderr of rank {rank}\n" in err and f"about rank {rank}'s own data" in err
    # a warning every rank repeats is left to rank 0; one about the rank's own data is kept everywhere
    assert "same on every rank" in (logs / "rank0.stderr.log").read_text()
    assert "same on every rank" not in (logs / "rank1.stderr.log").read_text()

    # the console shows rank 1 only (teed lines carry the global rank) ...
    assert "[rank1]:stdout of rank 1" in result.stdout and "[rank1]:stderr of rank 1" in result.stderr
    before, tail = result.stderr.split("accel launch: last stderr lines of rank 0, hidden by --local_ranks_filter")
    assert "stdout of rank 0" not in console and "stderr of rank 0" not in result.stdout + before
    # ... but hidden rank 0's failure is not: the launcher's summary line first, then its last stderr lines, then its
    # traceback (which the worker left to the launcher), once; the log file has the traceback too
    assert re.search(r"\naccel launch: rank 0 \(local rank 0, pid \d+\) exited with code 1: RuntimeError: rank 0 fails "
                     r"on purpose\n$", before), before
    assert f"(all of it: {logs / 'rank0.stderr.log'})" in tail.splitlines()[0]
    assert "\n[rank0]:stderr of rank 0\n" in tail
    assert tail.endswith("\n[rank0]: RuntimeError: rank 0 fails on purpose\n"), tail
    assert result.stderr.count("Traceback (most recent call last)") == 1
    assert "RuntimeError: rank 0 fails on purpose\n" in (logs / "rank0.stderr.log").read_text()
