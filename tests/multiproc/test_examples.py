"""Every example runs under `accel launch`: on the embedded default (one process) and on 2 CPU processes."""

import subprocess
from pathlib import Path

import pytest
from _launch import accel_launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def launch(isolated_env, *args: str) -> subprocess.CompletedProcess:
    return accel_launch(isolated_env, *args)


def test_there_are_examples():
    assert ROOT / "examples" / "quickstart.py" in EXAMPLES


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_on_the_embedded_default(isolated_env, example):
    out = launch(isolated_env, str(example)).stdout
    assert "1 process" in out


@pytest.mark.multiproc
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_on_two_cpu_processes(isolated_env, example):
    out = launch(isolated_env, "--cpu", "--num_processes", "2", str(example)).stdout
    assert "2 process" in out


@pytest.mark.multiproc
def test_accelerate_script_with_bf16_and_accumulation(isolated_env):
    out = launch(isolated_env, "--cpu", "--num_processes", "2", "--mixed_precision", "bf16",
                 str(ROOT / "examples" / "accelerate_style.py"), "--gradient_accumulation_steps", "2").stdout
    assert "on 203 eval samples" in out  # gather_for_metrics dropped the padding of the uneven last batch
    assert "mixed_precision=bf16" in out and "MULTI_CPU" in out
