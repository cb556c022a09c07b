"""Import cost: what `import accel` and `from accel import Accelerator` add to `import torch`.

    python benchmarks/bench_import.py                 # 20 fresh interpreters per command, alternated
    python benchmarks/bench_import.py --reps 40 --importtime

Each command runs in a fresh interpreter (`python -c ...`), the commands alternately, after one untimed
warm-up run each; the median wall time of each is printed, and the milliseconds each adds over
`import torch`, from the medians and from the minima (target: accel adds <= 50 ms). Wall times of whole
interpreters are noisy (tens to hundreds of ms on a busy machine), so a third measure is printed and used for
the verdict: the same imports timed with perf_counter inside the interpreter, after `import torch` (median
over the same number of fresh interpreters).

When accel adds more than the target (or with --importtime) it also prints the top offenders of
`python -X importtime`: the modules imported after torch, by self time, and accel's own modules by
cumulative time (medians over 5 runs). A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TARGET_MS = 50.0
COMMANDS = {
    "import torch": "import torch",
    "import torch, accel": "import torch, accel",
    "import torch; from accel import Accelerator": "import torch; from accel import Accelerator",
    # what Accelerator() then imports on its own (accel.data, lazily) before prepare() can run
    "... + import accel.data": "import torch; from accel import Accelerator; import accel.data",
}
IN_PROCESS = """
import json, time
import torch
t0 = time.perf_counter()
import accel
t1 = time.perf_counter()
from accel import Accelerator
t2 = time.perf_counter()
import accel.data
t3 = time.perf_counter()
print(json.dumps([(t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t0) * 1e3]))
"""


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def wall(code: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - start


def in_process(env: dict) -> list[float]:
    out = subprocess.run([sys.executable, "-c", IN_PROCESS], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def importtime(env: dict, runs: int = 5) -> None:
    """Top offenders of `python -X importtime` among the modules imported after torch."""
    code = COMMANDS["... + import accel.data"]
    self_us: dict[str, list[int]] = {}
    cumulative_us: dict[str, list[int]] = {}
    totals = []
    for _ in range(runs):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, check=True,
                             capture_output=True, text=True).stderr
        after_torch, total = False, 0
        for line in err.splitlines():
            if not line.startswith("import time:") or "imported package" in line:
                continue
            self_part, cum_part, name_part = line[len("import time:"):].split("|")
            name = name_part.rstrip()
            top_level = not name.startswith("  ")  # one space after the bar, more when nested
            name = name.strip()
            if not after_torch:
                after_torch = top_level and name == "torch"
                continue
            self_us.setdefault(name, []).append(int(self_part))
            cumulative_us.setdefault(name, []).append(int(cum_part))
            total += int(self_part)
        totals.append(total)
    print(f"\npython -X importtime -c \"{code}\" ({runs} runs, medians): modules imported after torch take "
          f"{median(totals) / 1e3:.1f} ms in all (self times summed)")
    print(f"{'self ms':>8} {'cumul ms':>9}  module (top 15 by self time)")
    for name in sorted(self_us, key=lambda n: -median(self_us[n]))[:15]:
        print(f"{median(self_us[name]) / 1e3:>8.1f} {median(cumulative_us[name]) / 1e3:>9.1f}  {name}")
    print("(accel.accelerator itself is missing from the trace: accel.__getattr__ loads it with importlib.import_module,"
          "\n which -X importtime does not time, so the modules it imports show up at the top level)")
    own = [n for n in cumulative_us if n == "accel" or n.startswith("accel.")]
    print(f"\n{'self ms':>8} {'cumul ms':>9}  accel's own modules (by cumulative time)")
    for name in sorted(own, key=lambda n: -median(cumulative_us[n])):
        print(f"{median(self_us[name]) / 1e3:>8.1f} {median(cumulative_us[name]) / 1e3:>9.1f}  {name}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="fresh interpreters per command")
    parser.add_argument("--importtime", action="store_true", help="always print the -X importtime offenders")
    args = parser.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPROFILEIMPORTTIME", None)

    print(f"python {sys.version.split()[0]} ({sys.executable}), {args.reps} runs per command, "
          f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    walls: dict[str, list[float]] = {name: [] for name in COMMANDS}
    inner: list[list[float]] = []
    for code in COMMANDS.values():  # warm-up: page cache, .pyc files
        wall(code, env)
    for _ in range(args.reps):
        for name, code in COMMANDS.items():
            walls[name].append(wall(code, env))
        inner.append(in_process(env))

    base, base_min = median(walls["import torch"]) * 1e3, min(walls["import torch"]) * 1e3
    print(f"\n{'command (fresh interpreter)':<46} {'median ms':>10} {'min ms':>8} {'added (median)':>15} "
          f"{'added (min)':>12} {'in-process ms':>14}")
    print("-" * 110)
    for i, (name, values) in enumerate(walls.items()):
        med, low = median(values) * 1e3, min(values) * 1e3
        added = "" if i == 0 else f"{med - base:+.1f}"
        added_min = "" if i == 0 else f"{low - base_min:+.1f}"
        inside = "" if i == 0 else f"{median([row[i - 1] for row in inner]):.1f}"
        print(f"{name:<46} {med:>10.1f} {low:>8.1f} {added:>15} {added_min:>12} {inside:>14}")
    inner_accel = median([row[0] for row in inner])
    inner_acc = median([row[1] for row in inner])
    print("\nadded: wall time minus that of `import torch` (medians, then minima: noise only adds, so the minima are "
          "the steadier estimate on a busy machine);\nin-process: perf_counter around the imports after `import torch`, "
          "median over fresh interpreters (the precise figure, used for the verdict)")
    worst = max(inner_accel, inner_acc)
    print(f"target: accel adds <= {TARGET_MS:.0f} ms over torch: `import accel` {inner_accel:.1f} ms, "
          f"`from accel import Accelerator` {inner_acc:.1f} ms -> " + ("ok" if worst <= TARGET_MS else "OVER"))
    if args.importtime or worst > TARGET_MS:
        importtime(env)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
