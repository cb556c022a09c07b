"""accel's own file trackers, "jsonl" and "csv": no library needed, each `init_trackers` call writes its own run
folder (`<logging_dir>/<project_name>/run-<NNN>/`), and a resumed run cuts its files back to the checkpoint.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from typing import TextIO

from accel.runtime.logging import get_logger
from accel.trackers.base import GeneralTracker, on_main_process


logger = get_logger(__name__)

JSONL = "jsonl"  # accel's own trackers: names for log_with, not LoggerType members (those stay Accelerate's)
CSV = "csv"


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
