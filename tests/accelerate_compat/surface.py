"""Audit accel's public surface against Hugging Face Accelerate: names, signatures, properties (and their setters),
dataclass fields and the attributes an instance sets.

    python tests/accelerate_compat/surface.py dump [--names REF.json ...] [--out FILE]   # whatever `accelerate` is
    python tests/accelerate_compat/surface.py compare REF.json ACCEL.json [--allowed FILE]
    python tests/accelerate_compat/surface.py audit [--accelerate116 /tmp/acc116] [--allowed FILE] [--json OUT]

`dump` without --names describes a real Accelerate: its public modules (every module of the package but
`accelerate.commands` and `accelerate.test_utils`), and in each the names it defines at top level (def, class,
assignment; in a package's `__init__`, also what it imports from inside Accelerate), read from the source. With
--names (dumps of real Accelerates) it describes exactly those paths in the `accelerate` this process imports:
accel under the shim (`PYTHONPATH=$(python -m accel.shim)`).

`audit` runs the dumps in subprocesses (Accelerate as installed, the 1.16 folder when it exists, accel through the
shim) and prints every difference, one per line: `<kind>:<path>` and what differs. The kinds:

    missing-module, missing-name, kind           a module or name accel lacks; a class where Accelerate has a function
    missing-param, default, position, required   a keyword accel lacks (no **kwargs either), a different default,
                                                  a positional parameter at another place, a parameter accel requires
    missing-member, missing-setter, missing-field  a method/property/attribute, a property's setter, a dataclass field

A line of the allow-list (`tests/accelerate_compat/surface_allowed.txt`) is `<kind>:<path>  # reason`; the path may
hold fnmatch wildcards. `compare`/`audit` exit 1 when a difference is not allowed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import fnmatch
import importlib
import inspect
import json
import logging
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALLOWED = HERE / "surface_allowed.txt"
EXCLUDED = ("accelerate.commands", "accelerate.test_utils")
DUNDERS = ("__init__", "__call__", "__len__", "__iter__", "__getitem__", "__enter__", "__exit__", "__next__")


# ---------------------------------------------------------------------------------------------------- describing

def _default_repr(value) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value):
        return getattr(value, "__qualname__", repr(value))
    text = repr(value)
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _default_value(value):
    """A plain value to compare defaults by (a str enum equals its string, as Accelerate's comparisons treat it)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str, type(None))) for v in value):
        return list(value)
    return _default_repr(value)


def describe_signature(func) -> dict | None:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    params = []
    for p in sig.parameters.values():
        entry = {"name": p.name, "kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = _default_repr(p.default)
            entry["value"] = _default_value(p.default)
        params.append(entry)
    return {"params": params}


def _self_assignments(cls) -> set[str]:
    """The public `self.X = ...` names in the class's own source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return set()
    names = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                        and not t.attr.startswith("_")):
                    names.add(t.attr)
    return names


def _member(cls, name: str) -> dict | None:
    for klass in cls.__mro__:
        if name in vars(klass):
            raw = vars(klass)[name]
            break
    else:
        return None
    if isinstance(raw, property):
        return {"kind": "property", "setter": raw.fset is not None}
    if isinstance(raw, (staticmethod, classmethod)):
        return {"kind": type(raw).__name__, "signature": describe_signature(getattr(cls, name))}
    if inspect.isfunction(raw):
        return {"kind": "method", "signature": describe_signature(raw)}
    if isinstance(cls, enum.EnumMeta) and isinstance(raw, cls):
        return {"kind": "enum-member", "value": _default_value(raw)}
    if callable(raw) and not inspect.isclass(raw):
        return {"kind": "method", "signature": describe_signature(raw)}
    if hasattr(raw, "__get__") and not inspect.isclass(raw):  # another descriptor (functools.cached_property ...)
        return {"kind": "property", "setter": hasattr(raw, "__set__") or not hasattr(type(raw), "__set__")}
    return {"kind": "attribute"}


def describe_class(cls, own_prefix: str | None) -> dict:
    """Members of the classes of its MRO that come from `own_prefix` (the real package), or the given names."""
    out: dict = {"kind": "class", "members": {}, "instance_attrs": [], "fields": {}}
    names: set[str] = set()
    attrs: set[str] = set()
    for klass in cls.__mro__:
        if own_prefix is not None and not klass.__module__.startswith(own_prefix):
            continue
        names.update(n for n in vars(klass) if not n.startswith("_") or n in DUNDERS)
        attrs |= _self_assignments(klass)
    if isinstance(cls, enum.EnumMeta):
        names.update(cls.__members__)
    for name in sorted(names):
        member = _member(cls, name)
        if member is not None:
            out["members"][name] = member
    out["instance_attrs"] = sorted(attrs - set(out["members"]))
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            entry = {}
            if f.default is not dataclasses.MISSING:
                entry = {"default": _default_repr(f.default), "value": _default_value(f.default)}
            elif f.default_factory is not dataclasses.MISSING:
                try:
                    made = f.default_factory()
                    entry = {"default": _default_repr(made), "value": _default_value(made)}
                except Exception as exc:  # noqa: BLE001 - only described
                    entry = {"default": f"<factory failed: {exc}>", "value": None}
            out["fields"][f.name] = entry
    out["getattr"] = any("__getattr__" in vars(k) for k in cls.__mro__ if k is not object)
    return out


def describe(obj, own_prefix: str | None) -> dict:
    if inspect.ismodule(obj):
        return {"kind": "module"}
    if inspect.isclass(obj):
        return describe_class(obj, own_prefix)
    if callable(obj):
        return {"kind": "function", "signature": describe_signature(obj)}
    return {"kind": "value", "type": type(obj).__name__}


def _top_level_names(path: str, package: bool) -> list[str]:
    tree = ast.parse(Path(path).read_text())
    names: list[str] = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, ast.Assign):
                names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.append(node.target.id)
            elif isinstance(node, ast.ImportFrom) and package and (node.level > 0 or
                                                                     (node.module or "").startswith("accelerate")):
                names.extend(a.asname or a.name for a in node.names if a.name != "*")
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


def discover() -> dict[str, list[str]]:
    """{module: [public names]} of the real Accelerate this process imports."""
    import accelerate

    modules = {"accelerate": accelerate}
    for info in pkgutil.walk_packages(accelerate.__path__, "accelerate."):
        if info.name.startswith(EXCLUDED) or any(part.startswith("_") for part in info.name.split(".")):
            continue
        try:
            modules[info.name] = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - an optional dependency missing: not importable here either
            continue
    out = {}
    for name, module in sorted(modules.items()):
        package = hasattr(module, "__path__")
        out[name] = [n for n in _top_level_names(module.__file__, package) if not _is_noise(getattr(module, n, None))]
    return out


def _is_noise(value) -> bool:
    return isinstance(value, (logging.Logger, logging.LoggerAdapter)) or (
        type(value).__name__ in ("TypeVar", "ParamSpec") or value is None and False)


# accel's classes whose instances get attributes its source does not assign to `self` (the shared state dicts):
# described from a CPU instance as well
INSTANCES = ("Accelerator", "AcceleratorState", "PartialState", "GradientState")


def _instance_names(module, name: str) -> set[str]:
    import accelerate

    try:
        accelerate.Accelerator(cpu=True)
        inst = getattr(module, name)()
    except Exception:  # noqa: BLE001 - only the source's names then
        return set()
    return {n for n in dir(inst) if not n.startswith("_")}


def dump(names: dict[str, list[str]] | None) -> dict:
    warnings.simplefilter("ignore")
    import accelerate

    real = names is None
    if real:
        names = discover()
    result: dict = {"version": getattr(accelerate, "__version__", "?"), "modules": {}, "objects": {}}
    seen: dict[int, str] = {}
    for mod_name, public in names.items():
        try:
            module = importlib.import_module(mod_name)
        except Exception as exc:  # noqa: BLE001
            result["modules"][mod_name] = {"missing": f"{type(exc).__name__}: {exc}"}
            continue
        entries = {}
        for name in public:
            if not hasattr(module, name):
                entries[name] = {"kind": "missing"}
                continue
            obj = getattr(module, name)
            entry = {"kind": "module" if inspect.ismodule(obj) else
                     "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"}
            if entry["kind"] in ("class", "function"):
                home = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', name)}"
                entry["home"] = home
                path = f"{mod_name}.{name}"
                if id(obj) not in seen:
                    seen[id(obj)] = path
                    try:
                        result["objects"][path] = described = describe(obj, "accelerate" if real else None)
                        if not real and name in INSTANCES:  # what an instance of accel's sets at run time too
                            described["instance_attrs"] = sorted(set(described["instance_attrs"]) |
                                                                 _instance_names(module, name))
                    except Exception as exc:  # noqa: BLE001 - described as far as it goes
                        result["objects"][path] = {"kind": entry["kind"], "error": repr(exc)}
                entry["object"] = seen[id(obj)]
            entries[name] = entry
        result["modules"][mod_name] = {"names": entries}
    return result


# ---------------------------------------------------------------------------------------------------- comparing

def _compare_signature(path: str, ref: dict | None, ours: dict | None, out: list) -> None:
    if not ref or not ours:
        return
    ref, ours = _unbound(ref), _unbound(ours)  # a staticmethod where the other has a method: called the same way
    mine = {p["name"]: p for p in ours["params"]}
    has_varkw = any(p["kind"] == "VAR_KEYWORD" for p in ours["params"])
    has_varargs = any(p["kind"] == "VAR_POSITIONAL" for p in ours["params"])
    ref_names = {p["name"] for p in ref["params"]}
    ref_positional = [p["name"] for p in ref["params"] if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    our_positional = [p["name"] for p in ours["params"] if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    for p in ref["params"]:
        name = p["name"]
        if p["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if not any(q["kind"] == p["kind"] for q in ours["params"]):
                out.append((f"missing-param:{path}({'*' if p['kind'] == 'VAR_POSITIONAL' else '**'}{name})",
                            "accel takes no " + ("extra positional" if p["kind"] == "VAR_POSITIONAL" else "extra keyword")
                            + " arguments"))
            continue
        q = mine.get(name)
        if q is None:
            if not has_varkw:
                out.append((f"missing-param:{path}({name})", "not a parameter in accel"))
            continue
        if "default" in p and "default" in q and p["value"] != q["value"]:
            out.append((f"default:{path}({name})", f"Accelerate {p['default']}, accel {q['default']}"))
        if "default" in p and "default" not in q and q["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            out.append((f"required:{path}({name})", f"Accelerate's default {p['default']}; accel requires it"))
        if name in ref_positional and p["kind"] != "POSITIONAL_ONLY":
            i = ref_positional.index(name)
            if name not in our_positional or our_positional.index(name) != i:
                where = (f"position {our_positional.index(name)}" if name in our_positional else "keyword-only")
                out.append((f"position:{path}({name})", f"Accelerate position {i}, accel {where}"))
    for q in ours["params"]:
        if q["name"] not in ref_names and "default" not in q and q["kind"] in (
                "POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY"):
            out.append((f"required:{path}({q['name']})", "accel requires a parameter Accelerate does not have"))
    del has_varargs


def _unbound(sig: dict) -> dict:
    params = sig["params"]
    if params and params[0]["name"] in ("self", "cls") and params[0]["kind"] == "POSITIONAL_OR_KEYWORD":
        return {"params": params[1:]}
    return sig


def _compare_class(path: str, ref: dict, ours: dict, out: list) -> None:
    members = ours.get("members", {})
    attrs = set(ours.get("instance_attrs", [])) | set(ours.get("fields", {}))
    for name, m in ref.get("members", {}).items():
        q = members.get(name)
        if q is None:
            if name in attrs and m["kind"] in ("attribute", "property"):
                continue  # an instance attribute in accel: readable and settable
            if name in DUNDERS and m["kind"] == "method":
                continue  # object's own (a dataclass's generated __init__ is compared by its fields)
            out.append((f"missing-member:{path}.{name}", f"Accelerate {m['kind']}"))
            continue
        if m["kind"] == "property" and m.get("setter") and q["kind"] == "property" and not q.get("setter"):
            out.append((f"missing-setter:{path}.{name}", "read-only in accel"))
        if "signature" in m and "signature" in q:
            _compare_signature(f"{path}.{name}", m["signature"], q["signature"], out)
    for name in ref.get("instance_attrs", []):
        if name not in members and name not in attrs:
            out.append((f"missing-member:{path}.{name}", "Accelerate instance attribute"))
    ref_fields, our_fields = ref.get("fields", {}), ours.get("fields", {})
    for name, f in ref_fields.items():
        q = our_fields.get(name)
        if q is None:
            if name in members or name in attrs:
                continue  # not a field in accel, but an attribute that its __init__ takes (compared there)
            out.append((f"missing-field:{path}.{name}", "Accelerate dataclass field"))
            continue
        init_default = {p["name"]: p.get("default") for p in
                        (ref.get("members", {}).get("__init__", {}).get("signature") or {"params": []})["params"]}
        if init_default.get(name) != "<factory>":
            continue  # a plain default: compared through __init__'s signature
        if "value" in f and "value" in q and f["value"] != q["value"]:
            out.append((f"default:{path}.{name}", f"Accelerate {f['default']}, accel {q['default']}"))
        if "default" in f and "default" not in q:
            out.append((f"required:{path}.{name}", f"Accelerate's default {f['default']}; accel requires it"))
    if ref_fields and not our_fields and "__init__" in members:  # accel's is a plain class: its __init__ takes them
        init = members["__init__"].get("signature") or {"params": []}
        fake = {"params": [
            {"name": n, "kind": "POSITIONAL_OR_KEYWORD", **f} for n, f in ref_fields.items()]}
        _compare_signature(f"{path}.__init__", fake, init, out)


def compare(ref: dict, ours: dict) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for mod_name, mod in ref["modules"].items():
        if "missing" in mod:
            continue
        our_mod = ours["modules"].get(mod_name, {"missing": "not dumped"})
        if "missing" in our_mod:
            out.append((f"missing-module:{mod_name}", our_mod["missing"].splitlines()[0][:120]))
            continue
        for name, entry in mod["names"].items():
            if entry["kind"] == "missing":
                continue  # not importable in this Accelerate (an optional dependency)
            q = our_mod["names"].get(name, {"kind": "missing"})
            if q["kind"] == "missing":
                out.append((f"missing-name:{mod_name}.{name}", f"Accelerate {entry['kind']}"))
                continue
            if entry["kind"] != q["kind"] and not (entry["kind"] in ("class", "function") and
                                                   q["kind"] in ("class", "function") and entry["kind"] == "function"):
                out.append((f"kind:{mod_name}.{name}", f"Accelerate {entry['kind']}, accel {q['kind']}"))
    for path, obj in ref["objects"].items():
        if "error" in obj:
            continue
        ours_obj = _find_ours(path, ref, ours)
        if ours_obj is None or "error" in ours_obj:
            continue
        if obj["kind"] == "function" and "signature" in ours_obj:
            _compare_signature(path, obj["signature"], ours_obj["signature"], out)
        elif obj["kind"] == "function" and ours_obj["kind"] == "class":
            init = ours_obj.get("members", {}).get("__init__", {}).get("signature")
            if init and obj.get("signature"):
                _compare_signature(path, obj["signature"], init, out)
        elif obj["kind"] == "class" and ours_obj["kind"] == "class":
            _compare_class(path, obj, ours_obj, out)
    return sorted(set(out))


def _find_ours(path: str, ref: dict, ours: dict) -> dict | None:
    """Accel's description of the object Accelerate has at `path`, looked up at any path Accelerate exports it."""
    if path in ours["objects"]:
        return ours["objects"][path]
    for mod_name, mod in ref["modules"].items():
        for name, entry in mod.get("names", {}).items():
            if entry.get("object") == path:
                q = ours["modules"].get(mod_name, {}).get("names", {}).get(name)
                if q and q.get("object") in ours["objects"]:
                    return ours["objects"][q["object"]]
    return None


def load_allowed(path: Path = ALLOWED) -> list[str]:
    if not path.exists():
        return []
    patterns = []
    for line in path.read_text().splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            patterns.append(key)
    return patterns


def unallowed(diffs: list[tuple[str, str]], patterns: list[str]) -> list[tuple[str, str]]:
    return [d for d in diffs if not any(fnmatch.fnmatchcase(d[0], p) for p in patterns)]


# ---------------------------------------------------------------------------------------------------- running

def run_dump(env_path: str | None, names_files: list[str], shim: bool, out: str) -> dict:
    env = dict(os.environ)
    paths = []
    if shim:
        import accel.shim

        paths.append(accel.shim.PATH)
    if env_path:
        paths.append(env_path)
    if env.get("PYTHONPATH") and not shim and not env_path:
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    cmd = [sys.executable, str(Path(__file__).resolve()), "dump", "--out", out]
    for f in names_files:
        cmd += ["--names", f]
    subprocess.run(cmd, env=env, check=True, cwd=tempfile.gettempdir())
    return json.loads(Path(out).read_text())


def real_available(path: str | None = None) -> bool:
    env = dict(os.environ, PYTHONPATH=path or "")
    probe = "import importlib.util, sys; spec = importlib.util.find_spec('accelerate'); sys.exit(spec is None)"
    return subprocess.run([sys.executable, "-c", probe], env=env, cwd=tempfile.gettempdir()).returncode == 0


def audit(acc116: str | None, allowed: list[str], workdir: str) -> dict:
    """{version label: [differences]} for the Accelerate as installed and (when given and present) the 1.16 folder."""
    refs = {}
    if real_available():
        refs["installed"] = run_dump(None, [], False, os.path.join(workdir, "ref_installed.json"))
    if acc116 and os.path.isdir(os.path.join(acc116, "accelerate")):
        refs["1.16"] = run_dump(acc116, [], False, os.path.join(workdir, "ref_116.json"))
    names_files = [os.path.join(workdir, f"ref_{'installed' if k == 'installed' else '116'}.json") for k in refs]
    ours = run_dump(None, names_files, True, os.path.join(workdir, "accel.json"))
    report = {}
    for label, ref in refs.items():
        diffs = compare(ref, ours)
        report[f"{label} ({ref['version']})"] = {"all": diffs, "unallowed": unallowed(diffs, allowed)}
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--names", action="append", default=[], help="a real Accelerate's dump: describe its paths")
    d.add_argument("--out")
    c = sub.add_parser("compare")
    c.add_argument("ref")
    c.add_argument("ours")
    c.add_argument("--allowed", default=str(ALLOWED))
    a = sub.add_parser("audit")
    a.add_argument("--accelerate116", default="/tmp/acc116")
    a.add_argument("--allowed", default=str(ALLOWED))
    a.add_argument("--all", action="store_true", help="list the allowed differences too")
    a.add_argument("--json")
    args = parser.parse_args(argv)
    if args.cmd == "dump":
        names = None
        if args.names:
            names = {}
            for f in args.names:
                ref = json.loads(Path(f).read_text())
                for mod, entry in ref["modules"].items():
                    if "names" in entry:
                        names.setdefault(mod, [])
                        names[mod] += [n for n in entry["names"] if n not in names[mod]]
        text = json.dumps(dump(names), indent=1, sort_keys=True)
        if args.out:
            Path(args.out).write_text(text)
        else:
            print(text)
        return 0
    if args.cmd == "compare":
        diffs = compare(json.loads(Path(args.ref).read_text()), json.loads(Path(args.ours).read_text()))
        left = unallowed(diffs, load_allowed(Path(args.allowed)))
        for key, why in left:
            print(f"{key}  # {why}")
        print(f"{len(diffs)} differences, {len(left)} not allowed", file=sys.stderr)
        return 1 if left else 0
    with tempfile.TemporaryDirectory() as workdir:
        report = audit(args.accelerate116, load_allowed(Path(args.allowed)), workdir)
    failed = False
    for label, r in report.items():
        shown = r["all"] if args.all else r["unallowed"]
        print(f"== Accelerate {label}: {len(r['all'])} differences, {len(r['unallowed'])} not allowed")
        for key, why in shown:
            print(f"{key}  # {why}")
        failed |= bool(r["unallowed"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
