"""Experiment trackers on one process: each built-in tracker's files read back, custom trackers, "all", errors."""

import csv
import glob
import json
import os
import sys

import pytest
import torch
from tracking_readers import wandb_history

from accel import Accelerator, ProjectConfiguration
from accel.tracking import CSV, JSONL, GeneralTracker, TensorBoardTracker, filter_trackers, get_available_trackers
from accel.utils import LoggerType

CONFIG = {"lr": 0.1, "optimizer": "adamw", "epochs": 3}


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCEL_LAUNCH_CONFIG", raising=False)


def run(log_with, steps=((1, {"loss": torch.tensor(0.5), "lr": 0.1, "phase": "train", "eval": {"acc": 0.75}}),
                         (None, {"loss": 0.25})), config=CONFIG, project="run", init_kwargs=None, **accel_kwargs):
    accelerator = Accelerator(cpu=True, log_with=log_with, **accel_kwargs)
    accelerator.init_trackers(project, config=config, init_kwargs=init_kwargs)
    for step, values in steps:
        accelerator.log(values, step=step)
    return accelerator


def test_jsonl_and_csv_write_the_shared_format_in_logging_dir(tmp_path):
    project = ProjectConfiguration(project_dir=str(tmp_path / "project"), logging_dir=str(tmp_path / "logs"))
    accelerator = run([JSONL, "csv"], project_config=project)
    folder = tmp_path / "logs" / "run" / "run-001"  # <logging_dir>/<project_name>/<run>, one run for both trackers
    # each call is on disk before end_training (append + flush)
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in line.items() if k != "time"} for line in lines] == [
        {"step": 1, "values": {"loss": 0.5, "lr": 0.1, "phase": "train", "eval/acc": 0.75}},
        {"step": None, "values": {"loss": 0.25}}]
    assert all(isinstance(line["time"], float) for line in lines)
    accelerator.end_training()
    rows = list(csv.reader((folder / "metrics.csv").open()))
    assert rows[0] == ["step", "time", "name", "value"]
    assert [[r[0], r[2], r[3]] for r in rows[1:]] == [
        ["1", "loss", "0.5"], ["1", "lr", "0.1"], ["1", "phase", "train"], ["1", "eval/acc", "0.75"],
        ["", "loss", "0.25"]]
    assert len({r[1] for r in rows[1:5]}) == 1 and float(rows[1][1]) <= float(rows[5][1])
    assert json.loads((folder / "config.json").read_text()) == CONFIG
    assert not (tmp_path / "project").exists()
    assert [p.name for p in (tmp_path / "logs" / "run").iterdir()] == ["run-001"]


def test_run_folder_defaults_to_project_dir_then_cwd(tmp_path, monkeypatch):
    run("jsonl", project_dir=str(tmp_path / "p")).end_training()
    assert len((tmp_path / "p" / "run" / "run-001" / "metrics.jsonl").read_text().splitlines()) == 2
    monkeypatch.chdir(tmp_path)
    run("csv", project="here", config=None).end_training()  # accel's file trackers: the current directory
    assert (tmp_path / "here" / "run-001" / "metrics.csv").is_file()
    # LoggerType members work as names; tensorboard needs a folder (no cwd default, as in Accelerate)
    run(LoggerType.TENSORBOARD, project="tb", config=None, project_dir=str(tmp_path)).end_training()
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    steps = [(s, {"loss": torch.tensor(1.0 / (s + 1)), "note": f"step {s}", "eval": {"acc": s / 4, "f1": 0.5}})
             for s in range(3)]
    accelerator = run("tensorboard", steps=steps, project_dir=str(tmp_path))
    assert isinstance(accelerator.get_tracker("tensorboard"), TensorBoardTracker)
    accelerator.end_training()

    def read(folder):
        events = EventAccumulator(str(folder))
        events.Reload()
        return events

    main = read(tmp_path / "run")
    assert main.Tags()["scalars"] == ["loss"] and main.Tags()["tensors"] == ["note/text_summary"]
    assert [(e.step, e.value) for e in main.Scalars("loss")] == [(s, pytest.approx(1 / (s + 1))) for s in range(3)]
    texts = [e.tensor_proto.string_val[0] for e in main.Tensors("note/text_summary")]
    assert texts == [b"step 0", b"step 1", b"step 2"]
    acc = read(tmp_path / "run" / "eval_acc")  # add_scalars: one folder per dict entry, tag = the dict's name
    assert [(e.step, e.value) for e in acc.Scalars("eval")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    hparams = [p for p in (tmp_path / "run").iterdir() if (p / "hparams.yml").exists()]
    assert len(hparams) == 1 and "lr: 0.1" in (hparams[0] / "hparams.yml").read_text()
    (session,) = glob.glob(str(tmp_path / "run" / "[0-9]*" / "events.out.tfevents.*"))  # add_hparams' own folder
    starts = [HParamsPluginData.FromString(v.metadata.plugin_data.content).session_start_info
              for event in EventFileLoader(session).Load() for v in event.summary.value
              if v.tag == "_hparams_/session_start_info"]
    assert [(h.hparams["lr"].number_value, h.hparams["optimizer"].string_value) for h in starts] == [(0.1, "adamw")]


class Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append(("start",))

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


def test_custom_tracker_gets_every_call_and_get_tracker(tmp_path):
    recorder = Recorder()
    accelerator = Accelerator(cpu=True, log_with=[recorder, "jsonl"], project_dir=str(tmp_path))
    accelerator.init_trackers("run", config={"lr": 1})
    accelerator.log({"loss": 2.0}, step=5, log_kwargs={"recorder": {"commit": True}, "wandb": {"x": 1}})
    assert accelerator.get_tracker("recorder") is recorder
    assert accelerator.get_tracker("recorder", unwrap=True) is recorder.calls
    assert accelerator.get_tracker("jsonl", unwrap=True).name.endswith("metrics.jsonl")  # the open file
    with pytest.raises(ValueError, match="wandb is not an available tracker"):
        accelerator.get_tracker("wandb")
    accelerator.end_training()
    assert recorder.calls == [("start",), ("config", {"lr": 1}), ("log", {"loss": 2.0}, 5, {"commit": True}),
                              ("finish",)]
    assert [t.name for t in accelerator.trackers] == ["recorder", "jsonl"]

    class Incomplete(GeneralTracker):
        pass

    with pytest.raises(NotImplementedError, match="`name`, `requires_logging_directory`, `tracker`"):
        Incomplete()


def test_all_means_every_installed_tracker(tmp_path):
    def installed(module):
        try:
            __import__(module)
            return True
        except ImportError:
            return False

    expected = {JSONL, CSV} | {name for name in ("tensorboard", "wandb", "mlflow", "aim", "comet_ml", "clearml",
                                                 "dvclive", "swanlab", "trackio") if installed(name)}
    recorder = Recorder()
    for log_with in ("all", LoggerType.ALL, ["all", recorder]):
        chosen = Accelerator(cpu=True, log_with=log_with, project_dir=str(tmp_path)).log_with
        assert {str(t) for t in chosen if not isinstance(t, GeneralTracker)} == expected
    assert chosen[0] is recorder
    assert filter_trackers(["jsonl", "jsonl", "csv"], ".") == ["jsonl", "csv"]  # no repeats
    assert set(map(str, get_available_trackers())) == expected
    assert "jsonl" not in LoggerType and "csv" not in LoggerType  # LoggerType stays Accelerate's


@pytest.mark.parametrize("module,extra", [("tensorboard", "accel-train[tensorboard]"), ("wandb", "accel-train[wandb]"),
                                          ("mlflow", "accel-train[mlflow]"), ("aim", "pip install aim"),
                                          ("comet_ml", "pip install comet_ml"), ("clearml", "pip install clearml"),
                                          ("dvclive", "pip install dvclive"), ("swanlab", "pip install swanlab"),
                                          ("trackio", "pip install trackio")])
def test_missing_library_is_one_line_naming_what_to_install(monkeypatch, tmp_path, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError) as error:
        Accelerator(cpu=True, log_with=module, project_dir=str(tmp_path))
    assert extra in str(error.value) and "\n" not in str(error.value) and repr(module) in str(error.value)
    assert module not in map(str, filter_trackers("all", "."))  # "all" skips it


def test_unknown_tracker_names_the_allowed_ones():
    with pytest.raises(ValueError, match="unsupported tracker 'tensorbord'; allowed: all, .*tensorboard.*jsonl, csv"):
        Accelerator(cpu=True, log_with=["jsonl", "tensorbord"])


def test_no_log_with_logs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accelerator = run(None)
    assert accelerator.trackers == [] and isinstance(accelerator.get_tracker("jsonl"), GeneralTracker)
    accelerator.end_training()
    assert not (tmp_path / "run").exists()


def test_wandb_offline_run_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    steps = [(s, {"loss": 1.0 / (s + 1), "phase": "train"}) for s in range(3)]
    accelerator = run("wandb", steps=steps, init_kwargs={"wandb": {"dir": str(tmp_path)}})
    assert accelerator.get_tracker("wandb", unwrap=True).project == "run"
    accelerator.end_training()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows, config = wandb_history(run_file)
    assert [(r["_step"], r["loss"], r["phase"]) for r in rows] == [(s, 1.0 / (s + 1), "train") for s in range(3)]
    assert {k: config[k] for k in CONFIG} == CONFIG


def test_mlflow_file_store_run_read_back(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this flag
    steps = [(s, {"loss": 1.0 / (s + 1), "phase": "train"}) for s in range(3)]
    accelerator = run("mlflow", steps=steps)
    run_id = accelerator.get_tracker("mlflow", unwrap=True).info.run_id
    accelerator.end_training()
    client = mlflow.tracking.MlflowClient()
    history = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / (s + 1)) for s in range(3)]
    finished = client.get_run(run_id)
    assert finished.data.params == {k: str(v) for k, v in CONFIG.items()} and finished.info.status == "FINISHED"
    assert client.get_experiment(finished.info.experiment_id).name == "run"
    assert "phase" not in finished.data.metrics  # numbers only, as in Accelerate
    assert os.path.isdir(tmp_path / "mlruns")
