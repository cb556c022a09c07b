"""Accelerate's `get_logger`: a standard `logging` logger whose records are emitted on the main process only
(`main_process_only=True`, the default), on every process (`main_process_only=False`), or on every process one
after another (`in_order=True`, which overrides `main_process_only`). Each message starts with `[RANK i] `."""

from __future__ import annotations

import functools
import logging
import os


class MultiProcessAdapter(logging.LoggerAdapter):
    """`logger.info(msg, main_process_only=False, in_order=True)`; the process state is read when logging."""

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        from accel.runtime.state import PartialState

        return not main_process_only or PartialState().is_main_process

    def process(self, msg, kwargs):
        """Prefix the rank, and report the caller's line (not this file's) as the record's origin."""
        from accel.runtime.state import PartialState

        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    def log(self, level, msg, *args, **kwargs):
        """Log on the processes asked for. `in_order=True` makes every rank log in turn, with a barrier after each
        turn, so every process must make the call."""
        from accel.runtime.state import PartialState

        if not PartialState._shared_state.get("_initialized"):
            raise RuntimeError("You must initialize the accelerate state by calling either `PartialState()` or "
                               "`Accelerator()` before using the logging utility.")
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if not in_order:
            if self._should_log(main_process_only):
                self.logger.log(level, msg, *args, **kwargs)
            return
        state = PartialState()
        for rank in range(state.num_processes):
            if rank == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
            state.wait_for_everyone()

    @functools.lru_cache(None)  # noqa: B019 (Accelerate's: once per adapter, which lives as long as its logger)
    def warning_once(self, *args, **kwargs):
        """`warning()`, emitted once per distinct arguments (per logger object, as in Accelerate)."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger `name`. A level (`log_level`, else $ACCELERATE_LOG_LEVEL, else accel's older $ACCEL_LOG_LEVEL) is
    set on it and on the root logger, as Accelerate does; with none, levels are left as they are."""
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL") or os.environ.get("ACCEL_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})


_LIBRARY_LOGGERS = ("accelerate", "accel")  # Accelerate's library logger, and accel's own modules'


def get_verbosity() -> int:
    """The effective level of the library's loggers (Accelerate 1.16's)."""
    return logging.getLogger("accelerate").getEffectiveLevel()


def set_verbosity(verbosity: int | str) -> None:
    """Set the level of the library's loggers (`accelerate` and `accel`): a logging level or a level name, any case.
    Loggers given a level of their own (`get_logger(..., log_level=)`, ACCELERATE_LOG_LEVEL) keep it."""
    level = verbosity.upper() if isinstance(verbosity, str) else verbosity
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def set_verbosity_debug() -> None:
    set_verbosity(logging.DEBUG)


def set_verbosity_info() -> None:
    set_verbosity(logging.INFO)


def set_verbosity_warning() -> None:
    set_verbosity(logging.WARNING)


def set_verbosity_error() -> None:
    set_verbosity(logging.ERROR)
