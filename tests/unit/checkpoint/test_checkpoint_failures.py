"""Checkpoints fail clearly and cleanly: a failed save is one line naming the folder and the cause, leaves no
temporary folder and the previous checkpoint intact; load_state reads only the checkpoint's own regular files,
checks everything before it changes anything, and a failed load leaves every object bit-unchanged."""

import contextlib
import copy
import errno
import io
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from accel import Accelerator, GradScalerKwargs
from accel.checkpoint import layout, state_load
from accel.checkpoint.layout import CheckpointError

UNCHANGED = "nothing was published (a checkpoint already there is unchanged)"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def prepared():
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=256)])
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def train_step(accelerator, model, optimizer, scheduler):
    accelerator.backward(model(torch.randn(2, 3)).pow(2).sum())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def snapshot(accelerator, model, optimizer, scheduler) -> dict:
    """Every bit of live state a load could change."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()), "scheduler": copy.deepcopy(scheduler.state_dict()),
            "scaler": copy.deepcopy(accelerator.scaler.state_dict()), "torch": torch.get_rng_state(),
            "python": random.getstate(), "numpy": np.random.get_state()}


def assert_same(before: dict, after: dict) -> None:
    assert before["model"].keys() == after["model"].keys()
    assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    assert before["optimizer"]["param_groups"] == after["optimizer"]["param_groups"]
    for pid, st in before["optimizer"]["state"].items():
        assert all(torch.equal(v, after["optimizer"]["state"][pid][n]) for n, v in st.items())
    assert before["scheduler"] == after["scheduler"] and before["scaler"] == after["scaler"]
    assert torch.equal(before["torch"], after["torch"]) and before["python"] == after["python"]
    assert all(np.array_equal(a, b) for a, b in zip(before["numpy"], after["numpy"]))


@pytest.fixture
def trained(tmp_path):
    """A checkpoint of one training step, then one more step: the live objects differ from the checkpoint."""
    objects = prepared()
    train_step(*objects)
    folder = Path(objects[0].save_state(str(tmp_path / "ckpt")))
    train_step(*objects)
    return folder, objects


# -- saving -------------------------------------------------------------------------------------------------

class FullDisk(io.FileIO):
    def write(self, _):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@contextlib.contextmanager
def full_disk_stream(self, path, mode):
    with FullDisk(path, "w") as stream:
        yield stream


def no_space(*_, **__):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "rank_0.safetensors")


def fail_at(where: str, monkeypatch, folder: Path) -> str:
    """Make the next save run out of disk space at `where`; the part of the message that names the place."""
    if where == "tensors":  # inside DCP's writer: its CheckpointException nests the cause
        from torch.distributed.checkpoint.filesystem import FileSystem

        monkeypatch.setattr(FileSystem, "create_stream", full_disk_stream)
        return "No space left on device; free space on that disk or save elsewhere"
    if where == "rng":
        import safetensors.torch

        def failing_save_file(tensors, filename, *_, **__):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

        monkeypatch.setattr(safetensors.torch, "save_file", failing_save_file)
        return "No space left on device (writing rng/rank_0.safetensors); free space on that disk"
    if where == "manifest":
        monkeypatch.setattr(layout, "write_manifest", no_space)
        return "No space left on device (rank_0.safetensors)"
    real_swap = layout.swap_in  # "publish": the swap into place fails (the rename, or renameat2's exchange)

    def failing_swap(tmp, target):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(tmp))

    monkeypatch.setattr(layout, "swap_in", failing_swap)
    assert real_swap is not failing_swap
    return "Input/output error"


@pytest.mark.parametrize("where", ["tensors", "rng", "manifest", "publish"])
def test_a_save_failing_anywhere_is_one_line_and_keeps_the_previous_checkpoint(trained, monkeypatch, where):
    folder, objects = trained
    accelerator, model = objects[0], objects[1]
    saved = layout.read_manifest(folder)
    expected = fail_at(where, monkeypatch, folder)
    with pytest.raises(CheckpointError) as caught:
        accelerator.save_state(str(folder))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{folder}: could not be saved: ")
    assert expected in message and message.endswith(UNCHANGED), message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no nest of tracebacks
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt"]  # no .tmp-/.old- folder left
    monkeypatch.undo()
    assert layout.read_manifest(folder) == saved
    before = {k: v.clone() for k, v in model.state_dict().items()}
    accelerator.load_state(str(folder))  # the previous checkpoint still loads: the first step's weights
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_read_only_destination_is_one_line(tmp_path, monkeypatch):
    """A real read-only folder where permissions bind (not as root, who ignores them), else EROFS faked."""
    accelerator, *_ = prepared()
    parent = tmp_path / "ro"
    parent.mkdir()
    accelerator.save_state(str(parent / "ckpt"))
    if os.geteuid() != 0:
        os.chmod(parent, 0o500)
        expected = (f"Permission denied (creating a folder in {parent}); make the folder writable for this user or "
                    "save elsewhere")
    else:
        real_mkdir = os.mkdir

        def read_only_mkdir(path, *args, **kwargs):
            if Path(path).parent == parent:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", read_only_mkdir)
        expected = f"Read-only file system (creating a folder in {parent}); save to a writable file system"
    try:
        with pytest.raises(CheckpointError) as caught:
            accelerator.save_state(str(parent / "ckpt"))
    finally:
        os.chmod(parent, 0o700)
    assert str(caught.value) == f"{parent / 'ckpt'}: could not be saved: {expected}; {UNCHANGED}"
    assert sorted(p.name for p in parent.iterdir()) == ["ckpt"]
    layout.read_manifest(parent / "ckpt")


def test_a_failing_save_hook_keeps_its_traceback_as_the_cause(tmp_path):
    accelerator, *_ = prepared()

    def broken_hook(models, weights, output_dir):
        raise KeyError("my_hook_bug")

    accelerator.register_save_state_pre_hook(broken_hook)
    with pytest.raises(CheckpointError, match="could not be saved: KeyError: 'my_hook_bug'") as caught:
        accelerator.save_state(str(tmp_path / "ckpt"))
    assert isinstance(caught.value.__cause__, KeyError)
    assert list(tmp_path.iterdir()) == []


# -- loading ------------------------------------------------------------------------------------------------

def edit_manifest(folder: Path, change) -> None:
    """Change the manifest as a tool that writes no checksums would (the checks behind the checksums still hold
    for such checkpoints; with the checksums kept, the manifest's own checksum finds any edit first)."""
    path = folder / layout.MANIFEST
    manifest = json.loads(path.read_text())
    manifest.pop("checksum", None)
    manifest.pop("checksums", None)
    change(manifest)
    path.write_text(json.dumps(manifest))


def without_checksums(folder: Path) -> None:
    edit_manifest(folder, lambda m: None)


def same_size_garbage(path: Path, text: bytes) -> None:
    size = path.stat().st_size
    path.write_bytes(text.ljust(size, b" ")[:size])


def first_key(manifest: dict, part: str) -> str:
    return next(k for k in json.dumps(manifest["skeleton"][part]).split('"') if k.startswith(f"/{part}/"))


def set_spec(manifest: dict, part: str, field: str, value) -> None:
    """Change `field` of the first tensor of `part` in the skeleton."""
    key = first_key(manifest, part)

    def walk(node):
        if isinstance(node, dict):
            if node.get("__tensor__") == key:
                node[field] = value
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(manifest["skeleton"][part])


def shard(folder: Path) -> Path:
    return next((folder / "state").glob("*.safetensors"))


def corrupt(case: str, folder: Path, tmp_path: Path) -> str:
    """Damage one part of the checkpoint; the start of the one-line error expected."""
    manifest_path = folder / layout.MANIFEST
    if case == "shard links to a device":  # links are followed (a Hub download): what they reach must be a file
        target = shard(folder)
        target.unlink()
        target.symlink_to("/dev/zero")
        return f"{target}: not a regular file"
    if case == "shard links to nothing":
        target = shard(folder)
        target.unlink()
        target.symlink_to(tmp_path / "gone.safetensors")
        return f"{target}: missing from checkpoint {folder} (a link to nothing)"
    if case == "rng folder links to a file":
        shutil.rmtree(folder / "rng")
        (folder / "rng").symlink_to(folder / layout.MANIFEST)
        return f"{folder / 'rng'}: not a folder"
    if case == "unlisted shard":
        (folder / "state" / "shard-00009-model-00001-of-00001.safetensors").write_bytes(shard(folder).read_bytes())
        return f"{folder / 'state'}/shard-00009-model-00001-of-00001.safetensors: not listed in {manifest_path}"
    if case == "manifest ..":
        edit_manifest(folder, lambda m: m["files"].update({"../../etc/shadow": 1}))
        return f"{manifest_path}: file entry '../../etc/shadow' is not inside the checkpoint"
    if case == "manifest absolute path":
        edit_manifest(folder, lambda m: m["files"].update({"/etc/passwd": 1}))
        return f"{manifest_path}: file entry '/etc/passwd' is not inside the checkpoint"
    if case == "model dtype":
        edit_manifest(folder, lambda m: set_spec(m, "models", "dtype", "Tensor"))
        return f"{manifest_path}: tensor /models/0/0.weight: dtype 'Tensor'; allowed: float64, float32"
    if case == "model huge shape":
        edit_manifest(folder, lambda m: set_spec(m, "models", "shape", [2**40, 2**40]))
        return f"{manifest_path}: tensor /models/0/0.weight: shape [1099511627776, 1099511627776], but"
    if case == "model negative shape":
        edit_manifest(folder, lambda m: set_spec(m, "models", "shape", [-1, 3]))
        return f"{manifest_path}: tensor /models/0/0.weight: shape [-1, 3]; allowed: a list of sizes >= 0"
    if case == "shard header":
        without_checksums(folder)
        same_size_garbage(shard(folder), b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
        return f"{shard(folder)}: damaged (header: the header: not JSON (line 1 column 2"
    if case == "optimizer dtype":
        edit_manifest(folder, lambda m: set_spec(m, "optimizers", "dtype", "float16"))
        return f"{manifest_path}: tensor /optimizers/0/state/0.weight/step: dtype float16, but"
    if case == "scheduler state":
        edit_manifest(folder, lambda m: m["skeleton"]["schedulers"].__setitem__(0, 5))
        return f"{manifest_path}: scheduler 0 (AcceleratedScheduler) refused its saved state (TypeError"
    if case == "non-tensor value":
        edit_manifest(folder, lambda m: m["skeleton"]["schedulers"][0].update({"x": {"__float__": "many"}}))
        return (f"{manifest_path}: damaged (key 'skeleton.schedulers[0].x': __float__ 'many'; allowed: 'inf', '-inf' "
                "or 'nan')")
    if case == "rng json":
        without_checksums(folder)
        same_size_garbage(folder / "rng" / "rank_0.json", b'{"python": [3, [1, 2], null]}')
        return f"{folder / 'rng' / 'rank_0.json'}: damaged (TypeError: state vector must be a tuple)"
    if case == "rng tensors":
        without_checksums(folder)
        same_size_garbage(folder / "rng" / "rank_0.safetensors", b"\x00" * 8)
        return f"{folder / 'rng' / 'rank_0.safetensors'}: damaged ("
    raise AssertionError(case)


CASES = ["shard links to a device", "shard links to nothing", "rng folder links to a file",
         "unlisted shard", "manifest ..", "manifest absolute path",
         "model dtype", "model huge shape", "model negative shape", "shard header", "optimizer dtype",
         "scheduler state", "non-tensor value", "rng json", "rng tensors"]


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_checkpoint_changes_nothing(trained, tmp_path, case):
    folder, objects = trained
    before = snapshot(*objects)
    expected = corrupt(case, folder, tmp_path)
    with pytest.raises(CheckpointError) as caught:
        objects[0].load_state(str(folder))
    message = str(caught.value)
    assert message.startswith(expected) and "\n" not in message, message
    assert_same(before, snapshot(*objects))


def as_hub_download(folder: Path, cache: Path) -> Path:
    """`folder` as huggingface_hub lays out a downloaded repository: snapshots/<commit>/ holds relative links (a
    subfolder's too) into ../../blobs/<sha256>."""
    import hashlib

    snapshot_dir, blobs = cache / "snapshots" / "0123abc", cache / "blobs"
    blobs.mkdir(parents=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder)
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        link = snapshot_dir / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot_dir


def test_a_checkpoint_downloaded_from_the_hub_loads(trained, tmp_path):
    """Every file of a Hub download is a link into ../../blobs: load_state follows the folder's own links (as
    Accelerate does) and restores exactly what the plain folder restores."""
    folder, objects = trained
    objects[0].load_state(str(folder))
    expected = snapshot(*objects)
    train_step(*objects)
    hub = as_hub_download(folder, tmp_path / "models--me--run")
    assert all(p.is_symlink() for p in hub.rglob("*") if not p.is_dir())
    objects[0].load_state(str(hub))
    assert_same(expected, snapshot(*objects))


def test_an_entry_outside_the_folder_is_never_opened(trained, tmp_path, monkeypatch):
    """The finding: '../../etc/shadow' was stat'ed and its size leaked into the error."""
    folder, objects = trained
    secret = tmp_path / "secret"
    secret.write_text("s" * 1234)
    edit_manifest(folder, lambda m: m["files"].update({"../secret": 1}))
    looked_at = []
    real_lstat, real_stat = os.lstat, os.stat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: looked_at.append(Path(p)) or real_lstat(p, *a, **k))
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: looked_at.append(Path(p)) or real_stat(p, *a, **k))
    with pytest.raises(CheckpointError, match="'../secret' is not inside the checkpoint") as caught:
        objects[0].load_state(str(folder))
    assert "1234" not in str(caught.value) and secret not in looked_at


@pytest.mark.parametrize("staged", [True, False])
def test_a_read_failing_midway_is_undone_when_staged(trained, monkeypatch, staged):
    """Past the checks, the tensors are read into fresh tensors (STAGING_BYTES): an I/O error half-way leaves the
    live ones as they were. A share too big to hold twice is read in place, and the error says so."""
    import torch.distributed.checkpoint as dcp

    folder, objects = trained
    before = snapshot(*objects)
    if not staged:
        monkeypatch.setattr(state_load, "STAGING_BYTES", 0)

    def read_half_then_fail(state_dict, **_):
        for tensor in list(state_dict.values())[:2]:
            tensor.fill_(7)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(dcp, "load", read_half_then_fail)
    with pytest.raises(CheckpointError, match=f"^{folder / 'state'}: could not be loaded: OSError") as caught:
        objects[0].load_state(str(folder))
    if staged:
        assert "partly" not in str(caught.value)
        assert_same(before, snapshot(*objects))
    else:
        assert str(caught.value).endswith("the models' and optimizers' tensors may be partly overwritten: load again")


@pytest.mark.parametrize("staged", [True, False])
def test_both_ways_of_reading_restore_the_checkpoint(trained, monkeypatch, staged):
    folder, objects = trained
    accelerator, model = objects[0], objects[1]
    if not staged:
        monkeypatch.setattr(state_load, "STAGING_BYTES", 0)
    expected = {}
    from safetensors.torch import load_file

    for file in (folder / "state").glob("*.safetensors"):
        expected.update({k.removeprefix("/models/0/"): v for k, v in load_file(str(file)).items()
                         if k.startswith("/models/0/")})
    accelerator.load_state(str(folder))
    assert all(torch.equal(expected[k], v) for k, v in model.state_dict().items())


def test_a_model_of_another_shape_is_refused_before_anything_changes(trained):
    folder, _ = trained
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=256)])
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    objects = (accelerator, *accelerator.prepare(model, optimizer, scheduler))
    train_step(*objects)
    before = snapshot(*objects)
    with pytest.raises(CheckpointError, match="model 0: 0.weight has shape \\[4, 3\\], the prepared model \\[5, 3\\]"):
        accelerator.load_state(str(folder))
    assert_same(before, snapshot(*objects))


def _prepared_with(make_optimizer):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=256)])
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler))


class _MyAdamW(torch.optim.AdamW):
    """The same hyper-parameters as AdamW, another type."""


@pytest.mark.parametrize("make_optimizer,message", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
     "optimizer 0 was saved from a torch.optim.adamw.AdamW, the prepared one is a torch.optim.sgd.SGD"),
    (lambda m: _MyAdamW(m.parameters(), lr=0.1), "the prepared one is a test_checkpoint_failures._MyAdamW"),
    (lambda m: torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[1].parameters()}], lr=0.1),
     "optimizer 0 has 1 parameter group\\(s\\), the prepared one 2"),
], ids=["sgd", "subclass", "two-groups"])
def test_an_optimizer_state_that_does_not_fit_is_refused_before_anything_changes(trained, make_optimizer, message):
    """AdamW's state into SGD used to load, then fail at the first step with KeyError 'momentum'."""
    folder, _ = trained
    objects = _prepared_with(make_optimizer)
    train_step(*objects)
    before = snapshot(*objects)
    with pytest.raises(CheckpointError, match=message):
        objects[0].load_state(str(folder))
    assert_same(before, snapshot(*objects))


def test_an_older_checkpoint_without_the_optimizer_type_is_checked_by_its_hyper_parameters(trained, tmp_path):
    folder, _ = trained
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    assert manifest["skeleton"]["optimizers"][0].pop("accel_type") == "torch.optim.adamw.AdamW"
    layout.write_manifest(folder, {k: v for k, v in manifest.items() if k not in ("format", "version", "files")})
    objects = _prepared_with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match="parameter group 0 has hyper-parameters \\['amsgrad', 'betas'"):
        objects[0].load_state(str(folder))
    _prepared_with(lambda m: torch.optim.AdamW(m.parameters(), lr=0.1))[0].load_state(str(folder))  # still loads


@pytest.mark.parametrize("what", ["shard bit", "shard bit, read in place", "shard bit, verified while read", "rng bit",
                                  "manifest value", "manifest step"])
def test_changed_bytes_are_found_by_the_checksums_before_anything_changes(trained, what, monkeypatch):
    """One flipped bit in a tensor shard, or a same-size edit of a value in the manifest, used to load silently. The
    checksums are verified before the read (on fewer than OVERLAP_MIN_CPUS cores, and before a read in place), or
    while the tensors are read into fresh tensors."""
    folder, objects = trained
    if what.endswith("in place"):
        monkeypatch.setattr(state_load, "STAGING_BYTES", 0)
    if what.endswith("while read"):  # as with OVERLAP_MIN_CPUS cores or more
        monkeypatch.setattr(state_load, "OVERLAP_MIN_CPUS", 1)
    before = snapshot(*objects)
    manifest_path = folder / layout.MANIFEST
    if what.startswith("manifest"):
        text = manifest_path.read_text()
        old = '"last_epoch": 1' if what == "manifest value" else '"step": 0'
        assert old in text
        manifest_path.write_text(text.replace(old, old[:-1] + "7", 1))  # the same size
        expected = f"{manifest_path}: damaged (its content does not match its checksum"
    else:
        path = shard(folder) if what == "shard bit" else folder / "rng" / "rank_0.safetensors"
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x04  # one bit of the last tensor's data
        path.write_bytes(bytes(data))
        expected = f"{path}: damaged (its bytes do not match the checksum in {layout.MANIFEST}"
    with pytest.raises(CheckpointError) as caught:
        objects[0].load_state(str(folder))
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value), str(caught.value)
    assert_same(before, snapshot(*objects))


def test_a_damaged_file_is_the_error_also_when_a_later_check_fails_while_it_is_verified(trained, monkeypatch):
    folder, objects = trained
    before = snapshot(*objects)
    path = shard(folder)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x04
    path.write_bytes(bytes(data))

    def mismatch(*_):
        raise CheckpointError("a mismatch found while the checksums are verified")

    monkeypatch.setattr(state_load, "_check_against_objects", mismatch)
    with pytest.raises(CheckpointError) as caught:
        objects[0].load_state(str(folder))
    assert str(caught.value).startswith(f"{path}: damaged (its bytes do not match the checksum"), str(caught.value)
    assert_same(before, snapshot(*objects))


def test_a_checkpoint_without_checksums_still_loads(trained):
    folder, objects = trained
    without_checksums(folder)
    objects[0].load_state(str(folder))
