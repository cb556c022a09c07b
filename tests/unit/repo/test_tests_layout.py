"""The tests' layout mirrors the package (docs/development.md, "Where the tests are"): the unit tests of
`accel/<floor>/<module>.py` are `tests/unit/<floor>/test_<module>.py`, so a reader finds a module's tests by its name.
Read from the file tree: every unit test file is in a folder named after a floor of accel/ (or accelerate/,
accelerator/, repo/), a file named after a module is in that module's floor, and basenames are unique across tests/
(pytest imports each test file by its basename)."""

from __future__ import annotations

import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ACCEL = ROOT / "accel"
UNIT = ROOT / "tests" / "unit"

# Accelerate's import paths: its shim, commands, utils, the compat layer, and the modules directly in accel/
ACCELERATE_PACKAGES = ("commands", "utils", "compat", "shim")
EXTRA_FOLDERS = ("accelerate", "accelerator", "repo")


def _floors() -> set[str]:
    return {p.name for p in ACCEL.iterdir() if (p / "__init__.py").is_file() and p.name not in ACCELERATE_PACKAGES}


def _module_folders() -> dict[str, set[str]]:
    """Each module name of accel, and the test folders its tests may live in (a name can be in several floors)."""
    folders = collections.defaultdict(set)
    for path in ACCEL.rglob("*.py"):
        if path.stem.startswith("_") or "__pycache__" in path.parts:
            continue
        package = path.parent.relative_to(ACCEL).parts
        if not package:
            folders[path.stem].add("accelerator" if path.stem == "accelerator" else "accelerate")
        else:
            folders[path.stem].add("accelerate" if package[0] in ACCELERATE_PACKAGES else package[0])
    return folders


def _unit_test_files() -> list[Path]:
    return sorted(p for p in UNIT.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_every_unit_folder_is_a_floor():
    allowed = _floors() | set(EXTRA_FOLDERS)
    folders = {p.name for p in UNIT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert not folders - allowed, f"tests/unit folders that name no floor of accel/: {sorted(folders - allowed)}"


def test_every_unit_test_file_is_in_a_floor_folder():
    loose = [p.relative_to(ROOT).as_posix() for p in _unit_test_files() if p.parent.parent != UNIT]
    assert not loose, f"unit test files outside tests/unit/<floor>/: {loose}"


def test_a_test_named_after_a_module_is_in_its_floor():
    folders = _module_folders()
    misplaced = []
    for path in _unit_test_files():
        module = path.stem.removeprefix("test_")
        if module in folders and path.parent.name not in folders[module]:
            misplaced.append(f"{path.relative_to(ROOT).as_posix()} (accel's {module}: {sorted(folders[module])})")
    assert not misplaced, f"test files named after a module, outside its floor: {misplaced}"


def test_basenames_are_unique_across_tests():
    names = collections.Counter(p.name for p in (ROOT / "tests").rglob("*.py") if "__pycache__" not in p.parts
                                and p.name != "__init__.py" and p.name != "conftest.py")
    assert not [n for n, c in names.items() if c > 1], f"basenames used twice: {[n for n, c in names.items() if c > 1]}"


def test_the_layout_rules_see_the_floors():
    """Guards the checks above against passing on an empty tree (a moved ROOT, a renamed folder)."""
    assert {"core", "config", "parallel", "checkpoint"} <= _floors()
    assert _module_folders()["data_parallel"] == {"parallel"} and "accelerate" in _module_folders()["state"]
    assert len(_unit_test_files()) > 50
