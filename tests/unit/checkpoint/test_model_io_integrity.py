"""save_model folders: every file checksummed and verified before the live model changes,
the folder's model replaced in one step (never a mix, even when killed), the folder's other files kept, and
concurrent saves serialised by the publish lock."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from accel.checkpoint import layout, model_io, model_writer
from accel.checkpoint.layout import CheckpointError
from accel.checkpoint.model_io import get_full_state_dict, load_checkpoint_in_model, save_state_dict_sharded

ROOT = Path(__file__).resolve().parents[3]
INDEX = "model.safetensors.index.json"
SHARD = "1100B"  # one Linear(16, 16) (1024 + 64 bytes) per shard


class Stack(nn.Module):
    def __init__(self, value: float | None = None, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))
        if value is not None:
            with torch.no_grad():
                for p in self.parameters():
                    p.fill_(value)


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def values_in(folder: Path) -> set[float]:
    """The distinct parameter values of the model in `folder` (loaded, so verified): one value, never a mix."""
    fresh = Stack(0.0)
    load_checkpoint_in_model(fresh, folder, strict=True)
    return {float(v) for p in fresh.parameters() for v in p.detach().flatten().unique()}


def flip_bit(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) - 7 if offset is None else offset  # in the tensor data (the header comes first)
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def one_line_error(info, file: Path, record: str) -> None:
    message = str(info.value)
    assert "\n" not in message
    assert message == (f"{file}: damaged (its bytes do not match the checksum in {record}: corrupted or changed "
                       "since the save)")


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --------------------------------------------------------------------------------------------------- checksums


def test_sharded_index_lists_every_file_and_its_own_checksum(tmp_path):
    paths = save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path / "out", max_shard_size=SHARD)
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    meta = index["metadata"]
    assert sorted(meta["accel_checksums"]) == [p.name for p in paths[:-1]]
    assert all(re.fullmatch(r"crc32:[0-9a-f]{8}", c) for c in meta["accel_checksums"].values())
    assert all(layout.verify_file_checksum(tmp_path / "out" / n, c) for n, c in meta["accel_checksums"].items())
    assert meta["accel_index_checksum"] == layout.manifest_checksum(model_io._index_body(index))
    assert not (tmp_path / "out" / model_io.CHECKSUMS_NAME).exists()  # a sharded save has it in its index


@pytest.mark.parametrize("safe", [True, False])
def test_flipped_bit_in_a_shard_is_one_line_and_the_model_is_unchanged(tmp_path, safe):
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path, max_shard_size=SHARD, safe_serialization=safe)
    ext, index = ("safetensors", INDEX) if safe else ("bin", "pytorch_model.bin.index.json")
    victim = tmp_path / f"{'model' if safe else 'pytorch_model'}-00003-of-00004.{ext}"
    flip_bit(victim)
    live = Stack(5.0)
    before = state_of(live)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_in_model(live, tmp_path)
    one_line_error(info, victim, index)
    assert same(before, state_of(live))
    with pytest.raises(CheckpointError):  # the index named directly, too
        load_checkpoint_in_model(live, tmp_path / index)
    with pytest.raises(CheckpointError):  # and the shard itself (its checksum is in the index beside it)
        load_checkpoint_in_model(live, victim)
    assert same(before, state_of(live))


@pytest.mark.parametrize("safe", [True, False])
def test_flipped_bit_in_a_single_file_save_is_found_by_the_sidecar(tmp_path, safe):
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path, safe_serialization=safe)
    name = "model.safetensors" if safe else "pytorch_model.bin"
    assert listing(tmp_path) == sorted([name, "accel_checksums.json"])
    sidecar = json.loads((tmp_path / "accel_checksums.json").read_text())
    assert sidecar["format"] == "accel-model-checksums" and list(sidecar["files"]) == [name]
    assert sidecar["checksum"] == layout.manifest_checksum(sidecar)
    flip_bit(tmp_path / name)
    live = Stack(5.0)
    before = state_of(live)
    for checkpoint in (tmp_path, tmp_path / name):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint_in_model(live, checkpoint)
        one_line_error(info, tmp_path / name, "accel_checksums.json")
    assert same(before, state_of(live))


def test_same_size_edits_of_the_index_and_of_the_sidecar_are_found(tmp_path):
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), sharded, max_shard_size=SHARD)
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), single)
    index = sharded / INDEX
    text = index.read_text()
    total = json.loads(text)["metadata"]["total_size"]
    edited = text.replace(f'"total_size": {total}', f'"total_size": {total + 1}')
    assert edited != text and len(edited) == len(text)
    index.write_text(edited)
    sidecar = single / "accel_checksums.json"
    content = json.loads(sidecar.read_text())
    checksum = content["files"]["model.safetensors"]
    content["files"]["model.safetensors"] = checksum[:-1] + ("0" if checksum[-1] != "0" else "1")
    sidecar.write_text(json.dumps(content))
    live = Stack(5.0)
    before = state_of(live)
    for record in (index, sidecar):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint_in_model(live, record.parent)
        assert str(info.value) == f"{record}: damaged (its content does not match its checksum: edited or corrupted)"
    assert same(before, state_of(live))


def test_a_shard_the_index_checksums_do_not_list_is_refused(tmp_path):
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path, max_shard_size=SHARD)
    index = json.loads((tmp_path / INDEX).read_text())
    del index["metadata"]["accel_checksums"]["model-00002-of-00004.safetensors"]
    index["metadata"]["accel_index_checksum"] = layout.manifest_checksum(model_io._index_body(index))
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not list every shard file"):
        load_checkpoint_in_model(Stack(), tmp_path)


def test_sha256_checksums_of_earlier_saves_are_verified_too(tmp_path):
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path, max_shard_size=SHARD)
    index = json.loads((tmp_path / INDEX).read_text())
    meta = index["metadata"]
    meta["accel_checksums"] = {n: layout.file_checksum(tmp_path / n, "sha256") for n in meta["accel_checksums"]}
    meta["accel_index_checksum"] = layout.manifest_checksum(model_io._index_body(index), "sha256")
    (tmp_path / INDEX).write_text(json.dumps(index))
    assert values_in(tmp_path) == {1.0}
    flip_bit(tmp_path / "model-00001-of-00004.safetensors")
    with pytest.raises(CheckpointError, match="model-00001-of-00004.safetensors: damaged"):
        load_checkpoint_in_model(Stack(), tmp_path)


def test_folders_of_other_tools_load_without_checksums(tmp_path):
    """Plain safetensors, a hand-made index without checksums, transformers' save_pretrained: loaded as before."""
    source = Stack(3.0)
    state = get_full_state_dict(source)
    single = tmp_path / "single"
    single.mkdir()
    save_file(state, single / "model.safetensors", metadata={"format": "pt"})
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weight_map = {}
    for i in range(4):
        part = {k: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        save_file(part, sharded / f"part{i}.safetensors", metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, f"part{i}.safetensors"))
    (sharded / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    for folder in (single, sharded):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert values_in(folder) == {3.0}

    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(config)
    for max_shard_size in ("1GB", "2KB"):
        out = tmp_path / f"hf-{max_shard_size}"
        gpt2.save_pretrained(out, max_shard_size=max_shard_size)
        fresh = GPT2LMHeadModel(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers leaves out lm_head.weight, tied to the embedding
            load_checkpoint_in_model(fresh, out)
        assert same(state_of(gpt2), state_of(fresh))


def test_transformers_loads_a_saved_gpt2_and_config_json_is_checksummed(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from accel import Accelerator

    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    accelerator = Accelerator(cpu=True)
    for name, max_shard_size, record in (("sharded", "4KB", INDEX), ("single", "1GB", "accel_checksums.json")):
        out = tmp_path / name
        accelerator.save_model(model, str(out), max_shard_size=max_shard_size)
        loaded = AutoModelForCausalLM.from_pretrained(str(out))
        assert same(state_of(model), state_of(loaded))
        meta = json.loads((out / record).read_text())
        listed = meta["metadata"]["accel_checksums"] if record == INDEX else meta["files"]
        assert "config.json" in listed
        fresh = GPT2LMHeadModel(config)
        load_checkpoint_in_model(fresh, out)
        assert same(state_of(model), state_of(fresh))
        # config.json is checksummed with the save, but a weights load reads (and verifies) only the weights: a
        # user's edit of the config (use_cache, say) does not stop it
        text = (out / "config.json").read_text()
        (out / "config.json").write_text(text.replace('"n_embd": 16', '"n_embd": 17'))
        load_checkpoint_in_model(fresh, out)
        assert same(state_of(model), state_of(fresh))


def test_a_folder_another_tool_saved_over_loads(tmp_path):
    """transformers' save_pretrained into a folder that holds a single-file save_model: the new model.safetensors
    is not checked against the stale accel_checksums.json (its header lacks the sidecar's save id), and loads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from accel import Accelerator

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    first, second = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    Accelerator(cpu=True).save_model(first, str(tmp_path))
    assert (tmp_path / "accel_checksums.json").is_file()
    second.save_pretrained(str(tmp_path))
    fresh = GPT2LMHeadModel(config)
    with pytest.warns(UserWarning, match="lm_head.weight"):  # transformers stores the tied head once, by its config
        load_checkpoint_in_model(fresh, tmp_path)
    assert same(state_of(second), state_of(fresh))


def test_the_device_map_loader_and_load_state_dict_verify_too(tmp_path):
    from accel import load_checkpoint_in_model as accelerate_load
    from accel.big_model.modeling import load_state_dict

    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path / "a", max_shard_size=SHARD)
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path / "b")
    victims = [tmp_path / "a" / "model-00002-of-00004.safetensors", tmp_path / "b" / "model.safetensors"]
    assert load_state_dict(victims[0]).keys() == {"layers.1.weight", "layers.1.bias"}
    for victim in victims:
        flip_bit(victim)
        live = Stack(5.0)
        before = state_of(live)
        with pytest.raises(CheckpointError, match=re.escape(f"{victim}: damaged")):
            accelerate_load(live, victim.parent, device_map={"": "cpu"})
        with pytest.raises(CheckpointError, match=re.escape(f"{victim}: damaged")):
            accelerate_load(live, victim.parent)
        with pytest.raises(CheckpointError, match=re.escape(f"{victim}: damaged")):
            load_state_dict(victim)
        assert same(before, state_of(live))


# --------------------------------------------------------------------------------------------- atomic replace


def test_user_files_survive_and_are_linked_not_copied(tmp_path):
    out = tmp_path / "out"
    (out / "assets").mkdir(parents=True)
    (out / "tokenizer.json").write_text('{"vocab": {}}')
    (out / "README.md").write_text("my model")
    (out / "assets" / "merges.txt").write_text("a b")
    (out / "latest").symlink_to("README.md")
    os.chmod(out / "assets", 0o750)
    inodes = {p: (out / p).stat().st_ino for p in ("tokenizer.json", "README.md", "assets/merges.txt")}
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out, max_shard_size=SHARD)
    save_state_dict_sharded(get_full_state_dict(Stack(2.0)), out)  # single file: the shards and index go
    assert listing(out) == sorted(["README.md", "accel_checksums.json", "assets", "latest", "model.safetensors",
                                   "tokenizer.json"])
    assert {p: (out / p).stat().st_ino for p in inodes} == inodes  # the same files: hard links, no copy
    assert (out / "assets" / "merges.txt").read_text() == "a b" and (out / "assets").stat().st_mode & 0o777 == 0o750
    assert os.readlink(out / "latest") == "README.md"
    assert values_in(out) == {2.0}
    assert listing(tmp_path) == ["out"]  # no temporary or old folder left beside it


def test_a_linked_folder_is_replaced_where_it_is(tmp_path):
    real = tmp_path / "disk" / "model"
    real.mkdir(parents=True)
    (real / "notes.txt").write_text("keep")
    (tmp_path / "link").symlink_to(real)
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and values_in(tmp_path / "link") == {1.0}
    assert (real / "notes.txt").read_text() == "keep" and listing(tmp_path / "disk") == ["model"]


def test_files_written_into_the_old_folder_during_the_swap_are_kept(tmp_path, monkeypatch):
    """Another process writes into the folder after its files were linked: new names and newer versions move into
    the new folder; nothing of it is lost with the old one."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "vocab.txt").write_text("old vocab")
    (out / "sub").mkdir()
    real_swap = model_writer.swap_in

    def swap_in(tmp, target):
        (target / "late.txt").write_text("late")
        (target / "sub" / "late.txt").write_text("late too")
        time.sleep(0.01)
        replacement = target / ".vocab.new"
        replacement.write_text("new vocab")
        os.replace(replacement, target / "vocab.txt")
        return real_swap(tmp, target)

    monkeypatch.setattr(model_writer, "swap_in", swap_in)
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out)
    assert (out / "late.txt").read_text() == "late" and (out / "sub" / "late.txt").read_text() == "late too"
    assert (out / "vocab.txt").read_text() == "new vocab"
    assert listing(tmp_path) == ["out"]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_failed_swap_keeps_the_old_model(tmp_path, monkeypatch, exchange):
    out = tmp_path / "out"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out, max_shard_size=SHARD)
    (out / "tokenizer.json").write_text("{}")
    if not exchange:
        monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
        real_replace = os.replace

        def replace(src, dst):
            if Path(src).name.startswith(".tmp-out-"):
                raise OSError(28, "No space left on device")
            return real_replace(src, dst)

        monkeypatch.setattr(layout.os, "replace", replace)
    else:
        def exchange_fails(a, b):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(layout, "_exchange", exchange_fails)
    with pytest.raises(OSError):
        save_state_dict_sharded(get_full_state_dict(Stack(2.0)), out)
    monkeypatch.undo()
    assert values_in(out) == {1.0}
    assert listing(tmp_path) == ["out"] and (out / "tokenizer.json").read_text() == "{}"


def test_without_exchange_the_two_renames_replace_it(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out, max_shard_size=SHARD)
    save_state_dict_sharded(get_full_state_dict(Stack(2.0)), out, max_shard_size=SHARD)
    assert values_in(out) == {2.0} and listing(tmp_path) == ["out"]


def test_a_folder_removed_midway_names_where_the_old_one_is(tmp_path):
    (tmp_path / ".old-out-0123abcd").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(".old-out-0123abcd")):
        load_checkpoint_in_model(Stack(), tmp_path / "out")


def test_in_place_when_the_folder_holds_the_working_directory(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out, max_shard_size=SHARD)
    (out / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(out)
    with pytest.warns(UserWarning, match="holds the working directory"):
        save_state_dict_sharded(get_full_state_dict(Stack(2.0)), ".")
    assert Path.cwd() == out.resolve() and values_in(out) == {2.0}
    assert listing(out) == ["accel_checksums.json", "model.safetensors", "tokenizer.json"]
    assert listing(tmp_path) == ["out"]


def test_in_place_when_a_file_cannot_be_linked(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out)
    (out / "tokenizer.json").write_text("{}")

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(model_writer.os, "link", refuse)
    with pytest.warns(UserWarning, match="cannot be linked"):
        save_state_dict_sharded(get_full_state_dict(Stack(2.0)), out, max_shard_size=SHARD)
    monkeypatch.undo()
    assert values_in(out) == {2.0} and (out / "tokenizer.json").read_text() == "{}"
    assert "accel_checksums.json" not in listing(out) and listing(tmp_path) == ["out"]


def test_in_place_when_the_folder_cannot_be_renamed(tmp_path, monkeypatch):
    """A bind mount of the same filesystem is not found by os.path.ismount; renaming it answers EBUSY."""
    out = tmp_path / "out"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out, max_shard_size=SHARD)
    (out / "tokenizer.json").write_text("{}")

    def busy(a, b):
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(layout, "_exchange", busy)
    with pytest.warns(UserWarning, match="cannot be renamed"):
        save_state_dict_sharded(get_full_state_dict(Stack(2.0)), out)
    monkeypatch.undo()
    assert values_in(out) == {2.0}
    assert listing(out) == ["accel_checksums.json", "model.safetensors", "tokenizer.json"]
    assert listing(tmp_path) == ["out"]


def test_stale_temporaries_of_a_model_folder_only(tmp_path):
    host, old = layout._HOST, layout.ABANDONED_AFTER + 60
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    made = {}
    for key, name in (("mine_dead", f".tmp-out-{host}-{dead.pid}-0123abcd"),
                      ("mine_alive", f".tmp-out-{host}-{os.getpid()}-0123abce"),
                      ("sibling_dead", f".tmp-other-{host}-{dead.pid}-0123abcf"),
                      ("unowned", ".tmp-out-something"),
                      ("foreign", ".tmp-cache")):
        path = tmp_path / name
        path.mkdir()
        then = time.time() - layout.UNOWNED_AFTER - 60 if key in ("unowned", "foreign") else time.time() - old
        os.utime(path, (then, then))
        made[key] = path
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), tmp_path / "out")
    assert {k for k, p in made.items() if p.exists()} == {"mine_alive", "sibling_dead", "unowned", "foreign"}


# ------------------------------------------------------------------------------------------------ processes

SAVER = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from accel.checkpoint import layout, model_io, model_writer

    out, value, shard, kill, repeat = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    model = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    state = {f"layers.{k}": v for k, v in model_io.get_full_state_dict(model).items()}

    def die():
        print("killing myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if kill == "shard":  # after the first shard is written
        real_write = model_writer.atomic_write
        def atomic_write(directory, name, write):
            path = real_write(directory, name, write)
            die()
        model_writer.atomic_write = atomic_write
    elif kill in ("swap", "swapped"):  # just before / after the folder is replaced
        real_swap = model_writer.swap_in
        def swap_in(tmp, target):
            if kill == "swap":
                die()
            old = real_swap(tmp, target)
            die()
        model_writer.swap_in = swap_in
    elif kill == "in_place":  # the working directory is the folder: files move in one by one; die after two
        os.chdir(out)
        real_replace, moved = os.replace, []
        def replace(src, dst):
            real_replace(src, dst)
            if Path(src).parent.name.startswith(".tmp-") and Path(dst).parent != Path(src).parent:
                moved.append(dst)
                if len(moved) == 2:
                    die()
        model_writer.os.replace = replace
    elif kill.startswith("race"):  # a wider window between linking the old folder's files and the swap
        real_swap = model_writer.swap_in
        def swap_in(tmp, target):
            time.sleep(0.01)
            return real_swap(tmp, target)
        model_writer.swap_in = swap_in
        if kill == "race_no_exchange":  # and between the two renames
            layout._exchange = lambda a, b: False
            real_replace = os.replace
            def replace(src, dst):
                real_replace(src, dst)
                if Path(dst).name.startswith(".old-"):
                    time.sleep(0.01)
            layout.os.replace = replace
    if kill == "hold":  # saves while the test holds the publish lock
        print("saving", flush=True)
    if os.environ.get("GO_FILE"):  # concurrent jobs start together: ready (torch imported), then wait for the go
        print("ready", flush=True)
        while not os.path.exists(os.environ["GO_FILE"]):
            time.sleep(0.005)
    for _ in range(repeat):
        model_io.save_state_dict_sharded(state, out, max_shard_size=shard)
    print("saved" if kill in ("none", "race", "race_no_exchange", "hold") else "not reached", flush=True)
''')


def run_saver(tmp_path: Path, out: Path, value: float, shard: str = SHARD, kill: str = "none", repeat: int = 1,
              wait: bool = True, go_file: Path | None = None):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(value), shard, kill, str(repeat)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "GO_FILE": str(go_file or "")})
    if not wait:
        return proc
    stdout, stderr = proc.communicate(timeout=240)
    return proc.returncode, stdout, stderr


def start_together(tmp_path: Path, *jobs: tuple) -> list:
    """run_saver(*args) for each of `jobs`, released together once each has imported torch."""
    go = tmp_path / "go"
    procs = [run_saver(*args, wait=False, go_file=go) for args in jobs]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.communicate(timeout=60)
    go.touch()
    return procs


@pytest.mark.parametrize("kill, survivor", [("shard", 1.0), ("swap", 1.0), ("swapped", 2.0)])
def test_sigkill_during_a_save_leaves_the_old_or_the_new_model_never_a_mix(tmp_path, kill, survivor):
    out = tmp_path / "models" / "out"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out, max_shard_size=SHARD)
    (out / "tokenizer.json").write_text("{}")
    rc, stdout, stderr = run_saver(tmp_path, out, 2.0, kill=kill)
    assert rc == -signal.SIGKILL and "killing myself" in stdout and "not reached" not in stdout, stderr
    assert values_in(out) == {survivor}  # complete and verified
    assert (out / "tokenizer.json").read_text() == "{}"
    leftovers = [p for p in (tmp_path / "models").iterdir() if p.name != "out"]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tmp-out-")  # kept until provably abandoned
    stale = time.time() - layout.ABANDONED_AFTER - 60
    for path in [leftovers[0], *leftovers[0].rglob("*")]:
        os.utime(path, (stale, stale), follow_symlinks=False)
    save_state_dict_sharded(get_full_state_dict(Stack(3.0)), out, max_shard_size=SHARD)  # removes it
    assert listing(tmp_path / "models") == ["out"] and values_in(out) == {3.0}


def test_sigkill_during_an_in_place_save_is_refused_not_loaded_as_a_mix(tmp_path):
    out = tmp_path / "out"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out, max_shard_size=SHARD)
    rc, stdout, stderr = run_saver(tmp_path, out, 2.0, kill="in_place")
    assert rc == -signal.SIGKILL and "killing myself" in stdout, stderr
    live = Stack(5.0)
    before = state_of(live)
    with pytest.raises(CheckpointError, match=r"model-0000[12]-of-00004.safetensors: damaged"):
        load_checkpoint_in_model(live, out)
    assert same(before, state_of(live))


@pytest.mark.parametrize("kill", ["race", "race_no_exchange"])
def test_two_jobs_saving_to_one_folder_end_with_one_complete_model(tmp_path, kill):
    """Two processes save different models (4 shards of 1.0 / one file of 2.0) into one folder, again and again,
    each with a wider window in its swap: every save succeeds, the folder always ends as exactly one of them, and a
    user file in it survives. (Without the publish lock, the variant with two renames fails here: a job finds the
    folder gone between the other's two renames, or cannot put the old one back.)"""
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    jobs = start_together(tmp_path, (tmp_path, out, 1.0, SHARD, kill, 20), (tmp_path, out, 2.0, "1GB", kill, 20))
    for job in jobs:
        stdout, stderr = job.communicate(timeout=240)
        assert job.returncode == 0 and "saved" in stdout, stderr
    final = values_in(out)
    assert final in ({1.0}, {2.0})
    expected = ([f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)] + [INDEX] if final == {1.0}
                else ["accel_checksums.json", "model.safetensors"])
    assert listing(out) == sorted([*expected, "tokenizer.json"])
    assert listing(tmp_path) == ["go", "out", "saver.py"]


def test_two_jobs_saving_to_sibling_folders_never_fail(tmp_path):
    parent = tmp_path / "models"
    jobs = start_together(tmp_path, (tmp_path, parent / "a", 1.0, SHARD, "race", 20),
                          (tmp_path, parent / "b", 2.0, SHARD, "race", 20))
    for job in jobs:
        stdout, stderr = job.communicate(timeout=240)
        assert job.returncode == 0 and "saved" in stdout, stderr
    assert values_in(parent / "a") == {1.0} and values_in(parent / "b") == {2.0}
    assert listing(parent) == ["a", "b"]


def test_a_save_waits_for_the_publish_lock(tmp_path):
    out = tmp_path / "out"
    save_state_dict_sharded(get_full_state_dict(Stack(1.0)), out)
    with layout.PublishLock(out):
        job = run_saver(tmp_path, out, 2.0, kill="hold", wait=False)
        assert job.stdout is not None and job.stdout.readline().strip() == "saving"
        time.sleep(2.0)  # its files are written by now; it waits for the lock
        assert job.poll() is None and values_in(out) == {1.0}
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 0 and "saved" in stdout, stderr
    assert values_in(out) == {2.0}


def test_the_lock_falls_back_to_a_lock_file_where_a_folder_cannot_be_locked(tmp_path, monkeypatch):
    import fcntl

    real_flock = fcntl.flock
    locked = []

    def flock(fd, op):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(9, "Bad file descriptor")  # as NFS answers for a folder
        locked.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with layout.PublishLock(tmp_path / "out") as lock:
        assert lock.fd is not None
        other = threading.Thread(target=lambda: layout.PublishLock(tmp_path / "out").__enter__().__exit__())
        other.start()
        other.join(0.5)
        assert other.is_alive()  # the second holder waits
    other.join(5)
    assert not other.is_alive()
    assert locked == [str(tmp_path / layout.PUBLISH_LOCK)] * 2
