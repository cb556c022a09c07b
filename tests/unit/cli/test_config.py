"""`accel config` (questionnaire and `default`) and `accel env`, driven through the real command line."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from accel.config import AccelConfig, PACKAGED_DEFAULT, read_config_file, build_config, resolve_config


def packaged() -> AccelConfig:
    return build_config([read_config_file(PACKAGED_DEFAULT)])


def assert_one_line_error(result, cmd: str) -> str:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"accel {cmd}: error: "), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def test_questionnaire_with_piped_answers_and_a_reasked_question(run_accel, tmp_path):
    target = tmp_path / "cfg" / "mine.yaml"
    answers = [
        "1",        # machines
        "maybe",    # CPU only? -> invalid, asked again
        "yes",
        "4",        # processes
        "fp32",     # mixed precision -> invalid (ConfigError text), asked again
        "BF16",     # choices are case-insensitive
        "4",        # gradient accumulation
        "2",        # ZeRO stage
        "n",        # offload optimizer (asked because stage >= 2; with pp_size 2 it would be refused and re-asked)
        "",         # tp size -> default
        "2",        # pp size
        "gpipe",    # schedule (asked because pp > 1)
        "8",        # micro-batches
    ]
    result = run_accel("config", "--config_file", target, input="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("Run on the CPU only") == 2
    assert "please answer yes or no" in out
    assert out.count("Mixed precision?") == 2
    assert "key 'mixed_precision': bad value 'fp32'" in out
    assert "Which GPUs" not in out  # not asked on CPU
    assert "IP address" not in out  # not asked on one machine
    assert f"saved to {target.resolve()}" in out

    cfg = resolve_config(target)
    assert (cfg.num_machines, cfg.use_cpu, cfg.num_processes) == (1, True, 4)
    assert (cfg.mixed_precision, cfg.gradient_accumulation_steps) == ("bf16", 4)
    par = cfg.parallelism
    assert (par.zero_stage, par.offload_optimizer, par.tp_size, par.pp_size) == (2, False, 1, 2)
    assert (par.pp_schedule, par.pp_microbatches) == ("GPipe", 8)
    assert not (tmp_path / "home" / ".cache").exists()  # HOME untouched when --config_file is given


def test_eof_takes_the_remaining_defaults(run_accel, tmp_path):
    target = tmp_path / "partial.yaml"
    result = run_accel("config", "--config_file", target, input="1\nno\n2\n")  # then stdin ends
    assert result.returncode == 0, result.stderr
    assert "Which GPUs" in result.stdout  # asked (not CPU only) and defaulted
    cfg = resolve_config(target)
    expected = packaged().to_dict()
    expected.update(num_processes=2, use_cpu=False)
    assert cfg.to_dict() == expected


def test_empty_stdin_saves_the_defaults_to_the_home_config(run_accel, tmp_path):
    result = run_accel("config", input="")
    assert result.returncode == 0, result.stderr
    saved = tmp_path / "home" / ".cache" / "accel" / "default_config.yaml"
    assert saved.is_file()
    assert str(saved) in result.stdout
    assert resolve_config(saved).to_dict() == packaged().to_dict()


def test_accel_config_file_env_names_the_target(run_accel, tmp_path):
    target = tmp_path / "from_env.yaml"
    result = run_accel("config", input="1\nyes\n", env={"ACCEL_CONFIG_FILE": str(target)})
    assert result.returncode == 0, result.stderr
    assert resolve_config(target).use_cpu is True


def test_multi_machine_questions_and_cross_field_reasks(run_accel, tmp_path):
    target = tmp_path / "multi.yaml"
    answers = ["2", "5", "1", "", "10.1.2.3", "", "c10d", "yes", "3", "4"]
    result = run_accel("config", "--config_file", target, input="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "key 'machine_rank': 5 is out of range" in out
    assert "an answer is required" in out  # empty IP
    assert "key 'num_processes': 3 is not divisible by num_machines=2" in out
    assert out.count("How many processes in total") == 2
    cfg = resolve_config(target)
    assert (cfg.num_machines, cfg.machine_rank, cfg.main_process_ip) == (2, 1, "10.1.2.3")
    assert (cfg.main_process_port, cfg.rdzv_backend, cfg.num_processes) == (29500, "c10d", 4)


def test_required_answer_missing_at_eof_is_a_one_line_error(run_accel, tmp_path):
    target = tmp_path / "never.yaml"
    result = run_accel("config", "--config_file", target, input="2\n0\n")
    line = assert_one_line_error(result, "config")
    assert "main_process_ip" in line
    assert not target.exists()


def test_config_default_writes_the_packaged_default(run_accel, tmp_path):
    target = tmp_path / "d.yaml"
    result = run_accel("config", "default", "--config_file", target)
    assert result.returncode == 0, result.stderr
    assert resolve_config(target).to_dict() == packaged().to_dict()

    # an existing file is left alone unless --force
    result = run_accel("config", "default", "--config_file", target, "--mixed_precision", "bf16")
    assert result.returncode == 0
    assert "already exists" in result.stderr
    assert resolve_config(target).mixed_precision == "no"
    result = run_accel("config", "default", "--config-file", target, "--mixed-precision", "bf16", "--force")
    assert result.returncode == 0, result.stderr
    assert resolve_config(target).mixed_precision == "bf16"


def test_config_default_rejects_a_bad_mixed_precision(run_accel, tmp_path):
    target = tmp_path / "bad.yaml"
    result = run_accel("config", "default", "--config_file", target, "--mixed_precision", "fp32")
    line = assert_one_line_error(result, "config")
    assert "mixed_precision" in line and "fp32" in line
    assert not target.exists()


def test_env_prints_versions_and_the_resolved_config(run_accel, tmp_path):
    result = run_accel("env", timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for needle in ("accel version: 0.1.0", "PyTorch version:", "Python version:", "OS:", "CUDA available:",
                   "gloo:", "nccl:", "accel config file: none: embedded default"):
        assert needle in out, needle

    cfg_file = tmp_path / "env.yaml"
    cfg_file.write_text("num_processes: 4\nmixed_precision: fp16\nparallelism:\n  tp_size: 2\n")
    result = run_accel("env", "--config_file", cfg_file, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"accel config file: {cfg_file}" in result.stdout
    yaml_text = textwrap.dedent(result.stdout.split("- resolved config:\n", 1)[1])
    resolved = yaml.safe_load(yaml_text)
    assert resolved == resolve_config(cfg_file).to_dict()
    assert resolved["num_processes"] == 4 and resolved["mixed_precision"] == "fp16"
    assert resolved["parallelism"]["tp_size"] == 2


def test_env_with_a_bad_config_file_is_a_one_line_error(run_accel, tmp_path):
    cfg_file = tmp_path / "typo.yaml"
    cfg_file.write_text("mixed_precison: fp16\n")
    result = run_accel("env", "--config_file", cfg_file, timeout=120)
    line = assert_one_line_error(result, "env")
    assert "did you mean 'mixed_precision'" in line


def test_no_subcommand_and_unknown_flags_exit_2(run_accel):
    assert run_accel().returncode == 2
    result = run_accel("config", "--nope")
    line = assert_one_line_error(result, "config")
    assert "--nope" in line


# -- the choices a question offers are the schema's, as the error for another answer lists them ----------------------

def _offered_and_allowed(out: str, prompt: str) -> tuple[list[str], list[str]]:
    """The choices the prompt offers `(a/b/c)` and the ones the refusal of a bad answer lists (`one of a, b, c`)."""
    offered = re.search(re.escape(prompt) + r" \(([^)]*)\)", out).group(1).split("/")
    allowed = re.search(r"allowed: one of ([^\n]*)", out).group(1).split(", ")
    return offered, allowed


def test_every_choice_question_offers_the_schemas_choices():
    from accel.cli.config import QUESTIONS, schema_choices
    from accel.config.schema import PARALLEL_FIELDS, TOP_FIELDS

    asked = [q for q in QUESTIONS if q.kind == "choice" and q.saved]
    assert {q.key for q in asked} >= {"mixed_precision", "rdzv_backend", "parallelism.pp_schedule"}
    for question in asked:
        section, _, name = question.key.rpartition(".")
        assert question.choices == schema_choices(question.key) == (PARALLEL_FIELDS if section else TOP_FIELDS)[
            name]["choices"], question.key


@pytest.mark.parametrize("torchao", [True, False])
def test_mixed_precision_prompt_and_its_error_list_the_same_choices(run_accel, tmp_path, torchao):
    env = {}
    if not torchao:  # the prompt is the same; fp8 is then refused naming torchao, and asked again
        hide = tmp_path / "hide_torchao"
        hide.mkdir()
        (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torchao'] = None\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))
    answers = ["1", "yes", "1", "fp32", *([] if torchao else ["fp8"]), "bf16"]
    result = run_accel("config", "--config_file", tmp_path / "c.yaml", input="\n".join(answers) + "\n", env=env)
    assert result.returncode == 0, result.stderr
    offered, allowed = _offered_and_allowed(result.stdout, "Mixed precision?")
    assert offered == allowed == ["no", "fp16", "bf16", "fp8"]
    assert result.stdout.count("Mixed precision?") == (2 if torchao else 3)
    if not torchao:
        assert "key 'mixed_precision': fp8 needs torchao, which is not installed" in result.stdout
    assert resolve_config(tmp_path / "c.yaml").mixed_precision == "bf16"


# -- an existing file is overwritten only when the user says so -------------------------------------------------------

SAVED = "mixed_precision: bf16\n"
NOT_CHANGED = "already exists; it was not changed (answer yes to overwrite it, pass --force, or choose another"


@pytest.mark.parametrize("answers", ["", "\n", "no\n", "maybe\nn\n1\nyes\n"])
def test_an_existing_file_is_left_alone_unless_the_answer_is_yes(run_accel, tmp_path, answers):
    target = tmp_path / "mine.yaml"
    target.write_text(SAVED)
    result = run_accel("config", "--config_file", target, input=answers)
    assert result.returncode == 0, result.stderr
    assert f"{target} already exists. Overwrite it? (yes/no) [no]: " in result.stdout
    assert "Mixed precision?" not in result.stdout  # no question asked after a no
    assert result.stderr == f"accel config: {target} {NOT_CHANGED} --config_file)\n"
    assert target.read_text() == SAVED
    if answers.startswith("maybe"):
        assert "'maybe': please answer yes or no" in result.stdout


def test_yes_or_force_overwrites_an_existing_file(run_accel, tmp_path):
    target = tmp_path / "mine.yaml"
    target.write_text(SAVED)
    result = run_accel("config", "--config_file", target, input="yes\n1\nyes\n2\n")
    assert result.returncode == 0, result.stderr
    assert "Overwrite it?" in result.stdout and f"saved to {target.resolve()}" in result.stdout
    cfg = resolve_config(target)
    assert (cfg.use_cpu, cfg.num_processes, cfg.mixed_precision) == (True, 2, "no")

    target.write_text(SAVED)
    result = run_accel("config", "--force", "--config_file", target, input="1\nyes\n4\n")  # no question first
    assert result.returncode == 0, result.stderr
    assert "Overwrite it?" not in result.stdout
    assert resolve_config(target).num_processes == 4

    target.write_text(SAVED)  # `accel config --force default` as `accel config default --force`
    assert run_accel("config", "--force", "default", "--config_file", target).returncode == 0
    assert resolve_config(target).mixed_precision == "no"


def test_a_new_file_is_written_without_the_overwrite_question(run_accel, tmp_path):
    target = tmp_path / "new.yaml"
    result = run_accel("config", "--config_file", target, input="1\nyes\n")
    assert result.returncode == 0, result.stderr
    assert "Overwrite it?" not in result.stdout and target.is_file()


def test_the_cli_page_says_what_config_does_with_an_existing_file():
    """docs/cli_reference.md (generated from the parsers) and docs/configuration.md say what the tests above hold."""
    root = Path(__file__).resolve().parents[3]
    cli = (root / "docs" / "cli_reference.md").read_text()
    assert "An existing file is overwritten only after you answer yes to the first question, or with --force." in cli
    assert "| `--force` |  |  | overwrite an existing file without asking |" in cli
    assert "An existing file is left alone unless --force is given." in cli  # `accel config default`
    configuration = " ".join((root / "docs" / "configuration.md").read_text().split())
    assert ("When the file exists, the first question is whether to overwrite it: only `yes` does; Enter, `no` or the "
            "end of input leave it unchanged") in configuration
