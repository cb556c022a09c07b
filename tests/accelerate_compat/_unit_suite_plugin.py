"""pytest plugin for unit_suite.py (loaded with `-p _unit_suite_plugin` in the suite's own pytest process): one JSON
line per test as it finishes, in $ACCEL_UNIT_SUITE_REPORT, so a file stopped by its time limit still reports the tests
it ran; a per-test time limit ($ACCEL_UNIT_SUITE_TEST_TIMEOUT seconds, SIGALRM) so one hung test fails alone; and, with
$ACCEL_UNIT_SUITE_ONLY (a file of test ids, one per line), only those tests run."""

from __future__ import annotations

import json
import os
import signal

import pytest

_RESULTS: dict[str, dict] = {}


class SuiteTimeout(Exception):
    """A test ran past the suite's per-test time limit."""


def _alarm(signum, frame):
    raise SuiteTimeout(f"ran past the per-test limit of {os.environ.get('ACCEL_UNIT_SUITE_TEST_TIMEOUT')}s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = int(os.environ.get("ACCEL_UNIT_SUITE_TEST_TIMEOUT", "0"))
    previous = signal.signal(signal.SIGALRM, _alarm) if limit else None
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        if previous is not None:
            signal.signal(signal.SIGALRM, previous)
    _write(_RESULTS.pop(item.nodeid, None))


def pytest_runtest_logreport(report):
    """Merge the setup/call/teardown reports: failed in any phase, else skipped in any, else passed."""
    entry = _RESULTS.setdefault(report.nodeid, {"id": report.nodeid, "outcome": "passed", "message": "",
                                                "seconds": 0.0})
    entry["seconds"] += report.duration
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["message"] = _last_line(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_collectreport(report):
    if report.failed:
        _write({"id": report.nodeid, "outcome": "error", "message": "collection: " + _last_line(report),
                "seconds": 0.0})


def _last_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _write(entry: dict | None) -> None:
    path = os.environ.get("ACCEL_UNIT_SUITE_REPORT")
    if entry is None or not path:
        return
    with open(path, "a") as out:
        out.write(json.dumps(entry) + "\n")


def pytest_collection_modifyitems(config, items):
    only = os.environ.get("ACCEL_UNIT_SUITE_ONLY")
    if not only:
        return
    with open(only) as f:
        wanted = {line.strip() for line in f if line.strip()}
    keep = [item for item in items if item.nodeid in wanted]
    dropped = [item for item in items if item.nodeid not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
