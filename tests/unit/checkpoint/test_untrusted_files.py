"""Nothing runs that the user did not write: files a loader reads are untrusted.

A planted pickle (a DCP `.metadata`, a `.distcp` item) runs nothing; a JSON value cannot make a loader allocate
more than the file holds; every refusal is one line naming the file (and the key)."""

from __future__ import annotations

import io
import json
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from accel.checkpoint import layout
from accel.checkpoint.layout import CheckpointError
from accel.checkpoint.merge import MergeError, merge_fsdp_weights
from accel.core.safe_json import JSONFileError, parse_json, read_json


# -- the JSON reader --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ('{"metadata": {"total_size": ' + "9" * 5000 + "}}",
     "key 'metadata.total_size': an integer of 5000 digits"),
    ('{"a": 1, "a": 2}', "names the key 'a' twice"),
    ('{"a": ' + "[" * 150 + "]" * 150 + "}", "nested more than 100 levels deep"),
    ('{"a": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),
    ("[1, 2]", "its top level is a JSON array; allowed: a JSON object"),
    ('{"a": ', "not JSON (line 1 column 7"),
])
def test_json_refusals_name_the_file_and_key(tmp_path, text, expected):
    path = tmp_path / "index.json"
    path.write_text(text)
    with pytest.raises(JSONFileError) as info:
        read_json(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and expected in message and "allowed: " in message
    assert "\n" not in message and len(message) < 400


def test_json_file_size_and_kind_are_bounded(tmp_path):
    big = tmp_path / "big.json"
    big.write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(JSONFileError, match=r"big.json: 2009 bytes; allowed: a JSON file of at most 1000 bytes"):
        read_json(big, max_bytes=1000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(JSONFileError, match="fifo.json: not a regular file"):  # refused, never blocks
        read_json(fifo)
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(JSONFileError, match=r"bad.json: not UTF-8 \(byte 0xff at offset 7\)"):
        read_json(bad)


def test_json_reads_what_accel_writes(tmp_path):
    value = {"a": [1, 2.5, None, True, "s", {"b": float("inf")}], "n": 2**64}
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(value))
    assert read_json(path) == value
    assert parse_json(b"\xef\xbb\xbf[1]", "x", top=list) == [1]


# -- planted pickles --------------------------------------------------------------------------------------------



class _Planted:
    """Unpickled, it creates its marker file: proof that the pickle ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path, marker) -> None:
    path.write_bytes(pickle.dumps(_Planted(marker)))


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)


class _Counter:
    """A registered object whose state holds a numpy array (the manifest's `__numpy__` values)."""

    def __init__(self):
        self.values = np.arange(3, dtype=np.uint32)

    def state_dict(self):
        return {"values": self.values}

    def load_state_dict(self, state):
        self.values = state["values"]


def _saved(tmp_path, name="ckpt"):
    from accel import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(2, 3)).sum())
    optimizer.step()
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    folder = tmp_path / name
    accelerator.save_state(str(folder))
    return accelerator, model, folder


def test_planted_metadata_in_a_save_state_folder_runs_nothing_cli(tmp_path, run_accel):
    """`accel merge-weights` of a save_state folder holding a planted `.metadata`: accel's manifest wins, the pickle
    is never opened, the merge is the model's; one planted in state/ (given as the folder or as state/) is refused in
    one line, as load_state refuses it, and never opened either."""
    accelerator, model, folder = _saved(tmp_path)
    marker = tmp_path / "ran"
    _plant(folder / ".metadata", marker)
    expected = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    proc = run_accel("merge-weights", folder, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], v) for k, v in expected.items())
    _plant(folder / "state" / ".metadata", marker)
    for source in (folder, folder / "state"):
        proc = run_accel("merge-weights", source, tmp_path / "out2")
        assert proc.returncode == 2 and not marker.exists()
        assert proc.stderr.strip().splitlines() == [f"accel merge-weights: error: {folder / 'state' / '.metadata'}: "
                                                    f"not listed in {folder / layout.MANIFEST}; a checkpoint's "
                                                    "state/ holds only the files its manifest lists"], proc.stderr
    assert not marker.exists()


def test_planted_metadata_in_a_dcp_folder_is_refused_by_name(tmp_path):
    folder = tmp_path / "pytorch_model_fsdp_0"
    dcp.save({"model": torch.nn.Linear(2, 2).state_dict()}, checkpoint_id=str(folder), no_dist=True)
    marker = tmp_path / "ran"
    _plant(folder / ".metadata", marker)
    with pytest.raises(MergeError) as info:
        merge_fsdp_weights(folder, tmp_path / "out")
    message = str(info.value)
    assert str(folder / ".metadata") in message and "io.open" in message and "\n" not in message, message
    assert "allowed: " in message
    assert not marker.exists() and not (tmp_path / "out" / "model.safetensors").exists()


def test_planted_pickle_in_a_distcp_item_runs_nothing(tmp_path):
    """A non-tensor item of a DCP folder is a pickle torch reads with weights_only=False: a merge never reads it
    (a model file holds tensors only), and the tensors still merge exactly."""
    marker = tmp_path / "ran"
    folder = tmp_path / "dcp"
    state = torch.nn.Linear(2, 3).state_dict()
    dcp.save({"model": dict(state), "evil": _Planted(marker)}, checkpoint_id=str(folder), no_dist=True)
    assert not marker.exists()
    merge_fsdp_weights(folder, tmp_path / "out")
    assert not marker.exists()
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert merged.keys() == {f"model.{k}" for k in state}
    assert all(torch.equal(merged[f"model.{k}"], v) for k, v in state.items())


def test_planted_metadata_is_ignored_by_load_state(tmp_path):
    accelerator, model, folder = _saved(tmp_path)
    marker = tmp_path / "ran"
    _plant(folder / ".metadata", marker)  # not listed in the manifest: never opened
    accelerator.load_state(str(folder))
    assert not marker.exists()
    _plant(folder / "state" / ".metadata", marker)  # state/ holds only the files the manifest lists
    with pytest.raises(CheckpointError, match=r"state/.metadata: not listed in"):
        accelerator.load_state(str(folder))
    assert not marker.exists()


def test_a_real_dcp_folder_merges_exactly(tmp_path):
    """Everything torch's own dcp.save writes reads through the allow-list: nested dicts, optimizer state with
    scalars and bytes, every dtype and memory format; the tensors come back bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    tensors = {"bf16": torch.randn(3).to(torch.bfloat16), "i8": torch.arange(4, dtype=torch.int8),
               "flag": torch.tensor([True, False]), "f8": torch.ones(2).to(torch.float8_e4m3fn),
               "c64": torch.randn(2, dtype=torch.complex64), "t": torch.randn(4, 4).t(), "scalar": torch.tensor(3.0),
               "nhwc": torch.randn(1, 2, 3, 3).to(memory_format=torch.channels_last)}
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "nested": {"a": {"b": tensors}},
             "extra": {"s": "text", "b": b"bytes", "i": 3, "f": 1.5, "l": [1, 2], "n": None}}
    folder = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    merge_fsdp_weights(folder, tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    expected.update({f"nested.a.b.{k}": v for k, v in tensors.items()})
    for param, values in optimizer.state_dict()["state"].items():
        expected.update({f"optim.state.{param}.{k}": v for k, v in values.items()})
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        got = merged[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got.reshape(-1).view(torch.uint8), value.reshape(-1).contiguous().view(torch.uint8)), key


# -- JSON values that allocate ----------------------------------------------------------------------------------

def _rewrite_manifest(folder, change) -> None:
    """Change the manifest as a tamperer would: the checksum recomputed."""
    path = folder / layout.MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["checksum"] = layout.manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))


def test_a_numpy_dtype_in_the_manifest_cannot_allocate(tmp_path):
    import tracemalloc

    accelerator, _, folder = _saved(tmp_path)

    def bomb(manifest):
        entry = manifest["skeleton"]["custom"][0]["values"]
        assert entry["dtype"] == "uint32"
        entry["dtype"] = "S300000000"

    _rewrite_manifest(folder, bomb)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            accelerator.load_state(str(folder))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert str(folder / layout.MANIFEST) in message and "skeleton.custom[0].values" in message, message
    assert "'S300000000'" in message and "allowed: " in message and "uint32" in message and "\n" not in message
    assert peak < 50 << 20


def test_a_numpy_dtype_in_the_rng_file_cannot_allocate(tmp_path):
    accelerator, _, folder = _saved(tmp_path)
    path = folder / "rng" / "rank_0.json"
    plain = json.loads(path.read_text())
    plain["numpy"]["__tuple__"][1] = {"__numpy__": [1, 2], "dtype": "S300000000"}
    path.write_text(json.dumps(plain))
    _rewrite_manifest(folder, lambda m: m["checksums"].update({"rng/rank_0.json": layout.file_checksum(path)})
                      or m["files"].update({"rng/rank_0.json": path.stat().st_size}))
    with pytest.raises(CheckpointError) as info:
        accelerator.load_state(str(folder))
    message = str(info.value)
    assert str(path) in message and "numpy" in message and "'S300000000'" in message and "allowed: " in message


def test_numpy_values_must_be_numbers_of_an_allowed_dtype(tmp_path):
    from accel.checkpoint import tree

    assert tree.join({"__numpy__": [1, 2], "dtype": "uint32"}, {}).tolist() == [1, 2]
    for bad, needle in (({"__numpy__": [1, 2], "dtype": "object"}, "dtype 'object'"),
                        ({"__numpy__": ["12"], "dtype": "int64"}, "allowed: numbers"),
                        ({"__numpy__": [[1], [2, 3]], "dtype": "int64"}, "numpy"),
                        ({"__float__": "1" * 5000}, "__float__"),
                        ({"__dict__": [[["a"], 1]]}, "__dict__")):
        with pytest.raises(tree.BadTree, match=needle):
            tree.join({"x": [bad]}, {})


def test_a_huge_number_in_the_manifest_names_the_file_and_key(tmp_path):
    accelerator, _, folder = _saved(tmp_path)
    path = folder / layout.MANIFEST
    text = path.read_text()
    assert '"step": 0' in text
    path.write_text(text.replace('"step": 0', '"step": ' + "9" * 5000))
    with pytest.raises(CheckpointError) as info:
        accelerator.load_state(str(folder))
    message = str(info.value)
    assert message.startswith(f"{path}: damaged: key 'skeleton.step': an integer of 5000 digits"), message
    with pytest.raises(MergeError, match=r"accel_checkpoint.json: damaged: key 'skeleton.step': an integer of 5000"):
        merge_fsdp_weights(folder, tmp_path / "out")


def test_offload_index_is_checked_before_anything_is_read(tmp_path):
    from accel.big_model.offload import load_offload_index, load_offloaded_weight, offload_state_dict

    offload_state_dict(tmp_path, {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})
    index = load_offload_index(tmp_path)
    assert torch.equal(load_offloaded_weight(index["w"], tmp_path), torch.arange(6.0).reshape(2, 3))
    path = tmp_path / "index.json"
    for entry, needle in (({"shape": [10**12, 10**12, 10**12]}, "key 'w.shape'"),
                          ({"dtype": "S300000000"}, "key 'w.dtype': 'S300000000'"),
                          ({"dtype": "save"}, "key 'w.dtype'"),
                          ({"shape": [2, "3"]}, "key 'w.shape'")):
        path.write_text(json.dumps({"w": {**index["w"], **entry}}))
        with pytest.raises(ValueError) as info:
            load_offload_index(tmp_path)
        assert str(path) in str(info.value) and needle in str(info.value) and "allowed: " in str(info.value)
    path.write_text(json.dumps({"w": {**index["w"], "shape": [3, 2]}}))  # a shape the file does not hold
    with pytest.raises(ValueError, match=r"shape \[3, 2\].*holds \[2, 3\]"):
        load_offloaded_weight(load_offload_index(tmp_path)["w"], tmp_path)
    path.write_text('{"w": {"shape": [' + "9" * 5000 + "]}}")
    with pytest.raises(ValueError, match=r"index.json: key 'w.shape\[0\]': an integer of 5000 digits"):
        load_offload_index(tmp_path)


def test_a_tensor_item_is_checked_before_torch_load(tmp_path):
    """torch reads a tensor item with torch.load(weights_only=True), which still calls `bytearray(n)`: an item whose
    pickle makes one (here 2 GiB, zero-filled) is refused before torch reads it, naming the file and the global."""
    import zipfile

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(folder), no_dist=True)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:  # stored records, as torch.save writes them
        archive.writestr("archive/data.pkl", b"\x80\x02cbuiltins\nbytearray\nJ\x00\x00\x00\x80\x85R.")  # 2 GiB
        archive.writestr("archive/version", b"3\n")
    (folder / "__0_0.distcp").write_bytes(buffer.getvalue())
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file
    (info,) = metadata.storage_data.values()
    info.offset, info.length = 0, len(buffer.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(MergeError) as info_:
        merge_fsdp_weights(folder, tmp_path / "out")
    message = str(info_.value)
    assert "__0_0.distcp" in message and "builtins.bytearray" in message and "allowed: " in message, message


class _ArrayOfShape:
    """Pickles as numpy's `_reconstruct` (or `numpy.ndarray` itself) asked for a 80 GB array."""

    def __init__(self, direct: bool):
        self.direct = direct

    def __reduce__(self):
        if self.direct:
            return (np.ndarray, ((10**5, 10**5), np.dtype("float64")))
        return (np._core.multiarray._reconstruct, (np.ndarray, (10**5, 10**5), np.dtype("float64")))


def test_accelerate_load_reads_numpy_without_a_shape_from_the_pickle(tmp_path):
    """`accelerate.utils.load` (torch.load weights_only with numpy admitted): numpy's RNG state and arrays load; a
    pickle that names an array's shape itself is refused before numpy allocates."""
    from accel.compat.other import load

    path = tmp_path / "state.bin"
    state = {"rng": np.random.get_state(), "array": np.arange(5, dtype=np.float32), "t": torch.arange(3)}
    torch.save(state, path)
    loaded = load(path)
    assert loaded["rng"][0] == "MT19937" and np.array_equal(loaded["rng"][1], state["rng"][1])
    assert np.array_equal(loaded["array"], state["array"]) and torch.equal(loaded["t"], state["t"])
    for direct in (False, True):
        torch.save({"x": _ArrayOfShape(direct)}, path)
        with pytest.raises(pickle.UnpicklingError, match=r"state.bin: refused numpy(.ndarray| _reconstruct)"):
            load(path)
    torch.save({"x": bytearray(8)}, path)  # weights_only would call bytearray(n) with any n
    with pytest.raises(pickle.UnpicklingError, match=r"state.bin: refused global builtins.bytearray; allowed: "):
        load(path)


def test_state_file_tensors_may_not_share_bytes(tmp_path):
    """A manifest naming many tensors over the same bytes of a state file would make load_state allocate each of
    them (optimizer state has no live tensor to check the shape against): the header's pieces may not overlap."""
    from accel.checkpoint import training_state

    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path = tmp_path / "shard.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(CheckpointError, match=r"shard.safetensors: damaged \(tensors a and b share bytes"):
        training_state._read_header(path, path.stat().st_size, {})


def test_merge_reads_only_the_state_files_the_manifest_lists(tmp_path):
    """DCP's safetensors reader reads every .safetensors file in state/ and sizes a tensor from its pieces' offsets:
    a merge checks state/ as load_state does first."""
    from safetensors.torch import save_file

    _, _, folder = _saved(tmp_path)
    save_file({"/models/0/0.weight": torch.zeros(1)}, str(folder / "state" / "planted.safetensors"),
              metadata={"DCP_SHARDING_INFO": json.dumps({"/models/0/0.weight": {"saved_offsets": [10**12]}})})
    with pytest.raises(MergeError, match=r"state/planted.safetensors: not listed in .*accel_checkpoint.json"):
        merge_fsdp_weights(folder, tmp_path / "out")


def test_flight_recorder_dumps_are_read_without_cpickles_memo():
    """A 9-byte pickle whose LONG_BINPUT names memo index 2**31 makes C pickle allocate 16 GiB (zeroed); the dump
    reader is the pure-Python unpickler, whose memo is a dict, and admits no global."""
    import resource
    import struct

    from accel.core.diagnostics import load_flight_recorder

    assert load_flight_recorder(pickle.dumps({"entries": [{"state": "completed"}]})) == {
        "entries": [{"state": "completed"}]}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert load_flight_recorder(b"\x80\x04Nr" + struct.pack("<I", 2**31) + b".") == {}
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: under 100 MiB
    with pytest.raises(pickle.UnpicklingError, match="unexpected object io.open"):
        load_flight_recorder(pickle.dumps(_Planted("/nonexistent/marker")))


def test_accelerate_load_still_reads_what_torch_save_writes(tmp_path):
    from accel.compat.other import load

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    state = {"sd": model.state_dict(), "p": torch.nn.Parameter(torch.randn(2)), "device": torch.device("cpu"),
             "size": torch.Size([2, 3]), "c": 1 + 2j, "set": {1, 2}, "b": b"xy", "view": torch.arange(10)[2:5],
             "bf16": torch.ones(2, dtype=torch.bfloat16), "empty": torch.zeros(0, 3), "t": (1, 2.5, None, "s"),
             "np": np.arange(6, dtype=np.int16).reshape(2, 3)}
    torch.save(state, tmp_path / "s.pt")
    loaded = load(tmp_path / "s.pt")
    assert loaded.keys() == state.keys() and loaded["sd"]._metadata == state["sd"]._metadata
    assert all(torch.equal(loaded["sd"][k], v) for k, v in state["sd"].items())
    assert torch.equal(loaded["view"], state["view"]) and np.array_equal(loaded["np"], state["np"])
    assert (loaded["device"], loaded["size"], loaded["c"], loaded["set"], loaded["t"]) == (
        state["device"], state["size"], state["c"], state["set"], state["t"])
