"""`save_state` / `load_state`: everything needed to continue a run, written atomically, loaded safely.

On-disk layout of one checkpoint folder::

    accel_checkpoint.json        manifest: format, version, world size, step, the JSON skeleton of every
                                 non-tensor value, the jsonl/csv trackers' run and how far its files were
                                 written (`trackers`, to resume that log), and the size of every file (written
                                 last)
    state/shard-*.safetensors    model, optimizer, scheduler, scaler, data-loader and registered objects'
                                 tensors, written by torch.distributed.checkpoint: every rank writes its
                                 own part, replicated tensors once, loadable on another process count
    rng/rank_<r>.safetensors     rank r's torch (and CUDA) RNG states
    rng/rank_<r>.json            rank r's Python and NumPy RNG states

No pickle anywhere: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import errno
import json
import math
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from accel.checkpoint import layout, main_save, tree
from accel.checkpoint.async_save import AsyncCheckpointer, spawn_checkpoint_process_without_main
from accel.checkpoint.layout import CheckpointError
from accel.core.safe_json import JSONFileError, parse_json
from accel.runtime.progress import stages


@dataclass
class TrainingObjects:
    """What a checkpoint holds, as the Accelerator knows it."""

    backend: Any
    models: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)  # AcceleratedOptimizer
    schedulers: list = field(default_factory=list)
    dataloaders: list = field(default_factory=list)
    custom: list = field(default_factory=list)
    scaler: Any = None
    step: int = 0
    # Accelerate's register_save_state_pre_hook / register_load_state_pre_hook: hook(models, weights, folder) and
    # hook(models, folder); what they remove from `weights` / `models` is not saved / loaded
    save_hooks: list = field(default_factory=list)
    load_hooks: list = field(default_factory=list)
    trackers: dict | None = None  # the main process's file-tracker run (accel.tracking.tracker_record), resumed
    # what the hooks see of a prepared model: the user's module (Accelerate hands them its `_models`: the module
    # before the DDP wrapper and torch.compile)
    hook_view: Callable[[Any], Any] | None = None
    # load_state restores plain loaders' place (epoch, shuffle) too: accel's exact resume (DataLoaderConfiguration's
    # exact_resume); False: as Accelerate, only stateful loaders
    exact_resume: bool = True
    throughput: Any = None  # the throughput monitor (accel.planning.throughput): its step count goes on after a load
    set_step: Callable[[int], None] | None = None  # where a load puts the saved `step` (the Accelerator's counter)

    def hook_models(self) -> list:
        return [self.hook_view(m) if self.hook_view is not None else m for m in self.models]


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


def _owner(objects: TrainingObjects, optimizer) -> int | None:
    """Index of the model whose parameters the optimizer updates; None for an optimizer of tensors no prepared model
    holds (Accelerate saves those too: their state is then kept by position, as torch's state_dict keeps it)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for i, model in enumerate(objects.models):
        if any(id(p) in params for p in model.parameters()):
            return i
    return None


def _owned_optimizer_state(objects: TrainingObjects, optimizer) -> dict:
    owner = _owner(objects, optimizer)
    if owner is None:  # tensors of no prepared model: torch's own (index-keyed) state dict
        state = {**optimizer.state_dict(), "accel_by_position": True}
    else:
        state = _optimizer_state(objects.backend, objects.models[owner], optimizer)
    return {**state, "accel_type": _optimizer_type(optimizer)}


def _optimizer_type(optimizer) -> str:
    """The optimizer class the user prepared: ZeRO-1's `ZeroRedundancyOptimizer` names the one it wraps, so a
    checkpoint saved on 2 processes under ZeRO-1 loads on 1 (plain AdamW) and the other way round."""
    cls = getattr(optimizer, "_optim_constructor", None) or type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_optimizer_fits(manifest_path: Path, i: int, saved: dict, optimizer) -> None:
    """An optimizer's saved state fits the prepared optimizer: the same type (when the checkpoint names it), as many
    parameter groups (their parameters may be split otherwise: pipeline stages), and no hyper-parameter the prepared
    one does not know (AdamW's state loaded into SGD would load, then fail at the first step with KeyError
    'momentum')."""
    where = f"{manifest_path}: optimizer {i}"
    saved_type, live_type = saved.get("accel_type"), _optimizer_type(optimizer)
    if saved_type is not None and saved_type != live_type:
        raise CheckpointError(f"{where} was saved from a {saved_type}, the prepared one is a {live_type}; "
                              "prepare the optimizer type the checkpoint was saved with")
    groups, live = saved.get("param_groups") or [], optimizer.param_groups
    if len(groups) != len(live):
        raise CheckpointError(f"{where} has {len(groups)} parameter group(s), the prepared one {len(live)}; prepare "
                              "the same parameter groups the checkpoint was saved with")
    for g, (group, mine) in enumerate(zip(groups, live, strict=True)):
        unknown = sorted(set(group) - set(mine) - {"params"})
        if unknown:
            raise CheckpointError(f"{where}, parameter group {g} has hyper-parameters {unknown} the prepared "
                                  f"{live_type.rsplit('.', 1)[-1]} does not know; prepare the optimizer type the "
                                  "checkpoint was saved with")


def _optimizer_state(backend, model, optimizer) -> dict:
    """The optimizer's checkpoint state dict. torch's DCP helpers first give an optimizer without state one (a
    zero-gradient step at lr 0: Adam's step count becomes 1), which would change the training that follows a
    save before the first step; a fresh optimizer is therefore left fresh, and its checkpoint says so
    (`accel_fresh`), so loading it leaves the optimizer fresh too, as Accelerate's state_dict round trip does."""
    fresh = isinstance(getattr(optimizer, "state", None), dict) and not optimizer.state
    state = backend.checkpoint_optimizer_state(model, optimizer)
    if fresh:
        optimizer.state.clear()
    return {**state, "accel_fresh": fresh}


def _collect(objects: TrainingObjects, model_states: list) -> dict:
    """The whole state tree (tensors and plain values) of everything in the checkpoint but the RNG; the models'
    part is `model_states` (after the pre-hooks)."""
    return {
        "models": model_states,
        "optimizers": [_owned_optimizer_state(objects, o.optimizer) for o in objects.optimizers],
        "schedulers": [s.state_dict() for s in objects.schedulers],
        "dataloaders": [loader_state(d) for d in objects.dataloaders if hasattr(d, "state_dict")],
        "custom": [obj.state_dict() for obj in objects.custom],
        "scaler": objects.scaler.state_dict() if objects.scaler is not None else None,
        "step": objects.step,
        "throughput": objects.throughput.state_dict() if objects.throughput is not None else None,
    }


def loader_state(loader) -> dict:
    """A prepared loader's whole state for a checkpoint: a stateful loader's `state_dict()` is torchdata's position
    alone (as Accelerate's), its epoch state is kept beside it (accel.data.stateful)."""
    return getattr(loader, "_accel_state_dict", loader.state_dict)()


def first_cause(exc: BaseException) -> str:
    """The original error inside DCP's `CheckpointException` (which nests every rank's traceback), as one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        return first_cause(inner[0] if isinstance(inner, tuple) else getattr(inner, "exception", inner))
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


FILE_BYTES = 256 * 2**20  # per file; the writer streams each file (no copy of it in memory): files of bounded size
# still let a load and merge-weights read several at once, and each is fsynced as soon as it is written


def _file_buckets(specs: dict[str, tuple[list[int], str]]) -> dict[str, int]:
    """Key -> file number (1-based): consecutive tensors in files of at most FILE_BYTES (one larger tensor
    gets a file of its own). Sizes are the whole tensors' (a rank writing a shard writes less)."""
    mapping, index, used = {}, 1, 0
    for key, (shape, dtype) in specs.items():
        size = math.prod(shape) * getattr(torch, dtype).itemsize
        if used and used + size > FILE_BYTES:
            index, used = index + 1, 0
        mapping[key] = index
        used += size
    return mapping


def _dedupe_aliases(tensors: dict[str, Any]) -> dict[str, str]:
    """Keys whose tensor is the same data as an earlier key's (tied weights) -> that earlier key. Sharded
    (DTensor) values are compared by their local shard: a tied parameter's two names hold the same shard."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type == "meta" or local.numel() == 0:
            continue
        ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), tuple(local.stride()),
                 local.dtype, tuple(t.shape))
        if ident in seen:
            aliases[key] = seen[ident]
        else:
            seen[ident] = key
    return aliases


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


# -- save -------------------------------------------------------------------------------------------------

def save_training_state(output_dir: str | os.PathLike, objects: TrainingObjects, mode: str = "no",
                        checkpointer: AsyncCheckpointer | None = None,
                        on_published: Callable[[], None] | None = None,
                        announce_failure: Callable[[str], str] = lambda message: message,
                        others_rng: Callable[[Path], list[int]] | None = None) -> Path:
    """Write a checkpoint of `objects` to `output_dir` atomically (all ranks call this); `on_published` runs on the
    main process once it is in place (rotation). With `mode` "thread" or "process" (and a `checkpointer`), return as
    soon as the tensors are staged and write them in the background (accel/checkpoint/async_save.py).

    The ranks agree after each step whether it worked everywhere. A failure on any rank (full disk, read-only
    or forbidden folder, a value that cannot be saved) removes the temporary folder and raises the same
    one-line CheckpointError on every rank, without a hang; a checkpoint already at `output_dir` is unchanged.

    Where every process holds the whole state (`backend.replicated_state`: DDP), the main process saves on its own
    and the others add their RNG states (main_save.py), so that save_state may be called on the main process
    alone, as Accelerate allows."""
    rank, world = _rank_world()
    if world > 1 and getattr(objects.backend, "replicated_state", False) and checkpointer is not None:
        kv = main_save.store()
        if kv is not None:
            return _save_from_main(Path(output_dir).absolute(), objects, mode, checkpointer, on_published, kv, rank)
    target = Path(output_dir).absolute()
    if world > 1 and (kv := main_save.store()) is not None:
        main_save.join_everyone(kv, main_save.announcement_key(objects.step), rank, world,
                                _layout_name(objects.backend), target)
    _one_folder_everywhere(target, "save_state")
    tmp = Path(_broadcast_from_main(str(layout.temporary_sibling(target))))

    def run(step):
        return _agreed(step, lambda exc: _save_failure(target, tmp, rank, world, exc),
                       lambda: _remove_temporary(tmp, rank, world))

    background = mode != "no" and checkpointer is not None
    if mode == "process" and world == 1:  # torch's checkpoint process needs a process group: one process writes
        mode = "thread"                   # in a thread instead
    group = checkpointer.group() if background and world > 1 else None  # type: ignore[union-attr]  # every rank
    with stages("save_state", 3) as begin:  # DCP writes in one call: the bar names the step, with elapsed time
        begin("collecting state")
        run(lambda: _make_temporary(target, tmp) if rank == 0 else None)
        weights, owners = run(lambda: _saved_weights(objects, tmp))
        tensors, meta = run(lambda: _split_state(objects, weights, owners))
        if world > 1 and objects.backend.holds_part_of_model:  # pipeline stages hold different tensors: merge them
            meta = run(lambda: _merged_over_stages(meta, world))
        publish = _publisher(tmp, target, meta, world, objects, on_published, others_rng) if rank == 0 else (
            lambda: None)
        if background:
            begin("staging tensors")
            run(lambda: _start_background_write(cast(AsyncCheckpointer, checkpointer), mode, group, tensors, meta,
                                                publish, tmp, target, rank, world, announce_failure, objects.models))
            return target
        begin("writing tensors")
        run(lambda: _write_tensors_and_rng(tensors, meta, tmp, rank, world))
        begin("publishing")
        run(publish)
    return target


def _layout_name(backend) -> str:
    par = getattr(backend, "parallelism", None)
    if par is None:
        return type(backend).__name__
    parts = [f"ZeRO-{par.zero_stage}"] if par.zero_stage else []
    parts += [f"{name} {size}" for name, size in (("tp", par.tp_size), ("pp", par.pp_size),
                                                  ("ep", getattr(par, "ep_size", 1))) if size > 1]
    return " x ".join(parts) or type(backend).__name__


def _save_from_main(target: Path, objects: TrainingObjects, mode: str, checkpointer: AsyncCheckpointer,
                    on_published: Callable[[], None] | None, kv, rank: int) -> Path:
    """The main process writes the checkpoint without a collective, with the RNG states the others hand over, and
    announces the outcome; another process joins, hands over its RNG states and follows (main_save.py)."""
    key = main_save.announcement_key(objects.step)
    if rank != 0:
        kv.set(f"{key}/joined/{rank}", str(target))
        if objects.save_hooks:  # run here too, as Accelerate runs them on every process that saves; the weights
            weights = [objects.backend.checkpoint_model_state(m) for m in objects.models]  # are the main's
            for hook in objects.save_hooks:
                hook(objects.hook_models(), weights, str(target))
        snapshot = rng_snapshot()
        kv.set(f"{key}/rng/{rank}", main_save.encode_rng(snapshot))
        checkpointer.start(target, target, main_save.done_future(),
                           lambda: main_save.follow_main_save(target, rank, snapshot, write_rng, kv, key,
                                                              main_save.timeout()),
                           lambda exc: str(exc) if isinstance(exc, CheckpointError) else
                           f"save_state: rank {rank} could not add its RNG states to {target} ({first_cause(exc)})",
                           alone=True)
        if mode == "no":  # a synchronous save returns once the checkpoint is complete, as the collective one does
            wait_for_save(checkpointer)
        return target

    started, world = time.monotonic(), dist.get_world_size()
    included: list[int] = []

    def others_rng(folder: Path) -> list[int]:
        for other, snapshot in main_save.collect_rng(kv, key, world, started, main_save.timeout(),
                                                            target).items():
            write_rng(folder, other, snapshot)
            included.append(other)
        return [0, *included]

    def published() -> None:
        if on_published is not None:
            on_published()
        main_save.announce(kv, key, " ".join(["ok", *map(str, included)]))

    def failed(message: str) -> str:
        main_save.announce(kv, key, f"failed: {message}")
        return message

    with alone():
        try:
            return save_training_state(target, objects, mode, checkpointer, published, announce_failure=failed,
                                       others_rng=others_rng)
        except CheckpointError as exc:
            failed(str(exc))
            raise
        except BaseException as exc:
            failed(f"save_state on the main process failed ({first_cause(exc)})")
            raise


def _start_background_write(checkpointer: AsyncCheckpointer, mode: str, group, tensors: dict, meta: dict,
                            publish: Callable[[], None], tmp: Path, target: Path, rank: int, world: int,
                            announce_failure: Callable[[str], str] = lambda message: message,
                            models: list | None = None) -> None:
    """Write the RNG states now, copy what may change before the next optimizer step, and hand the tensors to
    torch's async_save, which stages the rest in the background (the next step waits for it: async_save.py); the
    checkpointer follows the write and then publishes (main process)."""
    from torch.distributed.checkpoint import async_save
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    _save_rng(tmp / "rng", rank)
    tensors = _copied_if_changed_before_the_step(tensors, models or [])
    if world == 1:  # the background write warns, outside _quiet_single_process, that it assumes one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    if mode == "process":  # its checkpoint process must not run an unguarded script again (it hung)
        spawn_checkpoint_process_without_main()
    with _quiet_single_process():
        upload = async_save(tensors, storage_writer=_storage_writer(meta, tmp), process_group=group,
                            async_checkpointer_type=kind, async_stager=checkpointer.stager(mode, tensors),
                            no_dist=world == 1)
    staging = None
    if not isinstance(upload, Future):  # an AsyncSaveResponse: the staging copy goes on in the background
        staging, upload = upload.staging_completion, upload.upload_completion
    told = dist.get_world_size() if _ALONE.get() else world  # the message names the rank (the thread has no context)
    checkpointer.start(target, tmp, upload, publish,
                       lambda exc: announce_failure(_save_failure(target, tmp, rank, told, exc)), alone=_ALONE.get(),
                       staging=staging)


def _copied_if_changed_before_the_step(tensors: dict, models: list) -> dict:
    """`tensors` with those that may change before the next optimizer step copied now (the rest is staged in the
    background, and the step waits for that copy): the models' buffers (batch norm's running statistics change in
    the forward; DDP broadcasts them there) and every tensor outside the models' and optimizers' state (registered
    objects, schedulers, loaders, scaler). The parameters and the optimizer state change only in the step."""
    buffers = set()
    for model in models:
        for buffer in model.buffers() if isinstance(model, torch.nn.Module) else ():
            local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
            if local.device.type != "meta" and local.numel():
                buffers.add(local.untyped_storage().data_ptr())

    def changes(key: str, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if not key.startswith(("/models/", "/optimizers/")):
            return True
        local = t.to_local() if hasattr(t, "to_local") else t
        return (key.startswith("/models/") and local.device.type != "meta" and local.numel() > 0
                and local.untyped_storage().data_ptr() in buffers)

    return {k: (t.detach().clone() if changes(k, t) else t) for k, t in tensors.items()}


def wait_for_save(checkpointer: AsyncCheckpointer) -> Path | None:
    """Wait for the asynchronous save in flight (all ranks call this); the ranks agree on its outcome, and a
    failure anywhere is the same one-line CheckpointError on every rank, its temporary folder removed. Returns the
    folder it published (None when none was pending)."""
    if not checkpointer.pending:
        return None
    rank, world = _rank_world()
    outcome = checkpointer.wait()
    target, tmp, error, alone_ = outcome if outcome is not None else (None, None, None, False)
    if alone_:  # the main process's own save (or another process's RNG states for it): nothing to agree on
        if error:
            if tmp is not None and rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(error)
        return target
    failure = _first_failure(error)  # the message names the rank that failed (_save_failure)
    if failure:
        if tmp is not None:
            _remove_temporary(tmp, rank, world)
        raise CheckpointError(failure)
    return target


def _make_temporary(target: Path, tmp: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    layout.remove_stale_temporaries(target.parent)
    (tmp / "state").mkdir(parents=True)
    (tmp / "rng").mkdir()


def _remove_temporary(tmp: Path, rank: int, world: int) -> None:
    """After a failed save: rank 0 removes the temporary folder, then every other rank what is left of it where
    it sees another disk (a node-local path); the ranks wait for each other so none returns before."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if world > 1:
        _barrier()
        if rank != 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _split_state(objects: TrainingObjects, weights: list, owners: list) -> tuple[dict, dict]:
    """This rank's tensors to write (tied ones once, contiguous) and the manifest's skeleton, aliases, layouts."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = tree.split(_collect(objects, weights), "", tensors)
    aliases = _dedupe_aliases(tensors)
    for key in aliases:
        del tensors[key]
    tensors = {k: (t.contiguous() if type(t) is torch.Tensor else t) for k, t in tensors.items()}
    layouts = [objects.backend.checkpoint_layouts(m) if m is not None else {} for m in owners]
    return tensors, {"skeleton": skeleton, "aliases": aliases, "layouts": layouts}


def _merged_over_stages(meta: dict, world: int) -> dict:
    everyone: list = [None] * world
    dist.all_gather_object(everyone, meta)
    layouts = [{k: v for m in everyone for k, v in m["layouts"][i].items()} for i in range(len(meta["layouts"]))]
    return {"skeleton": tree.merge([m["skeleton"] for m in everyone]),
            "aliases": {k: v for m in everyone for k, v in m["aliases"].items()}, "layouts": layouts}


def _storage_writer(meta: dict, tmp: Path):
    """The DCP writer of a checkpoint's state/ files (the synchronous and the asynchronous save use the same)."""
    from accel.checkpoint.streaming_writer import StreamingSafetensorsWriter

    files = _file_buckets(tree.tensor_specs(meta["skeleton"]))  # the checksums reach write_manifest in a file
    return StreamingSafetensorsWriter(str(tmp / "state"), fqn_to_index_mapping=files, save_distributed=True,
                                      checksums_file=str(tmp / layout.INLINE_CHECKSUMS))


def _write_tensors_and_rng(tensors: dict, meta: dict, tmp: Path, rank: int, world: int) -> None:
    from torch.distributed.checkpoint import save as dcp_save

    with _quiet_single_process():
        dcp_save(tensors, storage_writer=_storage_writer(meta, tmp), no_dist=world == 1)
    _save_rng(tmp / "rng", rank)


def _publisher(tmp: Path, target: Path, meta: dict, world: int, objects: TrainingObjects,
               on_published: Callable[[], None] | None,
               others_rng: Callable[[Path], list[int]] | None = None) -> Callable[[], None]:
    """What the main process does once every rank's files are written: fsync, the manifest (last), the rename
    into place, then `on_published`. The values it needs are taken now (a background save publishes later)."""
    if _ALONE.get():  # the main process saved alone: the others' RNG states come later, if they called save_state
        world = dist.get_world_size()
    content = {"world_size": world, "step": objects.step, "aliases": meta["aliases"], "layouts": meta["layouts"],
               "skeleton": meta["skeleton"], **({} if objects.trackers is None else {"trackers": objects.trackers}),
               }

    def publish() -> None:
        if others_rng is not None:  # the main process saved alone: the RNG states the others handed over
            content["rng_ranks"] = others_rng(tmp / "rng")
        layout.fsync_tree(tmp)
        layout.write_manifest(tmp, content)
        layout.publish(tmp, target)
        if on_published is not None:
            on_published()

    return publish


def _saved_weights(objects: TrainingObjects, folder: Path) -> tuple[list, list]:
    """The model state dicts to write, after the save pre-hooks ran on them (Accelerate's
    `hook(models, weights, output_dir)`; `folder` is the checkpoint being built, published with it, so files a
    hook writes there are part of the checkpoint), and the model each belongs to (by identity, else position)."""
    models = objects.models
    weights = [objects.backend.checkpoint_model_state(m) for m in models]
    original = list(weights)
    index = {id(w): i for i, w in enumerate(weights)}
    for hook in objects.save_hooks:
        hook(objects.hook_models(), weights, str(folder))
    owners = [index.get(id(w), i) for i, w in enumerate(weights)]
    if objects.save_hooks and _distributed() and dist.get_world_size() > 1:
        # the main process's hooks decide which weights the checkpoint holds (Accelerate writes its list): a hook
        # that saves a model its own way and pops its weights on the main process only must not split the ranks
        chosen = _broadcast_from_main(owners)
        mine = dict(zip(owners, weights, strict=True))
        weights = [mine.get(i, original[i] if i < len(original) else None) for i in chosen]
        owners = chosen
    return weights, [models[i] if i < len(models) else None for i in owners]


# -- load -------------------------------------------------------------------------------------------------

STAGING_BYTES = 2**30  # a rank's model + optimizer tensors up to this size are read into fresh tensors first
# with at least this many CPUs, the checksums are verified while the tensors are read into fresh tensors; with fewer,
# before (both are memory-bound: on the 2-core benchmark machine, verifying 1.2 GB while reading it took 0.80 s,
# verifying then reading 0.58 s, reading alone 0.25 s)
OVERLAP_MIN_CPUS = 4


@dataclass
class _LoadPlan:
    """Everything read and checked before any live object changes."""

    manifest: dict
    specs: dict
    aliases: dict
    rng: dict | None
    models: list
    opened: Any = None  # the load's layout.checked_files(): every read finds the file first checked
    targets: dict = field(default_factory=dict)
    in_place: bool = False


def load_training_state(input_dir: str | os.PathLike, objects: TrainingObjects) -> dict:
    """Restore `objects` from a checkpoint; RNG states last. Returns the manifest.

    Nothing live changes until everything is checked: the files (regular files inside the folder only), the
    manifest (dtypes, shapes against the files' safetensors headers, every JSON value), this rank's RNG
    states, the match with the prepared objects. The tensors are then read into fresh tensors (in place, to
    spare a second copy, when this rank's share is over STAGING_BYTES) and handed to the objects. A failure
    raises a one-line CheckpointError naming the file, the same on every rank, objects as they were.

    The files' checksums (this rank's share of the files) are verified in threads from the start, while the other
    checks run and (with OVERLAP_MIN_CPUS) the tensors are read into fresh tensors; the load waits for them before
    anything live changes: before the load pre-hooks run, before the tensors are read in place, before they are handed
    over. A damaged file is the error a load reports first, also when a later check failed meanwhile."""
    folder = Path(input_dir).absolute()
    rank, world = _rank_world()
    _one_folder_everywhere(folder, "load_state")
    verification: list[layout.FileVerification] = []  # (made by _checked_files once the manifest is read)
    opened = layout.checked_files()  # each file is read through a checked descriptor, the same file every time

    def run(step):
        try:
            return _agreed(lambda: _damage_first(step, verification), lambda exc: _load_failure(folder, exc),
                           name_rank=True)
        except CheckpointError:  # (the same on every rank) a damaged file in any rank's share is the error
            if verification:
                _agreed(lambda: _verified(verification), lambda exc: _load_failure(folder, exc), name_rank=True)
            raise

    try:
        with stages("load_state", 3) as begin:  # DCP reads in one call: the bar names the step, with elapsed time
            begin("checking files")
            plan = run(lambda: _checked_files(folder, objects, rank, verification, opened))
            run(lambda: _check_against_objects(folder, plan, objects))  # collectives inside (ZeRO consolidates)
            begin("reading tensors")
            if plan.in_place or (os.cpu_count() or 1) < OVERLAP_MIN_CPUS:  # in place: the live tensors are
                run(lambda: _verified(verification))  # overwritten only with verified bytes
            run(lambda: _read_tensors(folder, plan, world, verification))  # (DCP's read is collective: every rank
            # knows the verification's outcome before it)
            begin("restoring objects")
            run(lambda: _restore(folder, plan, objects))
    finally:
        for pending in verification:  # (another rank's failure ended the load: no hashing goes on behind it)
            pending.stop()
    _apply_rng(plan.rng)
    return plan.manifest


def _verified(verification: list) -> None:
    for pending in verification:
        pending.result()


def _damage_first(step, verification: list):
    """Run a load step; should it fail while the files' checksums are being verified, a damaged file is the error."""
    try:
        return step()
    except Exception:
        for pending in verification:
            pending.result()
        raise


def _checked_files(folder: Path, objects: TrainingObjects, rank: int,
                   verification: list[layout.FileVerification], opened: Any = None) -> _LoadPlan:
    """The manifest and every file it names checked, this rank's RNG states read; then the load pre-hooks
    (Accelerate's `hook(models, input_dir)`: they take out the models they load themselves), once the files'
    checksums, verified in threads from here on (`verification`), are found right. Every file is read through a
    descriptor checked to be a regular file, the one `opened` recorded at its first open (a pipe or device that
    took a file's name after a check is one CheckpointError, never a hang)."""
    opened = opened or layout.checked_files()
    share = (rank, _rank_world()[1])
    manifest = layout.read_manifest(folder, share=share, verify_files=False, opened=opened)
    verification.append(layout.FileVerification(folder, manifest, share, opened))
    specs, aliases = _checked_manifest(folder / layout.MANIFEST, manifest)
    _check_state_files(folder, manifest, specs, aliases, opened)
    rng = _read_rng(folder, rank, manifest, opened)
    if objects.load_hooks:  # a hook may load a model itself from the folder: its files are verified first
        verification[0].result()
    views = objects.hook_models()
    shown = list(views)
    for hook in objects.load_hooks:
        hook(shown, str(folder))
    # the prepared models whose module the hooks left in the list (in the list's order): those are loaded here
    models = [objects.models[i] for view in shown for i, v in enumerate(views) if v is view]
    return _LoadPlan(manifest, specs, aliases, rng, models, opened)


def _check_against_objects(folder: Path, plan: _LoadPlan, objects: TrainingObjects) -> None:
    """The checkpoint holds what was prepared (counts, layouts, each model's names and shapes); the tensors
    to read into are made here (fresh, or the live ones)."""
    skeleton, models = plan.manifest["skeleton"], plan.models
    counts = {k: len(skeleton[k]) for k in _PARTS}
    have = {"models": len(models), "optimizers": len(objects.optimizers),
            "schedulers": len(objects.schedulers), "custom": len(objects.custom),
            "dataloaders": sum(hasattr(d, "state_dict") for d in objects.dataloaders)}
    for kind, count in counts.items():
        if have[kind] != count:
            hooks = " (after the pre-hooks)" if kind == "models" and (objects.save_hooks or objects.load_hooks) else ""
            raise CheckpointError(f"{folder / layout.MANIFEST}: holds {count} {kind} but {have[kind]} were prepared/"
                                  f"registered{hooks}; prepare the same objects, in the same order, before load_state")
    for i, (saved, opt) in enumerate(zip(skeleton["optimizers"], objects.optimizers, strict=True)):
        _check_optimizer_fits(folder / layout.MANIFEST, i, saved, opt.optimizer)
    _check_layouts(folder, plan.manifest.get("layouts") or [{} for _ in models], objects.backend, models)
    live: dict[str, torch.Tensor] = {}
    tree.split(_collect(objects, [objects.backend.checkpoint_model_state(m) for m in models]), "", live)
    loads = _held_keys(objects.backend)
    _check_model_tensors(folder / layout.MANIFEST, plan, live, loads)
    plan.targets, plan.in_place = _targets(plan, live, loads)


def _check_model_tensors(manifest_path: Path, plan: _LoadPlan, live: dict, loads) -> None:
    """Each model's tensor names and shapes are the checkpoint's, so handing them over cannot fail half-way."""
    for i in range(len(plan.models)):
        prefix = f"/models/{i}/"
        mine = {k: t for k, t in live.items() if k.startswith(prefix) and isinstance(t, torch.Tensor)}
        saved = {k for k in list(plan.specs) + list(plan.aliases) if k.startswith(prefix) and loads(k)}
        missing, extra = sorted(set(mine) - saved), sorted(saved - set(mine))
        if missing or extra:
            names = [f"lacks {k[len(prefix):]}" for k in missing[:3]] + [f"has {k[len(prefix):]}, unknown to the model"
                                                                       for k in extra[:3]]
            raise CheckpointError(f"{manifest_path}: model {i} does not match the prepared model: "
                                  f"{', '.join(names)}; load it into the model it was saved from")
        for key, tensor in mine.items():
            if key in plan.specs and list(plan.specs[key][0]) != list(tensor.shape):
                raise CheckpointError(f"{manifest_path}: model {i}: {key[len(prefix):]} has shape {plan.specs[key][0]},"
                                      f" the prepared model {list(tensor.shape)}; load it into the model it was saved "
                                      "from")


def _targets(plan: _LoadPlan, live: dict, loads) -> tuple[dict, bool]:
    """The tensors DCP reads into: fresh ones, where the live one has another shape or dtype, or the tensor is
    not live; for the live model/optimizer tensors, fresh copies of the same layout (a DTensor stays sharded
    alike) when they fit STAGING_BYTES and memory, else the live tensors themselves (no second copy)."""
    matching, targets = {}, {}
    for key, (shape, dtype) in plan.specs.items():
        if key in plan.aliases:
            continue
        target = live.get(key)
        if target is None and not loads(key):
            continue  # another pipeline stage's tensor
        if isinstance(target, torch.Tensor) and list(target.shape) == shape and _dtype_name(target) == dtype:
            matching[key] = target.detach()
        else:
            targets[key] = tree.empty_like_spec(shape, dtype)
    in_place = sum(t.numel() * t.element_size() for t in matching.values()) > STAGING_BYTES
    if not in_place:
        try:
            matching = {key: torch.empty_like(t) for key, t in matching.items()}
        except torch.OutOfMemoryError:
            in_place = True
    return {**targets, **matching}, in_place


def _read_tensors(folder: Path, plan: _LoadPlan, world: int, verification: list) -> None:
    """Read the tensors into `plan.targets` (into fresh tensors while the checksums are verified, or once they are
    found right), then wait for the verification."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        reader = state_reader(folder, plan.manifest, plan.opened or layout.checked_files())
        with _quiet_single_process():
            dcp_load(plan.targets, storage_reader=reader, no_dist=world == 1)
    except (Exception, CheckpointException) as exc:  # name the folder; DCP's message says which key or file
        partly = "; the models' and optimizers' tensors may be partly overwritten: load again" if plan.in_place else ""
        cause = _root_cause(exc, 0)[1]
        if isinstance(cause, CheckpointError):  # the reader's own refusal (a file replaced): it names the file
            raise CheckpointError(f"{cause}{partly}") from None
        raise CheckpointError(f"{folder / 'state'}: could not be loaded: {first_cause(exc)}{partly}") from None
    for pending in verification:  # before the objects get what was read
        pending.result()
    for key, original in plan.aliases.items():
        plan.targets[key] = plan.targets[original]


def state_reader(folder: Path, manifest: dict, opened):
    """DCP's reader of the checkpoint's state/ files, reading only the files the manifest lists, each through a
    checked descriptor (`opened`: the load's record): accel.checkpoint.dcp_reader.CheckedSafetensorsReader. Their
    headers are read here, so a file refused is this one-line CheckpointError, not DCP's wrapped one."""
    from accel.checkpoint.dcp_reader import CheckedSafetensorsReader

    names = sorted(rel.removeprefix("state/") for rel in manifest["files"] if rel.startswith("state/"))
    reader = CheckedSafetensorsReader(str(folder / "state"), opened, names)
    reader.read_metadata()
    return reader


def _restore(folder: Path, plan: _LoadPlan, objects: TrainingObjects) -> None:
    _hand_over(tree.join(plan.manifest["skeleton"], plan.targets), plan.models, objects, str(folder / layout.MANIFEST))


def _hand_over(state: dict, models: list, objects: TrainingObjects, source: str,
               in_flight: tuple = ()) -> None:
    """Hand a state tree (read from a checkpoint, or received from a live replica) to the objects: the small ones
    first, their previous state kept to undo them should a later one refuse its state, then models and optimizers
    (whose names and shapes were checked), then the step counter. Loaders in `in_flight` are being iterated: their
    place is moved otherwise (a heal's fast-forward)."""
    small = [(f"registered object {i} ({type(o).__name__})", o, sd) for i, (o, sd) in
             enumerate(zip(objects.custom, state["custom"], strict=False))]
    small += [(f"data loader {i}", d, sd) for i, (d, sd) in
              enumerate(zip([d for d in objects.dataloaders if hasattr(d, "state_dict")], state["dataloaders"],
                             strict=False))
              # Accelerate restores only stateful loaders (torchdata's position); accel's exact resume all of them
              if (objects.exact_resume or getattr(d, "use_stateful_dataloader", False))
              and not any(d is loader for loader in in_flight)]
    if objects.scaler is not None and state["scaler"] is not None:
        small.append(("the gradient scaler", objects.scaler, state["scaler"]))
    small += [(f"scheduler {i} ({type(s).__name__})", s, sd) for i, (s, sd) in
              enumerate(zip(objects.schedulers, state["schedulers"], strict=False))]
    if objects.throughput is not None and state.get("throughput") is not None:  # (older checkpoints have none)
        small.append(("the throughput monitor", objects.throughput, state["throughput"]))
    backend, undo, what, partly = objects.backend, [], "", ""
    try:
        for what, obj, sd in small:  # noqa: B007 (`what` names the object in the error below)
            before = _cpu_copy(loader_state(obj))
            obj.load_state_dict(sd)
            undo.append((obj, before))
        partly = "; the models/optimizers before it hold the checkpoint's values: load again"
        for i, (model, sd) in enumerate(zip(models, state["models"], strict=False)):
            what = f"model {i}"
            backend.load_checkpoint_model_state(model, sd)
        for i, (opt, sd) in enumerate(zip(objects.optimizers, state["optimizers"], strict=False)):
            what = f"optimizer {i}"
            sd = dict(sd)
            sd.pop("accel_type", None)
            fresh = sd.pop("accel_fresh", False)
            owner = None if sd.pop("accel_by_position", False) else _owner(objects, opt.optimizer)
            if owner is None:
                opt.optimizer.load_state_dict(sd)
            else:
                backend.load_checkpoint_optimizer_state(objects.models[owner], opt.optimizer, sd)
            if fresh:  # saved before its first step: no state, as it was
                opt.optimizer.state.clear()
    except Exception as exc:
        for obj, before in reversed(undo):
            with contextlib.suppress(Exception):
                obj.load_state_dict(before)
        raise CheckpointError(f"{source}: {what} refused its saved state ({first_cause(exc)}){partly}") from None
    if objects.set_step is not None:
        objects.set_step(int(state.get("step") or 0))


def _cpu_copy(value: Any) -> Any:
    """A copy of a state dict to undo a load with, its tensors on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_cpu_copy(v) for v in value)
    return copy.deepcopy(value)


# -- checking a checkpoint before loading it ----------------------------------------------------------------

_PARTS = ("models", "optimizers", "schedulers", "dataloaders", "custom")
# torch dtype name -> safetensors dtype code: the dtypes a checkpoint may hold
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
           "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
           "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64"}
_ITEM_BYTES = {code: getattr(torch, name).itemsize for name, code in _DTYPES.items()}
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _checked_manifest(path: Path, manifest: dict) -> tuple[dict, dict]:
    """The tensor specs (dtypes from the allowed set, shapes lists of sizes) and aliases of a manifest whose every
    other field has the type save_state writes; every non-tensor value decodes."""
    skeleton = manifest.get("skeleton")
    if not isinstance(skeleton, dict) or not all(isinstance(skeleton.get(k), list) for k in _PARTS):
        raise CheckpointError(f"{path}: damaged (its skeleton needs lists {', '.join(_PARTS)})")
    fields: tuple[tuple[str, Any, str, Any], ...]  # name, type(s), what is allowed, default
    fields = (("world_size", int, "an integer >= 1", None), ("step", int, "an integer", 0),
              ("aliases", dict, "a mapping", {}), ("layouts", (list, type(None)), "a list", None),
              ("trackers", (dict, type(None)), "a mapping", None))
    for name, kind, allowed, default in fields:  # the defaults: what checkpoints of older accels lack
        value = manifest.setdefault(name, default)
        if not isinstance(value, kind) or isinstance(value, bool) or (name == "world_size" and cast(int, value) < 1):
            raise CheckpointError(f"{path}: damaged ({name} is {value!r}; allowed: {allowed})")
    try:
        specs = tree.tensor_specs(skeleton)
        tree.join(skeleton, {}, ("skeleton",))  # every JSON value decodes (tuples, numpy arrays, non-finite floats)
    except tree.BadTree as exc:
        raise CheckpointError(f"{path}: damaged ({exc})") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: damaged ({first_cause(exc)})") from None
    for key, (shape, dtype) in specs.items():
        if not isinstance(key, str) or not isinstance(dtype, str) or dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {key}: dtype {dtype!r}; allowed: {', '.join(_DTYPES)}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise CheckpointError(f"{path}: tensor {key}: shape {shape!r}; allowed: a list of sizes >= 0")
    aliases = manifest["aliases"]
    for key, original in aliases.items():
        if key not in specs or original not in specs or original in aliases:
            raise CheckpointError(f"{path}: damaged (alias {key!r} -> {original!r} names no saved tensor)")
    return specs, aliases


def _check_state_files(folder: Path, manifest: dict, specs: dict, aliases: dict, opened: Any = None) -> None:
    """state/ holds only the files the manifest lists (DCP reads every file there), and their safetensors
    headers hold every tensor of the manifest with its dtype and whole shape, inside the files' sizes (each read
    through a checked descriptor: `opened`, the load's record)."""
    state, path = folder / "state", folder / layout.MANIFEST
    listed = {rel: size for rel, size in manifest["files"].items() if rel.startswith("state/")}
    if not listed and not specs:
        return
    if not state.is_dir():
        raise CheckpointError(f"{state}: missing or not a folder; {folder} is not a complete accel checkpoint")
    for entry in sorted(os.listdir(state)):
        if f"state/{entry}" not in listed:
            raise CheckpointError(f"{state / entry}: not listed in {path}; a checkpoint's state/ holds only the "
                                  "files its manifest lists")
    chunks: dict[str, list] = {}
    opened = opened or layout.checked_files()
    for rel, size in listed.items():
        _read_header(folder / rel, size, chunks, opened)
    for key, (shape, dtype) in specs.items():
        if key not in aliases:
            _check_chunks(path, state, key, shape, dtype, chunks.get(key, []))


def _read_header(file: Path, size: int, chunks: dict, opened: Any = None) -> None:
    """Add the tensors a safetensors file's header lists to `chunks` (key -> [(dtype code, offsets, shape)]),
    after checking each lies inside the file with the bytes its dtype and shape need. The file is read through a
    descriptor checked to be a regular file of `size` bytes (the manifest's), never beyond it."""
    with (opened or layout.checked_files()).open(file, size=size) as checked:
        head = checked.read(0, min(8, size))
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{file}: damaged (not a safetensors file: header length {length}, file size {size})")
        try:
            header = parse_json(checked.read(8, length), "the header")
            sharding = parse_json((header.get("__metadata__") or {}).get("DCP_SHARDING_INFO") or "{}",
                                  "its DCP_SHARDING_INFO")
        except JSONFileError as exc:
            raise CheckpointError(f"{file}: damaged (header: {exc})") from None
        except (ValueError, AttributeError, TypeError) as exc:
            raise CheckpointError(f"{file}: damaged (header: {first_cause(exc)})") from None
    data_bytes = size - 8 - length
    spans = []  # each tensor's bytes, which no other tensor may share: the shapes a load allocates fit the file
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            offsets = (sharding.get(key) or {}).get("saved_offsets", [0] * len(shape))
            numbers = [*shape, *offsets, begin, end]
            valid = (code in _ITEM_BYTES and all(type(n) is int and n >= 0 for n in numbers)
                     and len(offsets) == len(shape) and begin <= end <= data_bytes
                     and end - begin == math.prod(shape) * _ITEM_BYTES[code])
        except (KeyError, TypeError, ValueError, AttributeError):
            valid = False
        if not valid:
            raise CheckpointError(f"{file}: damaged (tensor {key}: {str(info)[:200]})")
        chunks.setdefault(key, []).append((code, offsets, shape))
        spans.append((begin, end, key))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CheckpointError(f"{file}: damaged (tensors {first} and {second} share bytes; allowed: each tensor's "
                                  "own data_offsets)")


def _check_chunks(path: Path, state: Path, key: str, shape: list, dtype: str, found: list) -> None:
    """The pieces of one tensor in the files (one, or one per shard) have the manifest's dtype and together
    span its whole shape."""
    if not found:
        raise CheckpointError(f"{path}: tensor {key} is in no file of {state}")
    codes = sorted({code for code, _, _ in found})
    if codes != [_DTYPES[dtype]]:
        raise CheckpointError(f"{path}: tensor {key}: dtype {dtype}, but {state} holds it as {', '.join(codes)}")
    if any(len(piece) != len(shape) for _, _, piece in found):
        held = found[0][2]
    else:
        held = [max(offsets[d] + piece[d] for _, offsets, piece in found) for d in range(len(shape))]
    if held != shape or sum(math.prod(piece) for _, _, piece in found) < math.prod(shape):
        raise CheckpointError(f"{path}: tensor {key}: shape {shape}, but {state} holds {held}")


def _held_keys(backend):
    """Which checkpoint keys this process loads: model tensors (`/models/<i>/<name>`) and optimizer state
    (`/optimizers/<i>/state/<name>/...`) of the names the backend holds, everything else; the held names are
    asked once per load, also where no live tensor exists yet (ZeRO-1 off its first data-parallel rank)."""
    model_names, optimizer_names = backend.held_names(), backend.held_names(for_optimizer=True)

    def loads(key: str) -> bool:
        parts = key.split("/")
        if parts[1] == "models" and model_names is not None:
            return "/".join(parts[3:]) in model_names
        if parts[1] == "optimizers" and len(parts) > 4 and parts[3] == "state" and optimizer_names is not None:
            return parts[4] in optimizer_names
        return True

    return loads


def _check_layouts(folder: Path, saved: list[dict], backend, models: list) -> None:
    """A parameter held in a backend's own layout (TP's reordered fused q/k/v) is only resumed into the same
    layout: loading it into another would scramble it silently."""
    for model, before in zip(models, saved, strict=False):
        now = backend.checkpoint_layouts(model)
        mine = {name for name, _ in backend.unwrap_model(model).named_parameters()}  # without DDP's prefix
        for name in sorted((set(now) | set(before)) & mine):
            if now.get(name) != before.get(name):
                raise CheckpointError(
                    f"{folder}: {name}: saved {before.get(name, 'in the model order')}, but this run holds it "
                    f"{now.get(name, 'in the model order')}; resume with the parallelism it was saved with "
                    "(save_model's weights, in the model order, load under any)")


# -- RNG states, per rank ---------------------------------------------------------------------------------

def rng_snapshot() -> tuple[dict, dict]:
    """This process's RNG states now: (tensors, plain JSON values)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = st
    plain: dict[str, Any] = {"python": tree.split(random.getstate(), "python", {})}
    try:
        import numpy as np

        plain["numpy"] = tree.split(np.random.get_state(), "numpy", {})
    except ImportError:
        pass
    return tensors, plain


def write_rng(folder: Path, rank: int, snapshot: tuple[dict, dict]) -> None:
    from safetensors.torch import save_file

    tensors, plain = snapshot
    save_file(tensors, str(folder / f"rank_{rank}.safetensors"))
    (folder / f"rank_{rank}.json").write_text(json.dumps(plain))


def _save_rng(folder: Path, rank: int) -> None:
    write_rng(folder, rank, rng_snapshot())


_RNG_BYTES = 1 << 20  # an RNG file: a few KB (torch's state, one per GPU, Python's and NumPy's)


def _read_rng(folder: Path, rank: int, manifest: dict, opened: Any = None) -> dict | None:
    """This rank's RNG states, read and tried on fresh generators (so a damaged one fails here, before anything
    is loaded); None where the checkpoint has none for this rank. Each file is read whole through a descriptor
    checked to be a regular file of the size the manifest lists (where it lists one), of at most _RNG_BYTES."""
    from safetensors.torch import load as load_safetensors

    saved_world = manifest["world_size"]
    if rank >= saved_world:
        warnings.warn(f"load_state: checkpoint has RNG states for {saved_world} processes; rank {rank} keeps its own",
                      stacklevel=1)
        return None
    written = manifest.get("rng_ranks")
    if isinstance(written, list) and rank not in written and not all(  # a late joiner adds its own after publishing
            (folder / "rng" / f"rank_{rank}.{ext}").is_file() for ext in ("safetensors", "json")):
        warnings.warn(f"load_state: {folder} was saved by the main process alone (save_state called there only): no "
                      f"RNG states for rank {rank}, which keeps its own", stacklevel=1)
        return None
    opened = opened or layout.checked_files()
    tensors_file, _ = layout.regular_file(folder, f"rng/rank_{rank}.safetensors", folder / layout.MANIFEST, opened)
    json_file, _ = layout.regular_file(folder, f"rng/rank_{rank}.json", folder / layout.MANIFEST, opened)
    raw = _rng_bytes(folder, f"rng/rank_{rank}.safetensors", manifest, opened)
    try:
        tensors = load_safetensors(raw)
        cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
        for state in [tensors["torch"], *cuda]:
            if state.dtype != torch.uint8 or state.dim() != 1:
                raise ValueError(f"an RNG state of dtype {state.dtype} and shape {list(state.shape)}")
        torch.Generator().set_state(tensors["torch"])
    except Exception as exc:
        raise CheckpointError(f"{tensors_file}: damaged ({first_cause(exc)})") from None
    text = _rng_bytes(folder, f"rng/rank_{rank}.json", manifest, opened)
    try:
        plain = parse_json(text, str(json_file), error=CheckpointError)
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace(f"{json_file}: ", f"{json_file}: damaged: ", 1)) from None
    try:
        return rng_state(tensors, plain, checked=True)
    except tree.BadTree as exc:
        raise CheckpointError(f"{json_file}: damaged ({exc})") from None
    except Exception as exc:
        raise CheckpointError(f"{json_file}: damaged ({first_cause(exc)})") from None


def _rng_bytes(folder: Path, rel: str, manifest: dict, opened) -> bytes:
    """A rank's RNG file, whole: of the size the manifest lists for it (a late joiner's is not listed), of at most
    _RNG_BYTES."""
    listed = manifest["files"].get(rel)
    with opened.open(folder / rel, size=listed if type(listed) is int else None, max_bytes=_RNG_BYTES) as checked:
        return checked.read()


def rng_state(tensors: dict, plain: dict, checked: bool = False) -> dict:
    """An `rng_snapshot()` (tensors, plain JSON values) as `_apply_rng` takes it; `checked`: the Python and NumPy
    states tried on fresh generators first (a damaged one fails here)."""
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    python = tree.join(plain["python"], {}, ("python",))
    numpy = None
    try:
        numpy = tree.join(plain["numpy"], {}, ("numpy",)) if "numpy" in plain else None
        if checked:
            random.Random().setstate(python)
            if numpy is not None:
                import numpy as np

                np.random.RandomState().set_state(numpy)
    except ImportError:
        numpy = None
    return {"torch": tensors["torch"], "cuda": cuda, "python": python, "numpy": numpy}


def _apply_rng(rng: dict | None) -> None:
    """Restore this rank's RNG states (last, so nothing else draws after them)."""
    if rng is None:
        return
    random.setstate(rng["python"])
    if rng["numpy"] is not None:
        import numpy as np

        np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"][: torch.cuda.device_count()])


# -- the state in memory: a replica heals from a live one (fault tolerance) --------------------------------------

def _local(value: Any) -> Any:
    """A tensor as this rank holds it (a DTensor's local shard), detached: what crosses to the same rank elsewhere."""
    if not isinstance(value, torch.Tensor):
        return value
    return (value.to_local() if hasattr(value, "to_local") else value).detach()


def _live_tensors(objects: TrainingObjects) -> dict:
    tensors: dict = {}
    tree.split(_collect(objects, [objects.backend.checkpoint_model_state(m) for m in objects.models]), "", tensors)
    return tensors


def capture_state(objects: TrainingObjects) -> dict:
    """This rank's whole training state, in memory: exactly what save_state writes (the same `_collect`, without the
    save pre-hooks: nothing is written) and this rank's RNG states, each tensor as this rank's shard. What a live
    replica sends to the same rank of a replica that heals (`restore_state` there), so a heal carries what a
    checkpoint would: a part added to checkpoints is healed too."""
    tensors: dict = {}
    skeleton = tree.split(_collect(objects, [objects.backend.checkpoint_model_state(m) for m in objects.models]),
                          "", tensors)
    # the peer may read them while this replica's next forward runs: what changes before the step is copied now, as
    # for an asynchronous save (batch norm's statistics, schedulers', loaders' and registered objects' tensors)
    tensors = _copied_if_changed_before_the_step({k: _local(v) for k, v in tensors.items()}, objects.models)
    return {"skeleton": skeleton, "tensors": tensors, "rng": rng_snapshot()}


def restore_state(objects: TrainingObjects, received: dict, source: str, in_flight: tuple = ()) -> None:
    """Load what `capture_state` gave on the same rank of a replica with the same layout: each shard goes back into a
    tensor of this rank's live layout (a DTensor's mesh and placements), then the objects take the state as they do
    from a checkpoint (`_hand_over`), and the RNG states last. A part that does not fit raises CheckpointError naming
    `source`."""
    live = _live_tensors(objects)
    tensors = {k: _like(live.get(k), v) for k, v in received["tensors"].items()}
    _hand_over(tree.join(received["skeleton"], tensors), objects.models, objects, source, in_flight)
    _apply_rng(rng_state(*received["rng"]))


def _like(live: Any, value: Any) -> Any:
    """`value` (a received shard) as a tensor laid out like `live` (this rank's tensor of the same name)."""
    if not isinstance(value, torch.Tensor) or not isinstance(live, torch.Tensor):
        return value
    from torch.distributed.tensor import DTensor

    if isinstance(live, DTensor):
        local = live.to_local()
        return DTensor.from_local(value.to(local.device, local.dtype), live.device_mesh, live.placements,
                                  run_check=False, shape=live.shape, stride=live.stride())
    return value.to(live.device)
