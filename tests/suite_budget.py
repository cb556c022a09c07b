"""The suite's time budget: a run of the whole suite (`python -m pytest -q`, the README's command: no file, `-k`,
`-m`, `--deselect` or `--lf` narrowing it) that takes more than 25% over `suite_budget_s` ([tool.pytest.ini_options]
in pyproject.toml, seconds of wall time on CI's 2 cores) fails, in one line naming the budget and the time measured.
A slower suite is then a decision (raise the budget in the same commit) rather than a drift."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

BUDGET_OPTION = "suite_budget_s"
TOLERANCE = 0.25  # the run fails above budget * (1 + TOLERANCE)


def add_budget_option(parser: pytest.Parser) -> None:
    parser.addini(BUDGET_OPTION, "wall-time budget of the whole suite in seconds; a run over it by more than "
                  f"{TOLERANCE:.0%} fails (0: no budget)", default="0")


def over_budget(seconds: float, budget: float) -> str | None:
    """The failure line when `seconds` exceed `budget` by more than TOLERANCE, else None (also for no budget)."""
    limit = budget * (1 + TOLERANCE)
    if budget <= 0 or seconds <= limit:
        return None
    return (f"suite time budget exceeded: {seconds:.0f} s measured, budget {budget:.0f} s + {TOLERANCE:.0%} = "
            f"{limit:.0f} s ({BUDGET_OPTION} in pyproject.toml [tool.pytest.ini_options])")


def runs_whole_suite(config: pytest.Config) -> bool:
    """The README's command: the controller (not an xdist worker) of a run of every test under `testpaths`."""
    option = vars(config.option)  # --lf and --sw exist only with the cache plugin
    narrowed = any(option.get(name) for name in ("keyword", "markexpr", "deselect", "lf", "stepwise", "collectonly"))
    return (not hasattr(config, "workerinput") and config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not narrowed)


class SuiteBudget:
    """Times the session from configuration to its end and fails the run past the budget."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.start = clock()
        self.failure: str | None = None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = session.config
        if not runs_whole_suite(config):
            return
        self.failure = over_budget(self.clock() - self.start, float(config.getini(BUDGET_OPTION)))
        if self.failure and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.failure:
            terminalreporter.write_line(self.failure, red=True, bold=True)
