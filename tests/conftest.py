"""Shared test helpers: an isolated environment for subprocesses and a free TCP port."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python
from suite_budget import SuiteBudget, add_budget_option

REPO_ROOT = Path(__file__).resolve().parents[1]

# inductor compiles its kernels in a pool of worker processes, one per core by default: on CI's 2 cores, with 2 ranks
# compiling at once, starting and feeding the pools costs more than it saves (a tiny GPT-2 block's first step: 35 s
# with the pool, 21 s without, measured under load). Every test process and launch inherits this.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


# the files that take longest (measured with --durations, 2 cores), started first: pytest-xdist hands whole files
# to its workers in collection order (--no-loadscope-reorder in pyproject.toml), and one of these started last
# would run on alone after the rest is done
LONGEST_FIRST = ("test_accelerate_unit_suite.py", "test_examples.py", "test_hf_models.py", "test_trainer.py",
                 "test_hf_models_compiled.py", "test_doc_blocks.py", "test_measure.py", "test_expert.py",
                 "test_sequence.py", "test_pipeline.py", "test_fault_tolerance.py", "test_ray_train.py",
                 "test_preemption.py")


GB_PER_WORKER = 4  # a pytest worker's peak: its zygotes and a 4-process job (about 2.2 GB measured), with room


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): one worker per core, two at least, and one more where memory allows. A launch test
    spends much of its time waiting (a rendezvous, a group that starts late, a signal's grace period, a timeout),
    and the extra worker runs another file then: 645 s against 664 s for the whole suite on 2 cores and 23 GB."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return auto_workers(cores, memory_gb())


def auto_workers(cores: int, memory: float) -> int:
    workers = max(2, cores)
    return workers + 1 if memory >= GB_PER_WORKER * (workers + 1) else workers


def memory_gb() -> float:
    """The machine's memory, or the container's limit (cgroup v2, then v1) where lower."""
    found = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(limit).read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            found = min(found, int(value))
    return found / 2**30


def pytest_addoption(parser) -> None:
    add_budget_option(parser)


def pytest_configure(config) -> None:
    config.pluginmanager.register(SuiteBudget(), "suite_budget")  # fails a whole-suite run far over its budget


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_collection_finish(session) -> None:
    """Every module the tests import is loaded now (torch, transformers, ...: a few hundred thousand objects that
    live as long as the worker): move them out of the garbage collector's reach, so each `gc.collect()` a test
    makes (accel's free_memory, find_executable_batch_size, ...) scans only what the tests made since. Measured: a
    full collection went from seconds, late in a worker's run, to the tests' own objects."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _environment_restored():
    """os.environ as it was before each test: a test running `accel launch` in this process (main(["launch", ...]))
    leaves the workers' variables (ACCEL_PREEMPTION_DIR, ...), and a later test's subprocess took itself for a
    launched worker."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


HARNESS_VARIABLES = ("ACCEL_UNIT_SUITE", "ACCEL_CONSUMER_", "ACCEL_FUZZ_", "ACCEL_ACCELERATE116")  # the suite's own


def make_isolated_env(tmp_path: Path) -> dict:
    """os.environ for a subprocess, with HOME in a temp dir (the real user config is never read or written)
    and no accel variables inherited from the caller."""
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    for name in [name for name in env if name.startswith("ACCEL_") and not name.startswith(HARNESS_VARIABLES)]:
        env.pop(name)  # a launcher run in this process (a unit test) may have left its workers' variables here
    env["HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    # every multi-process run is checked as the CUDA job it stands for: a host tensor sent where NCCL would refuse
    # it fails the run (accel.core.collective_check)
    env["ACCEL_CHECK_COLLECTIVE_DEVICES"] = "cuda"
    return env


@pytest.fixture
def isolated_env(tmp_path: Path) -> dict:
    return make_isolated_env(tmp_path)


@pytest.fixture
def run_accel(isolated_env: dict, tmp_path: Path):
    """Run `python -m accel.cli.main ARGS...` in a subprocess (always with a timeout; from a warm interpreter:
    tests/multiproc/warm_python.py); returns CompletedProcess."""

    def run(*args: str, input: str | None = None, timeout: float = 60, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        return warm_python.run([sys.executable, "-m", "accel.cli.main", *map(str, args)], input=input or "",
                               timeout=timeout, env={**isolated_env, **(env or {})}, cwd=cwd or tmp_path)

    return run


def get_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    """A TCP port that was free a moment ago (good enough for tests)."""
    return get_free_port()
