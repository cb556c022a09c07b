"""An optimizer that cannot train the prepared model is named in one line, on 2 CPU processes.

Under every layout that gives the model new parameters at `prepare` (ZeRO-2/3: FSDP2's shards, tensor parallelism's
DTensors, expert parallelism's rows of the stacked experts), a loop that built its optimizer on the model before
`prepare` and never passed it ran to exit code 0 and did not learn (its optimizer held the old parameters). Now the
first `accelerator.backward` says so when no optimizer was prepared, and the first `step` of an optimizer that holds
old parameters (a second model's, left out of `prepare`) says so too: an UnpreparedOptimizerError (a ValueError),
one line naming the layout and what to pass to `prepare`, the same on both ranks. The issue's own loop (a plain
`Accelerator()` under `accel launch --zero_stage 3`) ends the launch with exit code 1 and that line on stderr.

Where the numbers are right nothing is said: plain DDP and ZeRO-1 keep the parameters, so an optimizer never
prepared trains exactly as the prepared one (final weights equal); under ZeRO-3, an optimizer built before `prepare`
and prepared in a later call, or built after `prepare` and prepared, is re-pointed and trains equally.

Two launches of scripts/unprepared_optimizer.py, which runs every case in turn, each its own Accelerator: 2 processes,
and 4 for HSDP (2 x 2): refused without a prepared optimizer, quiet with one prepared in a later call."""

from __future__ import annotations

import json

import pytest
from _launch import SCRIPTS, accel_launch

pytestmark = pytest.mark.multiproc

ADVICE = "pass the optimizer to prepare with the model: `model, optimizer = accelerator.prepare(model, optimizer, ...)`"
REFUSED_AT_BACKWARD = {"zero2-unprepared": "ZeRO-2", "zero3-unprepared": "ZeRO-3",
                       "tp2-unprepared": "tensor parallelism (tp_size=2)",
                       "ep2-unprepared": "expert parallelism (ep_size=2)",
                       "hsdp-unprepared": "HSDP (dp_replicate_size=2 x dp_shard_size=2, ZeRO-3)"}
LINE = ("accelerator.backward: under ZeRO-3, prepare gave the model new parameters (4, e.g. '0.weight') but no "
        "optimizer was prepared")
QUIET = ("ddp-unprepared", "zero1-unprepared", "zero3-later", "zero3-after", "hsdp-later")
PROCESSES = {"hsdp-unprepared": 4, "hsdp-later": 4}  # the others: 2


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Two launches: 2 processes under --zero_stage 3 (every case, then the issue's loop, which fails), and 4
    processes for HSDP (2 x 2). Returns the first launch and every case's records by rank."""
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("unprepared_optimizer")
    env = make_isolated_env(out)
    proc = accel_launch(env, "--cpu", "--num_processes", 2, "--zero_stage", 3, SCRIPTS / "unprepared_optimizer.py",
                        "--out", out, expect=1, timeout=300)
    accel_launch(env, "--cpu", "--num_processes", 4, SCRIPTS / "unprepared_optimizer.py", "--out", out, "--hsdp",
                 timeout=300)
    records: dict = {}
    for path in out.glob("*.rank*.json"):
        name, rank = path.name.removesuffix(".json").split(".rank")
        records.setdefault(name, {})[int(rank)] = json.loads(path.read_text())
    return proc, records


def test_the_issues_loop_under_zero3_fails_in_one_line(launched):
    """Exit code 1 and the line on stderr (as a traceback's last line, or as accel's `accel: error: <line>` where
    the launcher condenses one-line errors), not cut; the cases before it were caught inside the worker."""
    proc, _ = launched
    lines = [line for line in proc.stderr.splitlines() if LINE in line]
    assert lines, proc.stderr
    for line in lines:
        assert ADVICE in line, line
    assert len(proc.stderr.splitlines()) < 60, proc.stderr  # a few frames at most, never screens of them


@pytest.mark.parametrize("case", sorted(REFUSED_AT_BACKWARD))
def test_no_prepared_optimizer_is_refused_at_the_first_backward(launched, case):
    _, records = launched
    assert sorted(records[case]) == list(range(PROCESSES.get(case, 2)))
    for record in records[case].values():
        error = record["error"]
        assert error is not None, record
        assert (error["type"], error["at"]) == ("UnpreparedOptimizerError", "backward"), error["traceback"]
        message = error["message"]
        assert "\n" not in message
        assert message.startswith(f"accelerator.backward: under {REFUSED_AT_BACKWARD[case]}, prepare gave the model "
                                  "new parameters ("), message
        assert ADVICE in message


def test_a_second_models_unprepared_optimizer_is_refused_at_its_first_step(launched):
    _, records = launched
    for record in records["zero3-second-model"].values():
        error = record["error"]
        assert error is not None, record
        assert (error["type"], error["at"]) == ("UnpreparedOptimizerError", "second step"), error["traceback"]
        assert "\n" not in error["message"]
        assert error["message"].startswith(
            "SGD.step: under ZeRO-3, prepare gave the model new parameters, and this optimizer (SGD) holds 4 of the "
            "old ones (e.g. '0.weight')"), error["message"]
        assert ADVICE in error["message"]


@pytest.mark.parametrize("case", QUIET)
def test_where_the_numbers_are_right_nothing_is_said(launched, case):
    _, records = launched
    assert sorted(records[case]) == list(range(PROCESSES.get(case, 2)))
    for rank, record in records[case].items():
        assert record["error"] is None, record["error"]["traceback"]
        assert len(record["losses"]) == 8 // PROCESSES.get(case, 2)  # 32 samples in batches of 4 per process
        assert not [w for w in record["warnings"] if "optimizer" in w.lower()], record["warnings"]
        if rank == 0:  # the same final weights as the loop with the optimizer prepared with the model
            assert record["difference"] <= 1e-6, record["difference"]
