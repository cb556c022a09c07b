"""Every bad input a new user tried is one line on stderr and exit code 2, before any process starts; `accel
launch`, `accel env` and `accel config` refuse the same configs (one check: accel.backends.launchable.check_launchable);
`accel launch --dry_run` prints the config and the command and starts nothing; `accel --version`."""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest
import yaml

import accel
from accel.config import ConfigError, read_config_file, resolve_config
from accel.backends.launchable import check_launchable

# the script every launch probe names: if it ever runs, it leaves a marker next to itself
SCRIPT = "import pathlib, sys\npathlib.Path(sys.argv[0]).with_name('script_ran').write_text('yes')\n"

FILES = {
    "empty.yaml": b"",
    "comment_only.yaml": b"# nothing set yet\n",
    "duplicate.yaml": b"num_processes: 2\nmixed_precision: bf16\nnum_processes: 4\n",
    "duplicate_nested.yaml": b"parallelism:\n  tp_size: 2\n  tp_size: 1\n",
    "latin1.yaml": "mixed_precision: no  # d\u00e9faut\n".encode("latin-1"),
    "tp2_one_process.yaml": b"num_processes: 1\nparallelism:\n  tp_size: 2\n",  # what `accel config` once saved
}


@pytest.fixture
def workdir(tmp_path):
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "a_folder").mkdir()
    return tmp_path


@pytest.fixture
def without_torchao(tmp_path) -> dict:
    """Environment for a subprocess in which torchao is not installed (find_spec gives None, import fails)."""
    hide = tmp_path / "hide_torchao"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torchao'] = None\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))}


def one_line_error(result, command: str, *needles: str) -> str:
    """Exit code 2, exactly one line on stderr (`accel <command>: error: ...`) naming every needle, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"accel {command}: error: "), lines[0]
    assert "Traceback" not in result.stdout
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------------------------------------
# the probes
# ----------------------------------------------------------------------------------------------------------

LAUNCH_PROBES = [
    ("tp-without-processes", ["--tp_size", "2", "train.py"], ["num_processes", "tp_size", "pp_size = 2"]),
    ("pp-without-processes", ["--pp_size", "2", "train.py"], ["num_processes", "pp_size = 2"]),
    ("missing-module", ["-m", "missing.module"], ["module not found: missing.module"]),
    ("script-file-with-m", ["-m", "train.py"], ["train.py is a file", "-m takes a module name"]),
    ("missing-script", ["no_such_script.py"], ["no_such_script.py", "not found"]),
    ("folder-as-script", ["a_folder"], ["a_folder", "directory without __main__.py"]),
    ("empty-config", ["--config_file", "empty.yaml", "train.py"], ["empty.yaml", "empty"]),
    ("comment-only-config", ["--config_file", "comment_only.yaml", "train.py"], ["comment_only.yaml", "empty"]),
    ("duplicate-key", ["--config_file", "duplicate.yaml", "train.py"],
     ["duplicate.yaml", "'num_processes' appears twice (lines 1 and 3)"]),
    ("duplicate-nested-key", ["--config_file", "duplicate_nested.yaml", "train.py"],
     ["duplicate_nested.yaml", "'tp_size' appears twice"]),
    ("non-utf8-config", ["--config_file", "latin1.yaml", "train.py"], ["latin1.yaml", "not UTF-8", "0xe9"]),
    ("folder-as-config", ["--config_file", "a_folder", "train.py"], ["a_folder", "is a directory"]),
    ("saved-tp2-one-process", ["--config_file", "tp2_one_process.yaml", "train.py"],
     ["tp2_one_process.yaml", "key 'num_processes': 1 is not divisible by tp_size x pp_size = 2"]),
    ("bad-flag-value", ["--num_processes", "two", "train.py"], ["--num_processes", "'two'"]),
    ("unknown-flag", ["--num_gpus", "2", "train.py"], ["--num_gpus"]),
    # a near miss is refused (never taken as an abbreviation of the flag) and the flag named
    ("misspelt-flag", ["--num_process", "2", "train.py"],
     ["unrecognized arguments: --num_process; did you mean --num_processes? (see 'accel launch --help')"]),
    ("misspelt-flag-with-value", ["--mixed-precison=bf16", "train.py"], ["did you mean --mixed-precision?"]),
]


def test_a_misspelt_launch_flag_names_the_flag_it_resembles(run_accel, workdir):
    result = run_accel("launch", "--num_process", "2", "--cpu", "train.py", cwd=workdir)
    assert result.stderr == ("accel launch: error: unrecognized arguments: --num_process; did you mean "
                             "--num_processes? (see 'accel launch --help')\n")
    assert result.returncode == 2 and not (workdir / "script_ran").exists()
    # no hint for a flag that resembles none; every near miss named when there are several (accel env takes no script)
    one_line_error(run_accel("launch", "--cpu", "--nope", "train.py", cwd=workdir), "launch", "arguments: --nope (see")
    one_line_error(run_accel("env", "--num_proc", "2", "--mixed_precison", "bf16", cwd=workdir), "env",
                   "unrecognized arguments: --num_proc 2 --mixed_precison bf16; did you mean --num_processes (for "
                   "--num_proc), --mixed_precision (for --mixed_precison)?")


def test_accelerates_launch_parser_names_the_flag_too(capsys):
    """`accelerate launch` through the shim (accel.commands) parses with the same one-line parser."""
    from accel.commands.launch import launch_command_parser

    with pytest.raises(SystemExit) as exit_info:
        launch_command_parser().parse_args(["--num_process", "2", "train.py"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --num_process; did you mean --num_processes?" in capsys.readouterr().err


@pytest.mark.parametrize("args,needles", [p[1:] for p in LAUNCH_PROBES], ids=[p[0] for p in LAUNCH_PROBES])
def test_launch_refuses_in_one_line_before_starting_anything(run_accel, workdir, args, needles):
    one_line_error(run_accel("launch", "--cpu", *args, cwd=workdir), "launch", *needles)
    assert not (workdir / "script_ran").exists()


def test_fp8_without_torchao_is_refused_by_launch_and_by_config(run_accel, workdir, without_torchao):
    one_line_error(run_accel("launch", "--cpu", "--mixed_precision", "fp8", "train.py", cwd=workdir,
                             env=without_torchao), "launch", "mixed_precision", "fp8 needs torchao", "accel-train[fp8]")
    assert not (workdir / "script_ran").exists()
    # one machine, CPU, one process, then fp8: refused, asked again, and stdin ends
    result = run_accel("config", "--config_file", workdir / "fp8.yaml", input="1\nyes\n1\nfp8\n", env=without_torchao)
    # the schema's choices, as a bad answer's error lists them (tests/unit/cli/test_config.py)
    assert "Mixed precision? (no/fp16/bf16/fp8) [no]" in result.stdout
    one_line_error(result, "config", "mixed_precision", "fp8 needs torchao")
    assert not (workdir / "fp8.yaml").exists()


@pytest.mark.parametrize("answers,needles", [
    # one machine, CPU, 1 process, defaults, then tensor-parallel size 2: refused; stdin ends
    ("1\nyes\n1\n\n\n\n2\n", ["key 'num_processes': 1 is not divisible by tp_size x pp_size = 2"]),
    # an answer that is not a yes/no, then stdin ends: the default is not taken silently
    ("1\nmaybe\n", ["'use_cpu'", "'maybe'", "yes or no"]),
], ids=["tp2-on-one-process", "invalid-then-eof"])
def test_config_saves_nothing_when_stdin_ends_after_a_refused_answer(run_accel, workdir, answers, needles):
    target = workdir / "never.yaml"
    one_line_error(run_accel("config", "--config_file", target, input=answers), "config", *needles)
    assert not target.exists()


@pytest.mark.parametrize("name", ["empty.yaml", "duplicate.yaml", "latin1.yaml", "tp2_one_process.yaml"])
def test_env_and_launch_refuse_a_file_with_the_same_line(run_accel, workdir, name):
    launch = one_line_error(run_accel("launch", "--config_file", name, "train.py", cwd=workdir), "launch", name)
    env = one_line_error(run_accel("env", "--config_file", name, cwd=workdir), "env", name)
    assert launch.removeprefix("accel launch: ") == env.removeprefix("accel env: ")


def test_env_takes_launch_flags_and_the_same_check(run_accel, workdir):
    ok = run_accel("env", "--cpu", "--num_processes", "4", "--tp_size", "2", cwd=workdir)
    assert ok.returncode == 0, ok.stderr
    assert "num_processes: 4" in ok.stdout and "tp_size: 2" in ok.stdout
    one_line_error(run_accel("env", "--tp_size", "2", cwd=workdir), "env", "accel env flags", "num_processes")


def test_check_launchable_is_the_rule_behind_them(workdir, monkeypatch):
    """The one function: a config file alone still resolves (a worker checks its real world size), the check
    refuses it with the line the commands print."""
    monkeypatch.setenv("HOME", str(workdir))
    path = workdir / "tp2_one_process.yaml"
    cfg = resolve_config(path)
    with pytest.raises(ConfigError, match=r"key 'num_processes': 1 is not divisible by tp_size x pp_size = 2"):
        check_launchable(cfg, str(path))
    cfg.num_processes = 2
    assert check_launchable(cfg) is cfg
    with pytest.raises(ConfigError, match="empty"):
        read_config_file(workdir / "empty.yaml")


# ----------------------------------------------------------------------------------------------------------
# accel launch --dry_run, accel --version
# ----------------------------------------------------------------------------------------------------------

def dry_run_parts(stdout: str) -> tuple[dict, list[str]]:
    """(the printed config, the command's words with the variables in front) of a dry run's output."""
    config_text, _, command = stdout.partition("# the command accel launch runs")
    return yaml.safe_load(config_text), shlex.split(command.splitlines()[1])


def test_dry_run_prints_the_config_with_sources_and_the_torchrun_command(run_accel, workdir):
    (workdir / "four.yaml").write_text("num_processes: 4\nparallelism:\n  tp_size: 2\n")
    result = run_accel("launch", "--config_file", "four.yaml", "--cpu", "--mixed_precision", "bf16", "--dry_run",
                       "train.py", "--lr", "1", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert not (workdir / "script_ran").exists()  # nothing started
    out = result.stdout
    assert "num_processes: 4  # four.yaml" in out and "  tp_size: 2  # four.yaml" in out
    assert "mixed_precision: bf16  # accel launch flags" in out and "distributed_type: MULTI_CPU  # derived" in out
    assert "gradient_accumulation_steps: 1  # packaged default" in out
    config, words = dry_run_parts(out)
    assert (config["num_processes"], config["parallelism"]["tp_size"], config["use_cpu"]) == (4, 2, True)
    variable, python, *argv = words
    name, _, value = variable.partition("=")
    assert name == "ACCEL_LAUNCH_CONFIG" and json.loads(value)["parallelism"]["tp_size"] == 2
    assert python == sys.executable and argv[:2] == ["-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc_per_node") + 1] == "4" and argv[-3:] == ["train.py", "--lr", "1"]


def test_dry_run_of_one_process_is_the_plain_python_command(run_accel, workdir):
    result = run_accel("launch", "--dry_run", "train.py", cwd=workdir)
    assert result.returncode == 0, result.stderr
    config, words = dry_run_parts(result.stdout)
    assert config["num_processes"] == 1 and words[1:] == [sys.executable, "train.py"]
    assert not (workdir / "script_ran").exists()


def test_version(run_accel):
    result = run_accel("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"accel {accel.__version__}"


@pytest.mark.parametrize("group", [False, True])
def test_ctrl_c_is_130_in_one_line_and_a_replica_groups_launcher_says_nothing(monkeypatch, capsys, tmp_path, group):
    """Ctrl-C in any command: exit 130 and `accel launch: interrupted`; in a replica group's launcher (fault
    tolerance) nothing, since its head says how the job ended."""
    from accel.cli import launch as launch_cmd
    from accel.cli.fault_tolerance import GROUP_ENV
    from accel.cli.main import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_cmd, "run_command", interrupted)
    monkeypatch.chdir(tmp_path)
    if group:
        monkeypatch.setenv(GROUP_ENV, "0")
    else:
        monkeypatch.delenv(GROUP_ENV, raising=False)
    assert main(["launch", "--cpu", "s.py"]) == 130
    assert capsys.readouterr().err == ("" if group else "accel launch: interrupted\n")
