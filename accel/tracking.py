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
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from functools import wraps
from typing import Any, TextIO

from accel.runtime.logging import get_logger
from accel.compat.dataclasses import LoggerType

logger = get_logger(__name__)

JSONL = "jsonl"  # accel's own trackers: names for log_with, not LoggerType members (those stay Accelerate's)
CSV = "csv"


def on_main_process(function):
    """Run a tracker method on the main process only when the tracker's `main_process_only` is true (checked at
    call time, so defining a tracker does not create the process state)."""

    @wraps(function)
    def execute_on_main_process(self, *args, **kwargs):
        if getattr(self, "main_process_only", False):
            from accel.runtime.state import PartialState

            return PartialState().on_main_process(function)(self, *args, **kwargs)
        return function(self, *args, **kwargs)

    return execute_on_main_process


# -- library checks -------------------------------------------------------------------------------------------------
def _has(module: str) -> bool:
    """Importable here (a module set to None in sys.modules, as tests do, counts as missing)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _import(module: str, tracker: str, install: str):
    """Import a tracker's library, or one line saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"log_with={tracker!r} needs the {module} package: {install}") from None


class GeneralTracker:
    """Base class of every tracker, Accelerate's contract: define `name` (str), `requires_logging_directory` (bool;
    when true the tracker is built as `cls(project_name, logging_dir, **init_kwargs)`, else `cls(project_name,
    **init_kwargs)`) and a `tracker` property (the library's own object); override `start`, `store_init_configuration`,
    `log` and `finish` as needed. `main_process_only = False` makes the `on_main_process` methods run everywhere."""

    main_process_only = True
    name: str  # the subclass's (checked when it is built or registered)
    requires_logging_directory: bool
    library: tuple[str, str] | None = None  # (module, install hint) for the missing-library error

    def __init__(self, _blank: bool = False):
        if _blank:
            return
        missing = [f"`{attr}`" for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if "tracker" not in dir(self):
            missing.append("`tracker`")
        if missing:
            raise NotImplementedError("The implementation for this tracker class is missing the following required "
                                      f"attributes. Please define them in the class definition: {', '.join(missing)}")

    @classmethod
    def available(cls) -> bool:
        return cls.library is None or _has(cls.library[0])

    def _library(self):
        return _import(self.library[0], self.name, self.library[1])

    def start(self):
        """Create the run (called by `init_trackers`, after the process state exists)."""

    def store_init_configuration(self, values: dict):
        """Record the run's hyperparameters."""

    def log(self, values: dict, step: int | None = None, **kwargs):
        """Record `values` (names to numbers or strings) at `step`."""

    def finish(self):
        """Close the run."""


# -- accel's file trackers ------------------------------------------------------------------------------------------
def flatten_values(values: dict, prefix: str = "") -> dict:
    """Names to plain values: nested dicts as "a/b", tensors as numbers (`.item()`, or lists when not scalar)."""
    flat: dict = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_values(value, name + "/"))
        elif hasattr(value, "item") and callable(value.item):  # torch tensors and numpy scalars
            flat[name] = value.item() if getattr(value, "numel", lambda: 1)() == 1 else value.tolist()
        else:
            flat[name] = value
    return flat


def _json_number(value):
    """NaN and infinities as strings: JSON has no literal for them."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


RUN_PREFIX = "run-"


def run_number(name: str) -> int | None:
    """The N of a run folder's name `run-<N>`; None for any other name."""
    digits = name[len(RUN_PREFIX):]
    return int(digits) if name.startswith(RUN_PREFIX) and digits.isdigit() else None


def new_run_id(project_folder: str | os.PathLike) -> str:
    """Create the project's next run folder (one past the highest `run-<N>` there) and return its name. mkdir is
    exclusive, so two trainings starting together in one project still get a folder each."""
    os.makedirs(project_folder, exist_ok=True)
    numbers = [run_number(name) for name in os.listdir(project_folder)]
    number = max([n for n in numbers if n is not None], default=0) + 1
    while True:
        run_id = f"{RUN_PREFIX}{number:03d}"
        try:
            os.mkdir(os.path.join(project_folder, run_id))
            return run_id
        except FileExistsError:
            number += 1


class _FileTracker(GeneralTracker):
    """Writes in its run folder `<logging_dir>/<project_name>/<run_id>/`: appends one record per `log()` call and
    flushes it, so a crash loses nothing and the file can be followed while training runs."""

    requires_logging_directory = True
    defaults_to_cwd = True  # accel's own file trackers: without logging_dir/project_dir they write under "."
    filename = ""
    name: str  # each subclass's (an annotation only: GeneralTracker checks that a real class defines it)

    def __init__(self, run_name: str, logging_dir: str | os.PathLike = ".", **kwargs):
        super().__init__()
        if kwargs:
            raise TypeError(f"init_kwargs[{self.name!r}]: unexpected {', '.join(sorted(kwargs))}; allowed: none")
        self.run_name, self.logging_dir_param = run_name, logging_dir
        self.run_id: str | None = None  # set by start_trackers (one run for all file trackers of a call)
        self.truncate_at: int | None = None  # a resumed run: the file's size when the checkpoint was saved
        self.logged = 0  # log() calls into this run since start
        self.new_run = False  # this tracker's run folder was created for it (not a resumed run's)
        self.file: TextIO | None = None

    @property
    def project_folder(self) -> str:
        return os.path.join(self.logging_dir_param, self.run_name)

    @on_main_process
    def start(self):
        if self.run_id is None:
            self.run_id, self.new_run = new_run_id(self.project_folder), True
        self.logging_dir = os.path.join(self.project_folder, self.run_id)
        os.makedirs(self.logging_dir, exist_ok=True)
        self.path = os.path.join(self.logging_dir, self.filename)
        self.file = open(self.path, "a", newline="", encoding="utf-8")
        if self.truncate_at is not None:
            self._cut_back(self.truncate_at)
            self.truncate_at = None

    @property
    def _out(self) -> TextIO:
        if self.file is None:
            raise RuntimeError(f"the {self.name} tracker is not started (or finished): call init_trackers first")
        return self.file

    def _cut_back(self, size: int) -> None:
        """Drop what was appended after the checkpoint (the resumed training logs it again)."""
        if self._out.tell() < size:
            logger.warning(f"{self.path}: {self._out.tell()} bytes, less than the {size} the checkpoint recorded; "
                           "appending to it as it is")
            return
        self._out.truncate(size)
        self._out.seek(size)

    def written(self) -> int:
        """How far the file is written (what a checkpoint records to resume from)."""
        return self._out.tell()

    @property
    def tracker(self):
        return self.file

    @on_main_process
    def store_init_configuration(self, values: dict):
        with open(os.path.join(self.logging_dir, "config.json"), "w", encoding="utf-8") as out:
            json.dump(values, out, indent=2, default=str)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self._out.write(self._format(flatten_values(values), step, time.time()))
        self._out.flush()
        self.logged += 1

    def _format(self, values: dict, step: int | None, now: float) -> str:
        raise NotImplementedError

    @on_main_process
    def finish(self):
        if self.file is not None:
            self.file.close()
            self.file = None


class JSONLTracker(_FileTracker):
    """`metrics.jsonl`: one line `{"step": int|null, "time": unix seconds, "values": {name: number|string}}` per
    `log()` call; read it back with `[json.loads(line) for line in open(path)]`."""

    name = JSONL
    filename = "metrics.jsonl"

    def _format(self, values: dict, step: int | None, now: float) -> str:
        values = {k: _json_number(v) for k, v in values.items()}
        return json.dumps({"step": step, "time": now, "values": values}, default=str) + "\n"


class CSVTracker(_FileTracker):
    """`metrics.csv`, long format `step,time,name,value` (one row per value; an empty step when none was given), so
    values logged at different steps share one table (`pandas.read_csv(path).pivot(...)`)."""

    name = CSV
    filename = "metrics.csv"

    @on_main_process
    def start(self):
        super().start()
        if self.file.tell() == 0:  # a new file (a resumed one keeps its header)
            self.file.write("step,time,name,value\n")
            self.file.flush()

    def _format(self, values: dict, step: int | None, now: float) -> str:
        lines = _CSVLines()
        writer = csv.writer(lines, lineterminator="\n")
        stamp = "" if step is None else step
        for name, value in values.items():
            writer.writerow([stamp, now, name, json.dumps(value) if isinstance(value, (list, tuple)) else value])
        return "".join(lines)


class _CSVLines(list):
    write = list.append


# -- Accelerate's trackers ------------------------------------------------------------------------------------------
class TensorBoardTracker(GeneralTracker):
    """TensorBoard (`pip install 'accel-train[tensorboard]'`): a SummaryWriter on `<logging_dir>/<run_name>`; numbers
    as scalars, strings as text, dicts through `add_scalars`; the config through `add_hparams` and `hparams.yml`."""

    name = "tensorboard"
    requires_logging_directory = True
    library = ("tensorboard", "pip install 'accel-train[tensorboard]'")

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs):
        super().__init__()
        self.run_name, self.logging_dir_param, self.init_kwargs = run_name, logging_dir, kwargs

    @classmethod
    def available(cls) -> bool:
        return _has("tensorboard") or _has("tensorboardX")

    @on_main_process
    def start(self):
        try:
            self._library()
            from torch.utils import tensorboard
        except ImportError:
            if not _has("tensorboardX"):
                raise
            import tensorboardX as tensorboard
        self.logging_dir = os.path.join(self.logging_dir_param, self.run_name)
        self.writer = tensorboard.SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self):
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict):
        import yaml

        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        folder = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hparams.yml"), "w") as out:
            yaml.dump(values, out)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        from accel.compat.operations import listify

        for k, v in listify(values).items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, global_step=step, **kwargs)
            elif isinstance(v, str):
                self.writer.add_text(k, v, global_step=step, **kwargs)
            elif isinstance(v, dict):
                self.writer.add_scalars(k, v, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs):
        for k, v in values.items():
            self.writer.add_images(k, v, global_step=step, **kwargs)

    @on_main_process
    def finish(self):
        self.writer.close()


class _RunTracker(GeneralTracker):
    """Trackers whose library has `init(project=...)` returning a run with `log` and `finish` (wandb, trackio,
    swanlab); `main_process_only = False`, as in Accelerate (the Accelerator still starts them on the main one)."""

    requires_logging_directory = False
    main_process_only = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name, self.init_kwargs = run_name, kwargs

    @on_main_process
    def start(self):
        self.run = self._library().init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self):
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict):
        self._library().config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self):
        self.run.finish()


class WandBTracker(_RunTracker):
    """Weights & Biases (`pip install 'accel-train[wandb]'`); `init_kwargs={"wandb": {...}}` go to `wandb.init`."""

    name = "wandb"
    library = ("wandb", "pip install 'accel-train[wandb]'")

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs):
        wandb = self._library()
        for k, v in values.items():
            self.log({k: [wandb.Image(image) for image in v]}, step=step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns=None, data=None, dataframe=None, step: int | None = None, **kwargs):
        wandb = self._library()
        self.log({table_name: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step=step, **kwargs)


class TrackioTracker(_RunTracker):
    name = "trackio"
    library = ("trackio", "pip install trackio")


class SwanLabTracker(_RunTracker):
    name = "swanlab"
    library = ("swanlab", "pip install swanlab")

    @on_main_process
    def start(self):
        super().start()
        self._library().config["FRAMEWORK"] = "🤗Accelerate"  # as Accelerate does


class CometMLTracker(GeneralTracker):
    name = "comet_ml"
    requires_logging_directory = False
    library = ("comet_ml", "pip install comet_ml")

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name, self.init_kwargs = run_name, kwargs

    @on_main_process
    def start(self):
        comet_ml = self._library()
        make = comet_ml.start if hasattr(comet_ml, "start") else comet_ml.Experiment  # start: comet_ml >= 3.41
        self.writer = make(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self):
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.writer.log_parameters(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        if step is not None:
            self.writer.set_step(step)
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self.writer.log_metric(k, v, step=step, **kwargs)
            elif isinstance(v, str):
                self.writer.log_other(k, v, **kwargs)
            elif isinstance(v, dict):
                self.writer.log_metrics(v, step=step, **kwargs)

    @on_main_process
    def finish(self):
        self.writer.end()


class AimTracker(GeneralTracker):
    name = "aim"
    requires_logging_directory = True
    library = ("aim", "pip install aim")

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = ".", **kwargs):
        super().__init__()
        self.run_name, self.aim_repo_path, self.init_kwargs = run_name, logging_dir, kwargs

    @on_main_process
    def start(self):
        self.writer = self._library().Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self):
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        for key, value in values.items():
            self.writer.track(value, name=key, step=step, **kwargs)

    @on_main_process
    def finish(self):
        self.writer.close()


class MLflowTracker(GeneralTracker):
    """MLflow (`pip install 'accel-train[mlflow]'`): an experiment named `experiment_name` (the project name), one run;
    the tracking URI is MLflow's own (`MLFLOW_TRACKING_URI`, e.g. `file:/path/mlruns`). Numbers only, as in
    Accelerate (other values are dropped with a warning)."""

    name = "mlflow"
    requires_logging_directory = False
    library = ("mlflow", "pip install 'accel-train[mlflow]'")

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike | None = None,
                 run_id: str | None = None, tags: dict | str | None = None, nested_run: bool | None = False,
                 run_name: str | None = None, description: str | None = None):
        from accel.core.probes import str_to_bool

        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested: str | bool | None = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir, self.run_id = logging_dir, os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = str_to_bool(nested) == 1 if isinstance(nested, str) else nested
        self.run_name, self.description = run_name, description

    @on_main_process
    def start(self):
        mlflow = self._library()
        found = mlflow.search_experiments(filter_string=f"name = '{self.experiment_name}'")
        experiment_id = found[0].experiment_id if found else mlflow.create_experiment(
            name=self.experiment_name, artifact_location=self.logging_dir, tags=self.tags)
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)

    @property
    def tracker(self):
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict):
        mlflow = self._library()
        limit = mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
        kept = [(k, v) for k, v in values.items() if len(str(v)) <= limit]
        if len(kept) < len(values):
            logger.warning_once(f"MLflow keeps parameters of at most {limit} characters; dropped: "
                           f"{', '.join(k for k in values if k not in dict(kept))}")
        batch = mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
        for i in range(0, len(kept), batch):
            mlflow.log_params(dict(kept[i:i + batch]))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        metrics = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        dropped = [k for k in values if k not in metrics]
        if dropped:
            logger.warning_once(f"MLflow logs numbers only; dropped: {', '.join(dropped)}")
        self._library().log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs):
        self._library().log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None):
        self._library().log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None):
        self._library().log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self):
        self._library().end_run()


class ClearMLTracker(GeneralTracker):
    name = "clearml"
    requires_logging_directory = False
    library = ("clearml", "pip install clearml")

    def __init__(self, run_name: str | None = None, **kwargs):
        super().__init__()
        self.user_provided_run_name, self.init_kwargs = run_name, kwargs
        self._initialized_externally = False
        self.task: Any = None  # clearml's Task, from start()

    @on_main_process
    def start(self):
        task_class = self._library().Task
        current = task_class.current_task()
        if current:
            self._initialized_externally, self.task = True, current
            return
        args = dict(self.init_kwargs)
        args.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name))
        args.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = task_class.init(**args)

    @property
    def tracker(self):
        return self.task

    @on_main_process
    def store_init_configuration(self, values: dict):
        return self.task.connect_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        clearml_logger = self.task.get_logger()
        for k, v in values.items():
            if not isinstance(v, (int, float)):
                logger.warning_once(f"ClearML logs numbers only; dropped {k!r}")
            elif step is None:
                clearml_logger.report_single_value(name=k, value=v, **kwargs)
            else:
                title, series = self._get_title_series(k)
                clearml_logger.report_scalar(title=title, series=series, value=v, iteration=step, **kwargs)

    @on_main_process
    def finish(self):
        if self.task and not self._initialized_externally:
            self.task.close()

    @staticmethod
    def _get_title_series(name: str) -> tuple[str, str]:
        for prefix in ("eval", "test", "train"):
            if name.startswith(prefix + "_"):
                return name[len(prefix) + 1:], prefix
        return name, "train"


class DVCLiveTracker(GeneralTracker):
    name = "dvclive"
    requires_logging_directory = False
    library = ("dvclive", "pip install dvclive")

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs):
        super().__init__()
        self.live, self.init_kwargs = live, kwargs

    @on_main_process
    def start(self):
        self.live = self.live if self.live is not None else self._library().Live(**self.init_kwargs)

    @property
    def tracker(self):
        return self.live

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for k, v in values.items():
            if Metric.could_log(v):
                self.live.log_metric(k, v, **kwargs)
            else:
                logger.warning_once(f"DVCLive logs scalars only; dropped {k!r}")
        self.live.next_step()

    @on_main_process
    def finish(self):
        self.live.end()


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
