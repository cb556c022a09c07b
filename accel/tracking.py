"""Experiment trackers, with Accelerate's `accelerate.tracking` names and semantics.

`Accelerator(log_with=...)` picks trackers by name ("jsonl", "csv", "tensorboard", "wandb", "mlflow", ... or "all"
for every one installed) or takes `GeneralTracker` instances; `init_trackers(project_name)` starts them on the main
process, `log()` sends each call to all of them, `end_training()` finishes them.

Where files go: logging_dir is `ProjectConfiguration(logging_dir=...)`, else `project_dir` (with neither, a
tracker that needs a folder is a ValueError, as in Accelerate; accel's own jsonl and csv then write under the
current directory). accel's own file trackers give each `init_trackers` call its own run folder,
`<logging_dir>/<project_name>/run-<NNN>/` (run-001, run-002, ...: the next free number, chosen by the main
process, the only one that writes), so two runs into one project never share a file:

- "jsonl": `run-<NNN>/metrics.jsonl`, one `{"step", "time", "values"}` object per `log()` call, and the config in
  `run-<NNN>/config.json`;
- "csv": `run-<NNN>/metrics.csv` with header `step,time,name,value` (one row per value), and `config.json`;
- "tensorboard" keeps Accelerate's folder: `SummaryWriter(log_dir=<logging_dir>/<project_name>)` for every run, one
  event file per run in it (`accel plot` draws each event file apart); the other trackers keep their library's runs.

A resumed run continues its own folder: `save_state` records the run and how far each of its files was written
(`"trackers"` in the checkpoint's manifest), and `load_state` of that checkpoint, before or after `init_trackers`,
switches the file trackers back to that run and cuts its files back to that point (what was logged after the save
is redone by the resumed training, so no step appears twice), then appends. A run folder that `init_trackers` has
just created and nothing was logged to is removed when the run switches away from it. This is also how a script
restarted by `accel launch --max_restarts` continues its log: it calls `load_state()` again. A checkpoint of
another project, or whose run folder is not in this project, leaves the new run as it is.

jsonl and csv need no extra library; the others need theirs (`pip install 'accel-train[tensorboard]'`, ...), and asking
for one that is missing is a one-line ImportError naming it.

This module is Accelerate's import path and the registry: the table of trackers by name, choosing and starting them,
a checkpoint's record of the file trackers' run and its resume. The trackers themselves live in accel/trackers/
(`base`: the `GeneralTracker` contract, `files`: jsonl and csv, `libraries`: the others).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from accel.runtime.logging import get_logger
from accel.compat.dataclasses import LoggerType

from accel.trackers.base import (  # noqa: F401
    GeneralTracker,
    on_main_process,
)
from accel.trackers.files import (  # noqa: F401
    CSV,
    CSVTracker,
    JSONL,
    JSONLTracker,
    RUN_PREFIX,
    _FileTracker,
    flatten_values,
    new_run_id,
    run_number,
)
from accel.trackers.libraries import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    MLflowTracker,
    SwanLabTracker,
    TensorBoardTracker,
    TrackioTracker,
    WandBTracker,
)

logger = get_logger(__name__)


LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "aim": AimTracker,
    "comet_ml": CometMLTracker,
    "mlflow": MLflowTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "clearml": ClearMLTracker,
    "dvclive": DVCLiveTracker,
    "swanlab": SwanLabTracker,
    "trackio": TrackioTracker,
    JSONL: JSONLTracker,
    CSV: CSVTracker,
}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make a GeneralTracker subclass selectable by its `name` in `log_with` (Accelerate's)."""
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"`tracker_class` must be a subclass of `GeneralTracker`, but got {tracker_class}.")
    if not getattr(tracker_class, "name", None):
        raise ValueError("The tracker class to register must define a non-empty `name` attribute.")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError("The tracker class to register must define a `requires_logging_directory` class attribute.")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(f"A tracker with the name '{tracker_class.name}' is already registered and will be overwritten "
                      f"by {tracker_class}.", stacklevel=1)
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def get_available_trackers() -> list:
    """Every built-in tracker whose library is installed here: what `log_with="all"` starts."""
    return [LoggerType(name) if name in LoggerType else name
            for name, cls in LOGGER_TYPE_TO_CLASS.items() if cls.available()]


def _name(log_type: Any) -> str:
    return str(log_type.value if isinstance(log_type, LoggerType) else log_type)


def filter_trackers(log_with: Any, logging_dir: str | os.PathLike | None = None) -> list:
    """`log_with` as a list of tracker names and GeneralTracker instances, without repeats. "all" means every
    installed tracker; a named tracker whose library is missing is a one-line ImportError."""
    if log_with is None:
        return []
    if not isinstance(log_with, (list, tuple)):
        log_with = [log_with]
    if any(_name(t) == "all" for t in log_with if not isinstance(t, GeneralTracker)):
        return [t for t in log_with if isinstance(t, GeneralTracker)] + get_available_trackers()
    loggers: list = []
    for entry in log_with:
        if isinstance(entry, GeneralTracker):
            loggers.append(entry)
            continue
        name = _name(entry)
        cls = LOGGER_TYPE_TO_CLASS.get(name)
        if cls is None:
            raise ValueError(f"Accelerator(log_with=...): unsupported tracker {entry!r}; allowed: all, "
                             f"{', '.join(LOGGER_TYPE_TO_CLASS)}, or a GeneralTracker instance")
        if not cls.available():
            module, hint = cls.library or (name, "")  # a tracker without a library is always available
            raise ImportError(f"log_with={name!r} needs the {module} package: {hint}")
        if cls.requires_logging_directory and logging_dir is None and not getattr(cls, "defaults_to_cwd", False):
            raise ValueError(f"Logging with `{name}` requires a `logging_dir` to be passed in.")
        kind = LoggerType(name) if name in LoggerType else name
        if kind not in loggers:
            loggers.append(kind)
    return loggers


def start_trackers(trackers: list, log_with: list, project_name: str, logging_dir: str | os.PathLike | None,
                   config: dict | None = None, init_kwargs: dict | None = None, resume: dict | None = None) -> list:
    """`Accelerator.init_trackers` (on the main process): build the named trackers, start every one (accel's file
    trackers in one new run folder, or in the run `resume` names: what `load_state` read before this call), store
    the config. Returns the trackers list, grown."""
    init_kwargs = init_kwargs or {}
    started = len(trackers)
    for entry in log_with:
        if isinstance(entry, GeneralTracker):
            trackers.append(entry)
            continue
        cls = LOGGER_TYPE_TO_CLASS[_name(entry)]
        args = (project_name, logging_dir or ".") if cls.requires_logging_directory else (project_name,)
        trackers.append(cls(*args, **init_kwargs.get(_name(entry), {})))
    files = [t for t in trackers[started:] if isinstance(t, _FileTracker) and t.run_id is None]
    if files:
        _choose_run(files, resume)
    for tracker in trackers[started:]:
        tracker.start()
    if config is not None:
        for tracker in trackers[started:]:
            tracker.store_init_configuration(config)
    return trackers


def _choose_run(files: list, resume: dict | None) -> None:
    """One run for every file tracker of an init_trackers call: the resumed one, else the project's next."""
    resumed = _resumable(resume, files[0])
    run_id, written = resumed if resumed else (new_run_id(files[0].project_folder), {})
    for tracker in files:
        tracker.run_id, tracker.truncate_at, tracker.new_run = run_id, written.get(tracker.filename), not resumed


def _resumable(record: dict | None, tracker: _FileTracker) -> tuple[str, dict] | None:
    """The run a checkpoint's record names and its files' sizes then, when it is a run folder of this tracker's
    project (a record that is not what tracker_record writes resumes nothing)."""
    if not isinstance(record, dict) or record.get("project") != tracker.run_name:
        return None
    run_id, written = record.get("run"), record.get("written")
    if not isinstance(run_id, str) or run_number(run_id) is None or not isinstance(written, dict):
        return None
    if not all(type(size) is int and size >= 0 for size in written.values()):
        return None
    return (run_id, written) if os.path.isdir(os.path.join(tracker.project_folder, run_id)) else None


def tracker_record(trackers: list) -> dict | None:
    """What a checkpoint keeps of accel's file trackers (main process): the project, the run and how many bytes
    of each file were written, so that resuming continues that run from exactly there."""
    files = [t for t in trackers if isinstance(t, _FileTracker) and t.file is not None]
    if not files:
        return None
    return {"project": files[0].run_name, "run": files[0].run_id, "written": {t.filename: t.written() for t in files}}


def resume_trackers(trackers: list, record: dict | None) -> None:
    """`load_state` after `init_trackers` (main process): move the file trackers to the run the checkpoint names,
    cut back to where the checkpoint was saved; the new run folder they leave is removed if nothing was logged."""
    files = [t for t in trackers if isinstance(t, _FileTracker) and t.file is not None]
    resumed = _resumable(record, files[0]) if files else None
    if resumed is None:
        return
    run_id, written = resumed
    left = {t.logging_dir for t in files if t.run_id != run_id}
    unused = all(t.new_run and t.logged == 0 for t in files)  # made by this init_trackers, nothing logged
    for tracker in files:
        tracker.finish()
        tracker.run_id, tracker.truncate_at, tracker.logged = run_id, written.get(tracker.filename), 0
        tracker.new_run = False
        tracker.start()
    for folder in left:
        if unused:
            _remove_fresh_run(folder, {t.filename for t in files}, files[0].logging_dir)
    logger.info(f"trackers: resumed run {os.path.join(files[0].project_folder, run_id)}")


def _remove_fresh_run(folder: str, names: set, resumed: str) -> None:
    """Remove a run folder holding only what starting the trackers wrote (empty logs and the config, which moves
    to the resumed run, as it does when load_state comes before init_trackers)."""
    try:
        entries = set(os.listdir(folder))
        if entries <= names | {"config.json"}:
            if "config.json" in entries:
                os.replace(os.path.join(folder, "config.json"), os.path.join(resumed, "config.json"))
            for name in entries - {"config.json"}:
                os.remove(os.path.join(folder, name))
            os.rmdir(folder)
    except OSError:
        pass  # shared or changed by someone else: leave it


def get_tracker(trackers: list, name: str, unwrap: bool = False):
    """The started tracker called `name` (its library object with unwrap=True); a blank tracker on processes that
    started none (the non-main ones), as in Accelerate."""
    if not trackers:
        return GeneralTracker(_blank=True)
    for tracker in trackers:
        if tracker.name == name:
            return tracker.tracker if unwrap else tracker
    raise ValueError(f"{name} is not an available tracker stored inside the `Accelerator`.")


def logging_root(project_configuration: Any) -> str | None:
    """Where run folders go: ProjectConfiguration's logging_dir, else project_dir; None when neither is set (a
    tracker that needs a folder is then a ValueError, as in Accelerate; accel's jsonl/csv use the current
    directory)."""
    return project_configuration.logging_dir or project_configuration.project_dir or None
