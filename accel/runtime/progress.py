"""Progress bars.

* `tqdm`: Accelerate's wrapper, a tqdm bar drawn on the local main process only (by default); needs tqdm.
* `progress` / `stages`: the bars of accel's own long operations (sharded checkpoint load and save,
  `save_state`/`load_state`). They are drawn on stderr by the main process only, only when stderr is a
  terminal (so log files and CI output stay clean), and never when `ACCEL_DISABLE_PROGRESS=1`,
  `HF_HUB_DISABLE_PROGRESS_BARS=1` (the Hugging Face switch) or `TQDM_DISABLE=1` is set. With tqdm installed they
  are tqdm bars; without it, one built-in `\\r`-updated line (tqdm is not a dependency of accel).
* the training status: with the throughput monitor on (accel/runtime/throughput.py), bars made by `tqdm` show its
  last report (`1.23k tok/s, MFU 41.2%, 0.153 s/step`) after whatever postfix the script sets.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sized

_OFF_SWITCHES = ("ACCEL_DISABLE_PROGRESS", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")


def tqdm(*args, main_process_only: bool = True, **kwargs):
    """Accelerate's `tqdm`: `tqdm.auto.tqdm(*args, **kwargs)`, disabled on all but the local main process when
    `main_process_only` (the default). Passing the old positional bool first is a ValueError, as in Accelerate."""
    try:
        from tqdm.auto import tqdm as _tqdm
    except ImportError:
        raise ImportError("accel.utils.tqdm needs the tqdm package: pip install tqdm") from None
    if args and isinstance(args[0], bool):
        raise ValueError("Passing `True` or `False` as the first argument to Accelerate's `tqdm` wrapper is "
                         "unsupported. Please use the `main_process_only` keyword argument instead.")
    from accel.runtime.state import PartialState

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return (_with_status(_tqdm) if _STATUS["shown"] else _tqdm)(*args, **kwargs, disable=disable)


_STATUS: dict = {"shown": False, "text": ""}  # the throughput monitor's last report, for the bars `tqdm` makes
_STATUS_CLASSES: dict = {}


def show_status(shown: bool) -> None:
    """Bars made by `tqdm` from now on carry the training status (the throughput monitor turns this on)."""
    _STATUS["shown"] = shown


def set_status(text: str) -> None:
    """The training status the bars show (drawn at their next refresh)."""
    _STATUS["text"] = text


def status() -> str:
    return _STATUS["text"]


def _with_status(cls: type) -> type:
    """`cls` (a tqdm class) whose postfix ends with the training status: set at each refresh, so the script's own
    `set_postfix` (every step, often) keeps it."""
    if cls not in _STATUS_CLASSES:
        def format_dict(self):
            values = super(bar, self).format_dict
            if _STATUS["text"]:
                values["postfix"] = ", ".join(part for part in (values.get("postfix"), _STATUS["text"]) if part)
            return values

        bar = type(cls.__name__, (cls,), {"format_dict": property(format_dict), "__module__": __name__})
        _STATUS_CLASSES[cls] = bar
    return _STATUS_CLASSES[cls]


def _is_main_process() -> bool:
    """Rank 0 of the job: from the process state when there is one, else from $RANK (set by the launcher).
    Never creates the state: loading a checkpoint must not start a process group."""
    from accel.runtime.state import PartialState

    state = PartialState._instance
    if state is not None and state.initialized:
        return state.is_main_process
    return os.environ.get("RANK", "0") == "0"


def progress_enabled() -> bool:
    """Whether accel's own bars are drawn here: main process, stderr a terminal, no off switch set."""
    if any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in _OFF_SWITCHES):
        return False
    try:
        tty = sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        tty = False
    return tty and _is_main_process()


class _LineBar:
    """The fallback without tqdm: `desc: 3/8 [#####.....] 2.1s` on one stderr line, rewritten with `\\r`."""

    width = 20

    def __init__(self, total: int | None, desc: str | None):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self.start = time.monotonic()
        self._draw()

    def _draw(self, end: str = "") -> None:
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            done = self.width * min(self.n, self.total) // self.total
            body = f"{self.n}/{self.total} [{'#' * done}{'.' * (self.width - done)}]"
        else:
            body = str(self.n)
        tail = f" {self.postfix}" if self.postfix else ""
        sys.stderr.write(f"\r{head}{body} {time.monotonic() - self.start:.1f}s{tail}\x1b[K{end}")
        sys.stderr.flush()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text
        self._draw()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def close(self) -> None:
        self._draw(end="\n")


def _bar(total: int | None, desc: str | None):
    """A tqdm bar on stderr when tqdm is installed, else the built-in line."""
    try:
        from tqdm import tqdm as _tqdm
    except ImportError:
        return _LineBar(total, desc)
    if _terminal_size() == (0, 0):  # a terminal of unknown size (a bare pty): tqdm would draw empty lines
        return _tqdm(total=total, desc=desc, file=sys.stderr, leave=True, ncols=80, nrows=24)
    return _tqdm(total=total, desc=desc, file=sys.stderr, leave=True, dynamic_ncols=True)


def _terminal_size() -> tuple[int, int] | None:
    try:
        columns, lines = os.get_terminal_size(sys.stderr.fileno())
        return columns, lines
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test's capture), or not a terminal
        return None


def progress(iterable: Iterable, total: int | None = None, desc: str | None = None) -> Iterator:
    """Yield from `iterable`, advancing a bar after each item when `progress_enabled()`; otherwise just yield.
    The bar is closed when the loop ends, breaks or raises."""
    if not progress_enabled():
        yield from iterable
        return
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    bar = _bar(total, desc)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()


@contextlib.contextmanager
def stages(desc: str, total: int):
    """For an operation made of a few unequal steps, one of them a single long call (DCP's read or write): a bar
    counting the steps done, naming the step running and the elapsed time. Yields `begin(name)`, to call before
    each step. Nothing is drawn when `progress_enabled()` is false."""
    bar = _bar(total, desc) if progress_enabled() else None
    started = [0]

    def begin(name: str) -> None:
        if bar is None:
            return
        if started[0]:
            bar.update(1)
        started[0] += 1
        bar.set_postfix_str(name)

    try:
        yield begin
        if bar is not None and started[0]:
            bar.update(1)
            bar.set_postfix_str("done")
    finally:
        if bar is not None:
            bar.close()
