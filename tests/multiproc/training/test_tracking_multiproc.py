"""Experiment trackers on 2 CPU processes, one launch of an Accelerate-style script (`from accelerate import
Accelerator` through `accel launch --accelerate_shim`) logging through every installed tracker: only the main process
writes, and the TensorBoard events hold the values Accelerate writes (computed here, and, when Accelerate is
installed, compared with a run of the same script on the real Accelerate)."""

import csv
import glob
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import SCRIPTS, accel_launch, worker_module

pytestmark = pytest.mark.multiproc
SCRIPT = SCRIPTS / "tracking_worker.py"


def installed(module):
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("tracking")
    env = {**make_isolated_env(out), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": f"file:{out / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}
    accel_launch(env, "--accelerate_shim", "--cpu", "--num_processes", 2, SCRIPT, out, "all", timeout=240)
    return out, [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


def expected_scalars() -> dict:
    """What Accelerate's TensorBoardTracker writes for the script's values: numbers (tensors through listify) as
    scalars at each step, strings as text, dicts through add_scalars."""
    script = worker_module("tracking_worker")
    rows = [script.values(step) for step in range(script.STEPS)]
    return {"loss": [(s, r["loss"].item()) for s, r in enumerate(rows)],
            "lr": [(s, r["lr"]) for s, r in enumerate(rows)],
            "eval_acc/eval": [(s, r["eval"]["acc"]) for s, r in enumerate(rows)]}


def tensorboard_scalars(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for sub, prefix in ((folder, ""), (folder / "eval_acc", "eval_acc/")):
        events = EventAccumulator(str(sub))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            found[prefix + tag] = [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)]
    return found


def test_trackers_start_and_log_on_the_main_process_only(run):
    out, ranks = run
    everything = {"jsonl", "csv"} | {n for n in ("tensorboard", "wandb", "mlflow") if installed(n)}
    assert set(ranks[0]["trackers"]) == everything | {"in-log-with-everywhere"}
    assert ranks[1]["trackers"] == [] and ranks[1]["get_tracker"] == "GeneralTracker"  # Accelerate's blank tracker
    folder = out / "tracking" / "run-001"  # accel's file trackers: a run folder (TensorBoard: the project's folder)
    assert sorted(p.name for p in (out / "tracking").glob("run-*")) == ["run-001"]
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]  # written once, not once per process
    assert lines[1]["values"] == {"loss": 0.5, "lr": 0.05, "phase": "train", "eval/acc": 0.25}
    assert len(list(csv.reader((folder / "metrics.csv").open()))) == 1 + 4 * 4
    # a tracker in log_with runs on the main process whatever its main_process_only (as in Accelerate); used
    # directly, on_main_process honours it
    assert sorted(p.name for p in out.glob("*-[01]")) == [
        "direct-everywhere-0", "direct-everywhere-1", "direct-main-0", "in-log-with-everywhere-0"]


def test_the_script_again_on_one_process_is_a_second_run_and_a_second_line(run, tmp_path):
    """The same script into the same project_dir, now on one process: its own run folder beside the 2-process
    run's, each with its steps once, and `accel plot` of the project draws two lines that never join."""
    from conftest import make_isolated_env

    from accel.cli import plot
    from accel.cli.plot_html import render_panel

    pytest.importorskip("tensorboard")  # the script asks for its tracker
    project = tmp_path / "project"
    shutil.copytree(run[0] / "tracking", project / "tracking")  # the 2-process run (and its TensorBoard events)
    accel_launch(make_isolated_env(tmp_path), "--accelerate_shim", "--cpu", SCRIPT, project, "jsonl,csv,tensorboard",
                 timeout=120)
    assert not (project / "rank1.json").exists()  # one process this time
    folder = project / "tracking"
    assert sorted(p.name for p in folder.glob("run-*")) == ["run-001", "run-002"]
    for name in ("run-001", "run-002"):
        lines = [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines] == [0, 1, 2, 3]
    runs = plot.load_runs([str(folder)])  # the run folders, not the TensorBoard events beside them
    assert [(r.label, r.source) for r in runs] == [("tracking/run-001", plot.JSONL), ("tracking/run-002", plot.JSONL)]
    expected = [r["lr"] for r in map(worker_module("tracking_worker").values, range(4))]
    for r in runs:
        assert (r.metrics["lr"].x, r.metrics["lr"].y) == ([0.0, 1.0, 2.0, 3.0], pytest.approx(expected))
    paths = re.findall(r'<path d="([^"]*)"[^>]*data-run="([^"]*)"', render_panel(runs, "lr", 0.0))
    assert [(d.count("M"), name) for d, name in paths] == [(1, "tracking/run-001"), (1, "tracking/run-002")]


def test_tensorboard_written_by_the_main_process_with_accelerates_values(run):
    pytest.importorskip("tensorboard")
    out, ranks = run
    events = glob.glob(str(out / "tracking" / "**" / "events.out.tfevents.*"), recursive=True)
    assert events and {int(re.search(r"\.(\d+)\.\d+$", e).group(1)) for e in events} == {ranks[0]["pid"]}
    assert tensorboard_scalars(out / "tracking") == expected_scalars()


def test_wandb_and_mlflow_runs_only_from_the_main_process(run):
    out, _ = run
    if installed("wandb"):
        from tracking_readers import wandb_history

        (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))  # one run, not two
        rows, config = wandb_history(run_file)
        assert [r["_step"] for r in rows] == [0, 1, 2, 3] and config["lr"] == 0.1
    if installed("mlflow"):
        runs = [p for p in glob.glob(str(out / "mlruns" / "*" / "*" / "meta.yaml")) if "/.trash/" not in p]
        assert len(runs) == 1
        metrics = Path(runs[0]).parent / "metrics"  # numbers only, as in Accelerate: the tensor loss is dropped
        assert sorted(p.name for p in metrics.iterdir()) == ["lr"]
        assert len((metrics / "lr").read_text().splitlines()) == 4


def test_same_events_as_the_real_accelerate(run, tmp_path):
    """The script on the real Accelerate (one plain process) writes the same TensorBoard scalars."""
    pytest.importorskip("tensorboard")
    if not installed("accelerate"):
        pytest.skip("the real Accelerate is not installed")
    from conftest import make_isolated_env

    env = {k: v for k, v in make_isolated_env(tmp_path).items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "tensorboard"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert tensorboard_scalars(tmp_path / "tracking") == tensorboard_scalars(run[0] / "tracking")
