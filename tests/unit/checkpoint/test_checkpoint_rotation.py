"""Destructive steps a reader could see: rotation (`total_limit`), a checkpoint published over an existing one,
save_model replacing a folder's model, `merge-weights --remove_checkpoint_dir`. A folder leaves its visible name in
one rename before anything in it is deleted (layout.remove_folder), so a reader never finds a checkpoint that looks
complete (its manifest there) but lacks files.

The deterministic tests delete part of a folder at the moment accel starts deleting it and look then (the
interleaving that showed a manifest without its state shard); the polling test runs a reader beside 52 rotations."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch

from accel import Accelerator
from accel.checkpoint import layout, model_io
from accel.checkpoint.layout import CheckpointError, ProjectConfiguration

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def rotating(tmp_path: Path, limit: int = 2) -> Accelerator:
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=limit))
    accelerator.prepare(torch.nn.Linear(3, 2))
    return accelerator


def partial_checkpoints(checkpoints: Path) -> list[str]:
    """What a reader finds now: every folder taken for a complete checkpoint (latest_checkpoint's candidates) that
    is not one (read_manifest: every listed file there, sizes and checksums right)."""
    seen = []
    for _, path in layout.numbered_checkpoints(checkpoints):
        try:
            layout.read_manifest(path)
        except CheckpointError as exc:
            if path.is_dir():  # (gone meanwhile: it left its name whole, which is fine)
                seen.append(f"{path.name}: {exc}")
    return seen


def deleting_partly_first(monkeypatch, look) -> list:
    """shutil.rmtree that first deletes the state/ files of the folder it was given, then calls `look()` (a reader
    at that moment), then deletes the rest: what a reader polling during a deletion can meet. Returns what each
    `look()` returned."""
    real, seen = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        state = Path(path) / "state"
        for file in sorted(state.glob("*")) if state.is_dir() else ():
            file.unlink()
        seen.append(look())
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return seen


def test_rotation_never_shows_a_half_deleted_checkpoint(tmp_path, monkeypatch):
    accelerator = rotating(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    accelerator.save_state()
    accelerator.save_state()
    seen = deleting_partly_first(monkeypatch, lambda: partial_checkpoints(checkpoints))
    accelerator.save_state()  # rotates checkpoint_0 out
    assert seen == [[]]  # rmtree ran once, and the reader then found only complete checkpoints
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_1", "checkpoint_2"]  # nothing hidden left
    assert layout.latest_checkpoint(checkpoints).name == "checkpoint_2"


def test_a_reader_polling_during_52_rotations_sees_only_complete_checkpoints(tmp_path):
    """A reader thread lists the complete checkpoints (those with a manifest) as fast as it can while 52 saves rotate
    (total_limit=2), reads each manifest and goes through the files it lists, as a loader does: a folder it took for
    complete must never be found, still under its name, without them. The interpreter switches threads every 10
    microseconds, so the reader runs inside every step of each rotation (deleted in place, 8-21 partial folders were
    found per run)."""
    accelerator = rotating(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    stop, found, rounds = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            for _, path in layout.numbered_checkpoints(checkpoints):
                try:
                    listed = list(json.loads((path / layout.MANIFEST).read_text())["files"])
                except OSError:
                    continue  # rotated away meanwhile
                for _ in range(50):  # a loader going through the files of the folder it took for complete
                    missing = [rel for rel in listed if not (path / rel).exists()]
                    if missing:
                        if path.is_dir():  # still there under its name, files gone: a partial checkpoint
                            found.append(f"{path.name} lacks {missing}")
                        break
            rounds.append(1)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread = threading.Thread(target=reader, daemon=True)
    try:
        thread.start()
        for _ in range(52):
            accelerator.save_state()
    finally:
        stop.set()
        thread.join(30)
        sys.setswitchinterval(interval)
    assert found == [], found[:3]
    assert len(rounds) > 52
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_50", "checkpoint_51"]
    assert partial_checkpoints(checkpoints) == []


def test_a_checkpoint_published_over_another_is_whole_at_every_step(tmp_path, monkeypatch):
    """save_state into a folder that holds a checkpoint: the old one is swapped out whole (renameat2's exchange, or
    renamed aside first where there is none), then deleted out of sight."""
    target = tmp_path / "ckpt"
    plain = Accelerator(cpu=True)
    plain.prepare(torch.nn.Linear(3, 2))
    plain.save_state(str(target))

    def look():
        try:
            layout.read_manifest(target)
            return "complete"
        except CheckpointError as exc:
            return "partial" if target.is_dir() else f"absent: {exc}"

    seen = deleting_partly_first(monkeypatch, look)
    plain.save_state(str(target))
    monkeypatch.setattr(layout, "_exchange", lambda a, b: False)  # NFS, not Linux: two renames
    plain.save_state(str(target))
    assert seen == ["complete", "complete"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_save_model_replacing_a_model_shows_a_whole_model_at_every_step(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    model = torch.nn.Linear(3, 2)
    model_io.save_state_dict_sharded(model.state_dict(), folder, max_shard_size=16)
    seen = deleting_partly_first(monkeypatch, lambda: model_io.load_checkpoint_in_model(torch.nn.Linear(3, 2), folder))
    model_io.save_state_dict_sharded(model.state_dict(), folder, max_shard_size=16)
    assert seen == [([], [])]  # the visible folder loaded whole while the old one was deleted


@pytest.mark.parametrize("given", ["folder", "state"])
def test_merge_removes_the_checkpoint_out_of_sight(tmp_path, monkeypatch, given):
    """`merge-weights --remove_checkpoint_dir`: the whole save_state folder (also when given its state/: a manifest
    without its files would look complete), renamed away before it is deleted."""
    from accel.checkpoint.merge import merge_fsdp_weights

    accelerator = rotating(tmp_path)
    accelerator.save_state()
    accelerator.save_state()
    checkpoints = tmp_path / "checkpoints"
    folder = checkpoints / "checkpoint_0"
    seen = deleting_partly_first(monkeypatch, lambda: partial_checkpoints(checkpoints) or folder.exists())
    merge_fsdp_weights(folder if given == "folder" else folder / "state", tmp_path / "out", remove_checkpoint_dir=True)
    assert seen == [False]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_1"]
    assert layout.latest_checkpoint(checkpoints).name == "checkpoint_1"


def test_remove_folder_leaves_a_folder_it_cannot_rename_whole(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoint_0"
    (folder / "state").mkdir(parents=True)

    def refuse(*_args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(layout.os, "rename", refuse)
    with pytest.warns(UserWarning, match="checkpoint_0: not removed \\(Permission denied\\)"):
        layout.remove_folder(folder)
    assert (folder / "state").is_dir()
    monkeypatch.undo()
    layout.remove_folder(tmp_path / "gone")  # already removed by another process: nothing to do
