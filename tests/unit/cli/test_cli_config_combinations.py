"""`accel config` refuses the combinations `accel launch` refuses (accel.backends.check_available): it asks the
offending question again, and with stdin ended it saves nothing and exits 2 with the one-line error."""

from __future__ import annotations

from accel.backends import check_available
from accel.config import resolve_config

# one machine, CPU only, 4 processes, default precision and accumulation, ZeRO 2 with optimizer offload
ZERO2_OFFLOAD = ["1", "yes", "4", "", "", "2", "yes", ""]
PIPELINE_OFFLOAD = "pipeline parallelism (pp_size=2) with CPU offload is not available yet"


def test_a_refused_combination_reasks_the_question_that_completed_it(run_accel, tmp_path):
    target = tmp_path / "combo.yaml"
    answers = [*ZERO2_OFFLOAD, "2", "1"]  # pp size 2: refused with offload, asked again; then 1
    result = run_accel("config", "--config_file", target, input="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("Pipeline-parallel size") == 2
    assert out.count(PIPELINE_OFFLOAD) == 1
    assert "Pipeline schedule?" not in out  # pp_size ended up 1: the pipeline questions do not apply
    cfg = resolve_config(target)
    par = cfg.parallelism
    assert (par.zero_stage, par.offload_optimizer, par.pp_size) == (2, True, 1)
    assert check_available(par, cfg.num_processes) == "zero"  # what was saved, accel launch accepts


def test_a_refused_combination_at_end_of_input_exits_2_and_saves_nothing(run_accel, tmp_path):
    target = tmp_path / "never.yaml"
    answers = [*ZERO2_OFFLOAD, "2"]  # then stdin ends while pp size is asked again
    result = run_accel("config", "--config_file", target, input="\n".join(answers) + "\n")
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("accel config: error: ") and PIPELINE_OFFLOAD in lines[0]
    assert "Traceback" not in result.stderr
    assert not target.exists()


def test_tensor_parallelism_with_zero_stage_1_is_reasked(run_accel, tmp_path):
    target = tmp_path / "tp.yaml"
    answers = ["1", "yes", "4", "", "", "1", "2", "1", ""]  # ZeRO 1; tp 2 refused, then tp 1; pp default
    result = run_accel("config", "--config_file", target, input="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Offload the optimizer" not in out  # CPU offload needs ZeRO 2 or 3: not offered at stage 1
    assert out.count("Tensor-parallel size") == 2
    assert "tensor parallelism (tp_size=2) with ZeRO stage 1" in out
    assert resolve_config(target).parallelism.tp_size == 1


def test_offload_is_only_offered_from_zero_stage_2(run_accel, tmp_path):
    target = tmp_path / "z1.yaml"
    result = run_accel("config", "--config_file", target, input="1\nyes\n2\n\n\n1\n")  # ZeRO 1, then defaults
    assert result.returncode == 0, result.stderr
    assert "Offload the optimizer" not in result.stdout
    cfg = resolve_config(target)
    assert (cfg.parallelism.zero_stage, cfg.parallelism.offload_optimizer) == (1, False)


# one machine, CPU only, 4 processes, default precision and accumulation, ZeRO 3 (no offload), no TP, no PP
ZERO3 = ["1", "yes", "4", "", "", "3", "", "", ""]
SEQUENCE_QUESTION = "Sequence length parallelism for long sequences"


def test_sequence_parallelism_is_asked_and_saved(run_accel, tmp_path):
    target = tmp_path / "sp.yaml"
    answers = [*ZERO3, "ulysses", "SP", "3", "2"]  # a bad choice; sp; degree 3 does not divide 4 processes, then 2
    result = run_accel("config", "--config_file", target, input="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count(SEQUENCE_QUESTION) == 2 and "'ulysses': please answer one of none, sp, cp" in out
    assert out.count("Sequence-parallel size") == 2 and "Context-parallel size" not in out
    assert "4 is not divisible by tp_size x pp_size x sp_size = 3" in out
    cfg = resolve_config(target)
    assert (cfg.parallelism.sp_size, cfg.parallelism.cp_size, cfg.parallelism.zero_stage) == (2, 1, 3)
    assert "sequence_parallelism" not in target.read_text()  # the choice is no config key
    assert check_available(cfg.parallelism, cfg.num_processes) == "zero"

    target = tmp_path / "cp.yaml"
    result = run_accel("config", "--config_file", target, input="\n".join([*ZERO3, "cp", ""]) + "\n")
    assert result.returncode == 0, result.stderr
    assert "Context-parallel size (each process holds 2 of 2N chunks of every sequence)? [2]" in result.stdout
    assert (resolve_config(target).parallelism.cp_size, resolve_config(target).parallelism.sp_size) == (2, 1)


def test_context_parallelism_with_pipeline_stages_is_saved(run_accel, tmp_path):
    """pp 2 x cp 2 composes (each stage's cp ranks hold a slice of every micro-batch): asked once, saved."""
    target = tmp_path / "pp_cp.yaml"
    answers = ["1", "yes", "4", "", "", "0", "", "2", "", "", "cp", "", "", ""]  # pp 2, then cp 2
    result = run_accel("config", "--config_file", target, input="\n".join(answers) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(SEQUENCE_QUESTION) == 1 and "not available yet" not in result.stdout
    cfg = resolve_config(target)
    par = cfg.parallelism
    assert (par.pp_size, par.cp_size, par.sp_size) == (2, 2, 1)
    assert check_available(par, cfg.num_processes) == "pipeline"