"""Import cost: what `import accel` and `from accel import Accelerator` add to `import torch`.

    python benchmarks/bench_import.py                 # 20 fresh interpreters per command, alternated
    python benchmarks/bench_import.py --reps 40 --importtime

Each command runs in a fresh interpreter (`python -c ...`), the commands alternately, after one untimed
warm-up run each; the median wall time of each is printed, and the milliseconds each adds over
`import torch`, from the medians and from the minima (target: accel adds <= 50 ms). Wall times of whole
interpreters are noisy (tens to hundreds of ms on a busy machine), so a third measure is printed and used for
the verdict: the same imports timed with perf_counter inside the interpreter, after `import torch` (median
over the same number of fresh interpreters).

Bytecode matters at this scale: an installed package has .pyc files, but an editable checkout under
PYTHONDONTWRITEBYTECODE=1 recompiles accel's sources at every import. The timed runs therefore use a
temporary PYTHONPYCACHEPREFIX (cached .pyc, as installed; nothing is written into the checkout), and the
in-process measure is repeated without .pyc (PYTHONDONTWRITEBYTECODE=1) for comparison.

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
from pathlib import Path
from statistics import median

TARGET_MS = 50.0
COMMANDS = {
    "import torch": "import torch",
    "import torch, accel": "import torch, accel",
    "import torch; from accel import Accelerator": "import torch; from accel import Accelerator",
    # what Accelerator() then imports on its own (accel.data.loading, lazily) before prepare() can run
    "... + import accel.data.loading": "import torch; from accel import Accelerator; import accel.data.loading",
}
IN_PROCESS = """
import json, time
import torch
t0 = time.perf_counter()
import accel
t1 = time.perf_counter()
from accel import Accelerator
t2 = time.perf_counter()
import accel.data.loading
t3 = time.perf_counter()
print(json.dumps([(t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t0) * 1e3]))
"""


def wall(code: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - start


def in_process(env: dict) -> list[float]:
    out = subprocess.run([sys.executable, "-c", IN_PROCESS], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def importtime(env: dict, runs: int = 5) -> None:
    """Top offenders of `python -X importtime` among the modules imported after torch (cached .pyc)."""
    code = COMMANDS["... + import accel.data.loading"]
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
    print(f"\npython -X importtime -c \"{code}\" (cached .pyc, {runs} runs, medians): "
          f"modules imported after torch take "
          f"{median(totals) / 1e3:.1f} ms in all (self times summed)")
    print(f"{'self ms':>8} {'cumul ms':>9}  module (top 15 by self time)")
    for name in sorted(self_us, key=lambda n: -median(self_us[n]))[:15]:
        print(f"{median(self_us[name]) / 1e3:>8.1f} {median(cumulative_us[name]) / 1e3:>9.1f}  {name}")
    print("(accel.accelerator itself is missing from the trace: accel.__getattr__ loads it with "
          "importlib.import_module,\n which -X importtime does not time, so the modules it imports show up at the "
          "top level)")
    own = [n for n in cumulative_us if n == "accel" or n.startswith("accel.")]
    print(f"\n{'self ms':>8} {'cumul ms':>9}  accel's own modules (by cumulative time)")
    for name in sorted(own, key=lambda n: -median(cumulative_us[n])):
        print(f"{median(self_us[name]) / 1e3:>8.1f} {median(cumulative_us[name]) / 1e3:>9.1f}  {name}")


def environments() -> tuple[dict, dict, str]:
    """(cached, source, tmpdir): the interpreters' environments for the two bytecode conditions.

    cached: bytecode written to and read from a temporary PYTHONPYCACHEPREFIX (never into the checkout), as an
            installed package gets .pyc files at install time; torch's too, after the warm-up run.
    source: PYTHONDONTWRITEBYTECODE=1 and no prefix: torch keeps its installed .pyc, accel (editable) is compiled
            from source on every import unless the checkout already has accel/__pycache__.
    """
    import tempfile

    base = dict(os.environ, OMP_NUM_THREADS="1")
    base.pop("PYTHONPROFILEIMPORTTIME", None)
    tmpdir = tempfile.mkdtemp(prefix="accel-bench-pycache-")
    cached = dict(base, PYTHONPYCACHEPREFIX=tmpdir)
    cached.pop("PYTHONDONTWRITEBYTECODE", None)
    source = dict(base, PYTHONDONTWRITEBYTECODE="1")
    source.pop("PYTHONPYCACHEPREFIX", None)
    return cached, source, tmpdir


def main(argv=None) -> int:
    import shutil

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="fresh interpreters per command")
    parser.add_argument("--importtime", action="store_true", help="always print the -X importtime offenders")
    args = parser.parse_args(argv)
    cached, source, tmpdir = environments()
    import accel

    checkout_pyc = (Path(accel.__file__).parent / "__pycache__").is_dir()
    print(f"python {sys.version.split()[0]} ({sys.executable}), {args.reps} runs per command; PYTHONDONTWRITEBYTECODE "
          f"in this shell: {os.environ.get('PYTHONDONTWRITEBYTECODE', 'unset')}; accel/__pycache__ in the checkout: "
          f"{'yes' if checkout_pyc else 'no'}; load average at start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    try:
        walls: dict[str, list[float]] = {name: [] for name in COMMANDS}
        inner: dict[str, list[list[float]]] = {"cached": [], "source": []}
        for code in COMMANDS.values():  # warm-up: page cache; fills the temporary .pyc cache (torch's too)
            wall(code, cached)
        for _ in range(args.reps):
            for name, code in COMMANDS.items():
                walls[name].append(wall(code, cached))
            inner["cached"].append(in_process(cached))
            inner["source"].append(in_process(source))

        def inside(condition: str, i: int) -> float:
            return median([row[i] for row in inner[condition]])

        base, base_min = median(walls["import torch"]) * 1e3, min(walls["import torch"]) * 1e3
        print(f"\n{'command (fresh interpreter, cached .pyc)':<46} {'median ms':>10} {'min ms':>8} "
              f"{'added (median)':>15} {'added (min)':>12} {'in-process ms':>14} {'no-.pyc ms':>11}")
        print("-" * 122)
        for i, (name, values) in enumerate(walls.items()):
            med, low = median(values) * 1e3, min(values) * 1e3
            cols = ["", "", "", ""] if i == 0 else [f"{med - base:+.1f}", f"{low - base_min:+.1f}",
                                                     f"{inside('cached', i - 1):.1f}", f"{inside('source', i - 1):.1f}"]
            print(f"{name:<46} {med:>10.1f} {low:>8.1f} {cols[0]:>15} {cols[1]:>12} {cols[2]:>14} {cols[3]:>11}")
        print("\nadded: wall time minus that of `import torch` (from the medians, then from the minima: noise only "
              "adds, so the minima are the steadier estimate on a busy machine)."
              "\nin-process: perf_counter around the imports after `import torch`, median over fresh interpreters "
              "(the precise figure; used for the verdict)."
              "\nno-.pyc: the same with PYTHONDONTWRITEBYTECODE=1 and no prefix, so accel's modules are compiled from "
              "source at each import (as in an editable checkout where bytecode is never written).")
        in_accel, in_acc = inside("cached", 0), inside("cached", 1)
        src_accel, src_acc = inside("source", 0), inside("source", 1)
        worst = max(in_accel, in_acc)
        print(f"target: accel adds <= {TARGET_MS:.0f} ms over torch: `import accel` {in_accel:.1f} ms, "
              f"`from accel import Accelerator` {in_acc:.1f} ms -> " + ("ok" if worst <= TARGET_MS else "OVER")
              + f"  (without .pyc: {src_accel:.1f} ms, {src_acc:.1f} ms -> "
              + ("ok" if max(src_accel, src_acc) <= TARGET_MS else "OVER") + ")")
        if args.importtime or worst > TARGET_MS:
            importtime(cached)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
