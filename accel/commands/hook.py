"""What the `accelerate` program of `eval "$(accel shim)"` runs: `python -m accel.commands.hook ARGS...`.

The shell reaches that program only where no other `accelerate` comes before it on PATH. At each call, in this order:

1. another `accelerate` program on PATH (after it: a real Accelerate's console script, of this environment or
   another; accel installs none) runs instead. A pyenv shim counts only where pyenv finds the program for the Python
   version in use;
2. else a real Accelerate this Python can import runs (its `accelerate.commands.accelerate_cli`, what its console
   script runs);
3. else accel's (`accel.commands.accelerate_cli`), with the shim's folder first on PYTHONPATH, so every process it
   starts (`accelerate launch`'s workers, `accelerate test`'s) imports accel as `accelerate`, and `accel launch`
   says so in its start line.

The decision imports nothing heavy (no torch, no accel package beyond accel.core.shim_version): a real Accelerate's
command starts about as fast as it would on its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

REAL_CLI = "import sys\nfrom accelerate.commands.accelerate_cli import main\nsys.exit(main())"


def _ours(path: str) -> bool:
    """Whether `path` is an `accelerate` program `accel shim` wrote (of this Python or another)."""
    from accel.core.shim_version import PROGRAM_MARKER

    try:
        with open(path, "rb") as handle:
            return PROGRAM_MARKER.encode() in handle.read(512)
    except OSError:
        return False


def _pyenv_has_it(environ) -> bool:
    """pyenv's shim exists when any installed Python version has the program; it fails in the others."""
    if shutil.which("pyenv", path=environ.get("PATH")) is None:
        return True
    try:
        return subprocess.run(["pyenv", "which", "accelerate"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=30, env=dict(environ)).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def program_on_path(environ=os.environ) -> str | None:
    """The first `accelerate` program on PATH that is not one `accel shim` wrote, or None."""
    for folder in environ.get("PATH", os.defpath).split(os.pathsep):
        found = shutil.which("accelerate", path=folder or os.curdir)
        if found is None or _ours(found):
            continue
        if os.path.basename(os.path.dirname(found)) == "shims" and not _pyenv_has_it(environ):
            continue
        return found
    return None


def choose(environ=os.environ) -> tuple[str, list[str]]:
    """("path", [program]), ("real", [python, -c, ...]) or ("accel", [])."""
    from accel.core.shim_version import real_accelerate_installed

    found = program_on_path(environ)
    if found is not None:
        return "path", [found]
    if real_accelerate_installed():
        return "real", [sys.executable, "-c", REAL_CLI]
    return "accel", []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    how, command = choose()
    if how != "accel":
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(command[0], [*command, *argv])  # replaces this process: its exit code is the command's
    from accel.shim import ShimVersionError, search_path

    try:
        shim = search_path()
    except ShimVersionError as err:
        sys.stderr.write(f"accelerate: error: {err}\n")
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (*shim, os.environ.get("PYTHONPATH")) if p)
    from accel.commands.accelerate_cli import main as accelerate_main

    return accelerate_main(argv)


if __name__ == "__main__":
    sys.exit(main())
