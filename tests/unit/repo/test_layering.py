"""The package's layering, as docs/architecture.md describes it, checked on the source (no import is executed).

Every `import` counts, those inside functions included (that is where circles hide); only `if TYPE_CHECKING:`
blocks are left out, as they never run.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# lower layers first: a module may import its own layer and the ones below, never one above
LAYERS = [
    ("core", ["accel.core"]),
    ("config", ["accel.config"]),
    ("runtime", ["accel.runtime"]),
    ("data, checkpoints, big models", ["accel.data", "accel.checkpoint", "accel.big_model"]),
    ("transforms", ["accel.transforms"]),  # the recipe's model transformations that are not a dimension
    ("parallel dimensions", ["accel.parallel"]),  # one part per dimension, the data-parallel plan
    ("backends", ["accel.backends", "accel.fault_tolerance"]),  # step owners; fault tolerance: a data-parallel variant
    ("planning", ["accel.planning"]),
    ("training pieces", ["accel.optimizer", "accel.scheduler", "accel.tracking", "accel.trackers", "accel.compat"]),
    ("Accelerator", ["accel.accelerator", "accel.accelerator_mixins"]),  # the facade; its members by concern
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


def _from_base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` in `module` names (relative ones resolved)."""
    base = node.module or ""
    if node.level:
        anchor = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            anchor = anchor.rpartition(".")[0]
        base = f"{anchor}.{base}" if base else anchor
    return base


def _imports(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
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
        raise AssertionError(f"{module} is in no layer of tests/unit/repo/test_layering.py (and docs/architecture.md)")
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


# -- references across floors that bypass an interface --------------------------------------------------------
# A private member (`x._name`, `getattr(x, "_name")`) is its module's own: another module that reads or writes it
# depends on that module's insides, which no import shows when the object was handed over. Each entry is a
# (module, private name) pair still doing so, and why; remove it once the owner offers a public way.
PRIVATE_ACCESS_ALLOWED = {
    ("accel.accelerator", "_throughput"): "hands the first prepared optimizer its step observer; optimizer.py has no "
                                          "public seam for it yet",
    ("accel.big_model.checkpoint_loading", "_FOLDER_CANDIDATES"): "checkpoint folder names shared with "
                                                                  "model_files; to be made public there",
    ("accel.big_model.checkpoint_loading", "_checked_shard_path"): "model_reader's shard path check, reused; to be "
                                                                   "made public there",
    ("accel.checkpoint.merge", "_check_state_files"): "state checks reused by the merger; to be made public",
    ("accel.checkpoint.merge", "_checked_manifest"): "state checks reused by the merger; to be made public",
    ("accel.checkpoint.run_state", "_accel_state_dict"): "the stateful data loader's own state, probed by name",
    ("accel.checkpoint.state_save", "_save_rng"): "rng_states' saver; to be made public there",
    ("accel.compat.other", "_reconstruct"): "numpy's own multiarray._reconstruct (torch_file's method of that "
                                            "name is another)",
    ("accel.cli.shim", "_find_module"): "cli.checks' module finder, reused; to be made public",
    ("accel.data.loading", "_clone"): "skip_first_batches copies a DataLoaderShard by its private method",
    ("accel.data.loading", "_parent"): "skip_first_batches links the copy to its DataLoaderShard by name",
    ("accel.data.prepared_loaders", "_add_dataloader"): "GradientState's registration of a loader (Accelerate's "
                                                        "private name)",
    ("accel.data.prepared_loaders", "_remove_dataloader"): "GradientState's registration of a loader (Accelerate's "
                                                           "private name)",
    ("accel.fault_tolerance.backend", "_parent"): "the prepared data loader's wrapped loader, probed by name",
    ("accel.launchers", "_carried"): "PartialState's singleton, reset by notebook_launcher as Accelerate does",
    ("accel.launchers", "_instance"): "PartialState's singleton, reset by notebook_launcher as Accelerate does",
    ("accel.launchers", "_shared_state"): "PartialState's singleton, reset by notebook_launcher as Accelerate does",
    ("accel.planning.estimate", "_COLUMN_NAMES"): "TP plan's module-name tables; to be made public in tensor_plan",
    ("accel.planning.estimate", "_EMBEDDING_NAMES"): "TP plan's module-name tables; to be made public in tensor_plan",
    ("accel.planning.estimate", "_FUSED_NAMES"): "TP plan's module-name tables; to be made public in tensor_plan",
    ("accel.planning.estimate", "_HEAD_NAMES"): "TP plan's module-name tables; to be made public in tensor_plan",
    ("accel.planning.estimate", "_ROW_NAMES"): "TP plan's module-name tables; to be made public in tensor_plan",
    ("accel.runtime.logging", "_shared_state"): "PartialState's shared state, read without building a state",
    ("accel.runtime.ops", "_instance"): "PartialState's singleton, read without building a state",
    ("accel.runtime.ops", "_shared_state"): "PartialState's shared state, read without building a state",
    ("accel.runtime.progress", "_instance"): "PartialState's singleton, read without building a state",
}
# Parameter names that stand for an object of a given floor: on a floor below it, such a parameter left untyped (or
# typed Any) hides an upward reference the import rule cannot see. Entries: (module, parameter) pairs and why.
UPPER_OBJECTS = {"accelerator": "Accelerator", "backend": "backends", "topology": "runtime"}
HIDDEN_PARAMETER_ALLOWED = {
    ("accel.checkpoint.fsdp_compat", "accelerator"): "Accelerate's save_fsdp_model/load_fsdp_* signatures take the "
                                                     "Accelerator",
    ("accel.checkpoint.fsdp_compat", "backend"): "Accelerate's FSDP plugin members, read from the backend",
    ("accel.fault_tolerance", "accelerator"): "committed_steps(accelerator): torchft's step count for a script",
    ("accel.fault_tolerance.semi_sync", "accelerator"): "Accelerate's LocalSGD(accelerator, model, ...) signature",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_names(statements: list) -> set[str]:
    """Names bound by a module's own statements (its functions, classes, assignments, imports), not inside them."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            names |= _module_names(getattr(node, "body", []) + getattr(node, "orelse", [])
                                   + getattr(node, "finalbody", []) + [s for h in getattr(node, "handlers", [])
                                                                       for s in h.body])
    return names


def _member_names(tree: ast.AST) -> set[str]:
    """Names of the module's classes' members: what a class body binds and what `self.x =` / `cls.x =` assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names |= _module_names(node.body)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


def _bindings(module: str, tree: ast.AST) -> dict[str, str]:
    """What each imported name of a module stands for (`tpl` -> accel.parallel.tensor_plan), anywhere in it."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                found[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for alias in node.names:
                found[alias.asname or alias.name] = f"{base}.{alias.name}"
    return found


def private_accesses(module: str, tree: ast.AST, top: dict[str, set[str]], members: dict[str, set[str]]) -> list:
    """(private name, owning modules, line) for each private member of another module of ours that `module` reads or
    writes: through a name it imported (`model_io._X`, `PartialState._instance`) or on any object (`x._y`,
    `getattr(x, "_y")`) when the name is a member of another module's classes. `self._x`, `cls._x` and names the
    module binds itself are its own; a name no module of ours binds is a third party's (torch's)."""
    own = top[module] | members[module]
    bound = _bindings(module, tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            name, target = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            name, target = node.args[1].value, node.args[0]
        else:
            continue
        if name in own or (isinstance(target, ast.Name) and target.id in ("self", "cls")):
            continue
        if isinstance(target, ast.Name) and target.id in bound:
            imported = bound[target.id]
            owner = _owner(imported) if imported.split(".")[0] == "accel" else None
            if owner is None:
                continue  # a third party's module or class
            owners = [owner] if name in (members[owner] | (top[owner] if imported == owner else set())) else []
        else:
            owners = sorted(m for m in MODULES if m != module and name in members[m])
        if owners:
            found.append((name, owners, node.lineno))
    return found


def hidden_parameters(module: str, tree: ast.AST) -> list:
    """(parameter, its object's floor, line) for each parameter named like an object of a floor above `module`'s
    (`accelerator`, `backend`) that is untyped or typed Any."""
    floors = {name: index for index, (name, _) in enumerate(LAYERS)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            floor = UPPER_OBJECTS.get(arg.arg)
            if floor is None or floors[floor] <= _layer(module):
                continue
            annotation = "" if arg.annotation is None else ast.unparse(arg.annotation).strip("'\"")
            if annotation in ("", "Any", "typing.Any"):
                found.append((arg.arg, floor, node.lineno))
    return found


TREES = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}
TOP = {module: {n for n in _module_names(tree.body) if _private(n)} for module, tree in TREES.items()}
MEMBERS = {module: {n for n in _member_names(tree) if _private(n)} for module, tree in TREES.items()}


def test_no_module_reaches_into_another_modules_private_members():
    """An object handed across modules is used through its public interface: a private member read elsewhere is a
    dependency no import shows (a monitor reading `accelerator._models` sat below the Accelerator unseen)."""
    found = {(m, name): (owners, line) for m in MODULES for name, owners, line in private_accesses(m, TREES[m], TOP,
                                                                                                     MEMBERS)}
    new = [f"{m}:{line} uses {name} of {', '.join(owners)}" for (m, name), (owners, line) in sorted(found.items())
           if (m, name) not in PRIVATE_ACCESS_ALLOWED]
    stale = sorted(key for key in PRIVATE_ACCESS_ALLOWED if key not in found)
    assert not new, "\n".join(new)
    assert not stale, f"PRIVATE_ACCESS_ALLOWED lists what no longer happens: {stale}"


def test_no_lower_floor_takes_an_upper_floor_object_untyped():
    found = {(m, name): (floor, line) for m in MODULES for name, floor, line in hidden_parameters(m, TREES[m])}
    new = [f"{m}:{line} takes `{name}` ({floor}) untyped or as Any"
           for (m, name), (floor, line) in sorted(found.items()) if (m, name) not in HIDDEN_PARAMETER_ALLOWED]
    stale = sorted(key for key in HIDDEN_PARAMETER_ALLOWED if key not in found)
    assert not new, "\n".join(new)
    assert not stale, f"HIDDEN_PARAMETER_ALLOWED lists what no longer happens: {stale}"


def test_the_reference_checks_see_a_planted_violation():
    """The checkers themselves, on a module planted on the runtime floor."""
    planted = ast.parse("import threading\nfrom accel.runtime import state\n"
                        "from accel.runtime.state import PartialState\n"
                        "def watch(accelerator, backend: Any, topology: 'Topology'):\n"
                        "    models = accelerator._models\n"
                        "    getattr(backend, '_models', None)\n"
                        "    return state._shared_state, PartialState._instance, self._own, threading._shutdown\n")
    module = "accel.runtime.progress"  # a real module's name: its floor and its imports' owners
    names = {name for name, _, _ in private_accesses(module, planted, TOP, {**MEMBERS, module: set()})}
    assert names >= {"_models", "_shared_state", "_instance"} and not names & {"_own", "_shutdown"}
    assert {name for name, _, _ in hidden_parameters(module, planted)} == {"accelerator", "backend"}
