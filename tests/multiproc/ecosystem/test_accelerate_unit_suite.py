"""Accelerate's own unit tests (`tests/test_*.py` of its source distribution, downloaded by pip at run time into a
temp cache, unchanged) on accel through the shim, for two releases:

- 1.15.0: exactly the tests listed in tests/accelerate_compat/unit_passing_on_accelerate.txt (those that pass on the
  real Accelerate 1.15.0 here) pass, except those in unit_expected_failures.txt, which must fail;
- 1.16.0: the same with unit_passing_on_accelerate_1.16.txt / unit_expected_failures_1.16.txt, but only the tests
  whose code differs from 1.15.0's (unit_suite.changed_tests: new tests, changed test functions, classes, or test
  helpers they use; about 70 of the 320): the others are 1.15.0's tests, run above. Its accelerate.test_utils come
  from a real Accelerate 1.16.0 that the harness pip-installs into its cache (site-packages holds 1.15.0).

A new failure fails here, and so does a fixed one (remove it from the list). Harness:
tests/accelerate_compat/unit_suite.py; reasons: docs/accelerate_compat.md."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc
if importlib.util.find_spec("accelerate") is None:  # its test_utils (not a runtime API) come from the real package
    pytest.skip("the real accelerate package (a test extra) is not installed", allow_module_level=True)
if os.environ.get("ACCEL_UNIT_SUITE", "1") == "0":
    pytest.skip("ACCEL_UNIT_SUITE=0: Accelerate's unit suite turned off", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "accelerate_compat"))
import unit_suite  # noqa: E402

BUDGET = 360  # seconds, on 2 CPU cores
BUDGET_1_16 = 120  # the tests that differ from 1.15.0's


def test_accelerate_unit_suite_on_accel():
    unit_suite.prepare()  # the download is not part of the budget
    start = time.monotonic()
    # 3 pytest processes at a time: their start-up and waits overlap on 2 cores
    results = unit_suite.run_suite("accel", only=sorted(unit_suite.read_ids(unit_suite.PASSING_FILE)), jobs=3)
    seconds = time.monotonic() - start
    problems = unit_suite.compare(results)
    passed = sum(r["outcome"] == "passed" for r in results.values())
    summary = f"{passed} of {len(results)} of Accelerate's passing unit tests pass on accel, in {seconds:.0f}s"
    assert not problems, summary + "\n" + "\n".join(problems)
    assert seconds < BUDGET * 1.5, summary + f": over the {BUDGET}s budget (deselect the slowest in unit_suite.py)"


def test_accelerate_1_16_unit_suite_on_accel():
    version = "1.16.0"
    unit_suite.prepare(version)  # the downloads (1.16.0's sdist and package, 1.15.0's sdist) and the choice: untimed
    passing = sorted(unit_suite.read_ids(unit_suite.list_files(version)[0]))
    only = unit_suite.changed_tests(passing, version)
    start = time.monotonic()
    results = unit_suite.run_suite("accel", only=only, jobs=3, version=version)
    seconds = time.monotonic() - start
    problems = unit_suite.compare(results, version, only)
    passed = sum(r["outcome"] == "passed" for r in results.values() if r["id"] in only)
    summary = (f"{passed} of the {len(only)} (of {len(passing)}) of Accelerate {version}'s passing unit tests that "
               f"differ from {unit_suite.VERSION}'s pass on accel, in {seconds:.0f}s")
    assert not problems, summary + "\n" + "\n".join(problems)
    assert seconds < BUDGET_1_16 * 1.5, summary + f": over the {BUDGET_1_16}s budget"
