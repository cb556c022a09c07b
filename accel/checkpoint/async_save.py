"""Asynchronous `save_state`: the loop waits only where the next step would overwrite what is still being copied.

`save_state(dir, async_save=True)` collects the state and agrees on it with the other ranks as a synchronous save
does, writes the (small) RNG files, copies at once what may change before the next optimizer step (the models'
buffers: batch norm's running statistics change in the forward; the registered objects', schedulers', loaders' and
scaler's tensors), and returns. The parameters and the optimizers' state, which only `optimizer.step()` changes, are
copied into staging memory in a background thread (`staging`) with torch's stager (pinned memory when the tensors are
on a GPU, copied on a stream of its own that waits for the work queued before the save; shared memory for the
`process` mode; plain CPU memory otherwise; the buffers are kept and reused by the next save), and
torch.distributed.checkpoint's `async_save` writes the copy in a background thread (`thread`) or a checkpoint process
of torch's (`process`), with a gloo process group of its own for its collectives, so training's collectives are never
mixed with them. When the write is complete everywhere, the main process fsyncs, writes the manifest (checksums
included) and renames the folder into place (rotation with `total_limit` after that): until then the previous
checkpoint stays the latest, also if the job is killed.

What waits for the staging copy (`wait_for_staging`): the prepared optimizer's `step()`, `train()` and `eval()`
(schedule-free optimizers swap the parameters there), and everything that waits for the whole save. So the first save
of a run, which allocates the staging memory, costs the loop only what the forward and backward of the next step do
not cover. Code that changes parameters or optimizer state in place by other means (`param.data.mul_`, a model's
`load_state_dict`, the raw optimizer's `step()`) right after an asynchronous save calls `wait_for_checkpoint()` first.
A failed staging is not raised by the step: like a failed write, it is raised at the next wait for the save.

One save is pending at a time: the next save, `load_state`, `wait_for_checkpoint()`, `end_training` and interpreter
exit wait for it. A failure in the background is raised at that wait as a one-line `CheckpointError`, the same on
every rank (the ranks agree, as in a synchronous save), and the temporary folder is removed.

A failure no wait raises (the script ended without waiting, or Accelerate's `destroy_process_group` waited for it) is
never lost: the temporary folder is removed, one line names the folder and the cause, and the process exits with
`EXIT_CODE` (74) instead of 0 (also instead of a script's own `sys.exit(N)`, which exit hooks cannot read; a script
that failed with an uncaught exception keeps its exit code 1), so `accel launch` exits non-zero, never with the
preemption code 75.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

MODES = ("no", "thread", "process")
# the exit code of a process whose asynchronous save failed with no wait left to raise it (sysexits.h's EX_IOERR: "an
# error occurred while doing I/O on some file"); docs/troubleshooting.md "Exit codes"
EXIT_CODE = 74
_UNRAISED: list[str] = []  # those failures, one line each: the process exits with EXIT_CODE
_UNCAUGHT: list[bool] = []  # sys.excepthook reported an uncaught exception: the process exits 1 as it would
_STAGING: list[Future] = []  # the staging copies in progress (of this process's save in flight)
_STAGING_WAITED = [0.0]  # seconds wait_for_staging waited, in all (benchmarks/bench_checkpoint.py reads it)


def wait_for_staging() -> None:
    """Wait until the staging copy of a save in flight is complete, before something overwrites the parameters or
    the optimizer state (the prepared optimizer's step). One list check when no copy is in progress. A failed
    staging is raised at the next wait for the save, not here."""
    if not _STAGING:
        return
    start = time.perf_counter()
    while _STAGING:
        try:
            future = _STAGING.pop()
        except IndexError:  # (its completion took it out meanwhile)
            break
        try:
            future.exception()  # waits; the write, which waits for it too, fails with its error
        except CancelledError:
            pass
    _STAGING_WAITED[0] += time.perf_counter() - start


def staging_waited() -> float:
    """Seconds this process's optimizer steps (and other waits) spent waiting for staging copies, in all."""
    return _STAGING_WAITED[0]


def _staging_started(future: Future) -> None:
    _STAGING.append(future)

    def done(_: Future) -> None:
        try:
            _STAGING.remove(future)
        except ValueError:  # (a wait took it out)
            pass

    future.add_done_callback(done)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A Parameter (or another tensor subclass but DTensor) as a plain tensor sharing its storage: the staged copy
    holds plain tensors, never a subclass rebuilt through its pickle arguments."""
    if type(tensor) is torch.Tensor or hasattr(tensor, "_local_tensor"):  # plain, or a DTensor (staged as one)
        return tensor
    return tensor.detach().as_subclass(torch.Tensor)


class BackgroundStager:
    """torch's `AsyncStager` protocol: `stage` returns a Future of the staged copy, made by torch's `DefaultStager`
    in a thread of its own (its buffers kept for the next save). For GPU tensors, the copy runs on a CUDA stream of
    its own, made to wait first for the work the training stream queued before the save (the last optimizer step),
    so the copy engine works beside the next step's kernels, never before the values it copies are final."""

    _synchronize_after_execute = False

    def __init__(self, pinned: bool, shared: bool, device: torch.device | None = None) -> None:
        self._options = (pinned, shared)
        self._stager = self._new_stager()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accel-staging")
        self._device = device
        self._stream: torch.cuda.Stream | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> Future:
        """Torch's stager is given the tensors only, as one flat dict; the other leaves (numbers, strings, objects of
        registered state) are copied here, at the save, by Python's deepcopy and the structure is rebuilt around the
        copies, so the staged copy holds the values at the save whatever the loop does next."""
        import copy

        from torch.utils._pytree import tree_flatten

        if self._device is not None and self._device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self._device)
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        leaves, spec = tree_flatten(state_dict)
        tensors = {str(i): _plain(leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
        others = {i: copy.deepcopy(leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
        return self._executor.submit(self._stage_leaves, tensors, others, spec, len(leaves))

    def _stage_leaves(self, tensors: dict, others: dict, spec, count: int) -> dict:
        from torch.utils._pytree import tree_unflatten

        staged = self._stage(tensors)
        return tree_unflatten([staged[str(i)] if str(i) in staged else others[i] for i in range(count)], spec)

    def _new_stager(self):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        pinned, shared = self._options
        return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=shared,
                                            use_async_staging=False, use_non_blocking_copy=False))

    def _stage(self, state_dict: dict) -> dict:
        inner = getattr(self._stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            # closed by someone else (its deepcopy table is emptied by close(), and every later copy then fails with
            # `KeyError: <class 'type'>`, seen on torch 2.11): a new one, without the previous save's buffers
            self._stager = self._new_stager()
        if self._stream is None:
            return self._stager.stage(state_dict)
        with torch.cuda.stream(self._stream):  # (blocking copies on this stream: the thread waits, training does not)
            return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        """Nothing: a caller's close after one save (torch 2.11 closed the stager between saves on an H200; torch 2.13
        leaves it to its owner) must not end a stager kept for the next save. accel releases it with `release`."""

    def release(self) -> None:
        self._executor.shutdown(wait=True)
        self._stager.close()


@dataclass
class _Pending:
    """One save in the background: this rank's write, then (main process) the publication."""

    target: Path
    tmp: Path  # the temporary folder it writes (removed after a failure)
    done: threading.Event
    error: str | None = None
    alone: bool = False  # one process's own save, with nothing to agree on with the others (main_save.py)


class AsyncCheckpointer:
    """The staging buffers, the checkpoint process group and the save in flight of one process."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None
        self._stagers: dict[str, BackgroundStager] = {}
        self._group: tuple[object, object] | None = None  # (default group it was made under, its gloo group)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    # -- starting -----------------------------------------------------------------------------------------
    def group(self):
        """The gloo group of the background collectives, made once per default group (every rank calls this)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        default = dist.distributed_c10d._get_default_group()
        if self._group is None or self._group[0] is not default:
            self._group = (default, dist.new_group(backend="gloo"))
        return self._group[1]

    def stager(self, mode: str, tensors: dict) -> BackgroundStager:
        """The stager for `mode`: pinned memory for GPU tensors, shared memory for the checkpoint process."""
        gpu = next((t.device for t in tensors.values() if getattr(t, "device", None) is not None
                    and t.device.type == "cuda"), None)
        key = f"{mode}-{gpu or 'cpu'}"
        if key not in self._stagers:
            self._stagers[key] = BackgroundStager(pinned=gpu is not None, shared=mode == "process", device=gpu)
        return self._stagers[key]

    def start(self, target: Path, tmp: Path, upload: Future, finish: Callable[[], None],
              describe: Callable[[BaseException], str], alone: bool = False, staging: Future | None = None) -> None:
        """Follow `upload` (this rank's background write) in a thread; then run `finish` (the main process
        publishes); a failure of either is kept, as one line, for the next wait. `staging`: the staging copy in
        progress, which the next optimizer step waits for (wait_for_staging)."""
        pending = _Pending(target, tmp, threading.Event(), alone=alone)
        if staging is not None:
            _staging_started(staging)

        def follow() -> None:
            try:
                upload.result()
                finish()
            except BaseException as exc:  # noqa: BLE001 (kept and raised, as one line, at the next wait)
                pending.error = " ".join(describe(exc).splitlines())
            finally:
                pending.done.set()

        threading.Thread(target=follow, name=f"accel-save-{target.name}", daemon=False).start()
        self._pending = pending
        _wait_at_exit(self)

    # -- waiting ------------------------------------------------------------------------------------------
    def wait(self) -> tuple[Path, Path, str | None, bool] | None:
        """Wait for this rank's save in flight, if any: (its folder, its temporary folder, this rank's failure as
        one line or None, whether it was this process's own). The ranks' agreement on the outcome is the caller's
        (training_state.wait_for_save)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        wait_for_staging()
        pending.done.wait()
        return pending.target, pending.tmp, pending.error, pending.alone

    def wait_quietly(self) -> None:
        """At exit or teardown (the other ranks may be gone): wait for this rank's part, raise nothing. A failure
        removes the temporary folder, is one line on stderr, and makes the process exit with EXIT_CODE."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        wait_for_staging()
        pending.done.wait()
        if pending.error:
            if pending.tmp != pending.target:  # (another process's part of the main's save names the folder itself)
                shutil.rmtree(pending.tmp, ignore_errors=True)
            _UNRAISED.append(pending.error)
            code = "" if _uncaught() else f"; exit code {EXIT_CODE}"
            sys.stderr.write(f"accel: error: {pending.error} (an asynchronous save_state, not waited for by the "
                             f"script){code}\n")
            sys.stderr.flush()

    def close(self) -> None:
        self.wait_quietly()
        for stager in self._stagers.values():
            stager.release()
        self._stagers.clear()
        self._group = None


def spawn_checkpoint_process_without_main() -> None:
    """torch's checkpoint process (`process` mode) is started with multiprocessing's spawn, which runs the parent's
    `__main__` again in the child (as `__mp_main__`): a training script without an `if __name__ == "__main__":`
    guard then trains again in that child, and the child, joining the job's process group, waits forever (the save
    and the job hang). The child needs nothing of `__main__` (torch's function, accel's writer, tensors): for the
    processes torch's checkpoint executor starts, spawn is told not to load it."""
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data
    if getattr(original, "_accel_without_main", False):
        return

    def get_preparation_data(name):
        data = original(name)
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.endswith(os.path.join("checkpoint", "_async_process_executor.py")):
                data.pop("init_main_from_path", None)
                data.pop("init_main_from_name", None)
                break
            frame = frame.f_back
        return data

    get_preparation_data._accel_without_main = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


_registered: list[bool] = []
_AT_EXIT: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()  # those with a save started (weak: its buffers)


def _wait_at_exit(checkpointer: AsyncCheckpointer) -> None:
    """Interpreter exit waits for a save in flight. It must wait before the thread pools shut down (torch's
    background write submits to them: after their shutdown it fails with 'cannot schedule new futures after
    interpreter shutdown'), so the wait is a threading exit hook registered after theirs (those run last first)."""
    import concurrent.futures.thread  # noqa: F401 (its exit hook is registered first, so it runs after ours)

    if not _registered:
        _registered.append(True)
        register = getattr(threading, "_register_atexit", None)
        if register is None:  # not CPython's threading: the atexit module runs after the pools stopped
            import atexit

            register = atexit.register
        register(_wait_for_all)
        previous = sys.excepthook

        def note_uncaught(exc_type, exc, tb) -> None:  # (a forked worker of accel launch calls it, sets no last_value)
            _UNCAUGHT.append(True)
            previous(exc_type, exc, tb)

        sys.excepthook = note_uncaught
    _AT_EXIT.add(checkpointer)


def _uncaught() -> bool:
    """The script ended by an uncaught exception (its exit code is 1 already)."""
    return bool(_UNCAUGHT) or getattr(sys, "last_value", None) is not None


def _wait_for_all() -> None:
    for checkpointer in list(_AT_EXIT):
        checkpointer.wait_quietly()
    if _UNRAISED and not _uncaught():  # (an uncaught exception already made it exit 1)
        _exit_after_shutdown(EXIT_CODE)


def _exit_after_shutdown(code: int) -> None:
    """Finish the interpreter's shutdown as it would (the threading exit hooks after this one, the non-daemon threads,
    the atexit functions: PartialState's teardown, loggers, child processes), then exit with `code`: an exit hook
    cannot change the exit status otherwise."""
    import atexit

    hooks = getattr(threading, "_threading_atexits", None)
    if isinstance(hooks, list) and _wait_for_all in hooks:  # CPython: we run among threading's exit hooks
        for hook in reversed(hooks[:hooks.index(_wait_for_all)]):
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 (as threading's shutdown would print it and go on)
                sys.stderr.write(f"accel: warning: an exit hook failed: {exc!r}\n")
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed or broken stream: nothing more to say)
            pass
    os._exit(code)
