"""Faults survived: `accel launch --max_restarts N` restarts the group after a worker dies, every worker knows
which attempt it is (ACCEL_RESTART_COUNT), and `load_state()` continues from the latest complete checkpoint."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _launch import SCRIPTS, accel_launch
from safetensors.torch import load_file

from accel.core.restarts import export_restart_count
from accel import Accelerator, PartialState, ProjectConfiguration
from accel.checkpoint import layout

STEPS_PER_EPOCH = 6  # restart_train.py: 48 samples, batches of 4, 2 processes


def attempts(out: Path) -> dict[tuple[int, int], dict]:
    """(attempt, rank) -> what that worker recorded after its load_state()."""
    return {(int(p.stem[7]), int(p.stem[-1])): json.loads(p.read_text()) for p in out.glob("attempt*_rank*.json")}


@pytest.mark.multiproc
def test_rank_killed_inside_a_save_restarts_and_ends_bit_equal(isolated_env, tmp_path):
    """Rank 1 SIGKILLs itself on the first attempt while checkpoint_2 (step 12) is half written; torchrun restarts
    the group once; the second attempt skips the half-written folder, resumes mid-epoch from checkpoint_1
    (step 8) and ends with exactly the weights of a run that was never interrupted; its loss log is one run that
    continues from the checkpoint, every step once, the same losses as the uninterrupted run's."""
    script = SCRIPTS / "restart_train.py"
    accel_launch(isolated_env, "--cpu", "--num_processes", 2, script, "--out", tmp_path / "a", timeout=120)
    killed = accel_launch(isolated_env, "--cpu", "--num_processes", 2, "--max_restarts", 1, script,
                          "--out", tmp_path / "b", "--kill_at", 12, timeout=180)
    restart = next(line for line in killed.stderr.splitlines() if "restarting the worker group" in line)
    assert "rank 1 was killed by signal 9" in restart, killed.stderr  # rank 0 may be named too: it lost its peer

    plain, restarted = attempts(tmp_path / "a"), attempts(tmp_path / "b")
    assert sorted(plain) == [(0, 0), (0, 1)]
    assert sorted(restarted) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for (attempt, _), seen in [*plain.items(), *restarted.items()]:
        assert seen["ACCEL_RESTART_COUNT"] == seen["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
        assert seen["restart_count"] == attempt
    assert all(seen["found"] == [] and seen["resumed_at"] == 0 for seen in plain.values())
    for rank in (0, 1):
        first, second = restarted[(0, rank)], restarted[(1, rank)]
        assert first["found"] == [] and first["resumed_at"] == 0  # FileNotFoundError: started fresh
        half_written, *complete = second["found"]
        assert half_written.startswith(".tmp-checkpoint_2-") and complete == ["checkpoint_0", "checkpoint_1"]
        assert second["resumed_at"] == 8 and 8 % STEPS_PER_EPOCH  # from checkpoint_1, in the middle of epoch 1
    # the resumed run saved checkpoint_2 and _3 (total_limit=2); the half-written folder of the killed attempt is
    # hidden and kept until it is old enough to be provably abandoned (layout.ABANDONED_AFTER without a write)
    half_written, *published = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert half_written.startswith(".tmp-checkpoint_2-") and published == ["checkpoint_2", "checkpoint_3"]

    expected = load_file(str(tmp_path / "a" / "final.safetensors"))
    resumed = load_file(str(tmp_path / "b" / "final.safetensors"))
    assert expected.keys() == resumed.keys() and len(expected) == 4
    for key in expected:
        assert torch.equal(expected[key], resumed[key]), key

    def losses(out: Path) -> list[tuple]:
        (run,) = (out / "train").iterdir()  # the restart's own new run folder was left for the checkpoint's
        assert run.name == "run-001"
        return [(r["step"], r["values"]["loss"]) for r in map(json.loads, (run / "metrics.jsonl").open())]

    assert [step for step, _ in losses(tmp_path / "b")] == list(range(1, 3 * STEPS_PER_EPOCH + 1))
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


@pytest.mark.parametrize("torchrun_count, given, expected", [("2", None, "2"), ("1", "0", "1"), (None, None, "0"),
                                                             (None, "3", "3")])
def test_restart_count_comes_from_torchrun(monkeypatch, torchrun_count, given, expected):
    """torchrun's count wins (a forked notebook_launcher worker inherits its parent's ACCEL_RESTART_COUNT);
    outside torchrun a value the user set is kept, else 0."""
    for name, value in (("TORCHELASTIC_RESTART_COUNT", torchrun_count), ("ACCEL_RESTART_COUNT", given)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    export_restart_count()
    assert os.environ["ACCEL_RESTART_COUNT"] == expected
    PartialState._reset_for_tests()
    try:
        assert PartialState().restart_count == int(expected)
    finally:
        PartialState._reset_for_tests()


def test_load_state_without_a_complete_checkpoint_is_a_file_not_found_error(tmp_path, monkeypatch):
    """The resume pattern's first attempt: nothing saved, or only half-written folders (a save killed before its
    rename, or a folder without a manifest), is FileNotFoundError; the complete checkpoint beside them is loaded."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    PartialState._reset_for_tests()
    try:
        project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
        accelerator = Accelerator(cpu=True, project_config=project)
        model = accelerator.prepare(torch.nn.Linear(2, 1))
        checkpoints = tmp_path / "checkpoints"
        with pytest.raises(FileNotFoundError) as missing:
            accelerator.load_state()
        assert str(missing.value) == (f"{checkpoints}: no complete checkpoint_<i> folder to load yet (each needs "
                                      "accel_checkpoint.json); to start fresh when there is none, catch "
                                      "FileNotFoundError")
        assert isinstance(missing.value, layout.CheckpointError)
        # a save killed earlier on this host: its process is gone and it has been idle long enough
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        abandoned = checkpoints / f".tmp-checkpoint_0-{layout._HOST}-{dead.pid}-0123abcd"
        (abandoned / "state").mkdir(parents=True)
        long_ago = time.time() - layout.ABANDONED_AFTER - 60
        for path in (abandoned / "state", abandoned):
            os.utime(path, (long_ago, long_ago))
        (checkpoints / "checkpoint_1").mkdir()
        with pytest.raises(FileNotFoundError):
            accelerator.load_state()

        with torch.no_grad():
            model.weight.fill_(1.0)
        project.iteration = 0
        saved = accelerator.save_state()  # checkpoint_0; its save removed the abandoned .tmp folder
        assert Path(saved).name == "checkpoint_0" and not list(checkpoints.glob(".tmp-*"))
        (checkpoints / ".tmp-checkpoint_2-4567cdef").mkdir()
        with torch.no_grad():
            model.weight.fill_(2.0)
        accelerator.load_state()
        assert torch.all(model.weight == 1.0) and project.iteration == 1
    finally:
        PartialState._reset_for_tests()


def test_one_process_restarts_too_and_each_restart_is_announced(isolated_env, tmp_path):
    """--max_restarts with one process runs under torchrun's agent (it used to run the script directly and ignore
    the flag), and a restart is one line on stderr (torch says so only in its INFO log)."""
    from _launch import accel_launch

    script = tmp_path / "die_once.py"
    script.write_text("import os, sys\nimport accel\nprint('attempt', os.environ['ACCEL_RESTART_COUNT'], flush=True)\n"
                      "sys.exit(3 if os.environ['ACCEL_RESTART_COUNT'] == '0' else 0)\n")
    proc = accel_launch(isolated_env, "--cpu", "--max_restarts", 1, script, timeout=120)
    assert proc.stdout.split() == ["attempt", "0", "attempt", "1"]
    assert "accel launch: rank 0 exited with code 3; restarting the worker group (restart 1 of 1" in proc.stderr
