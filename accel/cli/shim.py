"""Accelerate's commands and imports where only accel is installed (docs/shim.md#accelerates-commands-with-accel-alone).

`accel shim` writes a small `accelerate` program (PROGRAM: `exec <this python> -m accel.commands.hook "$@"`) to a
folder of the user's cache, one per Python, and prints the shell line that appends that folder to the END of PATH,
for `eval "$(accel shim)"` (~/.bashrc, ~/.zshrc, a job script; `accel shim --shell fish | source` in fish). The shell
finds it only where no other `accelerate` comes first: a real Accelerate's own program always wins, and every child
process (`bash train.sh`, make, subprocess) inherits it. accel/commands/hook.py then runs, at each call, a real
Accelerate's command where one is found after all, else accel's (`accelerate launch/config/env/estimate-memory/
merge-weights/test`, the shim on every process it starts). accel's distribution installs no `accelerate` program: it
would be the same file as the real Accelerate's (installing either overwrites it, uninstalling either removes it).

`accel launch script.py` (no --accelerate_shim) turns the shim on by itself when no real Accelerate is installed
and the script imports `accelerate` (read, never run: the script, and the modules of its own folder it imports), or
the shim is on PYTHONPATH already; its start line then ends with NOTE. With a real Accelerate installed nothing
changes: the script imports it.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import shlex
import sys
import tempfile

from accel.cli import checks
from accel.cli._common import UsageError
from accel.core.shim_version import PROGRAM_MARKER, on_pythonpath, real_accelerate_installed

NOTE = "accelerate: accel's shim (Accelerate is not installed)"
SHELLS = ("bash", "zsh", "sh", "fish")
ENTRY = "accel.commands.hook"  # the module the `accelerate` program runs
PROGRAM = ("#!/bin/sh\n# {marker}: Accelerate's `accelerate` command where no real one comes first on PATH\n"
           "exec {python} -m {entry} \"$@\"\n")
MAX_FILES = 64  # files read to find an `import accelerate` (the script and its own modules)
MAX_BYTES = 4 << 20  # a larger file is not read


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "shim",
        help="Accelerate's `accelerate` command where Accelerate is not installed: eval \"$(accel shim)\"",
        description="Write an `accelerate` program to accel's cache folder and print the shell line that appends "
                    "that folder to the end of PATH, for `eval \"$(accel shim)\"`: `accelerate launch/config/env/"
                    "estimate-memory/merge-weights/test` then run accel's command where no real Accelerate's comes "
                    "first (with the shim on every process it starts).",
        allow_abbrev=False,
    )
    parser.add_argument("--shell", choices=SHELLS, default=None,
                        help="the shell to write for (default: from $SHELL; bash, zsh and sh share one syntax)")
    parser.set_defaults(func=run)
    return parser


def program_folder(python: str | None = None, environ=os.environ) -> str:
    """Where `accel shim` writes the `accelerate` program for `python` (default: this one): one folder per
    interpreter under $XDG_CACHE_HOME/accel (else ~/.cache/accel)."""
    python = os.path.abspath(python or sys.executable)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "accel", "bin-" + hashlib.sha1(python.encode()).hexdigest()[:12])


def write_program(folder: str, python: str | None = None) -> str:
    """The `accelerate` program in `folder` (written atomically, left alone when it is already the same)."""
    text = PROGRAM.format(marker=PROGRAM_MARKER, python=shlex.quote(python or sys.executable), entry=ENTRY)
    path = os.path.join(folder, "accelerate")
    try:
        with open(path, encoding="utf-8") as handle:
            if handle.read() == text and os.access(path, os.X_OK):
                return path
    except (OSError, UnicodeDecodeError):
        pass
    try:
        os.makedirs(folder, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=folder, prefix=".accelerate-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(staging, 0o755)
        os.replace(staging, path)
    except OSError as exc:
        raise UsageError(f"cannot write the `accelerate` program to {folder} ({exc.strerror or exc}); allowed: a "
                         "writable $XDG_CACHE_HOME (or ~/.cache)") from None
    return path


def snippet(shell: str, folder: str) -> str:
    """The text `accel shim` prints for `shell`: `folder` appended to PATH once (evaluating it again adds nothing)."""
    quoted = shlex.quote(folder)
    head = ("# from `accel shim`: `accelerate` (launch, config, env, estimate-memory, merge-weights, test) where no "
            "real Accelerate's comes first on PATH\n")
    if shell == "fish":
        return head + f"contains -- {quoted} $PATH; or set -gx PATH $PATH {quoted}\n"
    return head + f'case ":$PATH:" in *:{quoted}:*) ;; *) export PATH="${{PATH:+$PATH:}}"{quoted} ;; esac\n'


def default_shell(environ=os.environ) -> str:
    name = os.path.basename(environ.get("SHELL", ""))
    return name if name in SHELLS else "sh"


def run(args: argparse.Namespace) -> int:
    folder = program_folder()
    write_program(folder)
    sys.stdout.write(snippet(args.shell or default_shell(), folder))
    return 0


# -- `accel launch` without --accelerate_shim ---------------------------------------------------------------------

def auto_shim(args: argparse.Namespace) -> bool:
    """Whether `accel launch` turns the shim on by itself (see the module docstring); never with --accelerate_shim,
    --no_python, or a real Accelerate installed."""
    if args.accelerate_shim or getattr(args, "no_python", False) or not args.script:
        return False
    if real_accelerate_installed():
        return False
    if on_pythonpath():
        return True
    found = script_file(args)
    return found is not None and imports_accelerate(*found)


def script_file(args: argparse.Namespace) -> tuple[str, str] | None:
    """(the file Python runs first, the folder first on the workers' sys.path) for the script or -m module; None for
    what cannot be read (a zip application, a module that is not a source file)."""
    if args.module:
        spec = checks._find_module(args.script, checks.worker_search_path(None))
        if spec is not None and spec.submodule_search_locations is not None:
            spec = checks._find_module(f"{args.script}.__main__", checks.worker_search_path(None))
        origin = getattr(spec, "origin", None)
        if not isinstance(origin, str) or not origin.endswith(".py") or not os.path.isfile(origin):
            return None
        return origin, os.getcwd()
    path = os.path.abspath(args.script)
    if os.path.isdir(path):
        return os.path.join(path, "__main__.py"), path
    return (path, os.path.dirname(path)) if os.path.isfile(path) else None


def imports_accelerate(path: str, folder: str) -> bool:
    """Whether the file at `path` imports `accelerate` (`import accelerate...`, `from accelerate... import`), itself
    or through a module of `folder` (the workers' first sys.path entry) or of its own package that it imports,
    followed to MAX_FILES files. Read with `ast`, never run; a file that cannot be read or parsed counts as none."""
    todo, seen = [os.path.abspath(path)], set[str]()
    while todo and len(seen) < MAX_FILES:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        tree = _parse(current)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names, base = [alias.name for alias in node.names], folder
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 0 and module.split(".")[0] == "accelerate":
                    return True
                base = folder
                if node.level:  # relative: from the importing file's package
                    base = os.path.dirname(current)
                    for _ in range(node.level - 1):
                        base = os.path.dirname(base)
                names = [f"{module}.{alias.name}" if module else alias.name for alias in node.names]
                if module:
                    names.append(module)
            else:
                continue
            for name in names:
                if not getattr(node, "level", 0) and name.split(".")[0] == "accelerate":
                    return True
                todo.extend(_local_files(name, base))
    return False


def _parse(path: str) -> ast.AST | None:
    try:
        with open(path, "rb") as handle:
            source = handle.read(MAX_BYTES + 1)
        if len(source) > MAX_BYTES:
            return None
        return ast.parse(source, filename=path)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _local_files(name: str, base: str) -> list[str]:
    """The source files under `base` that importing `name` runs (each package's __init__.py, the module itself)."""
    found, here = [], base
    for part in name.split("."):
        if not part.isidentifier():
            break
        here = os.path.join(here, part)
        if os.path.isfile(os.path.join(here, "__init__.py")):
            found.append(os.path.join(here, "__init__.py"))
        elif os.path.isfile(here + ".py"):
            found.append(here + ".py")
            break
        else:
            break
    return found
