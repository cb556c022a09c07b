"""`load_state`: a checkpoint checked whole, read (into fresh tensors, or in place when large) while its checksums
are verified, then handed to the objects; nothing live changes before every check passed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accel.checkpoint import layout, tree
from accel.checkpoint.layout import CheckpointError
from accel.runtime.progress import stages
from accel.checkpoint.rank_agreement import (
    _agreed,
    _load_failure,
    _one_folder_everywhere,
    _quiet_single_process,
    _rank_world,
    _root_cause,
    first_cause,
)
from accel.checkpoint.rng_states import _apply_rng, _read_rng
from accel.checkpoint.run_state import TrainingObjects, _collect, _hand_over
from accel.checkpoint.state_checks import (
    _PARTS,
    _check_layouts,
    _check_optimizer_fits,
    _check_state_files,
    _checked_manifest,
    _dtype_name,
    _held_keys,
)


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
