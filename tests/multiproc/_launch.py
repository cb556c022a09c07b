"""`accel launch` in a subprocess for the multi-process tests (this folder is on sys.path under pytest)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import warm_python

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def worker_module(name: str):
    """Import a worker script from scripts/ as a module (its model and data build the one-process reference)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def accel_launch(env: dict, *launch_args: str, timeout: int = 300, expect: int = 0) -> subprocess.CompletedProcess:
    """Run `accel launch LAUNCH_ARGS...` from the repository root, one thread per process; check the exit code."""
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", *map(str, launch_args)]
    proc = warm_python.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, timeout=timeout)
    assert proc.returncode == expect, f"{' '.join(cmd)}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def launch_jobs(out: Path, env: dict, num_processes: int, script: Path, jobs: list[tuple[str, list]]) -> str:
    """One launch of a worker script that runs several jobs one after another (its `--jobs FILE`,
    scripts/_jobs.py): each job is (folder, arguments), passed as `--out OUT/folder ARGUMENTS`; "{root}" in an
    argument is OUT. Returns the launch's stdout."""
    argv = []
    for folder, args in jobs:
        (out / folder).mkdir(exist_ok=True)
        argv.append(["--out", str(out / folder), *(str(a).format(root=out) for a in args)])
    (out / f"jobs-{num_processes}.json").write_text(json.dumps(argv))
    proc = accel_launch(env, "--cpu", "--num_processes", num_processes, script, "--jobs",
                        out / f"jobs-{num_processes}.json")
    return proc.stdout
