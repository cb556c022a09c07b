"""Every `from accelerate... import NAME` / `import accelerate.X` written in the installed consumer packages
(transformers, diffusers, TRL, sentence-transformers, PEFT by default), resolved through the shim: prints each
that does not resolve and exits 1 if any. Run with the shim on the path:

    PYTHONPATH=$(python -m accel.shim) python tests/accelerate_compat/consumer_imports.py [package ...]
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

DEFAULT = ("transformers", "diffusers", "trl", "sentence_transformers", "peft")


def imports_in(package: str) -> set[tuple[str, str | None]]:
    """(module, name) pairs: name None for `import accelerate.X`."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return set()
    found: set[tuple[str, str | None]] = set()
    for root in spec.submodule_search_locations:
        for path in Path(root).rglob("*.py"):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                        node.module == "accelerate" or node.module.startswith("accelerate.")):
                    found.update((node.module, alias.name) for alias in node.names)
                elif isinstance(node, ast.Import):
                    found.update((alias.name, None) for alias in node.names
                                 if alias.name == "accelerate" or alias.name.startswith("accelerate."))
    return found


def unresolved(pairs: set[tuple[str, str | None]]) -> list[str]:
    bad = []
    for module, name in sorted(pairs, key=lambda p: (p[0], p[1] or "")):
        if module.startswith("accelerate.test_utils"):
            continue  # Accelerate's own test helpers, not a runtime API
        try:
            loaded = importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 (report every kind of failure)
            bad.append(f"import {module}: {type(err).__name__}: {err}")
            continue
        if name is not None and name != "*" and not hasattr(loaded, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                bad.append(f"from {module} import {name}")
    return bad


def main(argv: list[str]) -> int:
    import accel.shim

    if not accel.shim.active():
        import accelerate  # noqa: F401 (the shim's module when it is on the path)
    if not accel.shim.active():
        print("consumer_imports: the shim is not on the path (PYTHONPATH=$(python -m accel.shim))", file=sys.stderr)
        return 2
    packages = argv or list(DEFAULT)
    total = 0
    bad: list[str] = []
    for package in packages:
        pairs = imports_in(package)
        total += len(pairs)
        bad += [f"{package}: {line}" for line in unresolved(pairs)]
    print("\n".join(bad))
    print(f"consumer_imports: {total - len(bad)} of {total} accelerate imports in {', '.join(packages)} resolve")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
