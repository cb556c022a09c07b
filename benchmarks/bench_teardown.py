"""Teardown reliability: how many of N 2-process DDP jobs that never call `end_training` exit 0.

    python benchmarks/bench_teardown.py            # 20 jobs (about 4 minutes on 2 cores)
    python benchmarks/bench_teardown.py --jobs 50

On torch 2.13, destroying the process group while a DDP reducer was still alive sometimes killed a rank with SIGABRT
at exit; accel releases every reducer first (tests/unit/runtime/test_release_at_destroy.py checks the order on one
process, tests/multiproc/parallelism/test_ddp.py runs a few such jobs). This repeats the job many times and prints the
exit codes and the wall time of each: the target is every one 0. A reliability measurement: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import time
from pathlib import Path

from _common import accel_command

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "multiproc" / "scripts" / "minimal_ddp.py"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20, help="2-process jobs to run one after another")
    args = parser.parse_args(argv)
    cmd = [*accel_command(), "launch", "--cpu", "--num_processes", "2", str(SCRIPT)]
    codes, times = collections.Counter(), []
    for job in range(args.jobs):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=300)
        times.append(time.perf_counter() - start)
        ok = proc.returncode == 0 and "done" in proc.stdout
        codes[proc.returncode if ok or proc.returncode else "no 'done'"] += 1
        print(f"job {job + 1}/{args.jobs}: exit {proc.returncode} in {times[-1]:.1f} s", flush=True)
    print(f"exit codes: {dict(codes)}; {codes[0]} of {args.jobs} exited 0 (target: all); "
          f"median job {sorted(times)[len(times) // 2]:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
