"""`save_state`: a run's state written atomically by every rank (or by the main process alone, where the state is
replicated), synchronously or in the background, then published under the folder's name.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from accel.checkpoint import layout, main_save, tree
from accel.checkpoint.async_save import AsyncCheckpointer, spawn_checkpoint_process_without_main
from accel.checkpoint.backend_view import CheckpointBackend
from accel.checkpoint.layout import CheckpointError
from accel.runtime.progress import stages
from accel.checkpoint.rank_agreement import (
    _ALONE,
    _agreed,
    _barrier,
    _broadcast_from_main,
    _distributed,
    _first_failure,
    _one_folder_everywhere,
    _quiet_single_process,
    _rank_world,
    _save_failure,
    alone,
    first_cause,
)
from accel.checkpoint import rng_states
from accel.checkpoint.run_state import TrainingObjects, _collect, _copied_if_changed_before_the_step


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


def _layout_name(backend: CheckpointBackend) -> str:
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
        snapshot = rng_states.rng_snapshot()
        kv.set(f"{key}/rng/{rank}", main_save.encode_rng(snapshot))
        checkpointer.start(target, target, main_save.done_future(),
                           lambda: main_save.follow_main_save(target, rank, snapshot, rng_states.write_rng, kv, key,
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
            rng_states.write_rng(folder, other, snapshot)
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

    rng_states._save_rng(tmp / "rng", rank)
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
    rng_states._save_rng(tmp / "rng", rank)


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
    weights: list[dict | None] = [objects.backend.checkpoint_model_state(m) for m in models]
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
