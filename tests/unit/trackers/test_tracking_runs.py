"""Runs that stay apart: each init_trackers call writes its own run folder, a run resumed from a checkpoint
(load_state before or after init_trackers) continues its own files with no step twice, and `accel plot` draws each
run as its own line (an old single-file log too)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from accel import Accelerator, ProjectConfiguration
from accel.cli import plot
from accel.cli.plot_html import render_panel


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCEL_LAUNCH_CONFIG", raising=False)


def loss(step: int, attempt: int) -> float:
    """A value that tells which attempt logged it."""
    return attempt * 100.0 + step


def train(project_dir: Path, attempt: int, steps: range, save_at: int | None = None, resume: str | None = None,
          project: str = "proj") -> Accelerator:
    """A tiny training script: trackers, then (resume="after") load_state, or load_state first (resume="before");
    logs `loss` at each step, saves the state after logging `save_at`."""
    config = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, log_with=["jsonl", "csv"], project_config=config)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    if resume == "before":
        accelerator.load_state()
    accelerator.init_trackers(project, config={"attempt": attempt})
    if resume == "after":
        accelerator.load_state()
    for step in steps:
        accelerator.log({"loss": loss(step, attempt)}, step=step)
        if step == save_at:
            accelerator.save_state()
    accelerator.end_training()
    del model
    return accelerator


def jsonl(folder: Path) -> list[tuple]:
    records = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["values"]["loss"]) for r in records]


def csv_rows(folder: Path) -> list[tuple]:
    rows = list(csv.reader((folder / "metrics.csv").open()))
    assert rows[0] == ["step", "time", "name", "value"]  # one header, also after a resume
    return [(int(r[0]), float(r[3])) for r in rows[1:]]


def test_each_init_trackers_starts_its_own_run(tmp_path):
    train(tmp_path, attempt=1, steps=range(4))
    train(tmp_path, attempt=2, steps=range(3))
    project = tmp_path / "proj"
    assert sorted(p.name for p in project.iterdir()) == ["run-001", "run-002"]
    assert jsonl(project / "run-001") == csv_rows(project / "run-001") == [(s, loss(s, 1)) for s in range(4)]
    assert jsonl(project / "run-002") == csv_rows(project / "run-002") == [(s, loss(s, 2)) for s in range(3)]
    assert json.loads((project / "run-002" / "config.json").read_text()) == {"attempt": 2}
    (project / "run-007").mkdir()  # the next run is one past the highest number, never an old one reused
    train(tmp_path, attempt=3, steps=range(1))
    assert (project / "run-008" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("order", ["after", "before"])
def test_resumed_run_continues_its_own_log_without_repeated_steps(tmp_path, order):
    """Attempt 1 logs steps 0-5, saving after step 2, then stops (as if it crashed); attempt 2 loads that checkpoint
    and logs 3-5 again: the run's files hold 0-2 of attempt 1 and 3-5 of attempt 2, each step once, and attempt 2
    left no run folder of its own."""
    train(tmp_path, attempt=1, steps=range(6), save_at=2)
    manifest = json.loads((tmp_path / "checkpoints" / "checkpoint_0" / "accel_checkpoint.json").read_text())
    assert manifest["trackers"]["project"] == "proj" and manifest["trackers"]["run"] == "run-001"
    train(tmp_path, attempt=2, steps=range(3, 6), resume=order)
    run = tmp_path / "proj" / "run-001"
    expected = [(s, loss(s, 1)) for s in range(3)] + [(s, loss(s, 2)) for s in range(3, 6)]
    assert jsonl(run) == csv_rows(run) == expected
    assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["run-001"]
    assert json.loads((run / "config.json").read_text()) == {"attempt": 2}
    # a new training into the project afterwards is a new run again
    train(tmp_path / "fresh", attempt=3, steps=range(2))
    train(tmp_path / "fresh", attempt=4, steps=range(2))
    assert sorted(p.name for p in (tmp_path / "fresh" / "proj").iterdir()) == ["run-001", "run-002"]


def test_checkpoint_of_another_project_leaves_the_new_run(tmp_path):
    train(tmp_path, attempt=1, steps=range(3), save_at=1, project="other")
    train(tmp_path, attempt=2, steps=range(2, 3), resume="after")
    assert jsonl(tmp_path / "proj" / "run-001") == [(2, loss(2, 2))]
    assert jsonl(tmp_path / "other" / "run-001") == [(s, loss(s, 1)) for s in range(3)]  # untouched


def test_a_run_logged_into_before_load_state_is_kept(tmp_path):
    """Something logged before load_state (an evaluation first, say) stays in its own run; the log moves on."""
    train(tmp_path, attempt=1, steps=range(3), save_at=1)
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, log_with="jsonl", project_config=config)
    accelerator.prepare(torch.nn.Linear(2, 1))
    accelerator.init_trackers("proj")
    accelerator.log({"loss": -1.0}, step=0)
    accelerator.load_state()
    accelerator.log({"loss": loss(2, 2)}, step=2)
    accelerator.end_training()
    assert jsonl(tmp_path / "proj" / "run-002") == [(0, -1.0)]
    assert jsonl(tmp_path / "proj" / "run-001") == [(0, loss(0, 1)), (1, loss(1, 1)), (2, loss(2, 2))]


def test_loading_another_runs_checkpoint_after_a_resume_removes_no_run(tmp_path):
    """Only the run folder init_trackers just made, with nothing logged, is removed when the log moves away: a
    resumed run's folder stays, with what it holds."""
    train(tmp_path, attempt=1, steps=range(3), save_at=1)  # run-001
    first = (tmp_path / "checkpoints" / "checkpoint_0").rename(tmp_path / "first")
    train(tmp_path, attempt=2, steps=range(3), save_at=1)  # run-002
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, log_with=["jsonl", "csv"], project_config=config)
    accelerator.prepare(torch.nn.Linear(2, 1))
    accelerator.init_trackers("proj")  # run-003, removed by the first load_state
    accelerator.load_state(str(first))
    accelerator.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))
    accelerator.end_training()
    assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["run-001", "run-002"]
    assert jsonl(tmp_path / "proj" / "run-001") == [(0, loss(0, 1)), (1, loss(1, 1))]
    assert jsonl(tmp_path / "proj" / "run-002") == [(0, loss(0, 2)), (1, loss(1, 2))]


def test_plot_draws_each_run_apart_and_an_old_single_file_log_too(tmp_path):
    """Two runs into one project, plus the single metrics.jsonl an older accel appended both to: three lines, none
    of which goes back in step (the old file's two runs stay one line: nothing tells them apart)."""
    train(tmp_path, attempt=1, steps=range(4))
    train(tmp_path, attempt=2, steps=range(3))
    project = tmp_path / "proj"
    old = "".join(json.dumps({"step": s, "time": 1.0, "values": {"loss": 9.0}}) + "\n" for s in range(2))
    (project / "metrics.jsonl").write_text(old)
    for target in (project, tmp_path):  # the project folder, or the folder of projects
        runs = plot.load_runs([str(target)])
        assert [r.label for r in runs] == ["proj", "proj/run-001", "proj/run-002"]
        series = {r.label: (r.metrics["loss"].x, r.metrics["loss"].y) for r in runs}
        assert series == {"proj": ([0.0, 1.0], [9.0, 9.0]),
                          "proj/run-001": ([0.0, 1.0, 2.0, 3.0], [loss(s, 1) for s in range(4)]),
                          "proj/run-002": ([0.0, 1.0, 2.0], [loss(s, 2) for s in range(3)])}
    paths = re.findall(r'<path d="([^"]*)"[^>]*data-run="([^"]*)"', render_panel(runs, "loss", 0.0))
    assert [run for _, run in paths] == ["proj", "proj/run-001", "proj/run-002"]
    assert [d.count("M") for d, _ in paths] == [1, 1, 1]  # each run one stroke of its own
    pytest.importorskip("matplotlib")
    lines = {line.get_gid(): list(line.get_xdata()) for line in plot.build_figure(runs, ["loss"], 0.0).axes[0].lines}
    assert lines == {"raw:proj": [0, 1], "raw:proj/run-001": [0, 1, 2, 3], "raw:proj/run-002": [0, 1, 2]}


def test_plot_numbers_runs_as_numbers_and_prefers_run_folders_over_tensorboards(tmp_path):
    """run-010 after run-009; a project folder with TensorBoard events (Accelerate's folder) and accel's run
    folders below it is drawn from the run folders, one line each, not as one TensorBoard line."""
    project = tmp_path / "proj"
    for number in (9, 10):
        (project / f"run-{number:03d}").mkdir(parents=True)
        (project / f"run-{number:03d}" / "metrics.jsonl").write_text(
            json.dumps({"step": 0, "time": 1.0, "values": {"loss": float(number)}}) + "\n")
    (project / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    runs = plot.load_runs([str(project)])
    assert [(r.label, r.source) for r in runs] == [("proj/run-009", plot.JSONL), ("proj/run-010", plot.JSONL)]


def test_plot_draws_each_tensorboard_run_of_one_folder_apart(tmp_path):
    """TensorBoard keeps Accelerate's folder, <project_dir>/<project_name>, for every run: each event file there
    (one SummaryWriter, one run) is its own line, with its own add_scalars values from the subfolder."""
    pytest.importorskip("tensorboard")
    for attempt, steps in ((1, 4), (2, 3)):
        accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
        accelerator.init_trackers("proj")
        for step in range(steps):
            accelerator.log({"loss": loss(step, attempt), "eval": {"acc": float(attempt)}}, step=step)
        accelerator.end_training()
    runs = plot.load_runs([str(tmp_path / "proj")])
    assert [r.label for r in runs] == ["proj#1", "proj#2"]
    assert [(r.metrics["loss"].x, r.metrics["loss"].y) for r in runs] == [
        ([0.0, 1.0, 2.0, 3.0], [loss(s, 1) for s in range(4)]), ([0.0, 1.0, 2.0], [loss(s, 2) for s in range(3)])]
    assert [r.metrics["eval/acc"].y for r in runs] == [[1.0] * 4, [2.0] * 3]
