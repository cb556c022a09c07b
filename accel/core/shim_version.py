"""The Accelerate version the shim answers as (accel/shim): here, below everything, so `accel env` reads it without
the shim's import machinery."""

from __future__ import annotations

import os
import re
import sys

ACCELERATE_VERSION = "1.15.0"  # the Accelerate release the shim answers as (accel/shim/accelerate-<it>.dist-info)
VERSION_ENV = "ACCEL_ACCELERATE_VERSION"  # pins another: the version libraries see, for their version checks


class ShimVersionError(ValueError):
    """$ACCEL_ACCELERATE_VERSION is not a release version."""


def accelerate_version() -> str:
    """The version `accelerate` answers as: `$ACCEL_ACCELERATE_VERSION` when set (checked), else ACCELERATE_VERSION."""
    pinned = os.environ.get(VERSION_ENV, "").strip()
    if not pinned:
        return ACCELERATE_VERSION
    if not re.fullmatch(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}", pinned):
        raise ShimVersionError(f"{VERSION_ENV}={pinned!r} is not a release version; allowed: numbers with dots, such "
                               f"as {ACCELERATE_VERSION} (the default), or unset")
    return pinned


# the shim's `accelerate` module (accel/shim/accelerate/__init__.py), found without importing the shim
FACADE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shim", "accelerate", "__init__.py")


def shim_active() -> bool:
    """Whether `accelerate` is the shim's module in this process (the script imported Accelerate's names)."""
    return getattr(sys.modules.get("accelerate"), "__file__", None) == FACADE


SHIM_FOLDER = os.path.dirname(os.path.dirname(FACADE))  # accel/shim: holds accelerate/ and its dist-info
PROGRAM_MARKER = "written by `accel shim`"  # in the `accelerate` program `accel shim` writes (accel/cli/shim.py)


def _same_folder(entry: str, folder: str) -> bool:
    try:
        return os.path.normcase(os.path.abspath(entry or os.getcwd())) == os.path.normcase(folder)
    except (OSError, ValueError):  # a cwd that is gone, a NUL character
        return False


def on_pythonpath(pythonpath: str | None = None) -> bool:
    """Whether the shim's folder is on $PYTHONPATH (or `pythonpath`): `import accelerate` in the processes started
    from here gives the shim (`accel launch --accelerate_shim`, `PYTHONPATH=$(python -m accel.shim)`, the `accelerate`
    command of `eval "$(accel shim)"`)."""
    text = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    return any(_same_folder(entry, SHIM_FOLDER) for entry in text.split(os.pathsep) if entry)


def real_accelerate_installed() -> bool:
    """Whether a real Hugging Face Accelerate can be imported by this interpreter: the import system is asked where
    `accelerate` would come from (nothing is imported), with the shim's own folder left out of the search, so the shim
    on PYTHONPATH never counts; a folder named `accelerate` without `__init__.py` (a namespace package) does not
    either."""
    import importlib.machinery

    if "accelerate" in sys.modules:  # imported already (None: blocked); the shim's module: look behind it
        module = sys.modules["accelerate"]
        if module is None or getattr(module, "__file__", None) != FACADE:
            return module is not None
    path = [entry for entry in sys.path if not _same_folder(entry, SHIM_FOLDER)]
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec("accelerate", path if finder is importlib.machinery.PathFinder else None)
        except Exception:  # noqa: BLE001 (a third-party finder's own trouble: it has no Accelerate for us)
            continue
        if spec is not None and spec.origin not in (None, "namespace", FACADE):
            return True
    return False
