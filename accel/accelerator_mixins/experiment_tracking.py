"""The Accelerator's experiment trackers (accel/tracking.py): chosen at construction, started and fed on the main
process only (end_training finishes them), continued from a checkpoint's run after load_state."""

from __future__ import annotations

import warnings
from typing import Any

from accel.accelerator_mixins.process import ProcessControl


class Tracking(ProcessControl):
    """`log_with`'s trackers and where they write (the project's logging dir)."""

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    def _tracker_names(self, log_with: Any) -> list:
        from accel.tracking import filter_trackers, logging_root

        trackers = filter_trackers(log_with, logging_root(self.project_configuration))
        if not trackers and log_with is not None:
            warnings.warn(f"`log_with={log_with}` was passed but no supported trackers are currently installed.",
                          stacklevel=3)
        return trackers

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the `log_with` trackers for a new run in `<logging_dir>/<project_name>/` (accel's jsonl/csv: in its
        own `run-<NNN>/` there; the checkpoint's run when load_state came first); `config`: its hyperparameters;
        `init_kwargs`: per tracker name, keyword arguments for its constructor (e.g. `{"wandb": {"tags": [...]}}`)."""
        from accel.tracking import logging_root, start_trackers

        if self.is_main_process:
            start_trackers(self.trackers, self.log_with, project_name, logging_root(self.project_configuration),
                           config, init_kwargs, resume=self._tracker_resume)
        self._tracker_resume = None

    def _resume_trackers(self, record: dict | None) -> None:
        """After load_state: the file trackers continue the checkpoint's run (accel/tracking.py says how), now if
        they are started, else at init_trackers."""
        from accel.tracking import resume_trackers

        if self.is_main_process and self.trackers:
            resume_trackers(self.trackers, record)
        else:
            self._tracker_resume = record

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called `name` (its library's own object with `unwrap=True`); a blank one off the main process."""
        from accel.tracking import get_tracker

        return get_tracker(self.trackers, name, unwrap)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send `values` (names to numbers or strings) at `step` to every tracker, from the main process only;
        `log_kwargs`: per tracker name, extra keyword arguments for its `log`."""
        if self.is_main_process:
            for tracker in self.trackers:
                tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))
