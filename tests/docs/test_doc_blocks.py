"""Docs that cannot rot: every python and shell block of README.md and docs/**/*.md runs here, on the
CPU with tiny models, unless the line before it says why not (`<!-- not-run: <reason> -->`); every yaml block is a
config accel accepts. The convention is in tests/docs/doc_blocks.py."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python
from doc_blocks import CONFIG, ROOT, RUN, Block, blocks, doc_pages

ALL = [block for page in doc_pages() for block in blocks(page)]
PAGES_WITH_RUNS = sorted({b.path for b in ALL if b.lang in RUN and b.marker is None},
                         key=lambda p: str(p.relative_to(ROOT)))
TIMEOUT = 180  # seconds for one block: a launch of two CPU processes takes a few


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_block_runs_or_says_why_not():
    problems = []
    for page in doc_pages():
        lines = page.read_text().splitlines()
        for block in blocks(page):
            before = lines[block.line - 2].strip() if block.line > 1 else ""
            if block.marker is None and before.startswith("<!--") and re.search(r"not.?run|file", before):
                problems.append(f"{block.where}: malformed marker {before!r}; allowed: <!-- not-run: <reason> --> "
                                "or <!-- file: NAME -->")
            if block.marker == "not-run" and len(block.value) < 10:
                problems.append(f"{block.where}: not-run without a reason ({block.value!r})")
            if block.marker == "file":
                if not re.fullmatch(r"[\w.-]+", block.value):
                    problems.append(f"{block.where}: file name {block.value!r}; allowed: a plain file name")
                later = [b for b in blocks(page) if b.line > block.line and b.lang in RUN and b.marker is None]
                if not any(block.value in b.code for b in later):
                    problems.append(f"{block.where}: file {block.value} is used by no block run after it")
    assert not problems, "\n".join(problems)


def test_the_convention_counts():
    """The blocks a reader sees are mostly run: a guard against marking everything not-run."""
    runnable = [b for b in ALL if b.lang in RUN]
    run = [b for b in runnable if b.marker is None]
    assert len(run) >= 10, [b.where for b in run]
    assert any(b.path.name == "README.md" for b in run)


def _env(tmp_path: Path) -> dict:
    from conftest import make_isolated_env

    env = make_isolated_env(tmp_path)
    # `python`, `accel` and `torchrun` in a block are this interpreter's
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", ACCEL_DISABLE_PROGRESS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


SHELL_SYNTAX = re.compile(r"[|&;<>()$`*?\\\[\]{}~]|^\w+=")  # anything only a shell would read in a line


def simple_commands(code: str) -> list[list[str]] | None:
    """A shell block's commands when each line is one plain command (words, a trailing `# comment`), else None."""
    commands = []
    for line in code.splitlines():
        if SHELL_SYNTAX.search(line.split("#")[0].strip()):
            return None
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands


def _command(words: list[str], env: dict) -> tuple[list[str], bool] | None:
    """(argv, from a warm interpreter): `accel ...` as its console script runs it (`accel.cli.main`), `python ...`
    as it is; another program as the shell would find it on the block's PATH; None for a shell builtin."""
    if words[0] == "accel":
        return [sys.executable, "-m", "accel.cli.main", *words[1:]], True
    if words[0] == "python":
        return [sys.executable, *words[1:]], True
    program = shutil.which(words[0], path=env["PATH"])
    return None if program is None else ([program, *words[1:]], False)


def _run(block: Block, index: int, work: Path, env: dict) -> None:
    """The block as a user runs it. A shell block of plain commands runs them one by one, `accel` and `python` from a
    warm interpreter (tests/multiproc/warm_python.py: a fresh one per command costs a few CPU seconds of imports);
    any other shell block runs in bash."""
    if block.lang in ("python", "py"):
        script = work / f"_doc_block_{index}.py"
        script.write_text(block.code)
        steps = [([sys.executable, script.name], True)]
    else:
        code = block.code
        if block.lang == "console":  # the `$ ` lines are the commands; the rest is their output
            code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ ")) + "\n"
        commands = simple_commands(code)
        found = [None] if commands is None else [_command(words, env) for words in commands]
        steps = [step for step in found if step is not None]
        if len(steps) < len(found):  # shell syntax or a builtin: the whole block in bash
            script = work / f"_doc_block_{index}.sh"
            script.write_text(code)
            steps = [(["bash", "-euo", "pipefail", script.name], False)]
    for command, warm in steps:
        try:
            if warm:
                done = warm_python.run(command, cwd=work, env=env, timeout=TIMEOUT)
            else:
                done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{block.where}: still running after {TIMEOUT} s\n{exc.stdout or ''}{exc.stderr or ''}")
        if done.returncode:
            tail = (done.stdout + done.stderr)[-4000:]
            pytest.fail(f"{block.where}: exit code {done.returncode} ({shlex.join(command)})\n--- the block ---\n"
                        f"{block.code}--- its output ---\n{tail}")


def test_plain_shell_blocks_are_split_into_their_commands():
    assert simple_commands("accel launch --cpu a.py --x 1   # a comment\n\nls runs/demo\n") == [
        ["accel", "launch", "--cpu", "a.py", "--x", "1"], ["ls", "runs/demo"]]
    for shell in ("accel env | grep x", "A=1 accel launch a.py", "cat > f <<'PY'", "accel launch a.py && ls",
                  "echo $HOME", "ls *.py", "accel launch \\\n  a.py", "(cd x)", "ls > out", "echo `date`"):
        assert simple_commands(shell) is None, shell
    env = {"PATH": str(Path(sys.executable).parent)}
    assert _command(["accel", "plot", "runs"], env) == ([sys.executable, "-m", "accel.cli.main", "plot", "runs"], True)
    assert _command(["python", "x.py"], env) == ([sys.executable, "x.py"], True)
    assert _command(["exit", "3"], env) is None  # a shell builtin: the block runs in bash


@pytest.mark.parametrize("page", PAGES_WITH_RUNS, ids=_page_id)
def test_page_blocks_run(page: Path, tmp_path: Path):
    """The page's blocks in order, in a folder of their own that holds the repository's examples/."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    env = _env(tmp_path)
    for index, block in enumerate(blocks(page)):
        if block.marker == "file":
            (work / block.value).write_text(block.code)
        elif block.marker is None and block.lang in RUN:
            _run(block, index, work, env)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in CONFIG and b.marker != "not-run"],
                         ids=lambda b: b.where)
def test_yaml_block_is_a_config_accel_accepts(block: Block, tmp_path: Path):
    from accel.config.resolve import build_config, read_config_file

    path = tmp_path / (block.value if block.marker == "file" else "config.yaml")
    path.write_text(block.code)
    build_config([read_config_file(path)], str(path))  # a ConfigError names the key; the block's place is the id


def test_a_bad_block_fails(tmp_path: Path):
    """The runner can fail: a block that exits non-zero, and a yaml block with a misspelt key."""
    from accel.config.errors import ConfigError
    from accel.config.resolve import read_config_file

    page = tmp_path / "page.md"
    page.write_text("```bash\nexit 3\n```\n")
    (work := tmp_path / "w").mkdir()
    env = _env(tmp_path)
    with pytest.raises(pytest.fail.Exception, match="exit code 3"):
        _run(blocks(page)[0], 0, work, env)
    page.write_text("```bash\nls\naccel plan gpt2 --num_processes 0\nls\n```\n")  # plain commands, one by one
    with pytest.raises(pytest.fail.Exception, match=r"exit code 2 \(.* -m accel.cli.main plan gpt2"):
        _run(blocks(page)[0], 1, work, env)
    from accel.cli.main import build_parser

    [words] = _accel_command_lines("exec accel plan gpt2 --num_procesess 8  # a typo\n")
    assert build_parser().parse_known_args(words)[1] == ["--num_procesess", "8"]
    config = tmp_path / "bad.yaml"
    config.write_text("num_proceses: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'num_processes'"):
        read_config_file(config)


def _accel_command_lines(code: str) -> list[list[str]]:
    """The `accel ...` command lines of a shell block, as words (continuations joined; `exec`/`srun`, environment
    assignments before the command and a trailing comment dropped; a line that shlex cannot split is skipped)."""
    import shlex

    out = []
    for line in code.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        while words and (words[0] in ("exec", "srun", "$") or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
            words = words[1:]  # a prefix, or an environment assignment (`PET_NNODES=2 accel launch ...`)
        for i, word in enumerate(words):  # `... && accel ...`, `... | accel ...`
            if word == "accel" and (i == 0 or words[i - 1] in ("&&", "||", ";", "|")):
                end = next((j for j in range(i + 1, len(words)) if words[j] in ("&&", "||", ";", "|")), len(words))
                out.append(words[i + 1:end])
    return out


def test_every_accel_command_line_in_the_docs_parses():
    """Blocks that cannot run here (GPUs, clusters) still cannot rot their flags: every `accel` command line of every
    shell block parses with the real parser (an unknown flag or a bad choice fails, naming the block)."""
    from accel.cli.main import _subparsers, build_parser

    problems, checked = [], 0
    for block in ALL:
        if block.lang not in RUN or block.lang in ("python", "py"):
            continue
        for words in _accel_command_lines(block.code):
            parser = build_parser()
            try:
                args, extras = parser.parse_known_args(words)
            except SystemExit:
                problems.append(f"{block.where}: accel {' '.join(words)}: refused by the parser")
                continue
            if extras and args.command:
                sub = _subparsers(parser)[args.command]
                problems.append(f"{block.where}: accel {' '.join(words)}: {sub.prog} does not know {extras}")
            checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= 20, checked
