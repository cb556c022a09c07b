"""The package's layering, as docs/architecture.md describes it, checked on the source (no import is executed).

Every `import` counts, those inside functions included (that is where circles hide); only `if TYPE_CHECKING:`
blocks are left out, as they never run.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# lower layers first: a module may import its own layer and the ones below, never one above
LAYERS = [
    ("core", ["accel.core"]),
    ("config", ["accel.config"]),
    ("runtime", ["accel.runtime"]),
    ("data, checkpoints, big models", ["accel.data", "accel.checkpoint", "accel.big_model"]),
    ("backends", ["accel.backends", "accel.fault_tolerance"]),  # fault tolerance: a data-parallel variant
    ("planning", ["accel.planning"]),
    ("training pieces", ["accel.optimizer", "accel.scheduler", "accel.tracking", "accel.compat"]),
    ("Accelerator", ["accel.accelerator"]),
    ("facades", ["accel", "accel.utils", "accel.data_loader", "accel.parallelism_config", "accel.state",
                 "accel.logging", "accel.hooks", "accel.big_modeling", "accel.launchers", "accel.shim"]),
    ("CLI", ["accel.cli"]),
    ("Accelerate's commands", ["accel.commands"]),  # `accelerate.commands`: Accelerate's CLI API over accel's CLI
]
FACADE_LAYERS = {"facades", "Accelerate's commands"}
# Accelerate's own top-level module names: the only modules directly in accel/ (everything else is a subpackage)
ACCELERATE_TOP_LEVEL = {"accelerator", "big_modeling", "checkpointing", "data_loader", "hooks", "inference",
                        "launchers", "local_sgd", "logging", "memory_utils", "optimizer", "parallelism_config",
                        "scheduler", "state", "tracking"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "accel").rglob("*.py")):
        found[_module_name(path)] = path
    return found


MODULES = _sources()


def _owner(name: str) -> str | None:
    """The module of ours an imported name lives in (`accel.config.schema.AccelConfig` -> accel.config.schema)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            names = [n for n in names[1:] if n in MODULES] or names[:1]  # `from pkg import submodule`: the submodule
        else:
            continue
        for name in names:
            owner = _owner(name) if name.split(".")[0] == "accel" else None
            if owner and owner != module:
                found.add(owner)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> int:
    best, rank = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    if rank is None:
        raise AssertionError(f"{module} is in no layer of tests/unit/test_layering.py (and docs/architecture.md)")
    return rank


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
              for m, deps in GRAPH.items() for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_internal_code_never_imports_a_facade():
    """Accelerate's import paths (`accel.utils`, `accel.state`, ...) are for users; accel's own code imports the
    module that implements a name, so a facade can change without moving the floors under it. (Below the facades
    the layer rule already says so; this covers the CLI above them, which only puts the shim on workers' path.)"""
    def is_facade(module: str) -> bool:
        return LAYERS[_layer(module)][0] in FACADE_LAYERS

    facade = [f"{m} imports {d}" for m, deps in GRAPH.items() if not is_facade(m) for d in sorted(deps)
              if is_facade(d) and not (m == "accel.cli.launch" and d == "accel.shim")]
    assert not facade, "\n".join(facade)


def test_no_import_circle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in GRAPH[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_top_level_holds_only_accelerates_module_names():
    """A newcomer reads the architecture off the folder listing: the modules directly in accel/ are Accelerate's
    import paths; each concern of accel's own is a subpackage."""
    top = {p.stem for p in (ROOT / "accel").glob("*.py")} - {"__init__"}
    assert top <= ACCELERATE_TOP_LEVEL, sorted(top - ACCELERATE_TOP_LEVEL)


@pytest.mark.parametrize("module", ["accel.state", "accel.logging", "accel.hooks", "accel.big_modeling",
                                    "accel.utils.modeling", "accel.utils.offload", "accel.utils.imports",
                                    "accel.utils.random", "accel.utils.other", "accel.utils.dataclasses"])
def test_an_accelerate_path_is_its_implementing_module(module):
    """Accelerate's paths stay importable, as the same module object as the implementation (so a test that patches
    `accelerate.utils.modeling.X` patches what accel runs)."""
    import importlib

    alias = importlib.import_module(module)
    assert alias.__name__ != module and importlib.import_module(alias.__name__) is alias


def test_the_facades_answer_every_name_they_list():
    import accel
    import accel.utils

    for facade in (accel, accel.utils):
        missing = [name for name in facade.__all__ if not hasattr(facade, name)]
        assert not missing, f"{facade.__name__}: {missing}"


def test_the_graph_sees_late_imports():
    """The checker itself: an import inside a function counts (a circle hidden there is still a circle)."""
    assert "accel.big_model.modeling" in GRAPH["accel.compat.other"]  # imported inside clean_state_dict_for_...
    assert os.path.basename(MODULES["accel.core.probes"]) == "probes.py"
