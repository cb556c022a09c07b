"""Every example runs under `accel launch`: on the embedded default (one process) and on 2 CPU processes."""

import json
import subprocess
from pathlib import Path

import pytest
from _launch import accel_launch

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


LOGGING = {"quickstart.py", "accelerate_style.py"}  # log to PROJECT_DIR/<name>/run-<NNN>/metrics.jsonl (default runs/)


def launch(isolated_env, *args: str) -> subprocess.CompletedProcess:
    return accel_launch(isolated_env, *args)


def logs_to(example: Path, tmp_path: Path) -> list[str]:
    """Keep the logging examples' files out of the repository."""
    return ["--project_dir", str(tmp_path)] if example.name in LOGGING else []


def test_there_are_examples():
    assert ROOT / "examples" / "quickstart.py" in EXAMPLES


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_on_the_embedded_default(isolated_env, example, tmp_path):
    out = launch(isolated_env, str(example), *logs_to(example, tmp_path)).stdout
    assert "1 process" in out
    if example.name in LOGGING:
        log = tmp_path / example.stem / "run-001" / "metrics.jsonl"  # the first run into this project_dir
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert [line["step"] for line in lines if "loss" in line["values"]] == list(range(96))  # 3 epochs x 32
        assert all(isinstance(line["values"].get("lr", 0.0), float) for line in lines)


@pytest.mark.multiproc
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_on_two_cpu_processes(isolated_env, example, tmp_path):
    out = launch(isolated_env, "--cpu", "--num_processes", "2", str(example), *logs_to(example, tmp_path)).stdout
    assert "2 process" in out


@pytest.mark.multiproc
def test_accelerate_script_with_bf16_and_accumulation(isolated_env, tmp_path):
    out = launch(isolated_env, "--cpu", "--num_processes", "2", "--mixed_precision", "bf16",
                 str(ROOT / "examples" / "accelerate_style.py"), "--gradient_accumulation_steps", "2",
                 "--project_dir", str(tmp_path)).stdout
    assert "on 203 eval samples" in out  # gather_for_metrics dropped the padding of the uneven last batch
    assert "mixed_precision=bf16" in out and "MULTI_CPU" in out


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pipeline_example_on_two_stages(isolated_env, schedule):
    out = launch(isolated_env, "--cpu", "--num_processes", "2", "--pp_size", "2", "--pp_schedule", schedule,
                 "--pp_microbatches", "4", str(ROOT / "examples" / "pipeline.py")).stdout
    assert "on 2 process(es), pp_size 2" in out
    accuracy = float(out.strip().splitlines()[-1].split("accuracy ")[1].split()[0])
    assert accuracy > 0.5  # it learns the repeating pattern (chance: 1/16)


@pytest.mark.multiproc
@pytest.mark.parametrize("flags", [["--zero_stage", "2"], ["--zero_stage", "3", "--mixed_precision", "bf16"],
                                   ["--tp_size", "2"], ["--pp_size", "2"]], ids=["zero2", "zero3-bf16", "tp2", "pp2"])
def test_hf_gpt2_example_on_every_backend(isolated_env, flags):
    """The issue's GPT-2 script: to the end, resumed from its last save_state, save_model tied in transformers."""
    pytest.importorskip("transformers")
    out = launch(isolated_env, "--cpu", "--num_processes", "2", *flags, str(ROOT / "examples" / "hf_gpt2.py")).stdout
    assert "step 12: loss" in out and "resumed from step_10" in out
    assert "from_pretrained: tied, logits match" in out
