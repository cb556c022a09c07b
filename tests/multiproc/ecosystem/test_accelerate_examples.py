"""Accelerate's own examples, unchanged, on accel through the shim against the real Accelerate, on the same offline
stand-ins (a tiny BERT and tokenizer as "bert-base-cased", a synthetic GLUE MRPC, its metric): nlp_example.py on 1
and 2 CPU processes, by_feature/checkpointing.py saving every 2 steps and resuming mid-epoch from step_4 on 2, and
complete_nlp_example.py saving per epoch and resuming from epoch_0 on 2; their printed metrics must be equal.

The examples are not in Accelerate's PyPI distribution: they come from $ACCEL_ACCELERATE_EXAMPLES or GitHub at the
pinned tag, and the test is skipped, with the reason, when neither is there (as in CI). The other examples run with
`python tests/accelerate_compat/examples_harness.py` (docs/accelerate_compat.md lists their results)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc
if importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("the real accelerate and transformers packages (test extras) are not installed",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "accelerate_compat"))
import examples_harness  # noqa: E402

CASES = [("nlp_example", 1), ("nlp_example", 2), ("checkpointing", 2), ("complete_nlp_example", 2)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("accelerate-examples")
    examples, reason = examples_harness.examples_dir(work)
    if examples is None:
        pytest.skip(reason)
    return examples, work, examples_harness.build_standins(work / "standins")


@pytest.mark.parametrize("name,num_processes", CASES, ids=[f"{n}-{p}proc" for n, p in CASES])
def test_example_prints_the_same_metrics(setup, name, num_processes):
    examples, work, env = setup
    result = examples_harness.compare(examples_harness.CASES[name], num_processes, examples, work / "runs", env)
    assert result.status == "equal", f"{name} on {num_processes} processes: {result.status}\n{result.detail}"
    # the metrics must have been printed by both, each epoch (and, after a resume, the resumed epochs)
    assert any(line.startswith("[run] epoch 2:") for line in result.lines["accel"]), result.lines["accel"]
    if examples_harness.CASES[name].resume is not None:
        assert any(line.startswith("[resume] Resumed from checkpoint") for line in result.lines["accel"])
