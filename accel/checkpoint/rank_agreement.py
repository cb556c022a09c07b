"""How every rank takes part in a save or a load of training state.

Who joins (all ranks, or the main process saving `alone()`), one folder for all of them, and each step's outcome
agreed: a failure on any rank is the same one-line CheckpointError on every rank, never a rank left waiting.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from accel.checkpoint import layout, tree
from accel.checkpoint.layout import CheckpointError


_ALONE = contextvars.ContextVar("accel_checkpoint_alone", default=False)  # the main process saves on its own


def _distributed() -> bool:
    """Whether this save or load runs with the other processes (not inside `alone()`)."""
    return dist.is_available() and dist.is_initialized() and not _ALONE.get()


@contextlib.contextmanager
def alone():
    """The main process writes a checkpoint without the others (replicated state, accel/checkpoint/main_save.py):
    no collective runs, as on one process."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def _rank_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _broadcast_from_main(value: Any) -> Any:
    if _distributed():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _one_folder_everywhere(folder: Path, verb: str) -> None:
    """A checkpoint is one folder that every process writes its part of and reads back: processes naming different
    folders (e.g. each its own tempfile.mkdtemp()) would split it, so they are refused, the same way everywhere."""
    if not _distributed() or dist.get_world_size() == 1:
        return
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, str(folder))
    if len(set(names)) > 1:
        shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
        raise layout.CheckpointError(f"{verb}: the processes named different folders ({shown}); allowed: the same "
                                     "folder on every process (one folder they all see, e.g. on a shared disk)")


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def first_cause(exc: BaseException) -> str:
    """The original error inside DCP's `CheckpointException` (which nests every rank's traceback), as one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        return first_cause(inner[0] if isinstance(inner, tuple) else getattr(inner, "exception", inner))
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


# -- agreeing on failures ----------------------------------------------------------------------------------

def _first_failure(message: str | None, name_rank: bool = False) -> str | None:
    """Every rank's outcome of a step (None: it worked) -> the first failure, the same on every rank; with
    `name_rank`, '(rank r)' is added where the ranks did not all fail alike."""
    if not _distributed():
        return message
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, message)
    failures = [(rank, text) for rank, text in enumerate(everyone) if text]
    if not failures:
        return None
    rank, text = failures[0]
    alike = len(failures) == len(everyone) and len({t for _, t in failures}) == 1
    return text if alike or not name_rank else f"{text} (rank {rank})"


def _agreed(step, describe, clean_up=lambda: None, name_rank: bool = False):
    """Run `step` on this rank, then agree with the others whether it worked everywhere: a failure anywhere
    raises the same one-line CheckpointError on every rank (after `clean_up`), so no rank is left waiting in
    the next collective. User code's own errors (a hook's, a custom object's) keep their traceback as cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        result, error = step(), None
    except (Exception, CheckpointException) as exc:
        result, error = None, exc
    failure = _first_failure(None if error is None else " ".join(describe(error).splitlines()), name_rank)
    if failure:
        clean_up()
        one_line = isinstance(error, (OSError, CheckpointException, CheckpointError, tree.NotSerializable))
        raise CheckpointError(failure) from (None if one_line else error)
    return result


def _root_cause(exc: BaseException, rank: int) -> tuple[int, BaseException]:
    """The rank and original error inside DCP's `CheckpointException` (which nests every rank's traceback)."""
    failures = getattr(exc, "failures", None)
    if failures:
        failed_rank, inner = next(iter(failures.items()))
        return _root_cause(inner[0] if isinstance(inner, tuple) else getattr(inner, "exception", inner), failed_rank)
    return rank, exc


_SAVE_HINTS = {errno.ENOSPC: "free space on that disk or save elsewhere",
               errno.EDQUOT: "free space within your quota or save elsewhere",
               errno.EROFS: "save to a writable file system",
               errno.EACCES: "make the folder writable for this user or save elsewhere",
               errno.EPERM: "make the folder writable for this user or save elsewhere"}


def _save_failure(target: Path, tmp: Path, rank: int, world: int, exc: BaseException) -> str:
    """'<folder>: could not be saved[ on rank r]: <cause>[ (<file>)]; <what to do>; nothing was published ...'"""
    failed_rank, cause = _root_cause(exc, rank)
    if isinstance(cause, CheckpointError) and str(cause).startswith("save_state: "):  # already says it all
        return str(cause)
    if isinstance(cause, OSError) and cause.strerror:
        text = cause.strerror + _where(cause.filename, tmp, target)
    else:
        text = first_cause(cause)
    code = getattr(cause, "errno", None)
    hint = None if code is None else _SAVE_HINTS.get(code)
    if _ALONE.get() and dist.is_available() and dist.is_initialized():  # the main process saving alone
        world = dist.get_world_size()
    who = f" on rank {failed_rank}" if world > 1 else ""
    return (f"{target}: could not be saved{who}: {text}" + (f"; {hint}" if hint else "")
            + "; nothing was published (a checkpoint already there is unchanged)")


def _where(filename, tmp: Path, target: Path) -> str:
    """The file an OSError names, as the checkpoint's own path (the temporary folder's name means nothing)."""
    if not filename:
        return ""
    path = Path(str(filename))
    if path == tmp:
        return f" (creating a folder in {target.parent})"
    if tmp in path.parents:
        return f" (writing {path.relative_to(tmp).as_posix()})"
    return f" ({path})"


def _load_failure(folder: Path, exc: BaseException) -> str:
    cause = _root_cause(exc, 0)[1]
    return str(cause) if isinstance(cause, CheckpointError) else f"{folder}: could not be loaded: {first_cause(cause)}"
