"""A DCP storage writer that streams safetensors files to disk instead of building each one in memory.

torch's `HuggingFaceStorageWriter` hands every tensor of a file to `safetensors.torch.save`, which returns the
whole file as one `bytes` object (after copying each tensor once more), and only then writes it: a save needs
about twice the bytes of the file being written on top of the live state. `StreamingSafetensorsWriter` writes the
same files, named the same way, with the same header (`__metadata__` with DCP_SHARDING_INFO, DCP_VERSION and
format; tensors in safetensors' order) and returns the same WriteResults; but it writes the header first (it
needs only the names, dtypes and shapes the save plan already holds) and then each tensor's bytes straight from
its storage, so a save holds no extra heap for a CPU tensor stored contiguously, and one tensor's copy for any
other (one on an accelerator, a non-contiguous view). Each file is then fsynced, as torch's writer does.

While a file is written its crc32 (`layout.crc32`) is computed from the same buffers, in a second thread (the
CRC releases the GIL), so the manifest needs no second read of the file: each file's checksum and size travel in
the WriteResults to the coordinator, whose `finish()` writes them to `checksums_file` (a small JSON that
`layout.write_manifest` reads and removes). WriteResults are the one channel DCP has from every rank to the
coordinator, and `finish()` runs wherever the write runs, so this also works from DCP's `async_save` (thread or
process executor). The constructor takes plain values only, so the writer pickles.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (
    CUSTOM_METADATA_KEY,
    DCP_VERSION_KEY,
    DEFAULT_EXTRA_METADATA_KEY,
    FORMAT_KEY,
    FORMAT_VALUE,
    HF_DCP_VERSION,
    _gen_file_name,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from accel.checkpoint.layout import crc32

__all__ = ["StreamingSafetensorsWriter", "CHUNK_BYTES"]

CHUNK_BYTES = 8 << 20  # bytes per write() call and per crc32 update

# safetensors' dtype codes in the order safetensors (0.8) lays tensors out in a file: by this order, then by name
_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2FNUZ",
          "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "F4", "BOOL")
_TORCH_NAMES = {"U64": "uint64", "I64": "int64", "F64": "float64", "C64": "complex64", "F32": "float32",
                "U32": "uint32", "I32": "int32", "BF16": "bfloat16", "F16": "float16", "U16": "uint16",
                "I16": "int16", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E4M3FNUZ": "float8_e4m3fnuz",
                "F8_E8M0": "float8_e8m0fnu", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8",
                "U8": "uint8", "F4": "float4_e2m1fn_x2", "BOOL": "bool"}
# torch dtype -> (rank in the file order, safetensors code), for the dtypes this torch has
_CODES: dict[torch.dtype, tuple[int, str]] = {
    getattr(torch, name): (_ORDER.index(code), code) for code, name in _TORCH_NAMES.items() if hasattr(torch, name)}


@dataclasses.dataclass
class _StreamedStorageInfo(_StorageInfo):
    """torch's `_StorageInfo` (file, offset, length: what the HF writer returns for each tensor), plus the crc32
    and size of the whole file the tensor went to, for the coordinator's `finish()`."""

    file_checksum: str | None = None
    file_size: int | None = None


class StreamingSafetensorsWriter(HuggingFaceStorageWriter):
    """`HuggingFaceStorageWriter` that streams each file (header, then each tensor's bytes) and checksums it.

    Args are `HuggingFaceStorageWriter`'s, plus:
        checksums_file: where the coordinator's `finish()` writes `{"files": {<path relative to the folder of
            checksums_file>: {"size": bytes, "checksum": "crc32:<8 hex>"}}}` for every file written; None: not
            written (the checksums are still in the WriteResults' `storage_data`).
        checksums: compute the files' crc32 while writing them (default True).
    """

    def __init__(self, path: str, fqn_to_index_mapping: dict[str, int] | None = None, thread_count: int = 1,
                 save_distributed: bool = False, enable_consolidation: bool = False,
                 thread_count_consolidation: int = 1, checksums_file: str | None = None,
                 checksums: bool = True) -> None:
        super().__init__(path, fqn_to_index_mapping=fqn_to_index_mapping, thread_count=thread_count,
                         save_distributed=save_distributed, enable_consolidation=enable_consolidation,
                         thread_count_consolidation=thread_count_consolidation)
        self.checksums_file = None if checksums_file is None else str(checksums_file)
        self.checksums = checksums

    # -- writing (every rank) --------------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not plan.items:
            done: Future = Future()
            done.set_result([])
            return done
        if not _streamable(plan.items) or self.transforms.extensions:
            return super().write_data(plan, planner)  # torch's writer, in memory (no checksums: hashed later)
        storage_data: dict[str, Any] = plan.storage_data
        storage_plan = storage_data.get("fqn_to_index_mapping")
        shard_index = storage_data.get("shard_index")
        buckets = self._split_by_storage_plan(storage_plan, plan.items)
        highest_index = max(storage_plan.values()) if storage_plan is not None else 1
        files: queue.Queue = queue.Queue()
        for file_index, items in buckets.items():
            name = _gen_file_name(file_index, highest_index, shard_index)
            files.put((self.fs.concat_path(self.path, name), name, items))

        results: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        syncer = _Syncer() if self.sync_files else None
        threads = [threading.Thread(target=self._write_files, args=(files, results, planner, errors, syncer),
                                    daemon=True) for _ in range(1, self.thread_count)]
        for thread in threads:
            thread.start()
        self._write_files(files, results, planner, errors, syncer)
        for thread in threads:
            thread.join()
        if syncer is not None:
            try:
                syncer.finish()  # every file is on disk before write_data returns
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        written: list[WriteResult] = []
        while not results.empty():
            written += results.get_nowait()
        future: Future[list[WriteResult]] = Future()
        future.set_result(written)
        return future

    def _write_files(self, files: queue.Queue, results: queue.Queue, planner: SavePlanner,
                     errors: list[BaseException], syncer: _Syncer | None) -> None:
        try:
            while not errors:
                try:
                    path, name, items = files.get_nowait()
                except queue.Empty:
                    return
                results.put(self._write_file(path, name, items, planner, syncer))
        except BaseException as exc:  # noqa: BLE001 (raised again by write_data, in the calling thread)
            errors.append(exc)

    def _write_file(self, path, name: str, items: list[WriteItem], planner: SavePlanner,
                    syncer: _Syncer | None) -> list[WriteResult]:
        """Write one safetensors file: header, then every tensor's bytes in safetensors' order; have `syncer`
        fsync it (while the next file is written)."""
        header, ordered = _header(items)
        crc = _Crc32() if self.checksums else None
        try:
            with self.fs.create_stream(path, "wb") as stream:  # buffered: large writes go straight from the tensor
                _write_all(stream, memoryview(header), crc)
                for item in ordered:
                    tensor, copied = _cpu_contiguous(planner.resolve_data(item), item)
                    if tensor.numel():
                        _write_all(stream, _bytes_of(tensor), crc)
                    if copied and crc is not None:
                        crc.drain()  # the copy is freed only once the checksum thread is done with it
                    del tensor
                size = stream.tell()
                if syncer is not None:
                    stream.flush()
                    syncer.add(stream, path)
        except BaseException:
            if crc is not None:
                crc.stop()
            raise
        checksum = None if crc is None else crc.finish()
        results = []
        for item in items:  # the HF writer's WriteResults: one per tensor, in the plan's order, offset 0
            length = _nbytes(item)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StreamedStorageInfo(
                name, 0, length, file_checksum=checksum, file_size=size)))
        return results

    # -- finishing (the coordinator) ---------------------------------------------------------------------------

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.checksums_file is not None:
            folder = Path(self.checksums_file).parent
            found = {}
            for result in (r for rank in results for r in rank):
                info = result.storage_data
                if getattr(info, "file_checksum", None) is None:
                    continue
                rel = Path(os.path.relpath(Path(self.path) / info.relative_path, folder)).as_posix()
                found[rel] = {"size": info.file_size, "checksum": info.file_checksum}
            with open(self.checksums_file, "w", encoding="utf-8") as fh:
                json.dump({"files": found}, fh)
        return super().finish(metadata, results)


def _streamable(items: list[WriteItem]) -> bool:
    """Tensors only (DCP's byte items would go into a safetensors file as torch's writer puts them: raw, before
    the header), of dtypes safetensors knows, on a little-endian host (safetensors files are little-endian)."""
    if sys.byteorder != "little":
        return False
    return all(item.type != WriteItemType.BYTE_IO and item.tensor_data is not None
               and item.tensor_data.properties.dtype in _CODES for item in items)


def _nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    count = 1
    for size in item.tensor_data.chunk.sizes:
        count *= size
    return count * item.tensor_data.properties.dtype.itemsize


def _header(items: list[WriteItem]) -> tuple[bytes, list[WriteItem]]:
    """The 8-byte length and the JSON header of a file of `items` (padded with spaces to a multiple of 8, as
    safetensors pads it), and the items in the order their bytes follow it."""
    sharding = {}
    for item in items:  # DCP_SHARDING_INFO in the plan's order, as torch's writer builds it
        assert item.tensor_data is not None
        sharding[item.index.fqn] = {"saved_offsets": list(item.tensor_data.chunk.offsets)}
    if len(sharding) != len(items):
        twice = sorted({i.index.fqn for i in items if sum(j.index.fqn == i.index.fqn for j in items) > 1})
        raise ValueError(f"a safetensors file cannot hold two pieces of one tensor: {twice}")
    header: dict[str, Any] = {DEFAULT_EXTRA_METADATA_KEY: {CUSTOM_METADATA_KEY: json.dumps(sharding),
                                                           DCP_VERSION_KEY: str(HF_DCP_VERSION),
                                                           FORMAT_KEY: FORMAT_VALUE}}
    ordered = sorted(items, key=lambda i: (_CODES[i.tensor_data.properties.dtype][0], i.index.fqn))  # type: ignore[union-attr]
    offset = 0
    for item in ordered:
        assert item.tensor_data is not None
        length = _nbytes(item)
        header[item.index.fqn] = {"dtype": _CODES[item.tensor_data.properties.dtype][1],
                                  "shape": list(item.tensor_data.chunk.sizes),
                                  "data_offsets": [offset, offset + length]}
        offset += length
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, ordered


def _cpu_contiguous(data: Any, item: WriteItem) -> tuple[torch.Tensor, bool]:
    """The tensor to write for `item`, on the CPU and contiguous; whether that took a copy."""
    assert item.tensor_data is not None
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{item.index.fqn}: expected a tensor to write, got {type(data).__name__}")
    tensor, copied = data.detach(), False
    if tensor.device.type != "cpu":
        tensor, copied = tensor.to("cpu"), True
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        tensor, copied = tensor.resolve_conj().resolve_neg().contiguous(), True
    if tensor.dtype != item.tensor_data.properties.dtype or list(tensor.shape) != list(item.tensor_data.chunk.sizes):
        raise ValueError(f"{item.index.fqn}: the tensor to write is {tensor.dtype} {list(tensor.shape)}, the save "
                         f"plan says {item.tensor_data.properties.dtype} {list(item.tensor_data.chunk.sizes)}")
    return tensor, copied


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the view keeps the tensor alive)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _write_all(stream, data: memoryview, crc: _Crc32 | None) -> None:
    """Write `data` in CHUNK_BYTES pieces, each handed to the checksum thread as it is written."""
    for start in range(0, len(data), CHUNK_BYTES):
        part = data[start:start + CHUNK_BYTES]
        if crc is not None:
            crc.feed(part)
        while part:
            written = stream.write(part)
            part = part[written:]


class _Syncer:
    """fsyncs written files in a thread, in the order they were written, while the writer goes on with the next
    file: the disk takes one file's bytes while the next one is copied into the page cache."""

    def __init__(self) -> None:
        self.error: OSError | None = None
        self._files: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="accel-fsync", daemon=True)
        self._thread.start()

    def add(self, stream, path) -> None:
        """Queue a file for fsync (a duplicate of its descriptor: the stream itself may be closed now); a stream
        without a descriptor is flushed to disk with os.sync() at once, as torch's writer does."""
        try:
            fd = os.dup(stream.fileno())
        except (AttributeError, io.UnsupportedOperation):
            os.sync()
            return
        self._files.put((fd, path))

    def _run(self) -> None:
        while (entry := self._files.get()) is not None:
            fd, path = entry
            try:
                if self.error is None:
                    os.fsync(fd)
            except OSError as exc:
                self.error = OSError(exc.errno, exc.strerror, str(path))
            finally:
                os.close(fd)

    def finish(self) -> None:
        self._files.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error


class _Crc32:
    """The crc32 of the buffers fed to it, in order, computed in a thread while the caller writes them."""

    def __init__(self) -> None:
        self.value = 0
        self.error: BaseException | None = None
        self._parts: queue.Queue = queue.Queue(maxsize=16)
        self._thread = threading.Thread(target=self._run, name="accel-crc32", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            part = self._parts.get()
            try:
                if part is None:
                    return
                if self.error is None:
                    self.value = crc32(part, self.value)
            except BaseException as exc:  # noqa: BLE001 (reported by finish)
                self.error = exc
            finally:
                self._parts.task_done()

    def feed(self, part: memoryview) -> None:
        self._parts.put(part)

    def drain(self) -> None:
        self._parts.join()

    def stop(self) -> None:
        self._parts.put(None)
        self._thread.join()

    def finish(self) -> str:
        self.stop()
        if self.error is not None:
            raise self.error
        return f"crc32:{self.value:08x}"
