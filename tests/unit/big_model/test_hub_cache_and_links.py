"""Models in the Hugging Face Hub cache load; what a file names outside its folder, and writes through links, do not.

A model downloaded with ``huggingface_hub`` lives in ``models--org--name/snapshots/<commit>/``, whose files are
relative symbolic links to ``../../blobs/<sha256>``. Reading a folder the user chose through its own links is what
every loader does; what is refused is an index that *names* a file outside its folder (an absolute path, ``..``),
a save that would write through a link into a file outside its target, a pickle that would run code, and JSON bombs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import accel
from accel.checkpoint import model_io
from accel.checkpoint.model_io import save_state_dict_sharded

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)
        self.register_buffer("steps", torch.tensor([3], dtype=torch.int64))

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _zeroed() -> Net:
    net = _net(1)
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    return net


def _assert_equal(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name].cpu(), value), name


def to_hub_cache(src: Path, cache: Path, repo: str = "org/tiny") -> Path:
    """Rearrange the files of ``src`` into the Hub cache layout (``huggingface_hub``'s: blobs named by their sha256,
    ``snapshots/<commit>/<file>`` relative links to ``../../blobs/<sha>``, ``refs/main`` naming the commit); returns the
    snapshot folder."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for file in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = file.relative_to(src)
        data = file.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (root / "blobs" / sha).write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / "blobs" / sha, link.parent), link)
    return snapshot


def _plain_sharded(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """A sharded safetensors checkpoint as transformers writes it (no accel checksums), plus a config.json."""
    folder.mkdir(parents=True)
    names = list(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), 1):
        file = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: state[n].contiguous() for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1},
                                                                     "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "net"}))


@pytest.fixture
def hub(tmp_path):
    expected = _net().state_dict()
    _plain_sharded(tmp_path / "src", expected)
    snapshot = to_hub_cache(tmp_path / "src", tmp_path / "cache")
    assert (snapshot / "model.safetensors.index.json").is_symlink()
    return snapshot, expected


# ----------------------------------------------------------------------------------------- Hub cache loads


def test_hub_cache_snapshot_loads_with_every_loader(hub, tmp_path):
    snapshot, expected = hub
    for load in (lambda m, c: model_io.load_checkpoint_in_model(m, c),
                 lambda m, c: accel.load_checkpoint_in_model(m, c),
                 lambda m, c: accel.load_checkpoint_in_model(m, c, device_map={"": "cpu"})):
        for checkpoint in (snapshot, snapshot / "model.safetensors.index.json"):
            model = _zeroed()
            assert load(model, checkpoint) == ([], [])
            _assert_equal(model, expected)
    for device_map in ("auto", {"": "cpu"}, None):
        with accel.init_empty_weights():
            model = Net()
        model = accel.load_checkpoint_and_dispatch(model, str(snapshot), device_map=device_map)
        _assert_equal(model, expected)


def test_hub_cache_snapshot_offloads_to_disk(hub, tmp_path):
    snapshot, expected = hub
    with accel.init_empty_weights():
        model = Net()
    device_map = {"a": "cpu", "b": "disk", "c": "disk", "steps": "cpu"}
    model = accel.load_checkpoint_and_dispatch(model, str(snapshot), device_map=device_map,
                                               offload_folder=str(tmp_path / "off"))
    x = torch.randn(2, 16)
    reference = _net()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_hub_cache_of_an_accel_save_loads(tmp_path):
    """A save_model folder uploaded to the Hub and downloaded again: the checksums in its index still verify."""
    expected = _net().state_dict()
    save_state_dict_sharded(dict(expected), tmp_path / "src", max_shard_size="1KB")
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 2
    snapshot = to_hub_cache(tmp_path / "src", tmp_path / "cache")
    model = _zeroed()
    assert accel.load_checkpoint_in_model(model, snapshot) == ([], [])
    _assert_equal(model, expected)
    save_state_dict_sharded(dict(expected), tmp_path / "single")
    snapshot = to_hub_cache(tmp_path / "single", tmp_path / "cache2")
    model = _zeroed()
    assert model_io.load_checkpoint_in_model(model, snapshot) == ([], [])
    _assert_equal(model, expected)


def test_bare_index_in_hub_cache_loads(tmp_path):
    """Accelerate's bare index ({name: shard}) under another name, in the Hub layout."""
    expected = _net().state_dict()
    _plain_sharded(tmp_path / "src", expected)
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    (tmp_path / "src" / "model.safetensors.index.json").unlink()
    (tmp_path / "src" / "weights.index.json").write_text(json.dumps(index))
    snapshot = to_hub_cache(tmp_path / "src", tmp_path / "cache")
    model = _zeroed()
    accel.load_checkpoint_in_model(model, snapshot)
    _assert_equal(model, expected)


# ------------------------------------------------------------------------------ names that leave the folder


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/ABS/outside.safetensors", "sub/../../x.safetensors",
                                   "sub\\..\\x.safetensors", "", "./../x.safetensors"])
def test_index_naming_a_file_outside_its_folder_is_refused(tmp_path, entry):
    expected = _net().state_dict()
    outside = tmp_path / "outside.safetensors"
    save_file({n: t.contiguous() for n, t in expected.items()}, str(outside))
    entry = entry.replace("/ABS", str(tmp_path)) if entry.startswith("/ABS") else entry
    folder = tmp_path / "ckpt" / "sub"
    folder.mkdir(parents=True)
    folder = folder.parent
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: entry for n in expected}}))
    loaders = (lambda m: model_io.load_checkpoint_in_model(m, folder),
               lambda m: accel.load_checkpoint_in_model(m, folder, device_map={"": "cpu"}))
    for load in loaders:
        model = _zeroed()
        with pytest.raises(ValueError) as info:
            load(model)
        message = str(info.value)
        assert "\n" not in message and "model.safetensors.index.json" in message and repr(entry) in message, message
        assert "allowed" in message, message
        assert all(not v.any() for k, v in model.state_dict().items() if k != "steps")  # nothing loaded
    # the bare-index form goes through the same check
    (folder / "model.safetensors.index.json").unlink()
    (folder / "w.index.json").write_text(json.dumps({n: entry for n in expected}))
    with pytest.raises(ValueError, match="allowed"):
        accel.load_checkpoint_in_model(_zeroed(), folder)


# ------------------------------------------------------------------------------------- writes through links


def _outside_file(tmp_path: Path) -> tuple[Path, bytes]:
    victim = tmp_path / "victim" / "blob"
    victim.parent.mkdir()
    victim.write_bytes(b"precious bytes")
    return victim, b"precious bytes"


@pytest.mark.parametrize("shard_size", ["10GB", "1KB"])
@pytest.mark.parametrize("in_place", [False, True])
def test_save_into_a_folder_whose_model_files_are_links_writes_no_file_outside(tmp_path, monkeypatch, shard_size,
                                                                                 in_place):
    """Saving into a Hub snapshot (or any folder whose model files link elsewhere): the links are replaced by the
    new files, the files they pointed to are untouched; other links of the folder stay links."""
    victim, content = _outside_file(tmp_path)
    target = tmp_path / "out"
    target.mkdir()
    names = ["model.safetensors", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
             "model-00003-of-00003.safetensors", "model.safetensors.index.json", "accel_checksums.json", "config.json"]
    for name in names:
        os.symlink(os.path.relpath(victim, target), target / name)
    tokenizer_dir = tmp_path / "victim" / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "vocab.txt").write_text("a b c")
    os.symlink(tokenizer_dir, target / "tokenizer")
    if in_place:
        monkeypatch.chdir(target)  # the working directory: replaced file by file
    expected = _net().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_state_dict_sharded(dict(expected), target, max_shard_size=shard_size,
                                extra_files={"config.json": lambda p: p.write_text("{}")})
    assert victim.read_bytes() == content
    assert sorted(os.listdir(tokenizer_dir)) == ["vocab.txt"] and (tokenizer_dir / "vocab.txt").read_text() == "a b c"
    assert (target / "tokenizer").is_symlink()
    for name in os.listdir(target):
        if name != "tokenizer" and not name.startswith("."):
            assert not (target / name).is_symlink(), name
    model = _zeroed()
    model_io.load_checkpoint_in_model(model, target)
    _assert_equal(model, expected)


def test_merge_output_through_links_writes_no_file_outside(tmp_path):
    """merge_fsdp_weights writes its output with the same save: a link named model.safetensors is replaced."""
    victim, content = _outside_file(tmp_path)
    target = tmp_path / "merged"
    target.mkdir()
    os.symlink(victim, target / "model.safetensors")
    save_state_dict_sharded(dict(_net().state_dict()), target, max_shard_size=2**62)
    assert victim.read_bytes() == content and not (target / "model.safetensors").is_symlink()


def test_offload_weight_through_a_link_writes_no_file_outside(tmp_path):
    from accel.big_model.offload import load_offloaded_weight, offload_weight

    victim, content = _outside_file(tmp_path)
    folder = tmp_path / "off"
    folder.mkdir()
    os.symlink(victim, folder / "a.weight.safetensors")
    value = torch.arange(6.0).reshape(2, 3)
    index = offload_weight(value, "a.weight", folder)
    assert victim.read_bytes() == content
    assert not (folder / "a.weight.safetensors").is_symlink()
    assert torch.equal(load_offloaded_weight(index["a.weight"], folder), value)


def test_offload_weight_named_out_of_its_folder_is_refused(tmp_path):
    from accel.big_model.offload import offload_state_dict

    with pytest.raises(ValueError) as info:
        offload_state_dict(tmp_path / "off", {"../escaped": torch.zeros(2)})
    assert "\n" not in str(info.value) and "'../escaped'" in str(info.value) and "allowed" in str(info.value)
    assert not (tmp_path / "escaped.safetensors").exists()


def test_offloaded_weights_index_naming_a_dat_file_outside_is_refused(tmp_path):
    from accel.big_model.modeling import load_offloaded_weights

    outside = tmp_path / "x.dat"
    outside.write_bytes(b"\0" * 16)
    (tmp_path / "off").mkdir()
    with pytest.raises(ValueError) as info:
        load_offloaded_weights(_net(), {"../x": {"dtype": "float32", "shape": [4]}}, tmp_path / "off")
    assert "\n" not in str(info.value) and "'../x'" in str(info.value)


# ---------------------------------------------------------------------------------------- malicious pickle


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _load_bin(how: str, folder: Path, weights: Path) -> None:
    """Load a .bin checkpoint through one of the loaders that read torch files."""
    if how == "model_io":
        model_io.load_checkpoint_in_model(_net(), folder)
    elif how == "modeling":
        accel.load_checkpoint_in_model(_net(), folder, device_map={"": "cpu"})
    elif how == "load_state_dict":
        from accel.big_model.modeling import load_state_dict

        load_state_dict(weights)
    else:
        accel.load_checkpoint_in_model(_net(), folder)


@pytest.mark.parametrize("how", ["model_io", "modeling", "load_state_dict", "sharded"])
def test_malicious_pickle_is_refused_in_one_line(tmp_path, how):
    marker = tmp_path / "pwned"
    folder = tmp_path / "ckpt"
    folder.mkdir()
    weights = folder / ("pytorch_model.bin" if how != "sharded" else "pytorch_model-00001-of-00001.bin")
    torch.save({"a.weight": _Evil(marker)}, weights)
    if how == "sharded":
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a.weight": weights.name}}))
    with pytest.raises(Exception) as info:
        _load_bin(how, folder, weights)
    message = str(info.value)
    assert "\n" not in message, message
    assert weights.name in message and "posix.system" in message and "safetensors" in message, message
    assert "tensors" in message and len(message) < 400, message
    assert not marker.exists()


class _Bytes:
    """Pickles as `bytearray(n)`, which torch.load(weights_only=True) admits: a 150-byte file asks for n bytes."""

    def __init__(self, n: int):
        self.n = n

    def __reduce__(self):
        return (bytearray, (self.n,))


@pytest.mark.parametrize("how", ["model_io", "modeling", "load_state_dict", "sharded"])
def test_a_bin_file_that_would_allocate_at_its_word_is_refused_before_torch_reads_it(tmp_path, how):
    """What weights_only admits can still allocate: bytearray(2**31) zero-fills 2 GiB from a tiny file. Each .bin
    loader checks the archive (accel.checkpoint.torch_file) first: one line naming the file, nothing allocated."""
    import resource

    folder = tmp_path / "ckpt"
    folder.mkdir()
    weights = folder / ("pytorch_model.bin" if how != "sharded" else "pytorch_model-00001-of-00001.bin")
    torch.save({"a.weight": _Bytes(2**31)}, weights)
    assert weights.stat().st_size < 2000
    if how == "sharded":
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a.weight": weights.name}}))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(Exception) as info:
        _load_bin(how, folder, weights)
    message = str(info.value)
    assert "\n" not in message and weights.name in message and "builtins.bytearray" in message, message
    assert "safetensors" in message, message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024  # KiB: far below 2 GiB


def test_real_bin_files_still_load_tied_views_and_parameters(tmp_path):
    """The check admits what torch.save writes for real models: tied weights (one storage, two names), a slice
    saved as a view of a bigger storage, parameters, bf16, an OrderedDict with _metadata."""
    from accel.big_model.modeling import load_state_dict

    net = _net()
    state = net.state_dict()
    fused = torch.arange(12.0).reshape(3, 4)
    state_in = {**state, "tied": state[next(iter(state))], "view": fused[1:], "param": nn.Parameter(torch.ones(2)),
                "half": torch.ones(3, dtype=torch.bfloat16)}
    path = tmp_path / "pytorch_model.bin"
    torch.save(state_in, path)
    loaded = load_state_dict(path)
    assert set(loaded) == set(state_in)
    assert all(torch.equal(loaded[k], v.detach()) for k, v in state_in.items())
    torch.save(net.state_dict(), path)  # an OrderedDict carrying _metadata
    model_io.load_checkpoint_in_model(net, tmp_path)


# --------------------------------------------------------------------------------------------- JSON bombs


@pytest.mark.parametrize("bomb", ["number_weight_map", "number_metadata", "deep_metadata", "deep_weight_map",
                                  "deep_bare"])
def test_json_bombs_in_an_index_are_one_line(tmp_path, bomb):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a.weight": torch.zeros(16, 16)}, str(folder / "model-00001-of-00001.safetensors"))
    big = "9" * 5000
    deep = "[" * 100_000 + "]" * 100_000
    shard = '"model-00001-of-00001.safetensors"'
    text = {
        "number_weight_map": '{"weight_map": {"a.weight": %s, "b": %s}}' % (shard, big),
        "number_metadata": '{"metadata": {"total_size": %s}, "weight_map": {"a.weight": %s}}' % (big, shard),
        "deep_metadata": '{"metadata": {"x": %s}, "weight_map": {"a.weight": %s}}' % (deep, shard),
        "deep_weight_map": '{"weight_map": {"a.weight": %s}}' % deep,
        "deep_bare": '{"a.weight": %s}' % deep,
    }[bomb]
    name = "w.index.json" if bomb == "deep_bare" else "model.safetensors.index.json"
    (folder / name).write_text(text)
    loaders = [lambda: accel.load_checkpoint_in_model(_net(), folder),
               lambda: accel.load_checkpoint_in_model(_net(), folder, device_map={"": "cpu"})]
    if bomb != "deep_bare":
        loaders.append(lambda: model_io.load_checkpoint_in_model(_net(), folder))
    for load in loaders:
        with pytest.raises(ValueError) as info:
            load()
        message = str(info.value)
        assert "\n" not in message and name in message and len(message) < 400, message


# ----------------------------------------------------------------------------- transformers' from_pretrained

_FROM_PRETRAINED = textwrap.dedent("""
    import json, os, sys, torch
    import accelerate
    from transformers import AutoModelForCausalLM
    cache, direct = sys.argv[1], sys.argv[2]
    ids = torch.tensor([[1, 5, 9, 200, 3, 17]])
    out = {"impl": accelerate.__file__}
    disk = {"device_map": "auto", "max_memory": {"cpu": "200KB"}, "offload_folder": "off"}
    for name, kwargs in {"plain": {}, "auto": {"device_map": "auto"}, "disk": disk}.items():
        for source, where in (("hub", dict(pretrained_model_name_or_path="org/tiny", cache_dir=cache)),
                              ("direct", dict(pretrained_model_name_or_path=direct))):
            model = AutoModelForCausalLM.from_pretrained(**where, **kwargs)
            with torch.no_grad():
                out[f"{name}-{source}"] = model(ids).logits.flatten().tolist()
    print(json.dumps(out))
""")


def test_from_pretrained_from_the_hub_cache_through_the_shim(tmp_path):
    transformers = pytest.importorskip("transformers")
    from accel.shim import PATH

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "direct", max_shard_size="60KB")
    assert len(list((tmp_path / "direct").glob("*.safetensors"))) > 2
    to_hub_cache(tmp_path / "direct", tmp_path / "cache")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": PATH}
    result = subprocess.run([sys.executable, "-c", _FROM_PRETRAINED, str(tmp_path / "cache"), str(tmp_path / "direct")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "accel" in out.pop("impl")
    for name in ("plain", "auto", "disk"):
        assert out[f"{name}-hub"] == out[f"{name}-direct"], name
    assert out["plain-hub"] == out["auto-hub"] == out["disk-hub"]


def test_max_memory_in_float_bytes_as_transformers_passes_it():
    """transformers' device_map="auto" without max_memory passes 90% of the free memory, a float."""
    from accel.big_model.modeling import get_max_memory

    assert get_max_memory({"cpu": 2_000_000.6}) == {"cpu": 2_000_000}
    with pytest.raises(ValueError, match="max_memory"):
        get_max_memory({"cpu": float("nan")})
