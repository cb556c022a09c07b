"""A tracker that needs a folder, without logging_dir or project_dir, is Accelerate's ValueError (the real
Accelerate is the reference); accel's own jsonl/csv fall back to the current directory."""

from __future__ import annotations

import pytest

from accel import Accelerator
from accel.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class


class DirTracker(GeneralTracker):
    name = "dir_tracker_probe"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs):
        super().__init__()
        self.run_name, self.logging_dir = run_name, logging_dir

    @property
    def tracker(self):
        return self


@pytest.fixture
def registered():
    saved = dict(LOGGER_TYPE_TO_CLASS)
    register_tracker_class(DirTracker)
    yield
    LOGGER_TYPE_TO_CLASS.clear()
    LOGGER_TYPE_TO_CLASS.update(saved)


def test_folder_needed(registered, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
        Accelerator(cpu=True, log_with="tensorboard")
    with pytest.raises(ValueError, match="requires a `logging_dir`"):
        Accelerator(cpu=True, log_with=DirTracker.name)
    accelerator = Accelerator(cpu=True, log_with=DirTracker.name, project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    assert accelerator.get_tracker(DirTracker.name).logging_dir == str(tmp_path)
    accelerator.end_training()
    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(cpu=True, log_with="jsonl")  # accel's own: the current directory
    accelerator.init_trackers("cwd_run")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    assert (tmp_path / "cwd_run" / "run-001" / "metrics.jsonl").is_file()


def test_same_error_on_accelerate():
    pytest.importorskip("tensorboard")
    real = pytest.importorskip("accelerate")
    with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
        real.Accelerator(cpu=True, log_with="tensorboard")
