"""Run Accelerate 1.15.0's own unit tests (`tests/test_*.py` of its source distribution, unchanged) on accel through
the shim, or on the real Accelerate, and compare the passing tests with the lists checked in beside this file.

    python tests/accelerate_compat/unit_suite.py                 # on accel; exit 1 on a new pass or a new failure
    python tests/accelerate_compat/unit_suite.py --impl accelerate --write-passing   # re-measure the reference list

The source distribution is downloaded with pip (never copied into this repository) and unpacked once into a cache
folder (ACCEL_UNIT_SUITE_CACHE, default a folder in the system temp dir). Each slow test file (FILE_SECONDS) runs in its
own pytest process, the quick ones together in one, each process with a time limit (a hung file fails its tests, the
others still report), CPU-only, offline, one thread.

unit_passing_on_accelerate.txt: the test ids that pass on the real Accelerate with this harness here.
unit_expected_failures.txt: those of them expected to fail on accel, each `ID  # reason` (a reason starting with
"flaky:" accepts either outcome).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION = "1.15.0"
PASSING_FILE = HERE / "unit_passing_on_accelerate.txt"
EXPECTED_FAILURES_FILE = HERE / "unit_expected_failures.txt"
# Files `--all` skips: nothing in them passes on the real Accelerate on a CPU machine offline (measured: they need
# GPUs, the hub or packages the test extras leave out), so running them would only cost minutes.
SKIP_FILES = ("test_activation_checkpointing_offload.py", "test_examples.py", "test_imports.py",
              "test_load_checkpoint_and_dispatch_with_broadcast.py", "test_metrics.py", "test_multidevice.py",
              "test_tpu.py")
FILE_TIMEOUT = 300  # seconds per test file
TEST_TIMEOUT = 90  # seconds per test (the plugin's SIGALRM)
# rough seconds per file (the listed tests, measured on a 2-core machine): the slowest start first. On accel,
# test_data_loader.py mostly waits: an expected failure with 2 loader workers keeps its loaders alive in the
# failure's traceback until a garbage collection, where torch's worker shutdown waits out its 5 s join timeout per
# worker; started first, that wait overlaps the other files.
FILE_SECONDS = {"test_data_loader.py": 45, "test_accelerator.py": 21, "test_state_checkpointing.py": 14,
                "test_scheduler.py": 10, "test_memory_utils.py": 10, "test_modeling_utils.py": 9, "test_utils.py": 9,
                "test_cli.py": 8, "test_grad_sync.py": 7, "test_cpu.py": 7}


def cache_dir() -> Path:
    return Path(os.environ.get("ACCEL_UNIT_SUITE_CACHE") or Path(tempfile.gettempdir()) / "accel_unit_suite_cache")


def fetch_sdist(cache: Path | None = None) -> Path:
    """Accelerate's unpacked source distribution, downloaded by pip the first time (later calls reuse it)."""
    cache = cache or cache_dir()
    root = cache / f"accelerate-{VERSION}"
    if (root / "tests").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"accelerate=={VERSION}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        archives = list(Path(tmp).glob("accelerate-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(tmp, filter="data")
        if not (root / "tests").is_dir():  # another run may have unpacked it meanwhile
            os.replace(Path(tmp) / f"accelerate-{VERSION}", root)
    return root


def shim_path() -> str:
    return subprocess.run([sys.executable, "-m", "accel.shim"], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def suite_env(impl: str, home: Path) -> dict:
    """CPU-only, offline, one thread, a fresh HOME; the shim first on PYTHONPATH for accel."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "ACCEL_", "PYTEST_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PYTHONPATH")}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1", HOME=str(home), PYTHONUNBUFFERED="1", WANDB_MODE="offline",
               ACCEL_UNIT_SUITE_TEST_TIMEOUT=str(TEST_TIMEOUT))
    # accel: the shim, then this checkout (the accel under test, wherever accel is installed); the plugin's folder
    env["PYTHONPATH"] = os.pathsep.join([*([shim_path(), str(HERE.parents[1])] if impl == "accel" else []), str(HERE)])
    return env


def run_file(root: Path, name: str, ids: list[str], env: dict, work: Path, timeout: int
             ) -> tuple[str, dict[str, dict], float, str]:
    """One test file (only `ids` of it, if given) in its own pytest process: (name, {id: result}, seconds, output
    tail). The plugin writes each test's result as it finishes, so a file stopped at `timeout` keeps what it ran."""
    report = work / f"{name.replace(' ', '_')}.jsonl"
    env = {**env, "ACCEL_UNIT_SUITE_REPORT": str(report)}
    paths = [f"tests/{name}"]
    if ids:  # the files, and the plugin keeps only these tests (a file that fails to import fails its tests alone)
        paths = sorted({test.split("::")[0] for test in ids})
        env["ACCEL_UNIT_SUITE_ONLY"] = str(report.with_suffix(".ids"))
        Path(env["ACCEL_UNIT_SUITE_ONLY"]).write_text("\n".join(ids))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_unit_suite_plugin",
           "--continue-on-collection-errors", *paths]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        tail = f"timed out after {timeout}s\n{out[-3000:]}"
    results = {}
    for line in report.read_text().splitlines() if report.is_file() else []:
        entry = json.loads(line)
        results[entry["id"]] = entry
    collection = [r["message"] for r in results.values() if r["message"].startswith("collection: ")]
    why = collection[0] if collection else (tail.splitlines()[0] if tail else "")
    for test in ids:  # not reported: the file failed to import, or its time limit stopped it first
        results.setdefault(test, {"id": test, "outcome": "error" if collection else "not run", "message": why,
                                  "seconds": 0.0})
    return name, results, time.monotonic() - start, tail


def run_suite(impl: str = "accel", only: list[str] | None = None, files: list[str] | None = None, jobs: int = 2,
              timeout: int = FILE_TIMEOUT, verbose: bool = False) -> dict[str, dict]:
    """{test id: result} of the tests `only` (ids), or of every test in Accelerate's test files (all but SKIP_FILES,
    or `files`)."""
    root = fetch_sdist()
    if only is not None:
        by_file: dict[str, list[str]] = {}
        for test in only:
            by_file.setdefault(test.split("::")[0].split("/")[-1], []).append(test)
        chosen = [(name, tests) for name, tests in sorted(by_file.items()) if not files or name in files]
        # the quick files share one pytest process (each file's own costs mostly the imports of torch, accelerate's
        # test helpers and transformers): the slow ones keep theirs, so they still run side by side
        quick = [item for item in chosen if item[0] not in FILE_SECONDS]
        work_items = [item for item in chosen if item[0] in FILE_SECONDS]
        if quick:
            work_items.append((f"{len(quick)} quick files", [test for _, tests in quick for test in tests]))
    else:
        names = files or sorted(p.name for p in (root / "tests").glob("test_*.py") if p.name not in SKIP_FILES)
        work_items = [(name, []) for name in names]
    # the slowest files first, so two workers finish together
    work_items.sort(key=lambda item: -FILE_SECONDS.get(item[0], 0))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "home").mkdir()
        env = suite_env(impl, work / "home")
        results = {}
        with ThreadPoolExecutor(jobs) as pool:
            futures = [pool.submit(run_file, root, *item, env, work, timeout) for item in work_items]
            for future in as_completed(futures):
                name, found, seconds, tail = future.result()
                results.update(found)
                if verbose:
                    passed = sum(r["outcome"] == "passed" for r in found.values())
                    print(f"{name}: {passed}/{len(found)} passed in {seconds:.0f}s", file=sys.stderr, flush=True)
                    if tail.startswith("timed out"):
                        print(tail, file=sys.stderr)
    return results


def read_ids(path: Path) -> dict[str, str]:
    """{id: comment} of a list file (blank lines and lines starting with # ignored)."""
    ids = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.strip() and not line.lstrip().startswith("#"):
            test, _, reason = line.partition("  # ")
            ids[test.strip()] = reason.strip()
    return ids


def compare(results: dict[str, dict]) -> list[str]:
    """Problems: an expected pass that did not pass, an expected failure that passed, a stale list entry."""
    reference, expected_fail = read_ids(PASSING_FILE), read_ids(EXPECTED_FAILURES_FILE)
    problems = [f"{t}: listed in {EXPECTED_FAILURES_FILE.name} but not in {PASSING_FILE.name}"
                for t in expected_fail if t not in reference]
    for test in sorted(reference):
        got = results.get(test, {"outcome": "not run", "message": ""})
        if expected_fail.get(test, "").startswith("flaky:"):
            continue  # seen failing for a reason outside accel; either outcome is accepted
        if test in expected_fail and got["outcome"] == "passed":
            problems.append(f"NEW PASS {test}: passes on accel now; remove it from {EXPECTED_FAILURES_FILE.name}")
        elif test not in expected_fail and got["outcome"] != "passed":
            problems.append(f"NEW FAILURE {test}: {got['outcome']} on accel (passes on Accelerate): {got['message']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=("accel", "accelerate"), default="accel")
    parser.add_argument("--all", action="store_true", help=f"run every test, not only those in {PASSING_FILE.name}")
    parser.add_argument("--files", default="", help="comma-separated test file names (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", help="write every test's result here (JSON)")
    parser.add_argument("--write-passing", action="store_true",
                        help=f"write the passing ids to {PASSING_FILE.name} (implies --all)")
    parser.add_argument("--write-failures", action="store_true",
                        help=f"rewrite {EXPECTED_FAILURES_FILE.name}: accel's failures, known reasons kept, new ones "
                             "with the failure's message")
    args = parser.parse_args(argv)
    start = time.monotonic()
    reference = read_ids(PASSING_FILE)
    only = None if args.all or args.write_passing else sorted(reference)
    results = run_suite(args.impl, only, [f for f in args.files.split(",") if f] or None, args.jobs, verbose=True)
    passed = sorted(t for t, r in results.items() if r["outcome"] == "passed")
    print(f"{args.impl}: {len(passed)} of {len(results)} passed; {len(set(passed) & set(reference))} of the "
          f"{len(reference)} that pass on Accelerate; {time.monotonic() - start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_passing:
        PASSING_FILE.write_text("".join(f"{t}\n" for t in passed))
        return 0
    if args.write_failures:
        expected = read_ids(EXPECTED_FAILURES_FILE)
        lines = [f"{t}  # {expected.get(t) or results.get(t, {}).get('message') or 'not run'}\n"
                 for t in sorted(reference) if results.get(t, {}).get("outcome") != "passed"]
        EXPECTED_FAILURES_FILE.write_text("".join(lines))
        return 0
    problems = compare(results)
    print("\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
