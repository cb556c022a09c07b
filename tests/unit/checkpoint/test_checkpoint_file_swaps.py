"""A checkpoint file replaced right after accel checked it (a FIFO, a link to /dev/zero, a shorter file), in every
loader: load_state (state shards, RNG files, the DCP read), load_checkpoint_in_model (index shards, single files,
with and without checksums, with a device map), load_state_dict, `accel merge-weights` (accel's folders and DCP
folders) and the Accelerate shim's loaders. Each is one CheckpointError line naming the file, never a hang: the
readers read through the descriptor that was checked (accel/core/checked_file.py).

The race is made deterministic: the check function is wrapped so that the file is swapped the moment it returns
(file_swaps.swap_after); `finishes` turns a hang (what these probes did before) into a failure."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from file_swaps import SWAPS, finishes, replace, swap_after

from accel import Accelerator
from accel.checkpoint import dcp_reader, layout, model_io, model_reader, state_checks, state_load, weights_files
from accel.checkpoint.layout import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def one_line(error: BaseException, path: Path, needle: str | tuple) -> str:
    """The error is one line that starts with the file's path and says `needle` (or one of them)."""
    message = str(error)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    assert any(n in message for n in ((needle,) if isinstance(needle, str) else needle)), message
    return message


# a shorter file in the place of one the load already opened is another file; in the place of one not yet opened,
# it is shorter than declared (by the manifest or index's checksum, or the safetensors header)
EXPECTED = {"fifo": "not a regular file (a FIFO)", "device": "not a regular file (a character device)",
            "short": ("another file has taken its name", "damaged")}


# -- load_state ---------------------------------------------------------------------------------------------------

def saved_state(tmp_path: Path):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    return accelerator, model, folder


def state_shard(folder: Path) -> Path:
    return next((folder / "state").glob("*.safetensors"))


@pytest.mark.parametrize("kind", SWAPS)
def test_load_state_after_the_manifest_check(tmp_path, monkeypatch, kind):
    """The shard swapped right after read_manifest checked it (name, size): the checksum thread and the header check
    read it next."""
    accelerator, model, folder = saved_state(tmp_path)
    shard = state_shard(folder)
    rel = shard.relative_to(folder).as_posix()
    done = swap_after(monkeypatch, layout, "regular_file", shard, kind, when=lambda f, r, *a: r == rel)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: accelerator.load_state(str(folder)), tmp_path)
    assert done
    one_line(caught.value, shard, EXPECTED[kind])
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("kind", SWAPS)
def test_load_state_after_the_header_check(tmp_path, monkeypatch, kind):
    """The shard swapped once every check passed: DCP's read (torch's reader opened the name again) reads next."""
    accelerator, _model, folder = saved_state(tmp_path)
    shard = state_shard(folder)
    done = swap_after(monkeypatch, state_load, "_check_state_files", shard, kind)
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: accelerator.load_state(str(folder)), tmp_path)
    assert done
    one_line(caught.value, shard, EXPECTED[kind])


@pytest.mark.parametrize("name", ["rank_0.safetensors", "rank_0.json"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_load_state_rng_file_after_its_check(tmp_path, monkeypatch, name, kind):
    """An RNG file swapped right after _read_rng's own check of it (its second, after the manifest's)."""
    accelerator, _model, folder = saved_state(tmp_path)
    target = folder / "rng" / name
    done = swap_after(monkeypatch, layout, "regular_file", target, kind, when=lambda f, r, *a: r == f"rng/{name}",
                      calls=2)
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: accelerator.load_state(str(folder)), tmp_path)
    assert done
    one_line(caught.value, target, EXPECTED[kind])


def test_load_state_reads_each_file_as_checked(tmp_path):
    """Unchanged files load as before (the checked descriptors are read, the same files every time)."""
    accelerator, model, folder = saved_state(tmp_path)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    finishes(lambda: accelerator.load_state(str(folder)), tmp_path)
    assert torch.equal(model.weight, saved)


# -- load_checkpoint_in_model, load_state_dict -------------------------------------------------------------------

def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def save_model(folder: Path, **kwargs) -> Path:
    model_io.save_state_dict_sharded(model_io.get_full_state_dict(model()), folder, **kwargs)
    return folder


def plain_index(folder: Path) -> Path:
    """A sharded folder as another tool writes it: an index with a weight_map only (no checksums to verify)."""
    from safetensors.torch import save_file

    folder.mkdir()
    state = model().state_dict()
    names = list(state)
    save_file({k: state[k] for k in names[:2]}, str(folder / "a.safetensors"))
    save_file({k: state[k] for k in names[2:]}, str(folder / "b.safetensors"))
    weight_map = {k: "a.safetensors" if i < 2 else "b.safetensors" for i, k in enumerate(names)}
    (folder / model_io.SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("kind", SWAPS)
@pytest.mark.parametrize("checksums", [True, False], ids=["accel's index", "another tool's index"])
def test_load_checkpoint_in_model_index_shard_after_its_check(tmp_path, monkeypatch, kind, checksums):
    folder = save_model(tmp_path / "m", max_shard_size=100) if checksums else plain_index(tmp_path / "m")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    done = swap_after(monkeypatch, model_reader, "_checked_shard_path", shard, kind,
                      when=lambda f, entry, *a, **k: entry == shard.name)
    fresh = model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: model_io.load_checkpoint_in_model(fresh, folder), tmp_path)
    assert done
    one_line(caught.value, shard, EXPECTED[kind])
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("kind", SWAPS)
@pytest.mark.parametrize("safe", [True, False], ids=["model.safetensors", "pytorch_model.bin"])
def test_load_checkpoint_in_model_single_file_after_its_verification(tmp_path, monkeypatch, kind, safe):
    folder = save_model(tmp_path / "m", safe_serialization=safe)
    file = folder / (model_io.SAFE_WEIGHTS_NAME if safe else model_io.WEIGHTS_NAME)
    done = swap_after(monkeypatch, weights_files, "verify_saved_file", file, kind)
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: model_io.load_checkpoint_in_model(model(), file), tmp_path)
    assert done
    one_line(caught.value, file, EXPECTED[kind])


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_accelerates_load_checkpoint_in_model_with_a_device_map(tmp_path, monkeypatch, kind):
    """accel.load_checkpoint_in_model (Accelerate's signature; the probe that froze the whole process)."""
    import accel

    folder = save_model(tmp_path / "m", max_shard_size=100)
    shard = sorted(folder.glob("*.safetensors"))[0]
    swap_after(monkeypatch, model_reader, "_checked_shard_path", shard, kind,
               when=lambda f, entry, *a, **k: entry == shard.name)
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: accel.load_checkpoint_in_model(model(), str(folder), device_map={"": "cpu"}), tmp_path)
    one_line(caught.value, shard, EXPECTED[kind])


@pytest.mark.parametrize("kind", SWAPS)
def test_load_state_dict_after_its_verification(tmp_path, monkeypatch, kind):
    from accel.utils import load_state_dict

    file = save_model(tmp_path / "m") / model_io.SAFE_WEIGHTS_NAME
    swap_after(monkeypatch, weights_files, "verify_saved_file", file, kind)
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: load_state_dict(str(file)), tmp_path)
    one_line(caught.value, file, EXPECTED[kind])


def test_unchanged_model_files_load_as_before(tmp_path):
    from accel.utils import load_state_dict

    expected = model().state_dict()
    for folder, kwargs in ((tmp_path / "one", {}), (tmp_path / "bin", {"safe_serialization": False}),
                           (tmp_path / "sharded", {"max_shard_size": 100})):
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        finishes(lambda folder=folder, kwargs=kwargs, fresh=fresh: model_io.load_checkpoint_in_model(
            fresh, save_model(folder, **kwargs)))
        assert all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())
    loaded = load_state_dict(str(tmp_path / "one" / model_io.SAFE_WEIGHTS_NAME), device_map={"0": "cpu", "1": "cpu"})
    assert all(torch.equal(expected[k], loaded[k]) for k in expected)


# -- accel merge-weights ---------------------------------------------------------------------------------------------

@pytest.fixture
def merge_cli(capsys):
    """`accel merge-weights ARGS` in this process: (exit code, stderr)."""
    from accel.cli.main import main as accel_main

    def run(*args):
        try:
            code = accel_main(["merge-weights", *map(str, args)])
        except SystemExit as exc:
            code = exc.code
        return code, capsys.readouterr().err

    return run


def one_error_line(code: int, err: str, path: Path, needle: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("accel merge-weights: error: cannot read the checkpoint: ") and str(path) in lines[0]
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_merge_an_accel_folder_after_its_checks(tmp_path, monkeypatch, merge_cli, kind):
    _accelerator, _model, folder = saved_state(tmp_path)
    shard = state_shard(folder)
    swap_after(monkeypatch, state_checks, "_check_state_files", shard, kind)
    code, err = finishes(lambda: merge_cli(folder, tmp_path / "out"), tmp_path)
    one_error_line(code, err, shard, EXPECTED[kind])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_merge_a_dcp_folder_after_its_checks(tmp_path, monkeypatch, merge_cli, kind):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "pytorch_model_fsdp_0"
    dcp.save({"model": model().state_dict()}, checkpoint_id=str(folder), no_dist=True)
    data = next(folder.glob("*.distcp"))
    swap_after(monkeypatch, dcp_reader, "check_metadata", data, kind)
    code, err = finishes(lambda: merge_cli(folder, tmp_path / "out"), tmp_path)
    one_error_line(code, err, data, EXPECTED[kind])


# -- the Accelerate shim's loaders --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_accelerates_load_of_a_pipe_or_device(tmp_path, kind):
    """`accelerate.utils.load(path)` (accel.compat.other.load): torch.save files, read through a checked descriptor."""
    from accel.compat.other import load

    path = tmp_path / "state.bin"
    torch.save({"x": torch.ones(2)}, path)
    assert torch.equal(finishes(lambda: load(path))["x"], torch.ones(2))
    replace(path, kind)
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: load(path), tmp_path)
    one_line(caught.value, path, EXPECTED[kind])


@pytest.mark.parametrize("kind", ["fifo", "device", "short"])
def test_accelerates_offloaded_dat_file(tmp_path, kind):
    """An Accelerate offload folder's raw `<name>.dat` tensor: read only as the bytes its index declares."""
    from accel.utils import load_offloaded_weights

    target = torch.nn.Linear(2, 2, bias=False)
    weight = torch.arange(4.0).reshape(2, 2)
    path = tmp_path / "weight.dat"
    path.write_bytes(weight.numpy().tobytes())
    index = {"weight": {"dtype": "float32", "shape": [2, 2]}}
    finishes(lambda: load_offloaded_weights(target, index, str(tmp_path)))
    assert torch.equal(target.weight, weight)
    replace(path, kind)
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: load_offloaded_weights(target, index, str(tmp_path)), tmp_path)
    one_line(caught.value, path, "damaged (size 8 bytes, expected 16)" if kind == "short" else EXPECTED[kind])


def test_fsdp_compat_loader_reads_through_checked_files(tmp_path, monkeypatch):
    """Accelerate's load_fsdp_model (accel's checkpoint folders): load_state's reader, so the same one line."""
    from accel.checkpoint.fsdp_compat import load_fsdp_model, save_fsdp_model

    accelerator = Accelerator(cpu=True)
    net = accelerator.prepare(model())
    save_fsdp_model(None, accelerator, net, str(tmp_path))
    folder = tmp_path / "pytorch_model_fsdp_0"
    shard = state_shard(folder)
    swap_after(monkeypatch, state_load, "_check_state_files", shard, "fifo")
    with pytest.raises(CheckpointError) as caught:
        finishes(lambda: load_fsdp_model(None, accelerator, net, str(tmp_path)), tmp_path)
    one_line(caught.value, shard, EXPECTED["fifo"])
    assert os.path.exists(folder)
