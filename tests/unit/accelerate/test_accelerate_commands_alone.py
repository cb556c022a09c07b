"""Accelerate's commands and imports with accel alone (accel/cli/shim.py, accel/commands/hook.py; docs/shim.md): the
`accelerate` program `eval "$(accel shim)"` puts at the end of PATH, which of a real Accelerate's command or accel's
it runs, `python -m accelerate` under the shim, and `accel launch`'s own decision to put the shim on a script that
imports `accelerate` where no real Accelerate is installed (said in the start line) and to change nothing where one
is. The launches themselves: tests/multiproc/ecosystem/test_accelerate_alone_launch.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from accel.cli import launch
from accel.cli import shim as shim_cli
from accel.cli.main import build_parser, main
from accel.commands import hook
from accel.core import shim_version
from accel.core.version import __version__
from conftest import REPO_ROOT
from hide_accelerate import SHIM, without_accelerate

def program(folder, name: str, body: str):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def in_shell(env: dict, commands: str, cwd) -> subprocess.CompletedProcess:
    """`commands` in bash after `eval "$(accel shim)"`."""
    script = f'eval "$({sys.executable} -m accel.cli.main shim --shell bash)"\n{commands}'
    return subprocess.run(["bash", "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def alone(isolated_env, tmp_path) -> dict:
    """A subprocess environment without Accelerate (package, distribution, program) and with its own cache."""
    return {**without_accelerate(isolated_env, tmp_path / "hide"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


# -- `accel shim`: an `accelerate` program at the end of PATH -------------------------------------------------------

def test_the_snippet_appends_the_programs_folder_to_path_once(capsys, monkeypatch, tmp_path):
    assert shim_cli.snippet("bash", "/c/accel/bin-1") == (
        "# from `accel shim`: `accelerate` (launch, config, env, estimate-memory, merge-weights, test) where no real "
        "Accelerate's comes first on PATH\n"
        'case ":$PATH:" in *:/c/accel/bin-1:*) ;; *) export PATH="${PATH:+$PATH:}"/c/accel/bin-1 ;; esac\n')
    assert shim_cli.snippet("zsh", "/c") == shim_cli.snippet("sh", "/c") == shim_cli.snippet("bash", "/c")
    assert shim_cli.snippet("fish", "/my cache/b").splitlines()[1] == (
        "contains -- '/my cache/b' $PATH; or set -gx PATH $PATH '/my cache/b'")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = shim_cli.program_folder()
    assert folder.startswith(str(tmp_path / "cache" / "accel" / "bin-")) and folder != shim_cli.program_folder("/py")
    monkeypatch.setenv("SHELL", "/usr/bin/fish")
    assert main(["shim"]) == 0 and capsys.readouterr().out == shim_cli.snippet("fish", folder)
    monkeypatch.setenv("SHELL", "/bin/tcsh")  # not one of ours: the sh syntax
    assert main(["shim"]) == 0 and capsys.readouterr().out == shim_cli.snippet("sh", folder)
    written = os.path.join(folder, "accelerate")
    assert open(written).read() == (f"#!/bin/sh\n# written by `accel shim`: Accelerate's `accelerate` command where no "
                                    f"real one comes first on PATH\nexec {sys.executable} -m accel.commands.hook "
                                    '"$@"\n')
    assert os.access(written, os.X_OK) and os.listdir(folder) == ["accelerate"]
    assert "shim" in build_parser().format_help()


def test_an_unwritable_cache_is_one_line(capsys, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file where a folder must be
    assert main(["shim"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("accel shim: error: cannot write the `accelerate` program to ")
    assert captured.err.count("\n") == 1


def test_a_real_accelerate_program_is_run_untouched(alone, tmp_path):
    """A real Accelerate's `accelerate` (a stand-in here) is the shell's choice wherever it is on PATH before the
    folder; after it, the program runs it."""
    first = program(tmp_path / "first", "accelerate", 'echo "the real accelerate: $*"; exit 3')
    program(tmp_path / "last", "accelerate", 'echo "a later accelerate: $*"')
    env = {**alone, "PATH": os.pathsep.join([str(tmp_path / "first"), alone["PATH"]])}
    proc = in_shell(env, "command -v accelerate\naccelerate launch --num_processes 2 train.py", tmp_path)
    assert proc.stdout.splitlines() == [str(first), "the real accelerate: launch --num_processes 2 train.py"]
    assert proc.returncode == 3
    proc = in_shell(alone, f'PATH="$PATH:{tmp_path / "last"}"\naccelerate env', tmp_path)
    assert proc.stdout == "a later accelerate: env\n", proc.stderr


def test_without_accelerate_the_program_and_python_m_accelerate_are_accels(alone, tmp_path):
    proc = in_shell(alone, f'eval "$({sys.executable} -m accel.cli.main shim)"\necho "$PATH"\naccelerate --version\n'
                           "sh -c 'accelerate --version'\naccelerate launch", tmp_path)
    path, *versions = proc.stdout.splitlines()
    assert path.split(os.pathsep)[-1].startswith(str(tmp_path / "cache" / "accel" / "bin-"))
    assert path.count("bin-") == 1  # evaluated twice, appended once
    assert versions == [f"accel {__version__}"] * 2, proc.stderr  # a child process finds it too
    assert proc.stderr == ("accel launch: error: no script given; usage: accel launch [flags] script.py "
                           "[script args...]\n")
    under_shim = {**alone, "PYTHONPATH": os.pathsep.join([SHIM, alone["PYTHONPATH"]])}
    proc = subprocess.run([sys.executable, "-m", "accelerate", "--version"], env=under_shim, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, f"accel {__version__}\n"), proc.stderr


def test_the_hook_chooses_path_then_real_then_accel(tmp_path, monkeypatch):
    found = program(tmp_path / "bin", "accelerate", "exit 0")
    ours = shim_cli.write_program(str(tmp_path / "ours"))
    assert hook.choose({"PATH": os.pathsep.join([str(tmp_path / "ours"), str(tmp_path / "bin")])}) == (
        "path", [str(found)])
    assert hook.program_on_path({"PATH": os.path.dirname(ours)}) is None  # its own program: never itself
    assert hook.choose({"PATH": str(tmp_path / "empty")}) == ("real", [sys.executable, "-c", hook.REAL_CLI])
    monkeypatch.setattr(shim_version, "real_accelerate_installed", lambda: False)
    assert hook.choose({"PATH": str(tmp_path / "empty")}) == ("accel", [])


@pytest.mark.parametrize("pyenv_finds", [True, False])
def test_a_pyenv_shim_counts_only_where_pyenv_finds_the_program(tmp_path, pyenv_finds):
    """pyenv's shims folder has `accelerate` when any Python version has it; it fails in the others."""
    shim = program(tmp_path / "pyenv" / "shims", "accelerate", "exit 127")
    program(tmp_path / "pyenv" / "bin", "pyenv", "exit 0" if pyenv_finds else "exit 1")
    path = os.pathsep.join([str(tmp_path / "pyenv" / "shims"), str(tmp_path / "pyenv" / "bin")])
    assert hook.program_on_path({"PATH": path}) == (str(shim) if pyenv_finds else None)


def test_the_hook_runs_accels_command_with_the_shim_on_pythonpath(monkeypatch):
    seen = {}

    def accelerate_main(argv):
        seen.update(argv=argv, pythonpath=os.environ["PYTHONPATH"])
        return 0

    monkeypatch.setattr(hook, "choose", lambda: ("accel", []))
    monkeypatch.setattr("accel.commands.accelerate_cli.main", accelerate_main)
    monkeypatch.setenv("PYTHONPATH", "/mine")
    assert hook.main(["env"]) == 0
    assert seen == {"argv": ["env"], "pythonpath": os.pathsep.join([SHIM, "/mine"])}
    monkeypatch.setenv("ACCEL_ACCELERATE_VERSION", "one")
    assert hook.main(["env"]) == 2


def test_accelerate_test_runs_accels_check_without_accelerate(monkeypatch, tmp_path, capsys):
    from accel.commands import test as test_cmd

    runs = []
    monkeypatch.setattr(test_cmd.subprocess, "run", lambda cmd: runs.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(shim_version, "real_accelerate_installed", lambda: False)
    test_cmd.test_command(test_cmd.test_command_parser().parse_args(["--config_file", "two.yaml"]))
    assert runs[-1][3:] == ["launch", "--config_file", "two.yaml", str(REPO_ROOT / "accel/commands/launch_check.py")]
    monkeypatch.setattr(shim_version, "real_accelerate_installed", lambda: True)
    test_cmd.test_command(test_cmd.test_command_parser().parse_args([]))
    assert runs[-1][3:5] == ["launch", "--accelerate_shim"] and runs[-1][-1].endswith("test_script.py")
    assert capsys.readouterr().out.count("Test is a success!") == 2


# -- is a real Accelerate installed? ---------------------------------------------------------------------------------

def test_a_real_accelerate_is_found_and_the_shim_never_counts(isolated_env, tmp_path):
    assert shim_version.real_accelerate_installed()  # the test extras install it
    assert shim_version.on_pythonpath(os.pathsep.join(["/a", SHIM + os.sep])) and not shim_version.on_pythonpath("/a")
    env = without_accelerate(isolated_env, tmp_path / "hide")
    code = ("from accel.core.shim_version import real_accelerate_installed as r, on_pythonpath as p\n"
            "a = (r(), p())\nimport accelerate\nprint(a, r(), accelerate.__file__)")
    for pythonpath, expected in ((env["PYTHONPATH"], None), (os.pathsep.join([SHIM, env["PYTHONPATH"]]), True)):
        proc = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": pythonpath}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        if expected is None:  # nothing to import at all
            assert "No module named 'accelerate'" in proc.stderr, proc.stderr
            continue
        facade = str(REPO_ROOT / "accel" / "shim" / "accelerate" / "__init__.py")
        assert proc.stdout.split() == ["(False,", "True)", "False", facade], proc.stderr


# -- does the script import accelerate? ------------------------------------------------------------------------------

@pytest.mark.parametrize("source, imports", [
    ("from accelerate import Accelerator\n", True),
    ("import accelerate\n", True),
    ("import os, accelerate.utils as u\n", True),
    ("from accelerate.utils import set_seed\n", True),
    ("def main():\n    from accelerate import Accelerator\n", True),
    ("try:\n    import accelerate\nexcept ImportError:\n    accelerate = None\n", True),
    ("from accel import Accelerator\n", False),
    ("import accelerated_thing\n# import accelerate\nprint('from accelerate import x')\n", False),
    ("from . import accelerate\n", False),  # relative: a module of the script's own package
    ("from accelerate import (\n", False),  # does not parse: left to python
])
def test_imports_accelerate_reads_the_script(tmp_path, source, imports):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert shim_cli.imports_accelerate(str(script), str(tmp_path)) is imports


def test_imports_accelerate_follows_the_scripts_own_modules(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "loop.py").write_text("from .setup import make\n")
    (tmp_path / "pkg" / "setup.py").write_text("def make():\n    import accelerate\n")
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom pkg.loop import make\n")
    assert shim_cli.imports_accelerate(str(script), str(tmp_path))
    (tmp_path / "pkg" / "setup.py").write_text("def make():\n    import accel\n")
    assert not shim_cli.imports_accelerate(str(script), str(tmp_path))
    (tmp_path / "helpers.py").write_text("from accelerate.utils import set_seed\n")
    script.write_text("import helpers\n")
    assert shim_cli.imports_accelerate(str(script), str(tmp_path))
    script.write_text("import train\n")  # itself: read once
    assert not shim_cli.imports_accelerate(str(script), str(tmp_path))


# -- accel launch's decision and its start line ------------------------------------------------------------------

@pytest.fixture
def home(monkeypatch, tmp_path):
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def launch_args(*argv: str):
    return build_parser().parse_args(["launch", *argv])


@pytest.mark.parametrize("installed", [True, False])
def test_the_decision(home, monkeypatch, installed):
    monkeypatch.setattr(shim_cli, "real_accelerate_installed", lambda: installed)
    (home / "hf.py").write_text("from accelerate import Accelerator\n")
    (home / "plain.py").write_text("from accel import Accelerator\n")
    (home / "pkg").mkdir()
    (home / "pkg" / "__init__.py").write_text("")
    (home / "pkg" / "__main__.py").write_text("import accelerate\n")
    assert shim_cli.auto_shim(launch_args("hf.py")) is not installed
    assert shim_cli.auto_shim(launch_args("-m", "pkg")) is not installed
    assert not shim_cli.auto_shim(launch_args("plain.py"))
    assert not shim_cli.auto_shim(launch_args("--accelerate_shim", "hf.py"))  # asked for: nothing to decide
    assert not shim_cli.auto_shim(launch_args("--no_python", "hf.py"))
    monkeypatch.setenv("PYTHONPATH", SHIM)  # the shim is on the workers' path already (`accelerate launch`)
    assert shim_cli.auto_shim(launch_args("plain.py")) is not installed


def start(capsys, monkeypatch, *argv: str) -> tuple[str, str]:
    """(the start line, the workers' PYTHONPATH) of `accel launch ARGV` (nothing is started)."""
    seen = {}
    monkeypatch.setattr(launch, "_run_torchrun",
                        lambda cfg, argv, preemptible=True: seen.update(path=os.environ.get("PYTHONPATH", "")) or 0)
    assert main(["launch", *argv]) == 0
    return capsys.readouterr().err.strip(), seen["path"]


def test_without_accelerate_the_launcher_puts_the_shim_on_and_says_so(home, monkeypatch, capsys):
    monkeypatch.setattr(shim_cli, "real_accelerate_installed", lambda: False)
    (home / "train.py").write_text("from accelerate import Accelerator\n")
    line, path = start(capsys, monkeypatch, "--cpu", "--num_processes", "2", "train.py")
    assert line == ("accel launch: 2 processes (MULTI_CPU, gloo), DDP, dp_replicate 2, mixed precision no, gradient "
                    "accumulation 1 (set by accel launch flags: num_processes 2, use_cpu true); accelerate: accel's "
                    "shim (Accelerate is not installed)")
    assert path.split(os.pathsep)[0] == SHIM
    monkeypatch.delenv("PYTHONPATH")  # the launch above set it, in this process
    assert main(["launch", "--cpu", "--num_processes", "2", "--dry_run", "train.py"]) == 0
    assert f"PYTHONPATH={SHIM} " in capsys.readouterr().out


def test_with_accelerate_installed_nothing_changes(home, monkeypatch, capsys):
    assert shim_version.real_accelerate_installed()  # the real one, as the test extras install it
    (home / "train.py").write_text("from accelerate import Accelerator\n")
    line, path = start(capsys, monkeypatch, "--cpu", "--num_processes", "2", "train.py")
    assert line == ("accel launch: 2 processes (MULTI_CPU, gloo), DDP, dp_replicate 2, mixed precision no, gradient "
                    "accumulation 1 (set by accel launch flags: num_processes 2, use_cpu true)")
    assert path == ""
    line, path = start(capsys, monkeypatch, "--cpu", "--num_processes", "2", "--accelerate_shim", "train.py")
    assert "accelerate:" not in line and path == SHIM  # asked for: as before
