"""Accelerate's tracker contract: the `GeneralTracker` base class every tracker subclasses, `on_main_process` for
its methods, and the check that a tracker's library is installed (a one-line ImportError naming it when not).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import wraps



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
