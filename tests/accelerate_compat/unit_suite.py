"""Run an Accelerate release's own unit tests (`tests/test_*.py` of its source distribution, unchanged: 1.15.0, the
default, or 1.16.0) on accel through the shim, or on the real Accelerate of that release, and compare the passing
tests with the lists checked in beside this file.

    python tests/accelerate_compat/unit_suite.py                 # 1.15.0 on accel; exit 1 on a new pass or failure
    python tests/accelerate_compat/unit_suite.py --version 1.16.0                 # 1.16.0's tests on accel
    python tests/accelerate_compat/unit_suite.py --version 1.16.0 --changed-only  # those differing from 1.15.0's
    python tests/accelerate_compat/unit_suite.py --impl accelerate --write-passing   # re-measure the reference list

The source distribution is downloaded with pip (never copied into this repository) and unpacked once into a cache
folder (ACCEL_UNIT_SUITE_CACHE, default a folder in the system temp dir). The listed tests run in as many pytest
processes as run side by side (`--jobs`), their files packed by time (FILE_SECONDS), each process with a time limit (a
hung file fails its tests, the other processes still report), CPU-only, offline, one thread.

Accelerate's test helpers (`accelerate.test_utils`, which the shim loads from a real Accelerate installation) must be
the tests' own release: where the installed accelerate is another release, pip installs the wanted one (`pip install
--no-deps --target`) into the cache too, and that folder goes on the tests' PYTHONPATH, after the shim (for accel: the
shim's `real_accelerate_dir()` finds it before site-packages') or alone (for `--impl accelerate`: the real release
itself is the one under test). On accel the shim answers as the tests' release (`ACCEL_ACCELERATE_VERSION`).

`--changed-only` (what tests/multiproc/ecosystem/test_accelerate_unit_suite.py runs for 1.16.0): only the listed tests whose
code differs from 1.15.0's (changed_tests: new tests, changed test functions or classes, changed definitions of the
test file or of accelerate.test_utils they use, by syntax tree); the rest are 1.15.0's tests, which that release's
run covers.

Per release (VERSIONS): unit_passing_on_accelerate[_1.16].txt, the test ids that pass on the real Accelerate with this
harness here; unit_expected_failures[_1.16].txt, those of them expected to fail on accel, each `ID  # reason` (a
reason starting with "flaky:" accepts either outcome).
"""

from __future__ import annotations

import argparse
import ast
import copy
import functools
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
# each release whose tests run: (passing on the real Accelerate, expected to fail on accel), files beside this one
VERSIONS = {"1.15.0": ("unit_passing_on_accelerate.txt", "unit_expected_failures.txt"),
            "1.16.0": ("unit_passing_on_accelerate_1.16.txt", "unit_expected_failures_1.16.txt")}
VERSION = "1.15.0"  # the default
PASSING_FILE, EXPECTED_FAILURES_FILE = HERE / VERSIONS[VERSION][0], HERE / VERSIONS[VERSION][1]
VERSION_ENV = "ACCEL_ACCELERATE_VERSION"  # the Accelerate version the shim answers as (accel/shim/__init__.py)
# Files `--all` skips: nothing in them passes on the real Accelerate on a CPU machine offline (measured: they need
# GPUs, the hub or packages the test extras leave out), so running them would only cost minutes.
SKIP_FILES = ("test_activation_checkpointing_offload.py", "test_examples.py", "test_imports.py",
              "test_load_checkpoint_and_dispatch_with_broadcast.py", "test_metrics.py", "test_multidevice.py",
              "test_tpu.py")
FILE_TIMEOUT = 300  # seconds per test file
TEST_TIMEOUT = 90  # seconds per test (the plugin's SIGALRM)
QUICK_FILE_SECONDS = 2  # a file not in FILE_SECONDS
# rough seconds per file (the listed tests, measured on a 2-core machine): the slowest start first.
FILE_SECONDS = {"test_accelerator.py": 21, "test_state_checkpointing.py": 14, "test_data_loader.py": 8,
                "test_scheduler.py": 10, "test_memory_utils.py": 10, "test_modeling_utils.py": 9, "test_utils.py": 9,
                "test_cli.py": 8, "test_grad_sync.py": 7, "test_cpu.py": 7}


def cache_dir() -> Path:
    return Path(os.environ.get("ACCEL_UNIT_SUITE_CACHE") or Path(tempfile.gettempdir()) / "accel_unit_suite_cache")


def list_files(version: str = VERSION) -> tuple[Path, Path]:
    """(passing on Accelerate, expected failures on accel) of a release in VERSIONS."""
    if version not in VERSIONS:
        raise ValueError(f"no lists for accelerate {version}; known: {', '.join(VERSIONS)}")
    passing, failures = VERSIONS[version]
    return HERE / passing, HERE / failures


def fetch_sdist(cache: Path | None = None, version: str = VERSION) -> Path:
    """Accelerate's unpacked source distribution, downloaded by pip the first time (later calls reuse it)."""
    cache = cache or cache_dir()
    root = cache / f"accelerate-{version}"
    if (root / "tests").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"accelerate=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        archives = list(Path(tmp).glob("accelerate-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(tmp, filter="data")
        if not (root / "tests").is_dir():  # another run may have unpacked it meanwhile
            os.replace(Path(tmp) / f"accelerate-{version}", root)
    return root


def installed_accelerate_version() -> str | None:
    """The version of the accelerate distribution installed for this interpreter (not the shim's), or None."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no shim, nothing of a caller's
    proc = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('accelerate'))"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tempfile.gettempdir())
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def fetch_package(cache: Path | None = None, version: str = VERSION) -> Path | None:
    """A folder holding the real Accelerate `version` (its `accelerate/` and dist-info), to put on PYTHONPATH: None
    where the installed accelerate is that version already, else installed there by pip the first time (no
    dependencies: each release's are the same as the installed one's)."""
    if installed_accelerate_version() == version:
        return None
    cache = cache or cache_dir()
    root = cache / f"accelerate-{version}-pkg"
    if (root / "accelerate" / "__init__.py").is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        target = Path(tmp) / "pkg"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--target", str(target), f"accelerate=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0 or not (target / "accelerate" / "__init__.py").is_file():
            raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        if not (root / "accelerate" / "__init__.py").is_file():  # another run may have installed it meanwhile
            os.replace(target, root)
    return root


def prepare(version: str = VERSION) -> tuple[Path, Path | None]:
    """(the unpacked source distribution, the real package folder or None): the downloads, done once."""
    return fetch_sdist(version=version), fetch_package(version=version)


# test helpers rewritten in 1.16 whose values are the same on this CPU-only harness: testing.get_backend (now through
# get_torch_accelerator_backend) still makes torch_device "cpu", device_count 1, memory_allocated_func 0 without an
# accelerator; counted as changed, they would choose every test that names torch_device or a require_* decorator
HELPERS_SAME_HERE = frozenset({"get_backend", "torch_device", "device_count", "memory_allocated_func"})


def _defs(tree: ast.Module) -> dict[str, ast.AST]:
    """A module's top-level definitions by name: functions, classes, assignments (imports are left out: the names
    they bring are compared where they are defined)."""
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found[name.id] = node
    return found


@functools.lru_cache(maxsize=None)
def _words(node: ast.AST) -> frozenset[str]:
    """The names a piece of code refers to: names, attributes, and string constants (also without a .py ending: a
    test names the script it launches by its file name)."""
    words: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            words.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            words.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and len(sub.value) < 200:
            words.update({sub.value, sub.value.removesuffix(".py"), Path(sub.value).stem})
    return frozenset(words)


_DUMPS: dict[int, tuple[ast.AST, str]] = {}  # ast.dump by node (the node kept, so its id is not reused)


def _dump(node: ast.AST) -> str:
    if id(node) not in _DUMPS:
        _DUMPS[id(node)] = (node, ast.dump(node))
    return _DUMPS[id(node)][1]


def _same(a: ast.AST | None, b: ast.AST | None) -> bool:
    return a is not None and b is not None and _dump(a) == _dump(b)


def _changed_names(new: dict[str, ast.AST], old: dict[str, ast.AST], same: frozenset[str] = frozenset()) -> set[str]:
    """The definitions in `new` that are not in `old` or differ (but `same`), and those referring to them (to a
    fixpoint)."""
    changed = {name for name, node in new.items() if name not in same and not _same(node, old.get(name))}
    while True:
        more = {name for name, node in new.items() if name not in changed and _words(node) & changed}
        if not more:
            return changed
        changed |= more


def _helpers_changed(new_root: Path, old_root: Path) -> set[str]:
    """What differs in Accelerate's test helpers (`accelerate.test_utils`, scripts included) between two source
    distributions: the changed definitions (and those using them) by name, and each changed module's name."""
    changed: set[str] = set()
    for path in sorted((new_root / "src/accelerate/test_utils").rglob("*.py")):
        old_path = old_root / path.relative_to(new_root)
        new_tree = ast.parse(path.read_text())
        old_tree = ast.parse(old_path.read_text()) if old_path.is_file() else ast.Module(body=[], type_ignores=[])
        if ast.dump(new_tree) != ast.dump(old_tree):
            if path.parent.name == "scripts" or path.parent.parent.name == "scripts":
                changed.add(path.stem)  # a test names a script it runs (by module or file name)
            changed |= _changed_names(_defs(new_tree), _defs(old_tree), HELPERS_SAME_HERE)
    return changed - {"main"}  # every script has a main: a test names the script itself


def _find_test(tree: ast.Module, test_id: str) -> tuple[ast.ClassDef | None, ast.AST | None]:
    """The class and function of a pytest id in a parsed test file (parameterized names: the class or function
    whose name is the longest prefix; pytest's [params] dropped)."""
    parts = test_id.split("::")[1:]
    func_name = parts[-1].split("[")[0]
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    cls = None
    if len(parts) > 1:
        cls = classes.get(parts[0]) or max((c for name, c in classes.items() if parts[0].startswith(name)),
                                           key=lambda c: len(c.name), default=None)
    scope = cls.body if cls is not None else tree.body
    funcs = [node for node in scope if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if cls is not None:  # a test inherited from a base class of the same file
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                funcs += [n for n in classes[base.id].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    func = max((f for f in funcs if func_name.startswith(f.name)), key=lambda f: len(f.name), default=None)
    return cls, func


@functools.lru_cache(maxsize=None)
def _class_rest(cls: ast.ClassDef | None) -> ast.AST | None:
    """A test class without its test methods (decorators, bases, setUp, helpers, attributes)."""
    if cls is None:
        return None
    rest = copy.copy(cls)
    rest.body = [node for node in cls.body
                 if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"))]
    return rest


def changed_tests(ids: list[str], version: str, base: str = VERSION) -> list[str]:
    """The tests of `ids` (of release `version`) whose code differs from release `base`'s: new tests; tests whose
    function, class (its setUp, helpers, decorators: all but the other tests) or the test file's definitions they
    use differ; tests that use a test helper (`accelerate.test_utils`, by name: a function, or a script by its file
    name) that differs. Read from the two source distributions' syntax trees (comments and formatting do not count).
    What it cannot see: a test whose code is the same but whose outcome changed through Accelerate itself (the
    other release's run covers those tests)."""
    new_root, old_root = fetch_sdist(version=version), fetch_sdist(version=base)
    helpers = _helpers_changed(new_root, old_root)
    trees: dict[tuple[Path, str], ast.Module | None] = {}

    def tree(root: Path, name: str) -> ast.Module | None:
        if (root, name) not in trees:
            path = root / name
            trees[root, name] = ast.parse(path.read_text()) if path.is_file() else None
        return trees[root, name]

    chosen, changed_defs = [], {}
    for test in ids:
        file = test.split("::")[0]
        new_tree, old_tree = tree(new_root, file), tree(old_root, file)
        if new_tree is None or old_tree is None:
            chosen.append(test)
            continue
        new_cls, new_func = _find_test(new_tree, test)
        old_cls, old_func = _find_test(old_tree, test)
        if not _same(new_func, old_func) or (new_cls is not None and not _same(_class_rest(new_cls),
                                                                                _class_rest(old_cls))):
            chosen.append(test)
            continue
        # what the test uses: its function and its class's other members, and the file's definitions they name
        if file not in changed_defs:
            changed_defs[file] = _changed_names(_defs(new_tree), _defs(old_tree)) | helpers
        changed_here = changed_defs[file]
        used = _words(new_func) | (_words(_class_rest(new_cls)) if new_cls is not None else frozenset())
        if used & changed_here:
            chosen.append(test)
    return chosen


def shim_path(version: str = VERSION) -> str:
    """The shim's PYTHONPATH entries, answering as Accelerate `version`."""
    return subprocess.run([sys.executable, "-m", "accel.shim"], capture_output=True, text=True, check=True,
                          timeout=120, env={**os.environ, VERSION_ENV: version}).stdout.strip()


def suite_env(impl: str, home: Path, version: str = VERSION, package: Path | None = None) -> dict:
    """CPU-only, offline, one thread, a fresh HOME; the shim first on PYTHONPATH for accel; the real Accelerate
    `package` folder (if any) next, before site-packages."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "ACCEL_", "PYTEST_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PYTHONPATH")}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1", HOME=str(home), PYTHONUNBUFFERED="1", WANDB_MODE="offline",
               ACCEL_UNIT_SUITE_TEST_TIMEOUT=str(TEST_TIMEOUT))
    # accel: the shim, then this checkout (the accel under test, wherever accel is installed); then the real
    # Accelerate of the tests' release when site-packages has another (accel: for accelerate.test_utils alone); the
    # plugin's folder
    first = [shim_path(version), str(HERE.parents[1])] if impl == "accel" else []
    env["PYTHONPATH"] = os.pathsep.join([*first, *([str(package)] if package else []), str(HERE)])
    if impl == "accel":
        env[VERSION_ENV] = version
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
    # a file that failed to import reports under its own path (several files share a process: each its own error)
    collection = {r["id"]: r["message"] for r in results.values() if r["message"].startswith("collection: ")}
    for test in ids:  # not reported: the file failed to import, or its time limit stopped it first
        why = collection.get(test.split("::")[0])
        results.setdefault(test, {"id": test, "outcome": "error" if why else "not run",
                                  "message": why or (tail.splitlines()[0] if tail else ""), "seconds": 0.0})
    return name, results, time.monotonic() - start, tail


def packed(files: list[tuple[str, list[str]]], processes: int) -> list[tuple[str, list[str], int]]:
    """The files' tests in at most `processes` groups of about equal time (FILE_SECONDS, QUICK_FILE_SECONDS for the
    others; the slowest placed first), each group one pytest process: (name, test ids, number of files). What a
    process costs of its own is mostly its imports (torch, accelerate's test helpers, transformers: about 4 s of CPU
    each), and as many processes as run side by side keep the cores as busy as one per file did."""
    groups: list[tuple[float, list[str], list[str]]] = [(0.0, [], []) for _ in range(max(1, processes))]
    for name, tests in sorted(files, key=lambda item: -FILE_SECONDS.get(item[0], QUICK_FILE_SECONDS)):
        load, names, ids = min(groups, key=lambda group: group[0])
        groups.remove((load, names, ids))
        groups.append((load + FILE_SECONDS.get(name, QUICK_FILE_SECONDS), [*names, name], [*ids, *tests]))
    groups.sort(key=lambda group: -group[0])
    return [(", ".join(names)[:120], ids, len(names)) for _, names, ids in groups if names]


def run_suite(impl: str = "accel", only: list[str] | None = None, files: list[str] | None = None, jobs: int = 2,
              timeout: int = FILE_TIMEOUT, verbose: bool = False, version: str = VERSION) -> dict[str, dict]:
    """{test id: result} of the tests `only` (ids), or of every test in Accelerate `version`'s test files (all but
    SKIP_FILES, or `files`)."""
    root, package = prepare(version)
    if only is not None:
        by_file: dict[str, list[str]] = {}
        for test in only:
            by_file.setdefault(test.split("::")[0].split("/")[-1], []).append(test)
        chosen = [(name, tests) for name, tests in sorted(by_file.items()) if not files or name in files]
        work_items = packed(chosen, jobs)
    else:
        names = files or sorted(p.name for p in (root / "tests").glob("test_*.py") if p.name not in SKIP_FILES)
        # the slowest files first, so the workers finish together
        work_items = [(name, [], 1) for name in sorted(names, key=lambda name: -FILE_SECONDS.get(name, 0))]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "home").mkdir()
        env = suite_env(impl, work / "home", version, package)
        results = {}
        with ThreadPoolExecutor(jobs) as pool:
            futures = [pool.submit(run_file, root, name, ids, env, work, timeout * file_count)  # per file, as alone
                       for name, ids, file_count in work_items]
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


def compare(results: dict[str, dict], version: str = VERSION, only: list[str] | None = None) -> list[str]:
    """Problems: an expected pass that did not pass, an expected failure that passed, a stale list entry; of the
    tests `only`, if given (a run of some of the list)."""
    passing_file, failures_file = list_files(version)
    reference, expected_fail = read_ids(passing_file), read_ids(failures_file)
    problems = [f"{t}: listed in {failures_file.name} but not in {passing_file.name}"
                for t in expected_fail if t not in reference]
    for test in sorted(reference if only is None else set(reference) & set(only)):
        got = results.get(test, {"outcome": "not run", "message": ""})
        if expected_fail.get(test, "").startswith("flaky:"):
            continue  # seen failing for a reason outside accel; either outcome is accepted
        if test in expected_fail and got["outcome"] == "passed":
            problems.append(f"NEW PASS {test}: passes on accel now; remove it from {failures_file.name}")
        elif test not in expected_fail and got["outcome"] != "passed":
            problems.append(f"NEW FAILURE {test}: {got['outcome']} on accel (passes on Accelerate): {got['message']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=("accel", "accelerate"), default="accel")
    parser.add_argument("--version", choices=tuple(VERSIONS), default=VERSION,
                        help="the Accelerate release whose tests run (and, for --impl accelerate, which runs them)")
    parser.add_argument("--all", action="store_true", help="run every test, not only those in the passing list")
    parser.add_argument("--changed-only", action="store_true",
                        help=f"only the listed tests whose code differs from accelerate {VERSION}'s (changed_tests: "
                             "what the CI test runs for another release)")
    parser.add_argument("--files", default="", help="comma-separated test file names (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", help="write every test's result here (JSON)")
    parser.add_argument("--write-passing", action="store_true",
                        help="write the passing ids to the version's passing list (implies --all)")
    parser.add_argument("--write-failures", action="store_true",
                        help="rewrite the version's expected failures: accel's failures, known reasons kept, new ones "
                             "with the failure's message")
    args = parser.parse_args(argv)
    passing_file, failures_file = list_files(args.version)
    prepare(args.version)  # the downloads, not timed
    start = time.monotonic()
    reference = read_ids(passing_file)
    only = None if args.all or args.write_passing else sorted(reference)
    if args.changed_only and args.version != VERSION:
        only = changed_tests(sorted(reference) if only is None else only, args.version)
        print(f"{len(only)} of the {len(reference)} tests differ from accelerate {VERSION}'s", file=sys.stderr)
    results = run_suite(args.impl, only, [f for f in args.files.split(",") if f] or None, args.jobs, verbose=True,
                        version=args.version)
    passed = sorted(t for t, r in results.items() if r["outcome"] == "passed")
    listed = set(reference) if only is None else set(reference) & set(only)
    print(f"{args.impl}, accelerate {args.version}'s tests: {len(passed)} of {len(results)} passed; "
          f"{len(set(passed) & listed)} of the {len(listed)} run that pass on Accelerate; "
          f"{time.monotonic() - start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_passing:
        passing_file.write_text("".join(f"{t}\n" for t in passed))
        return 0
    if args.write_failures:  # the tests this run left out keep their entries
        expected = read_ids(failures_file)
        ran = set(reference if only is None else only) & set(reference)
        lines = [f"{t}  # {expected.get(t) or results.get(t, {}).get('message') or 'not run'}\n"
                 for t in sorted(reference)
                 if (t in expected and t not in ran) or (t in ran and results.get(t, {}).get("outcome") != "passed")]
        failures_file.write_text("".join(lines))
        return 0
    problems = compare(results, args.version, only)
    print("\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
