"""Launcher overhead: wall time of `accel launch` against torchrun (2 processes) and against python (1 process).

    python benchmarks/bench_launch.py              # 12 timed runs of each 2-process command, 16 of each 1-process one
    python benchmarks/bench_launch.py --reps 4 --reps-single 6

Every command runs the same script, benchmarks/_trivial.py (join a gloo group when WORLD_SIZE > 1, then leave),
so only the launchers differ. The commands of a group run alternately (A, B, C, A, B, C, ...), after one untimed
warm-up run each, with OMP_NUM_THREADS=1 for all of them:

  2 processes   accel launch --cpu --num_processes 2 _trivial.py   vs  torchrun --nproc_per_node 2 _trivial.py
                (also torchrun --standalone, the rendezvous accel uses on one machine: c10d on a free port)
  1 process     accel launch _trivial.py                           vs  python _trivial.py

The console scripts beside this interpreter are called directly (a pyenv shim would add its own time to both).
It prints the median (and min, max) wall time of each command and the ratios of the medians and of the minima
(target: accel/torchrun <= 1.05 with 2 processes, judged on the medians; the 1-process ratio accel/python is held
to the same 1.05). On a busy machine noise only adds time, so the minima are the steadier figure there.
A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

TARGET_RATIO = 1.05
HERE = Path(__file__).resolve().parent
TRIVIAL = HERE / "_trivial.py"


def console_script(name: str) -> list[str]:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return [str(beside)]
    found = shutil.which(name)
    if found:
        return [found]
    modules = {"accel": "accel.cli.main", "torchrun": "torch.distributed.run"}
    return [sys.executable, "-m", modules[name]]


def run_once(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"exit code {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return elapsed


def measure(group: dict[str, list[str]], reps: int, env: dict) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in group}
    for name, cmd in group.items():  # warm-up: page cache, .pyc files
        run_once(cmd, env)
    for rep in range(reps):
        for name, cmd in group.items():
            times[name].append(run_once(cmd, env))
        print(f"  round {rep + 1}/{reps}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), flush=True)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12, help="timed runs of each 2-process command")
    parser.add_argument("--reps-single", type=int, default=16, help="timed runs of each 1-process command")
    parser.add_argument("--no-standalone", action="store_true", help="skip the torchrun --standalone variant")
    args = parser.parse_args(argv)

    env = dict(os.environ, OMP_NUM_THREADS="1")
    accel, torchrun, script = console_script("accel"), console_script("torchrun"), str(TRIVIAL)
    multi = {
        "accel launch --cpu --num_processes 2": [*accel, "launch", "--cpu", "--num_processes", "2", script],
        "torchrun --nproc_per_node 2": [*torchrun, "--nproc_per_node", "2", script],
    }
    if not args.no_standalone:
        multi["torchrun --standalone --nproc_per_node 2"] = [*torchrun, "--standalone", "--nproc_per_node", "2", script]
    single = {
        "accel launch": [*accel, "launch", script],
        "python": [sys.executable, script],
    }
    print(f"script: {script}\naccel: {' '.join(accel)}\ntorchrun: {' '.join(torchrun)}\n"
          f"python: {sys.executable}\nCPU cores: {os.cpu_count()}, load average at start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    print("2 processes:", flush=True)
    multi_times = measure(multi, args.reps, env)
    print("1 process:", flush=True)
    single_times = measure(single, args.reps_single, env)

    def table(title: str, times: dict[str, list[float]], baseline: str, accel_name: str) -> None:
        base, base_min = median(times[baseline]), min(times[baseline])
        print(f"\n{title}; ratios against `{baseline}`")
        header = (f"{'command':<42} {'runs':>4} {'median s':>9} {'min s':>7} {'max s':>7} {'ratio (median)':>15} "
                  f"{'ratio (min)':>12}")
        print(header)
        print("-" * len(header))
        for name, values in times.items():
            ratio = median(values) / base
            mark = ""
            if name == accel_name:
                mark = f"  target <= {TARGET_RATIO}: " + ("ok" if ratio <= TARGET_RATIO else "OVER")
            print(f"{name:<42} {len(values):>4} {median(values):>9.3f} {min(values):>7.3f} {max(values):>7.3f} "
                  f"{ratio:>15.3f} {min(values) / base_min:>12.3f}{mark}")
        delta = (median(times[accel_name]) - base) * 1e3
        delta_min = (min(times[accel_name]) - base_min) * 1e3
        print(f"accel adds {delta:+.0f} ms (medians), {delta_min:+.0f} ms (minima) over `{baseline}`")

    table("2 processes (gloo init + barrier + destroy in each worker)", multi_times,
          "torchrun --nproc_per_node 2", "accel launch --cpu --num_processes 2")
    standalone = multi_times.get("torchrun --standalone --nproc_per_node 2")
    if standalone:
        mine = multi_times["accel launch --cpu --num_processes 2"]
        print(f"accel launch / torchrun --standalone (the same c10d rendezvous on a free port): "
              f"{median(mine) / median(standalone):.3f} (medians), {min(mine) / min(standalone):.3f} (minima)")
    table("1 process (imports torch.distributed only)", single_times, "python", "accel launch")
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
