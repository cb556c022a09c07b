"""A subprocess environment in which Hugging Face Accelerate looks not installed (the test extras install it): a
`sitecustomize.py` first on PYTHONPATH hides its package and its distribution from every import and metadata lookup
of every Python process started with that environment (a launcher's workers too), while the shim's `accelerate`
(accel/shim) stays findable; PATH has no `accelerate` program."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import REPO_ROOT

SHIM = str(REPO_ROOT / "accel" / "shim")
PATH = os.pathsep.join(p for p in ("/usr/bin", "/bin") if os.path.isdir(p))  # a shell's tools; no `accelerate`

SITECUSTOMIZE = '''
import importlib.abc
import importlib.metadata
import sys

SHIM = {shim!r}


def _real(name, where):
    return name.split(".")[0] == "accelerate" and not str(where or "").startswith(SHIM)


class HideAccelerate(importlib.abc.MetaPathFinder):
    """The other finders, blind to a real Accelerate (as if it were not installed: find_spec gives None)."""

    def __init__(self, finders):
        self.finders = finders

    def find_spec(self, name, path=None, target=None):
        for finder in self.finders:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                where = spec.origin or next(iter(spec.submodule_search_locations or []), None)
                if not _real(name, where):
                    return spec
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        for finder in self.finders:
            for dist in getattr(finder, "find_distributions", lambda *a: ())(context):
                if not _real((dist.metadata["Name"] or "").lower(), getattr(dist, "_path", None)):
                    yield dist


for name in [name for name in sys.modules if name.split(".")[0] == "accelerate"]:
    del sys.modules[name]
sys.meta_path[:] = [HideAccelerate(list(sys.meta_path))]
'''


def without_accelerate(env: dict, folder: Path) -> dict:
    """`env` with Accelerate hidden (the sitecustomize written to `folder`) and PATH without an `accelerate`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(shim=SHIM))
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")])), "PATH": PATH}
