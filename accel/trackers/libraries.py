"""The trackers of Accelerate's libraries (TensorBoard, Weights & Biases, Trackio, SwanLab, Comet ML, Aim, MLflow,
ClearML, DVCLive), each a `GeneralTracker` over its library, imported only when the tracker is built.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from accel.runtime.logging import get_logger
from accel.trackers.base import GeneralTracker, _has, on_main_process


logger = get_logger(__name__)


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
