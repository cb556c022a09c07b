"""Accelerate's `get_logger`: a standard `logging` logger whose records are emitted on the main process only
(`main_process_only=True`, the default) or on every process, optionally one process after another (`in_order`)."""

from __future__ import annotations

import logging
import os


class MultiProcessAdapter(logging.LoggerAdapter):
    """`logger.info(msg, main_process_only=False, in_order=True)`; the process state is read when logging."""

    def log(self, level, msg, *args, main_process_only: bool = True, in_order: bool = False, **kwargs):
        from accel.state import PartialState

        if not self.isEnabledFor(level):
            return
        state = PartialState._instance
        if state is None or not state.initialized:
            if int(os.environ.get("RANK", "0")) == 0 or not main_process_only:
                self.logger.log(level, msg, *args, **kwargs)
            return
        if main_process_only:
            if state.is_main_process:
                self.logger.log(level, msg, *args, **kwargs)
            return
        if not in_order:
            self.logger.log(level, msg, *args, **kwargs)
            return
        for rank in range(state.num_processes):
            if rank == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    def warning_once(self, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        seen = self.__dict__.setdefault("_warned", set())
        if key not in seen:
            seen.add(key)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger `name` (level `log_level`, else $ACCELERATE_LOG_LEVEL or $ACCEL_LOG_LEVEL if set)."""
    level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL") or os.environ.get("ACCEL_LOG_LEVEL")
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
