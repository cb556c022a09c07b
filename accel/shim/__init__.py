"""The Accelerate shim: `import accelerate` (and `accelerate.utils`, `accelerate.state`, ...) resolves to accel.

`accel launch --accelerate_shim script.py` puts `PATH` (this package's `accelerate/` folder's parent) first on the
workers' PYTHONPATH; `PYTHONPATH=$(python -m accel.shim) python script.py` (or `torchrun ...`) does the same by
hand. That folder's `accelerate/__init__.py` makes `accelerate` the `accel` module and installs `AccelerateAlias`,
which answers every `accelerate.X` import with accel's module of the same name (`accelerate.utils.dataclasses` is
`accel.compat.dataclasses`). The one exception is `accelerate.test_utils` (Accelerate's own test helpers, not a
runtime API): it is loaded from a real Accelerate installation when there is one, its imports again going to accel.

The real `accelerate` package, if installed, is shadowed while the shim is on the path (its metadata stays, so
`importlib.metadata.version("accelerate")`, which transformers checks, reports the real one, or nothing).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import cast

PATH = os.path.dirname(os.path.abspath(__file__))  # holds accelerate/__init__.py
REAL_ONLY = ("accelerate.test_utils",)  # taken from a real Accelerate installation


def real_accelerate_dir() -> str | None:
    """The folder of a real Accelerate installation on sys.path (not the shim's), without importing it."""
    for entry in sys.path:
        folder = os.path.join(os.path.abspath(entry or os.getcwd()), "accelerate")
        if os.path.abspath(entry or os.getcwd()) != PATH and os.path.isfile(os.path.join(folder, "__init__.py")):
            return folder
    return None


class AccelerateAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `accelerate.X` as accel's `accel.X` (the same module object under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("accelerate."):
            return None
        if fullname == REAL_ONLY[0] or fullname.startswith(REAL_ONLY[0] + "."):
            return self._real_spec(fullname)
        accel_name = "accel" + fullname[len("accelerate"):]
        try:
            found = importlib.util.find_spec(accel_name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            return None  # ModuleNotFoundError: No module named 'accelerate.X' (accel has no such module)
        spec = importlib.machinery.ModuleSpec(fullname, self, is_package=found.submodule_search_locations is not None)
        spec.loader_state = accel_name
        return spec

    def create_module(self, spec):
        return importlib.import_module(spec.loader_state)

    def exec_module(self, module) -> None:
        """Nothing: the accel module is already executed."""

    def get_code(self, fullname: str):
        """The accel module's code, for `python -m accelerate.X` (runpy runs it as `__main__`)."""
        accel_name = "accel" + fullname[len("accelerate"):]
        spec = importlib.util.find_spec(accel_name)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(accel_name + ".__main__")
        if spec is None:
            return None
        loader = cast(importlib.abc.InspectLoader, spec.loader)  # accel's modules: source or bytecode files
        return loader.get_code(spec.name)

    @staticmethod
    def _real_spec(fullname: str):
        root = real_accelerate_dir()
        if root is None:
            return None
        parts = fullname.split(".")[1:]
        base = os.path.join(root, *parts)
        if os.path.isfile(os.path.join(base, "__init__.py")):
            return importlib.util.spec_from_file_location(fullname, os.path.join(base, "__init__.py"),
                                                          submodule_search_locations=[base])
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(fullname, base + ".py")
        return None


def install() -> None:
    """Make `accelerate` and its submodules resolve to accel in this process."""
    import accel

    if not any(isinstance(f, AccelerateAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, AccelerateAlias())
    sys.modules["accelerate"] = accel
