"""Accelerate's unit suite runs in as many pytest processes as run side by side (tests/accelerate_compat/unit_suite.py
`packed`): every listed test in exactly one process, the processes' estimated times about equal."""

import sys

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "accelerate_compat"))
import unit_suite


def test_every_test_is_in_one_process_and_the_loads_are_balanced():
    files = [(name, [f"tests/{name}::test_{i}" for i in range(3)])
             for name in [*unit_suite.FILE_SECONDS, "test_a_quick_one.py", "test_another_quick_one.py"]]
    groups = unit_suite.packed(files, 3)
    assert len(groups) == 3
    ids = [test for _, tests, _ in groups for test in tests]
    assert sorted(ids) == sorted(test for _, tests in files for test in tests)
    assert sum(count for *_, count in groups) == len(files)

    def load(tests):
        names = {test.split("::")[0].split("/")[-1] for test in tests}
        return sum(unit_suite.FILE_SECONDS.get(name, unit_suite.QUICK_FILE_SECONDS) for name in names)

    loads = [load(tests) for _, tests, _ in groups]
    assert max(loads) - min(loads) <= max(unit_suite.FILE_SECONDS.values()), loads


def test_fewer_files_than_processes_makes_one_process_each():
    groups = unit_suite.packed([("test_cli.py", ["tests/test_cli.py::test_x"])], 3)
    assert groups == [("test_cli.py", ["tests/test_cli.py::test_x"], 1)]
