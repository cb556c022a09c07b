"""`save_state` / `load_state`: everything needed to continue a run, written atomically, loaded safely.

On-disk layout of one checkpoint folder::

    accel_checkpoint.json        manifest: format, version, world size, step, the JSON skeleton of every
                                 non-tensor value, and the size of every file (written last)
    state/shard-*.safetensors    model, optimizer, scheduler, scaler, data-loader and registered objects'
                                 tensors, written by torch.distributed.checkpoint: every rank writes its
                                 own part, replicated tensors once, loadable on another process count
    rng/rank_<r>.safetensors     rank r's torch (and CUDA) RNG states
    rng/rank_<r>.json            rank r's Python and NumPy RNG states

No pickle anywhere: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from accel.checkpoint import layout, tree
from accel.checkpoint.layout import CheckpointError


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


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_from_main(value: Any) -> Any:
    if dist.is_available() and dist.is_initialized():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _owner(objects: TrainingObjects, optimizer) -> int:
    """Index of the model whose parameters the optimizer updates."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for i, model in enumerate(objects.models):
        if any(id(p) in params for p in model.parameters()):
            return i
    raise CheckpointError("save_state: an optimizer updates parameters of no prepared model; prepare the model too")


def _collect(objects: TrainingObjects, model_states: list) -> dict:
    """The whole state tree (tensors and plain values) of everything in the checkpoint but the RNG; the models'
    part is `model_states` (after the pre-hooks)."""
    backend = objects.backend
    return {
        "models": model_states,
        "optimizers": [backend.checkpoint_optimizer_state(objects.models[_owner(objects, o)], o.optimizer)
                       for o in objects.optimizers],
        "schedulers": [s.state_dict() for s in objects.schedulers],
        "dataloaders": [d.state_dict() for d in objects.dataloaders if hasattr(d, "state_dict")],
        "custom": [obj.state_dict() for obj in objects.custom],
        "scaler": objects.scaler.state_dict() if objects.scaler is not None else None,
        "step": objects.step,
    }


def first_cause(exc: BaseException) -> str:
    """The original error inside DCP's `CheckpointException` (which nests every rank's traceback), as one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        return first_cause(inner[0] if isinstance(inner, tuple) else getattr(inner, "exception", inner))
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


FILE_BYTES = 256 * 2**20  # DCP's safetensors writer builds each file in memory: bound the peak by the file size


def _file_buckets(specs: dict[str, tuple[list[int], str]]) -> dict[str, int]:
    """Key -> file number (1-based): consecutive tensors in files of at most FILE_BYTES (one larger tensor
    gets a file of its own), so a save never holds more than about one file's bytes extra. Sizes are the
    whole tensors' (a rank writing a shard writes less)."""
    mapping, index, used = {}, 1, 0
    for key, (shape, dtype) in specs.items():
        size = math.prod(shape) * getattr(torch, dtype).itemsize
        if used and used + size > FILE_BYTES:
            index, used = index + 1, 0
        mapping[key] = index
        used += size
    return mapping


def _dedupe_aliases(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
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


def save_training_state(output_dir: str | os.PathLike, objects: TrainingObjects) -> Path:
    """Write a checkpoint of `objects` to `output_dir` atomically (all ranks call this)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException

    rank, world = _rank_world()
    target = Path(output_dir).absolute()
    tmp = None
    if rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        layout.remove_stale_temporaries(target.parent)
        tmp = layout.temporary_sibling(target)
        (tmp / "state").mkdir(parents=True)
        (tmp / "rng").mkdir()
    tmp = Path(_broadcast_from_main(str(tmp)))

    weights, owners = _saved_weights(objects, tmp)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = tree.split(_collect(objects, weights), "", tensors)
    aliases = _dedupe_aliases(tensors)
    for key in aliases:
        del tensors[key]
    tensors = {k: (t.contiguous() if type(t) is torch.Tensor else t) for k, t in tensors.items()}
    layouts = [objects.backend.checkpoint_layouts(m) if m is not None else {} for m in owners]
    if world > 1 and objects.backend.holds_part_of_model:  # pipeline stages hold different tensors: merge them
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (skeleton, aliases, layouts))
        skeleton = tree.merge([s for s, _, _ in everyone])
        aliases = {k: v for _, a, _ in everyone for k, v in a.items()}
        layouts = [{k: v for _, _, ls in everyone for k, v in ls[i].items()} for i in range(len(layouts))]
    files = _file_buckets(tree.tensor_specs(skeleton))
    writer = HuggingFaceStorageWriter(str(tmp / "state"), fqn_to_index_mapping=files, save_distributed=True)
    try:
        with _quiet_single_process():
            dcp_save(tensors, storage_writer=writer, no_dist=world == 1)
    except (Exception, CheckpointException) as exc:  # one line naming the folder and the cause, not DCP's nest
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{target}: could not be saved: {first_cause(exc)}") from None
    _save_rng(tmp / "rng", rank)
    _barrier()
    if rank == 0:
        layout.fsync_tree(tmp)
        layout.write_manifest(tmp, {"world_size": world, "step": objects.step, "aliases": aliases, "layouts": layouts,
                                    "skeleton": skeleton})
        layout.publish(tmp, target)
    _barrier()
    return target


def _saved_weights(objects: TrainingObjects, folder: Path) -> tuple[list, list]:
    """The model state dicts to write, after the save pre-hooks ran on them (Accelerate's
    `hook(models, weights, output_dir)`; `folder` is the checkpoint being built, published with it, so files a
    hook writes there are part of the checkpoint), and the model each belongs to (by identity, else position)."""
    models = objects.models
    weights = [objects.backend.checkpoint_model_state(m) for m in models]
    index = {id(w): i for i, w in enumerate(weights)}
    for hook in objects.save_hooks:
        hook(list(models), weights, str(folder))
    owners = [index.get(id(w), i) for i, w in enumerate(weights)]
    return weights, [models[i] if i < len(models) else None for i in owners]


def load_training_state(input_dir: str | os.PathLike, objects: TrainingObjects) -> dict:
    """Restore `objects` from a checkpoint in place; RNG states last. Returns the manifest."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(input_dir).absolute()
    manifest = layout.read_manifest(folder)
    rank, world = _rank_world()
    models = list(objects.models)  # Accelerate's load pre-hooks take out the models they load themselves
    for hook in objects.load_hooks:
        hook(models, str(folder))
    skeleton = manifest["skeleton"]
    counts = {k: len(skeleton[k]) for k in ("models", "optimizers", "schedulers", "dataloaders", "custom")}
    have = {"models": len(models), "optimizers": len(objects.optimizers),
            "schedulers": len(objects.schedulers), "custom": len(objects.custom),
            "dataloaders": sum(hasattr(d, "state_dict") for d in objects.dataloaders)}
    for kind, count in counts.items():
        if have[kind] != count:
            hooks = " (after the pre-hooks)" if kind == "models" and (objects.save_hooks or objects.load_hooks) else ""
            raise CheckpointError(f"{folder / layout.MANIFEST}: holds {count} {kind} but {have[kind]} were prepared/"
                                  f"registered{hooks}; prepare the same objects, in the same order, before load_state")

    _check_layouts(folder, manifest.get("layouts") or [{} for _ in models], objects.backend, models)
    # Targets: the live model/optimizer tensors, loaded in place (no second copy of the state in memory;
    # sharded layouts reshard), fresh tensors for the rest. read_manifest has already checked every file.
    live: dict[str, torch.Tensor] = {}
    tree.split(_collect(objects, [objects.backend.checkpoint_model_state(m) for m in models]), "", live)
    aliases = manifest.get("aliases", {})
    loads = _held_keys(objects.backend)
    targets = {}
    for key, (shape, dtype) in tree.tensor_specs(skeleton).items():
        if key in aliases:
            continue
        target = live.get(key)
        if target is None and not loads(key):
            continue  # another pipeline stage's tensor
        if target is None or list(target.shape) != shape or str(target.dtype).removeprefix("torch.") != dtype:
            target = tree.empty_like_spec(shape, dtype)
        targets[key] = target.detach()
    try:
        with _quiet_single_process():
            dcp_load(targets, storage_reader=HuggingFaceStorageReader(str(folder / "state")), no_dist=world == 1)
    except (Exception, CheckpointException) as exc:  # name the folder; DCP's message says which key or file
        raise CheckpointError(f"{folder / 'state'}: could not be loaded: {first_cause(exc)}") from None
    for key, original in aliases.items():
        targets[key] = targets[original]
    state = tree.join(skeleton, targets)

    backend = objects.backend
    for model, sd in zip(models, state["models"]):
        backend.load_checkpoint_model_state(model, sd)
    for opt, sd in zip(objects.optimizers, state["optimizers"]):
        backend.load_checkpoint_optimizer_state(objects.models[_owner(objects, opt)], opt.optimizer, sd)
    for sched, sd in zip(objects.schedulers, state["schedulers"]):
        sched.load_state_dict(sd)
    for loader, sd in zip([d for d in objects.dataloaders if hasattr(d, "state_dict")], state["dataloaders"]):
        loader.load_state_dict(sd)
    for obj, sd in zip(objects.custom, state["custom"]):
        obj.load_state_dict(sd)
    if objects.scaler is not None and state["scaler"] is not None:
        objects.scaler.load_state_dict(state["scaler"])
    _load_rng(folder / "rng", rank, manifest["world_size"])
    return manifest


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
    for model, before in zip(models, saved):
        now = backend.checkpoint_layouts(model)
        mine = {name for name, _ in backend.unwrap_model(model).named_parameters()}  # without DDP's prefix
        for name in sorted((set(now) | set(before)) & mine):
            if now.get(name) != before.get(name):
                raise CheckpointError(
                    f"{folder}: {name}: saved {before.get(name, 'in the model order')}, but this run holds it "
                    f"{now.get(name, 'in the model order')}; resume with the parallelism it was saved with "
                    "(save_model's weights, in the model order, load under any)")


# -- RNG states, per rank ---------------------------------------------------------------------------------

def _save_rng(folder: Path, rank: int) -> None:
    from safetensors.torch import save_file

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
    save_file(tensors, str(folder / f"rank_{rank}.safetensors"))
    (folder / f"rank_{rank}.json").write_text(json.dumps(plain))


def _load_rng(folder: Path, rank: int, saved_world: int) -> None:
    """Restore this rank's RNG states (last, so nothing else draws after them)."""
    from safetensors.torch import load_file

    if rank >= saved_world:
        warnings.warn(f"load_state: checkpoint has RNG states for {saved_world} processes; rank {rank} keeps its own")
        return
    tensors_file, json_file = folder / f"rank_{rank}.safetensors", folder / f"rank_{rank}.json"
    try:
        tensors = load_file(str(tensors_file))
    except Exception as exc:
        raise CheckpointError(f"{tensors_file}: damaged ({exc})") from None
    try:
        plain = json.loads(json_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{json_file}: damaged ({exc})") from None
    random.setstate(tree.join(plain["python"], {}))
    if "numpy" in plain:
        try:
            import numpy as np

            np.random.set_state(tree.join(plain["numpy"], {}))
        except ImportError:
            pass
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
