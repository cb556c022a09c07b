"""The streaming safetensors writer of save_state, and the crc32 checksums of checkpoint files."""

import json
import pickle
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from accel import Accelerator
from accel.checkpoint import layout
from accel.checkpoint.layout import CheckpointError
from accel.checkpoint.streaming_writer import StreamingSafetensorsWriter


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def mixed_state() -> dict:
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    return {"/w/fp32": torch.randn(3, 5), "/w/bf16": torch.randn(7).to(torch.bfloat16),
            "/w/int64": torch.arange(9) * 3, "/w/transposed": base.t(), "/w/slice": base[2:4],
            "/w/empty": torch.zeros(0, 3), "/w/scalar": torch.tensor(2.5), "/w/bool": torch.tensor([True, False]),
            "/w/fp16": torch.randn(2, 2).half(), "/w/uint8": torch.arange(5, dtype=torch.uint8),
            "/w/fp64": torch.randn(3).double()}


def save_with(writer_class, folder: Path, state: dict, mapping: dict, **kwargs) -> list:
    """dcp.save with `writer_class`; the WriteResults its finish() got."""
    writer = writer_class(str(folder), fqn_to_index_mapping=mapping, save_distributed=True, **kwargs)
    seen = {}
    real_finish = writer.finish

    def finish(metadata, results):
        seen["results"] = results
        return real_finish(metadata, results)

    writer.finish = finish
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return seen["results"]


def parts(path: Path) -> tuple[dict, dict, bytes]:
    """A safetensors file's header (tensors, in file order), its __metadata__, and its data bytes."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    assert length % 8 == 0  # padded as safetensors pads it
    header = json.loads(data[8:8 + length])
    return header, header.pop("__metadata__"), data[8 + length:]


def plain(results: list) -> list:
    return [[(r.index, r.size_in_bytes, r.storage_data.relative_path, r.storage_data.offset,
              r.storage_data.length, r.storage_data.transform_descriptors) for r in rank] for rank in results]


def test_the_files_are_torch_s_files_and_the_write_results_its_results(tmp_path):
    state = mixed_state()
    mapping = {key: 1 + i % 2 for i, key in enumerate(state)}
    theirs = save_with(HuggingFaceStorageWriter, tmp_path / "hf", {k: v.contiguous() for k, v in state.items()},
                       mapping)  # torch's writer refuses a non-contiguous tensor; ours writes it as it is
    ours = save_with(StreamingSafetensorsWriter, tmp_path / "ours", state, mapping,
                     checksums_file=str(tmp_path / "sums.json"))
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert names == ["shard-00001-model-00001-of-00002.safetensors", "shard-00001-model-00002-of-00002.safetensors"]
    for name in names:
        (header, meta, data), (header2, meta2, data2) = parts(tmp_path / "hf" / name), parts(tmp_path / "ours" / name)
        assert list(header.items()) == list(header2.items())  # same tensors, same order, same offsets
        assert meta == meta2 and set(meta) == {"DCP_SHARDING_INFO", "DCP_VERSION", "format"}
        assert data == data2  # byte for byte (safetensors orders __metadata__'s keys at random: the only change)
    assert plain(theirs) == plain(ours)
    sums = json.loads((tmp_path / "sums.json").read_text())["files"]
    for name in names:
        path = tmp_path / "ours" / name
        assert sums[f"ours/{name}"] == {"size": path.stat().st_size,
                                        "checksum": f"crc32:{zlib.crc32(path.read_bytes()):08x}"}


def test_what_it_writes_loads_back_bit_exactly(tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = mixed_state()
    save_with(StreamingSafetensorsWriter, tmp_path / "ours", state, dict.fromkeys(state, 1), thread_count=2)
    file = next((tmp_path / "ours").iterdir())
    assert {k: v.dtype for k, v in load_file(str(file)).items()} == {k: v.dtype for k, v in state.items()}
    targets = {k: torch.full_like(v.contiguous(), 1) if v.numel() else torch.empty_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(tmp_path / "ours")), no_dist=True)
    for key, value in state.items():
        assert targets[key].dtype == value.dtype and torch.equal(targets[key], value), key


def test_it_pickles_for_the_process_executor_of_async_save(tmp_path):
    writer = StreamingSafetensorsWriter(str(tmp_path / "state"), fqn_to_index_mapping={"/a": 1},
                                        save_distributed=True, checksums_file=str(tmp_path / "sums.json"))
    copy = pickle.loads(pickle.dumps(writer))
    assert (copy.path, copy.fqn_to_index_mapping, copy.checksums_file, copy.save_distributed) == (
        writer.path, {"/a": 1}, str(tmp_path / "sums.json"), True)


class Holder:
    """A registered object whose state is tensors of several dtypes and shapes."""

    def __init__(self):
        self.values = {"fp32": torch.randn(4, 3), "bf16": torch.randn(5).to(torch.bfloat16),
                       "int64": torch.arange(6).reshape(2, 3), "transposed": torch.randn(3, 2).t(),
                       "empty": torch.zeros(0), "scalar": torch.tensor(-1.25, dtype=torch.float64)}

    def state_dict(self):
        return dict(self.values)

    def load_state_dict(self, state):
        self.values = dict(state)


def saved_checkpoint(tmp_path: Path) -> tuple[Accelerator, Holder, Path]:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(2, 3)).sum())
    optimizer.step()
    holder = Holder()
    accelerator.register_for_checkpointing(holder)
    return accelerator, holder, Path(accelerator.save_state(str(tmp_path / "ckpt")))


def test_save_state_round_trips_bit_exactly_with_crc32_checksums(tmp_path):
    accelerator, holder, folder = saved_checkpoint(tmp_path)
    expected = {k: v.clone() for k, v in holder.values.items()}
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    assert not (folder / layout.INLINE_CHECKSUMS).exists() and layout.INLINE_CHECKSUMS not in manifest["files"]
    assert manifest["checksum"].startswith("crc32:")
    for rel, checksum in manifest["checksums"].items():
        assert checksum == f"crc32:{zlib.crc32((folder / rel).read_bytes()):08x}", rel
        assert layout.verify_file_checksum(folder / rel, checksum)
    holder.values = {k: torch.zeros_like(v) for k, v in holder.values.items()}
    accelerator.load_state(str(folder))
    for key, value in expected.items():
        assert holder.values[key].dtype == value.dtype and torch.equal(holder.values[key], value), key


def test_a_flipped_bit_is_found_by_the_crc32(tmp_path):
    accelerator, _, folder = saved_checkpoint(tmp_path)
    shard = next((folder / "state").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert not layout.verify_file_checksum(shard, json.loads((folder / layout.MANIFEST).read_text())["checksums"][
        f"state/{shard.name}"])
    with pytest.raises(CheckpointError) as caught:
        accelerator.load_state(str(folder))
    message = str(caught.value)
    assert message.startswith(f"{shard}: damaged (its bytes do not match the checksum in {layout.MANIFEST}")
    assert "\n" not in message


def as_sha256(folder: Path) -> None:
    """Rewrite a manifest as accel wrote it before crc32: sha256 checksums, its own one too."""
    path = folder / layout.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["checksums"] = {rel: layout.file_checksum(folder / rel, "sha256") for rel in manifest["files"]}
    manifest.pop("checksum")
    manifest["checksum"] = layout.manifest_checksum(manifest, "sha256")
    path.write_text(json.dumps(manifest))


def test_a_sha256_manifest_of_an_older_checkpoint_still_verifies(tmp_path):
    accelerator, holder, folder = saved_checkpoint(tmp_path)
    expected = {k: v.clone() for k, v in holder.values.items()}
    as_sha256(folder)
    manifest = layout.read_manifest(folder)
    assert all(c.startswith("sha256:") and len(c) == 71 for c in manifest["checksums"].values())
    holder.values = {}
    accelerator.load_state(str(folder))
    assert all(torch.equal(holder.values[k], v) for k, v in expected.items())
    shard = next((folder / "state").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"^{shard}: damaged \\(its bytes do not match the checksum"):
        layout.read_manifest(folder)


def test_checksum_forms(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"accel" * 1000)
    crc = layout.file_checksum(path)
    assert crc == f"crc32:{zlib.crc32(b'accel' * 1000):08x}"
    assert layout.verify_file_checksum(path, crc) and layout.verify_file_checksum(str(path), layout.file_checksum(
        path, "sha256"))
    assert not layout.verify_file_checksum(path, "crc32:00000000")
    for bad in ("md5:" + "0" * 32, "crc32:123", "CRC32:0000000A", None):
        with pytest.raises(ValueError, match="allowed: crc32:<8 hex digits> or sha256:<64 hex digits>"):
            layout.verify_file_checksum(path, bad)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert layout.file_checksum(empty) == "crc32:00000000"


def test_a_checksum_of_an_unknown_form_is_a_damaged_manifest(tmp_path):
    _, _, folder = saved_checkpoint(tmp_path)
    path = folder / layout.MANIFEST
    manifest = json.loads(path.read_text())
    rel = sorted(manifest["checksums"])[0]
    manifest["checksums"][rel] = "md5:" + "0" * 32
    manifest.pop("checksum")
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"^{path}: damaged \\(the checksum of {rel} is 'md5:0+'; allowed"):
        layout.read_manifest(folder)


def test_write_manifest_hashes_what_the_writer_did_not_and_ignores_a_stale_size(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "a.safetensors").write_bytes(b"a" * 100)
    (folder / "rng").mkdir()
    (folder / "rng" / "r.json").write_text("{}")
    (folder / "state" / "b.safetensors").write_bytes(b"b" * 10)
    (folder / layout.INLINE_CHECKSUMS).write_text(json.dumps({"files": {
        "state/a.safetensors": {"size": 100, "checksum": "crc32:0badc0de"},  # trusted: the writer computed it
        "state/b.safetensors": {"size": 11, "checksum": "crc32:0badc0de"}}}))  # another size: hashed again
    layout.write_manifest(folder, {})
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    assert not (folder / layout.INLINE_CHECKSUMS).exists()
    assert sorted(manifest["files"]) == ["rng/r.json", "state/a.safetensors", "state/b.safetensors"]
    assert manifest["checksums"] == {"rng/r.json": f"crc32:{zlib.crc32(b'{}'):08x}",
                                     "state/a.safetensors": "crc32:0badc0de",
                                     "state/b.safetensors": f"crc32:{zlib.crc32(b'b' * 10):08x}"}
