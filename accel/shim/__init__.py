"""The Accelerate shim: `import accelerate` (and `accelerate.utils`, `accelerate.state`, ...) resolves to accel.

`accel launch --accelerate_shim script.py` puts `search_path()` (this package's folder, which holds `accelerate/`
and an `accelerate-<version>.dist-info`) first on the workers' PYTHONPATH; `PYTHONPATH=$(python -m accel.shim) python
script.py` (or `torchrun ...`) does the same by hand. That folder's `accelerate/__init__.py` is the `accelerate`
module: it answers `accelerate.X` with `accel.X` and has its own `__version__`, the Accelerate version the shim
answers as (`ACCELERATE_VERSION`, or `$ACCEL_ACCELERATE_VERSION` where a user pins another), while `accel.__version__`
stays accel's. It installs `AccelerateAlias`, which answers every `accelerate.X` import with accel's module of the
same name (`accelerate.utils.dataclasses` is `accel.compat.dataclasses`). The one exception is
`accelerate.test_utils` (Accelerate's own test helpers, not a runtime API): it is loaded from a real Accelerate
installation when there is one, its imports again going to accel.

Libraries ask the `accelerate` *distribution* whether it is installed and which version it is
(`importlib.metadata.version("accelerate")`: transformers' Trainer, diffusers, PEFT, TRL). The dist-info folder
answers them, with or without a real Accelerate installed: the real package, if any, is shadowed, code and metadata.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import types
from typing import cast

from accel.core.shim_version import (
    ACCELERATE_VERSION,
    FACADE,
    VERSION_ENV,
    ShimVersionError,
    accelerate_version,
    shim_active,
)

PATH = os.path.dirname(os.path.abspath(__file__))  # holds accelerate/__init__.py and accelerate-*.dist-info
REAL_ONLY = ("accelerate.test_utils",)  # taken from a real Accelerate installation
__all__ = ["ACCELERATE_VERSION", "PATH", "VERSION_ENV", "AccelerateAlias", "ShimVersionError", "accelerate_version",
           "active", "install", "register_alias", "search_path"]


def metadata_text(version: str) -> str:
    """The dist-info METADATA the shim answers with: Accelerate's name, version and home page (sentence-transformers
    checks that the home page is Hugging Face's), accel's summary."""
    return (f"Metadata-Version: 2.1\nName: accelerate\nVersion: {version}\n"
            f"Summary: accel's Accelerate shim: answers as Accelerate {version}; the code is accel's\n"
            "Home-page: https://github.com/huggingface/accelerate\n")


def _pinned_metadata_folder(version: str) -> str:
    """A folder holding only `accelerate-<version>.dist-info` (made once, atomically), for a pinned version."""
    import tempfile

    for base in (os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "accel"),
                 tempfile.gettempdir()):
        folder = os.path.join(base, f"accelerate-shim-{version}")
        info = os.path.join(folder, f"accelerate-{version}.dist-info")
        if os.path.isfile(os.path.join(info, "METADATA")):
            return folder
        try:
            os.makedirs(folder, exist_ok=True)
            staging = tempfile.mkdtemp(dir=folder, prefix=".staging-")
            with open(os.path.join(staging, "METADATA"), "w", encoding="utf-8") as out:
                out.write(metadata_text(version))
            with open(os.path.join(staging, "top_level.txt"), "w", encoding="utf-8") as out:
                out.write("accelerate\n")
            try:
                os.rename(staging, info)
            except OSError:  # another launcher made it first
                shutil.rmtree(staging, ignore_errors=True)
            if os.path.isfile(os.path.join(info, "METADATA")):
                return folder
        except OSError:
            continue
    raise ShimVersionError(f"{VERSION_ENV}={version}: could not write the shim's metadata folder under ~/.cache/accel "
                           "or the temp dir; allowed: a writable cache, or unset")


def search_path() -> list[str]:
    """The folders to put first on PYTHONPATH: the pinned version's metadata folder (if pinned), then PATH."""
    version = accelerate_version()
    return [PATH] if version == ACCELERATE_VERSION else [_pinned_metadata_folder(version), PATH]


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


def register_alias() -> None:
    """`accelerate.X` imports resolve to `accel.X` (the finder first on sys.meta_path, once)."""
    if not any(isinstance(f, AccelerateAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, AccelerateAlias())


def install() -> None:
    """Make `accelerate` (the shim's module, with its metadata) and its submodules resolve to accel in this process."""
    register_alias()
    current = sys.modules.get("accelerate")
    if isinstance(current, types.ModuleType) and getattr(current, "__file__", None) == FACADE:
        return
    for folder in reversed(search_path()):  # the metadata too, as under PYTHONPATH
        if folder not in sys.path:
            sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("accelerate", FACADE,
                                                  submodule_search_locations=[os.path.dirname(FACADE)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["accelerate"] = module
    spec.loader.exec_module(module)


active = shim_active
