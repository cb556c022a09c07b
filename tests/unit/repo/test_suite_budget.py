"""The suite's time budget (tests/suite_budget.py): a whole-suite run more than 25% over `suite_budget_s` fails in
one line naming the budget and the measured time; a narrowed run (a file, -k) is never checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import suite_budget
from suite_budget import over_budget

TESTS = Path(suite_budget.__file__).resolve().parent  # the folder of the plugin, on the inner run's path


def test_within_25_percent_passes_and_beyond_fails_naming_both_figures():
    assert over_budget(600, 600) is None and over_budget(750, 600) is None
    assert over_budget(751, 600) == ("suite time budget exceeded: 751 s measured, budget 600 s + 25% = 750 s "
                                     "(suite_budget_s in pyproject.toml [tool.pytest.ini_options])")
    assert over_budget(10_000, 0) is None  # no budget set


def _run_suite(tmp_path: Path, budget: float, elapsed: float, *args: str) -> subprocess.CompletedProcess:
    """pytest on a project of one passing test whose clock says `elapsed` seconds passed between start and end."""
    (tmp_path / "pytest.ini").write_text(f"[pytest]\ntestpaths = t\nsuite_budget_s = {budget}\n")
    (tmp_path / "t").mkdir(exist_ok=True)
    (tmp_path / "t" / "test_one.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "conftest.py").write_text(
        "from suite_budget import SuiteBudget, add_budget_option\n\n"
        "def pytest_addoption(parser):\n    add_budget_option(parser)\n\n"
        "def pytest_configure(config):\n"
        f"    config.pluginmanager.register(SuiteBudget(clock=iter([0.0, {elapsed}]).__next__), 'suite_budget')\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          cwd=tmp_path, env={"PYTHONPATH": str(TESTS), "PATH": ""}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("elapsed,fails", [(1.2, False), (1.3, True)])
def test_a_whole_suite_run_over_budget_fails_in_one_line(tmp_path, elapsed, fails):
    proc = _run_suite(tmp_path, 1, elapsed)
    line = "suite time budget exceeded: 1 s measured, budget 1 s + 25% = 1 s"
    assert (proc.returncode, line in proc.stdout) == ((1, True) if fails else (0, False)), proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_a_narrowed_run_is_not_checked(tmp_path):
    assert _run_suite(tmp_path, 1, 100, "t/test_one.py").returncode == 0
    assert _run_suite(tmp_path, 1, 100, "-k", "one").returncode == 0


def test_auto_workers_add_one_where_memory_allows():
    """`-n auto`: a worker per core (two at least), one more with 4 GB per worker; the machine's count decides."""
    from conftest import GB_PER_WORKER, auto_workers, memory_gb

    assert auto_workers(2, 23.5) == 3  # the 2-core machine the suite's figures come from
    assert auto_workers(2, 7.0) == 2  # a 7 GB runner keeps two
    assert auto_workers(1, 64.0) == 3 and auto_workers(1, 4.0) == 2
    assert auto_workers(16, GB_PER_WORKER * 17) == 17 and auto_workers(16, 32.0) == 16
    assert 0 < memory_gb() < 2**20
