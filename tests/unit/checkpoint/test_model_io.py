"""Model weights in Hugging Face's layout: sizes, sharded saves, tied weights, safe loading."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from accel.checkpoint import model_writer
from accel.checkpoint.layout import CheckpointError
from accel.checkpoint.model_io import (
    get_full_state_dict,
    load_checkpoint_in_model,
    parse_size,
    save_state_dict_sharded,
)

# --------------------------------------------------------------------------------------------- helpers


class Tiny(nn.Module):
    """Four 600-byte float32 tensors (150 elements) and one 5 KB tensor (1250 elements), plus a buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(15, 10)  # weight 150 floats = 600 B, bias 40 B
        self.b = nn.Linear(15, 10)
        self.big = nn.Linear(1250, 1, bias=False)  # weight 1250 floats = 5000 B
        self.c = nn.Linear(15, 10)
        self.register_buffer("steps", torch.tensor([7], dtype=torch.int64))


class TiedLM(nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 20, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight


def randomized(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    "value, expected",
    [
        (1234, 1234),
        (0, 0),
        ("10GB", 10 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("100KB", 100_000),
        ("1.5GB", 1_500_000_000),
        ("1kib", 1024),
        ("3 MiB", 3 * 2**20),
        ("1TB", 10**12),
        ("1TiB", 2**40),
        ("42", 42),
        ("42B", 42),
        (" 7 gb ", 7 * 10**9),
    ],
)
def test_parse_size_forms(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("bad", ["", "GB", "10XB", "ten GB", "-5MB", "1.2.3GB", -1, 1.5, None, True, "10 G B"])
def test_parse_size_rejects_bad_values(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert "GiB" in message and "GB" in message  # names the accepted forms


# ------------------------------------------------------------------------------------------------ save


def test_single_file_save_is_plain_safetensors(tmp_path):
    model = randomized(Tiny())
    sd = get_full_state_dict(model)
    paths = save_state_dict_sharded(sd, tmp_path / "out")
    assert paths == [tmp_path / "out" / "model.safetensors"]
    assert listing(tmp_path / "out") == ["accel_checksums.json", "model.safetensors"]  # + the file's checksum
    loaded = load_file(paths[0])
    assert loaded.keys() == sd.keys()
    for k in sd:
        assert torch.equal(loaded[k], sd[k]), k
    with safe_open(paths[0], framework="pt") as f:
        assert f.metadata() == {"format": "pt", "accel_save_id": f.metadata()["accel_save_id"]}  # the sidecar's


def test_sharded_save_respects_limit_and_writes_index(tmp_path):
    model = randomized(Tiny())
    sd = get_full_state_dict(model)
    out = tmp_path / "out"
    paths = save_state_dict_sharded(sd, out, max_shard_size="1KB")
    index_path = out / "model.safetensors.index.json"
    assert paths[-1] == index_path
    shards = paths[:-1]
    n = len(shards)
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert listing(out) == sorted(p.name for p in paths)

    index = json.loads(index_path.read_text())
    sizes = {k: v.numel() * v.element_size() for k, v in sd.items()}
    checksums = index["metadata"].pop("accel_checksums")  # every shard's checksum, and the index's own
    assert sorted(checksums) == [p.name for p in shards] and index["metadata"].pop("accel_index_checksum")
    assert index["metadata"] == {"total_size": sum(sizes.values())}
    assert index["weight_map"].keys() == sd.keys()

    seen_order = []
    for shard in shards:
        content = load_file(shard)
        with safe_open(shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        assert {k for k, v in index["weight_map"].items() if v == shard.name} == content.keys()
        total = sum(sizes[k] for k in content)
        if "big.weight" in content:
            assert list(content) == ["big.weight"]  # the oversized tensor alone
            assert total > 1000
        else:
            assert total <= 1000
        for k, v in content.items():
            assert torch.equal(v, sd[k])
        seen_order.extend(sorted(content, key=list(sd).index))
    assert seen_order == list(sd)  # shards filled in state-dict order
    # steps (8 B) + a.weight (600 B) + a.bias (40 B) fit together; b.weight would overflow
    assert [sorted(load_file(s)) for s in shards] == [
        ["a.bias", "a.weight", "steps"], ["b.bias", "b.weight"], ["big.weight"], ["c.bias", "c.weight"]
    ]


def test_resave_with_bigger_limit_removes_stale_shards(tmp_path):
    sd = get_full_state_dict(randomized(Tiny()))
    out = tmp_path / "out"
    (out).mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "model_ema.safetensors").write_bytes(b"not ours")
    first = save_state_dict_sharded(sd, out, max_shard_size="1KB")
    assert len(first) > 3
    second = save_state_dict_sharded(sd, out, max_shard_size="3KB")
    assert len(second) < len(first)
    assert listing(out) == sorted([p.name for p in second] + ["notes.txt", "model_ema.safetensors"])
    assert not any(p.exists() for p in first if p not in second)
    third = save_state_dict_sharded(sd, out)
    assert listing(out) == sorted(["model.safetensors", "accel_checksums.json", "notes.txt", "model_ema.safetensors"])
    assert third == [out / "model.safetensors"]
    # switching format removes the other format's files too (a folder load would otherwise pick them)
    fourth = save_state_dict_sharded(sd, out, safe_serialization=False)
    assert listing(out) == sorted(["pytorch_model.bin", "accel_checksums.json", "notes.txt", "model_ema.safetensors"])
    assert fourth == [out / "pytorch_model.bin"]


def test_atomic_write_leaves_no_temp_files_even_on_failure(tmp_path, monkeypatch):
    sd = get_full_state_dict(randomized(Tiny()))
    out = tmp_path / "out"
    save_state_dict_sharded(sd, out, max_shard_size="1KB")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert all(not name.startswith(".") and not name.endswith(".tmp") for name in before)

    import safetensors.torch

    real_save = safetensors.torch.save_file
    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"partial")
            raise OSError("disk full")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    sd2 = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    with pytest.raises(OSError, match="disk full"):
        save_state_dict_sharded(sd2, out, max_shard_size="1KB")
    # Writes went to temp names in a temporary folder beside it; none remain and the old index/shards are intact.
    assert all(Path(c).parent.parent == tmp_path and Path(c).parent.name.startswith(".tmp-out-") for c in calls)
    assert listing(tmp_path) == ["out"]
    assert set(listing(out)) == set(before)
    for name, data in before.items():
        assert (out / name).read_bytes() == data, name


def test_fsync_and_replace_used(tmp_path, monkeypatch):
    synced, replaced = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(model_writer.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(
        model_writer.os, "replace", lambda a, b: (replaced.append((Path(a), Path(b))), real_replace(a, b))[1]
    )
    paths = save_state_dict_sharded(get_full_state_dict(Tiny()), tmp_path / "out", max_shard_size="2KB")
    # each file written to a temporary name, then renamed, in a temporary folder that then became the model's
    assert [dst.name for _, dst in replaced] == [p.name for p in paths]
    assert all(src.parent == dst.parent != tmp_path / "out" and src != dst for src, dst in replaced)
    assert all(p.is_file() for p in paths) and listing(tmp_path) == ["out"]
    assert len(synced) >= len(paths) + 1  # every file and the folder


# ------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("safe", [True, False])
@pytest.mark.parametrize("limit", ["10GB", "1KB"])
def test_round_trip(tmp_path, safe, limit):
    src = randomized(Tiny(), seed=1)
    save_state_dict_sharded(get_full_state_dict(src), tmp_path, max_shard_size=limit, safe_serialization=safe)
    dst = randomized(Tiny(), seed=2)
    dst.steps.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing, unexpected = load_checkpoint_in_model(dst, tmp_path, strict=True)
    assert (missing, unexpected) == ([], [])
    assert_same_state(src, dst)


def test_bin_layout_names(tmp_path):
    sd = get_full_state_dict(randomized(Tiny()))
    paths = save_state_dict_sharded(sd, tmp_path, max_shard_size="1KB", safe_serialization=False)
    assert paths[-1].name == "pytorch_model.bin.index.json"
    n = len(paths) - 1
    assert [p.name for p in paths[:-1]] == [f"pytorch_model-{i:05d}-of-{n:05d}.bin" for i in range(1, n + 1)]
    index = json.loads(paths[-1].read_text())
    assert index["weight_map"].keys() == sd.keys()
    merged = {}
    for p in paths[:-1]:
        merged.update(torch.load(p, weights_only=True))
    assert merged.keys() == sd.keys()


def test_load_single_files_and_index_file(tmp_path):
    src = randomized(Tiny(), seed=3)
    sd = get_full_state_dict(src)
    save_state_dict_sharded(sd, tmp_path / "st", max_shard_size="1KB")
    for ckpt in (tmp_path / "st" / "model.safetensors.index.json",):
        dst = Tiny()
        load_checkpoint_in_model(dst, ckpt, strict=True)
        assert_same_state(src, dst)
    torch.save(sd, tmp_path / "weights.pt")
    dst = Tiny()
    load_checkpoint_in_model(dst, tmp_path / "weights.pt", strict=True)
    assert_same_state(src, dst)


def test_folder_without_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_checkpoint_in_model(Tiny(), tmp_path)
    assert str(tmp_path) in str(info.value)
    names = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")
    for name in names:
        assert name in str(info.value)


def test_folder_prefers_safetensors_index(tmp_path):
    src = randomized(Tiny(), seed=4)
    save_state_dict_sharded(get_full_state_dict(src), tmp_path, max_shard_size="1KB")
    torch.save(get_full_state_dict(randomized(Tiny(), seed=5)), tmp_path / "pytorch_model.bin")
    dst = Tiny()
    load_checkpoint_in_model(dst, tmp_path)
    assert_same_state(src, dst)


# ---------------------------------------------------------------------------------------------- tying


@pytest.mark.parametrize("limit", ["10GB", "300B"])
def test_tied_weights_saved_once_and_restored(tmp_path, limit):
    src = randomized(TiedLM(), seed=6)
    assert src.lm_head.weight is src.embed.weight
    sd = get_full_state_dict(src)
    assert sd["lm_head.weight"] is sd["embed.weight"]
    paths = save_state_dict_sharded(sd, tmp_path, max_shard_size=limit)

    stored = {}
    tied_records = {}
    for p in paths:
        if p.suffix == ".safetensors":
            stored.update(load_file(p))
            with safe_open(p, framework="pt") as f:
                meta = f.metadata()
            assert meta["format"] == "pt"
            if "accel_tied" in meta:
                tied_records[p.name] = json.loads(meta["accel_tied"])
    assert "lm_head.weight" not in stored and "embed.weight" in stored  # saved once, first name kept
    holder = [p.name for p in paths if p.suffix == ".safetensors" and "embed.weight" in load_file(p)]
    assert tied_records == {holder[0]: {"lm_head.weight": "embed.weight"}}
    if len(paths) > 1:
        index = json.loads(paths[-1].read_text())
        assert index["metadata"]["accel_tied"] == {"lm_head.weight": "embed.weight"}
        assert "lm_head.weight" not in index["weight_map"]
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in stored.values())

    tied_dst = TiedLM()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_checkpoint_in_model(tied_dst, tmp_path, strict=True) == ([], [])
    assert tied_dst.lm_head.weight is tied_dst.embed.weight
    assert_same_state(src, tied_dst)

    untied_dst = TiedLM(tie=False)
    assert load_checkpoint_in_model(untied_dst, tmp_path, strict=True) == ([], [])
    assert untied_dst.lm_head.weight is not untied_dst.embed.weight
    assert torch.equal(untied_dst.lm_head.weight, src.embed.weight)
    assert torch.equal(untied_dst.embed.weight, src.embed.weight)
    assert_same_state(src, untied_dst)


def test_tied_weights_bin_round_trip(tmp_path):
    src = randomized(TiedLM(), seed=7)
    save_state_dict_sharded(get_full_state_dict(src), tmp_path, safe_serialization=False)
    raw = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert raw["lm_head.weight"].untyped_storage().data_ptr() == raw["embed.weight"].untyped_storage().data_ptr()
    dst = TiedLM(tie=False)
    load_checkpoint_in_model(dst, tmp_path, strict=True)
    assert_same_state(src, dst)


def test_views_sharing_storage_saved_as_copies(tmp_path):
    base = torch.arange(12.0)
    sd = {"whole": base.view(3, 4), "flat": base, "half": base[6:], "t": base.view(3, 4).t()}
    save_state_dict_sharded(sd, tmp_path)
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == sd.keys()
    for k in sd:
        assert torch.equal(loaded[k], sd[k]), k


# ------------------------------------------------------------------------------------- dtype and meta


def test_dtype_conversion_on_load(tmp_path):
    src = randomized(Tiny(), seed=8)
    save_state_dict_sharded(get_full_state_dict(src), tmp_path)
    dst = Tiny()
    weight_obj = dst.a.weight
    load_checkpoint_in_model(dst, tmp_path, dtype=torch.bfloat16, strict=True)
    assert dst.a.weight is weight_obj and dst.a.weight.dtype == torch.bfloat16
    assert dst.big.weight.dtype == torch.bfloat16
    assert dst.steps.dtype == torch.int64  # integer buffers keep their dtype
    assert torch.equal(dst.a.weight, src.a.weight.to(torch.bfloat16))

    # without dtype: checkpoint values are converted to the model's dtype
    half = {k: v.half() if v.is_floating_point() else v for k, v in get_full_state_dict(src).items()}
    save_state_dict_sharded(half, tmp_path / "half")
    dst = Tiny()
    load_checkpoint_in_model(dst, tmp_path / "half", strict=True)
    assert dst.a.weight.dtype == torch.float32
    assert torch.equal(dst.a.weight, src.a.weight.half().float())


@pytest.mark.parametrize("tie", [True, False])
def test_meta_model_materialized(tmp_path, tie):
    src = randomized(TiedLM(), seed=9)
    save_state_dict_sharded(get_full_state_dict(src), tmp_path, max_shard_size="400B")
    with torch.device("meta"):
        dst = TiedLM(tie=tie)
    dst.body.bias.requires_grad_(False)
    assert dst.embed.weight.is_meta
    load_checkpoint_in_model(dst, tmp_path, strict=True)
    for name, t in list(dst.named_parameters(remove_duplicate=False)) + list(dst.named_buffers()):
        assert t.device.type == "cpu" and isinstance(t, nn.Parameter), name
    assert dst.body.bias.requires_grad is False and dst.body.weight.requires_grad is True
    assert (dst.lm_head.weight is dst.embed.weight) == tie
    if not tie:  # independent storages: writing one must not change the other
        with torch.no_grad():
            dst.lm_head.weight.zero_()
        assert torch.equal(dst.embed.weight, src.embed.weight)
    else:
        assert_same_state(src, dst)


# -------------------------------------------------------------------------------------- pickle safety


class Payload:
    def __init__(self):
        self.x = 1


def test_bin_loaded_with_weights_only_and_pickled_objects_refused(tmp_path, monkeypatch):
    src = randomized(Tiny(), seed=10)
    torch.save(get_full_state_dict(src), tmp_path / "pytorch_model.bin")

    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    dst = Tiny()
    load_checkpoint_in_model(dst, tmp_path, strict=True)
    assert_same_state(src, dst)
    assert calls and all(c.get("weights_only") is True for c in calls)

    evil = {**get_full_state_dict(src), "extra": Payload()}
    torch.save(evil, tmp_path / "evil.bin")
    with pytest.raises(RuntimeError) as info:
        load_checkpoint_in_model(Tiny(), tmp_path / "evil.bin")
    assert "evil.bin" in str(info.value) and "weights_only" in str(info.value)
    import pickle

    assert isinstance(info.value, pickle.UnpicklingError)  # as Accelerate's load raises; one line, torch's not chained
    assert "Payload" in str(info.value) and "\n" not in str(info.value) and info.value.__cause__ is None


# ------------------------------------------------------------------------------------ key mismatches


def test_missing_and_unexpected_keys_warn_or_raise(tmp_path):
    sd = get_full_state_dict(randomized(Tiny()))
    del sd["c.bias"]
    sd["ghost.weight"] = torch.zeros(3)
    save_state_dict_sharded(sd, tmp_path)
    with pytest.warns(UserWarning) as record:
        missing, unexpected = load_checkpoint_in_model(Tiny(), tmp_path)
    assert missing == ["c.bias"] and unexpected == ["ghost.weight"]
    text = str(record[0].message)
    assert "c.bias" in text and "ghost.weight" in text

    dst = randomized(Tiny(), seed=11)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"c\.bias[\s\S]*ghost\.weight"):
        load_checkpoint_in_model(dst, tmp_path, strict=True)
    for k, v in dst.state_dict().items():  # strict failure happens before anything is copied
        assert torch.equal(v, before[k]), k


def test_many_missing_keys_listed_first_ten_and_count(tmp_path):
    save_file({"only": torch.zeros(1)}, tmp_path / "model.safetensors")
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])  # 16 keys
    with pytest.warns(UserWarning, match=r"16 key\(s\)[\s\S]*\(6 more\)"):
        missing, unexpected = load_checkpoint_in_model(model, tmp_path)
    assert len(missing) == 16 and unexpected == ["only"]


def test_shape_mismatch_is_an_error(tmp_path):
    sd = get_full_state_dict(Tiny())
    sd["a.weight"] = torch.zeros(10, 14)
    for safe in (True, False):
        out = tmp_path / str(safe)
        save_state_dict_sharded(sd, out, safe_serialization=safe)
        with pytest.raises(RuntimeError) as info:
            load_checkpoint_in_model(Tiny(), out)
        assert "a.weight" in str(info.value) and "(10, 14)" in str(info.value) and "(10, 15)" in str(info.value)


# ---------------------------------------------------------------------------------- hostile checkpoints


def _write_index(folder: Path, weight_map: dict) -> Path:
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize(
    "entry", ["../evil.safetensors", "/tmp/evil.safetensors", "sub/../../evil.safetensors", "../ckpt/ok.safetensors"]
)
def test_index_escaping_folder_refused(tmp_path, entry):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a.weight": torch.zeros(10, 15)}, tmp_path / "evil.safetensors")
    save_file({"a.weight": torch.zeros(10, 15)}, folder / "ok.safetensors")  # any ".." is refused
    _write_index(folder, {"a.weight": entry})
    with pytest.raises(ValueError) as info:
        load_checkpoint_in_model(Tiny(), folder)
    assert entry in str(info.value)


def test_index_shard_that_is_a_link_in_the_folder_loads(tmp_path):
    """The folder's own links are followed (the Hub cache's layout: tests/unit/big_model/test_hub_cache_and_links.py);
    only what the index names is checked."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a.weight": torch.ones(10, 15)}, tmp_path / "blob.safetensors")
    (folder / "model-00001-of-00001.safetensors").symlink_to(tmp_path / "blob.safetensors")
    _write_index(folder, {"a.weight": "model-00001-of-00001.safetensors"})
    model = Tiny()
    with pytest.warns(UserWarning, match="missing keys"):
        load_checkpoint_in_model(model, folder)
    assert torch.equal(model.a.weight, torch.ones(10, 15))


def test_missing_shard_named(tmp_path):
    save_state_dict_sharded(get_full_state_dict(Tiny()), tmp_path, max_shard_size="1KB")
    victim = tmp_path / "model-00003-of-00004.safetensors"
    victim.unlink()
    dst = randomized(Tiny(), seed=12)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(FileNotFoundError, match=re.escape(victim.name)):
        load_checkpoint_in_model(dst, tmp_path)
    for k, v in dst.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_truncated_shard_named(tmp_path):
    save_state_dict_sharded(get_full_state_dict(Tiny()), tmp_path, max_shard_size="1KB")
    victim = tmp_path / "model-00002-of-00004.safetensors"
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=re.escape(victim.name)):  # found by its checksum
        load_checkpoint_in_model(Tiny(), tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"  # a folder of another tool: no checksums
    index = json.loads(index_path.read_text())
    del index["metadata"]["accel_checksums"], index["metadata"]["accel_index_checksum"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:  # shorter than its safetensors header declares: one line
        load_checkpoint_in_model(Tiny(), tmp_path)
    assert str(info.value).startswith(f"{victim}: damaged (size ") and "its header declares" in str(info.value)


def test_truncated_single_file_named(tmp_path):
    save_state_dict_sharded(get_full_state_dict(Tiny()), tmp_path)
    victim = tmp_path / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:20])
    with pytest.raises(RuntimeError, match="model.safetensors"):
        load_checkpoint_in_model(Tiny(), tmp_path)


# ----------------------------------------------------------------------------------- full state dict


def test_get_full_state_dict_unwraps_and_strips_prefix():
    model = randomized(TiedLM(), seed=13)
    wrapper = nn.Module()
    wrapper._orig_mod = model  # what torch.compile's OptimizedModule looks like
    for candidate in (model, wrapper):
        sd = get_full_state_dict(candidate)
        assert list(sd) == list(model.state_dict())
        assert sd["lm_head.weight"] is sd["embed.weight"]
        assert all(not v.requires_grad and v.device.type == "cpu" for v in sd.values())

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Module()
            self.inner._orig_mod = nn.Linear(2, 2)

    sd = get_full_state_dict(Holder())
    assert sorted(sd) == ["inner.bias", "inner.weight"]


def test_get_full_state_dict_unwraps_ddp(monkeypatch):
    model = randomized(Tiny(), seed=14)
    ddp = object.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = model
    sd = get_full_state_dict(ddp)
    assert list(sd) == list(model.state_dict())
