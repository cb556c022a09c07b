"""Reading a torch.distributed.checkpoint (DCP) folder that may come from anywhere, running nothing from it.

torch's `FileSystemReader.read_metadata` reads the folder's `.metadata` with plain `pickle.load`: a planted file
runs any code it names. `SafeFileSystemReader` is that reader with `read_metadata` replaced:

* the file is a regular file of at most MAX_METADATA_BYTES, read whole and unpickled by `_MetadataUnpickler`, the
  pure-Python unpickler (its memo is a dict: C pickle's memo array grows to the index a 9-byte pickle names) with
  an allow-list: `find_class` admits only what torch's own `Metadata` pickles hold (the dataclasses of
  torch.distributed.checkpoint.metadata, `_StorageInfo`, `torch.Size`, torch dtypes, layouts through
  `torch.serialization._get_layout`, the memory-format enum, `collections.OrderedDict`, pathlib paths as pure
  paths), and every other global is refused in one line naming the file and the global;
* what may be called is narrower still: REDUCE only `torch.Size`, the layout lookup, the enum, OrderedDict and pure
  paths (none of which does more than build a small value), NEWOBJ only those dataclasses without arguments,
  BUILD only instances of them with a state of their own fields; INST/OBJ and persistent ids are refused;
* the result is then checked as a whole (`check_metadata`): the types of every field, sizes and offsets small
  integers, chunks inside their tensor, every tensor's bytes (its size x its dtype) within the bytes its chunks'
  slices hold, slices inside their files and not overlapping, the files regular files inside the folder. So what
  DCP's planner allocates (`torch.empty` of each saved size) is bounded by the folder's size, and a path names
  nothing outside it.

`TensorsOnlyPlanner` rebuilds a folder's tensors only: DCP reads a non-tensor item with `torch.load(...,
weights_only=False)` (DefaultLoadPlanner.load_bytes), so non-tensor items are never read. The tensor items are
read by torch with `torch.load(weights_only=True)` from slices checked as above.

Every data file is read through a descriptor checked to be a regular file (accel.core.checked_file), the same file
`check_metadata` sized: a FIFO or a link to a device that takes a file's name after the check is one MetadataError
line, never a hang. `CheckedSafetensorsReader` is torch's `HuggingFaceStorageReader` (accel's state/ folders) read
the same way, and only the files the checkpoint's manifest lists.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import stat
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner

from accel.core.checked_file import CheckedFiles

MAX_METADATA_BYTES = 256 << 20  # 256 MiB: a 70B model's optimizer state over 512 ranks is about 100 MB
MAX_DIMS = 64
MAX_SIZE = 2**62  # a dimension, an offset, a byte count
_ALLOWED_TEXT = ("the classes torch.distributed.checkpoint's Metadata holds (its dataclasses, _StorageInfo, "
                 "torch.Size, torch dtypes and layouts, collections.OrderedDict, pathlib paths)")


class MetadataError(ValueError):
    """A DCP folder whose `.metadata` (or the files it names) is refused; one line naming the file."""


def _layout(name: Any) -> torch.layout:
    """`torch.serialization._get_layout`, for the layouts torch has only."""
    found = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in found:
        raise pickle.UnpicklingError(f"unknown torch layout {str(name)[:40]!r}")
    return found[name]


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md

    allowed: dict[tuple[str, str], Any] = {}
    for name in _DATACLASS_NAMES:
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(dcp_md, name)
    allowed[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = dcp_md._MEM_FORMAT_ENCODING
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_fs._StorageInfo
    # torch 2.0's names of the same classes (Accelerate's FSDP checkpoints of that time)
    allowed[("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties")] = dcp_md.TensorProperties
    allowed[("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING")] = dcp_md._MEM_FORMAT_ENCODING
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout
    allowed[("collections", "OrderedDict")] = OrderedDict
    for module in ("pathlib", "pathlib._local"):  # a StorageMeta's checkpoint_id: a pure path touches nothing
        for name in ("Path", "PosixPath", "PurePath", "PurePosixPath"):
            allowed[(module, name)] = PurePosixPath
        for name in ("WindowsPath", "PureWindowsPath"):
            allowed[(module, name)] = PureWindowsPath
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


_DATACLASS_NAMES = ("Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
                    "BytesStorageMetadata", "TensorProperties")
_GLOBALS: dict[tuple[str, str], Any] = {}


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python unpickler
    """pickle's own pure-Python unpickler, its dispatch table narrowed to what a DCP Metadata pickle needs."""

    dispatch = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # pickle's own, set by load()

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source
        if not _GLOBALS:
            _GLOBALS.update(_allowed_globals())
        self.dataclasses = {_GLOBALS[("torch.distributed.checkpoint.metadata", n)] for n in _DATACLASS_NAMES}
        self.dataclasses.add(_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")])
        self.callables = {torch.Size, _layout, OrderedDict, PurePosixPath, PureWindowsPath,
                          _GLOBALS[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")]}

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise MetadataError(f"{self.source}: refused global {module}.{name} (a pickle naming it could run "
                                f"code); allowed: {_ALLOWED_TEXT}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataError(f"{self.source}: refused a persistent id; allowed: {_ALLOWED_TEXT}")

    def _refuse(self, what: str) -> None:
        raise MetadataError(f"{self.source}: refused {what}; allowed: {_ALLOWED_TEXT}")

    def _reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        if not any(func is c for c in self.callables) or type(args) is not tuple:
            self._refuse(f"a call of {_name(func)}")
        if func is PurePosixPath or func is PureWindowsPath:
            fits = len(args) <= 256 and all(type(a) is str and len(a) <= 4096 for a in args)
        elif func is OrderedDict:
            fits = args == ()
        elif func is torch.Size:
            fits = len(args) == 1 and type(args[0]) in (list, tuple) and len(args[0]) <= MAX_DIMS and all(
                type(n) is int for n in args[0])
        else:  # the layout lookup (a name), the memory-format enum (a small integer)
            fits = len(args) == 1 and type(args[0]) in (str, int) and len(str(args[0])) <= 40
        if not fits:
            self._refuse(f"a call of {_name(func)} with {str(args)[:60]}")
        pickle._Unpickler.load_reduce(self)  # type: ignore[attr-defined]

    def _newobj(self) -> None:
        cls, args = self.stack[-2], self.stack[-1]
        if not any(cls is c for c in self.dataclasses) or args != ():
            self._refuse(f"creating {_name(cls)}")
        pickle._Unpickler.load_newobj(self)  # type: ignore[attr-defined]

    def _build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        kind = type(inst)
        if not any(kind is c for c in self.dataclasses):
            self._refuse(f"setting the state of {_name(kind)}")
        if kind.__name__ == "TensorProperties":
            if type(state) is not tuple or len(state) != 5:
                self._refuse("a TensorProperties state that is not 5 values")
        elif type(state) is not dict or not set(state) <= {f for f in kind.__dataclass_fields__}:
            self._refuse(f"a {kind.__name__} state with fields it does not have")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    def _refused_opcode(self) -> None:
        self._refuse("an instance built by the INST/OBJ/NEWOBJ_EX opcodes")


_D: dict[int, Any] = _MetadataUnpickler.dispatch
_D[pickle.REDUCE[0]] = _MetadataUnpickler._reduce
_D[pickle.NEWOBJ[0]] = _MetadataUnpickler._newobj
_D[pickle.BUILD[0]] = _MetadataUnpickler._build
for _op in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX):
    _D[_op[0]] = _MetadataUnpickler._refused_opcode


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def read_metadata_file(path: Path) -> Any:
    """The Metadata pickled in `path`, through the allow-list; a MetadataError (one line naming `path`) for
    anything else: another global, a file too large, not a regular file, a damaged pickle."""
    import io

    from accel.core.safe_json import read_bounded

    data = read_bounded(path, MAX_METADATA_BYTES, "the .metadata file torch writes", MetadataError)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), str(path)).load()
    except MetadataError:
        raise
    except RecursionError:
        raise MetadataError(f"{path}: damaged (nested too deeply); allowed: the .metadata file torch writes") from None
    except Exception as exc:  # a truncated or malformed pickle, a refused value inside an allowed call
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise MetadataError(f"{path}: damaged ({detail}); allowed: the .metadata file torch writes") from None
    return metadata


# -- the whole, checked -----------------------------------------------------------------------------------------

def _size(value: Any, what: str, path: Path) -> tuple[int, ...]:
    if type(value) is not torch.Size or len(value) > MAX_DIMS or not all(0 <= n < MAX_SIZE for n in value):
        raise MetadataError(f"{path}: {what} is {str(value)[:80]}; allowed: a torch.Size of at most {MAX_DIMS} "
                            f"sizes from 0 to 2**62")
    return tuple(value)


def data_files() -> CheckedFiles:
    """A DCP folder's record of the data files a read opens: each checked on its descriptor, the same file after."""
    return CheckedFiles(MetadataError, "a regular file inside the checkpoint")


def check_metadata(metadata: Any, folder: Path, path: Path, opened: CheckedFiles | None = None) -> None:
    """Refuse (MetadataError naming `path`) a Metadata whose fields are not what torch writes, or that would make
    DCP allocate more than the folder's files hold, or read outside them. Each data file is sized on an opened
    descriptor, recorded in `opened` so that the read finds the same file."""
    import torch.distributed.checkpoint.metadata as dcp_md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def bad(what: str, allowed: str) -> MetadataError:
        return MetadataError(f"{path}: {what}; allowed: {allowed}")

    if type(metadata) is not dcp_md.Metadata:
        raise bad(f"holds a {type(metadata).__name__}", "a torch.distributed.checkpoint Metadata")
    entries, planner_data, storage = metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data
    if type(entries) is not dict or not all(type(k) is str for k in entries):
        raise bad("state_dict_metadata is not a dict of names", "a dict of names to storage metadata")
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not dcp_md.StorageMeta:
        raise bad("storage_meta is not a StorageMeta", "a StorageMeta or None")
    if type(storage) is not dict:
        raise bad("storage_data is not a dict", "a dict of MetadataIndex to _StorageInfo")
    if planner_data is not None:
        if type(planner_data) is not dict:
            raise bad("planner_data is not a dict", "a dict of names to key paths")
        for name, keys in planner_data.items():
            if (type(keys) not in (tuple, list) or not 0 < len(keys) <= MAX_DIMS
                    or not all(type(k) is str or (type(k) is int and 0 <= k <= len(entries)) for k in keys)):
                raise bad(f"planner_data[{str(name)[:60]!r}] is {str(keys)[:80]}",
                          f"a path of names and list indices up to {len(entries)}")
    slices: dict[str, list[tuple[int, int]]] = {}
    for index, info in storage.items():
        if type(index) is not dcp_md.MetadataIndex or type(info) is not _StorageInfo:
            raise bad("storage_data holds something other than MetadataIndex -> _StorageInfo", "what torch writes")
        rel, offset, length = info.relative_path, info.offset, info.length
        if not (type(offset) is int and type(length) is int and 0 <= offset < MAX_SIZE and 0 <= length < MAX_SIZE):
            raise bad(f"the slice of {str(index.fqn)[:60]!r} is offset {str(offset)[:30]} length {str(length)[:30]}",
                      "byte offsets and lengths from 0 to 2**62")
        if info.transform_descriptors:
            raise bad(f"{str(index.fqn)[:60]!r} is stored through {str(info.transform_descriptors)[:60]}",
                      "items stored as they are (no compression or other transform)")
        slices.setdefault(_data_file(rel, folder, path), []).append((offset, length))
    sizes = {}
    opened = opened or data_files()
    for rel, spans in slices.items():
        with opened.open(folder / rel) as checked:  # the name may have changed since _data_file's stat
            sizes[rel] = checked.size
        end = 0
        for offset, length in sorted(spans):
            if offset < end or offset + length > sizes[rel]:
                raise bad(f"{rel}: a slice at byte {offset} of {length} bytes overlaps another or ends past the "
                          f"file ({sizes[rel]} bytes)", "slices inside the file, each byte in one slice")
            end = offset + length
    for name, entry in entries.items():
        if type(entry) is dcp_md.BytesStorageMetadata:
            continue
        if type(entry) is not dcp_md.TensorStorageMetadata:
            raise bad(f"{name[:60]!r} is a {type(entry).__name__}", "TensorStorageMetadata or BytesStorageMetadata")
        props = entry.properties
        if (type(props) is not dcp_md.TensorProperties or type(props.dtype) is not torch.dtype
                or props.layout is not torch.strided):
            raise bad(f"{name[:60]!r} has properties {str(props)[:80]}", "a strided tensor of a torch dtype")
        shape = _size(entry.size, f"the size of {name[:60]!r}", path)
        held = 0
        if type(entry.chunks) is not list:
            raise bad(f"the chunks of {name[:60]!r} are not a list", "a list of ChunkStorageMetadata")
        for chunk in entry.chunks:
            if type(chunk) is not dcp_md.ChunkStorageMetadata:
                raise bad(f"a chunk of {name[:60]!r} is a {type(chunk).__name__}", "ChunkStorageMetadata")
            offsets = _size(chunk.offsets, f"a chunk offset of {name[:60]!r}", path)
            sizes_ = _size(chunk.sizes, f"a chunk size of {name[:60]!r}", path)
            if len(offsets) != len(shape) or len(sizes_) != len(shape) or any(
                    o + s > d for o, s, d in zip(offsets, sizes_, shape, strict=True)):
                raise bad(f"a chunk of {name[:60]!r} at {list(offsets)} of {list(sizes_)} lies outside its size "
                          f"{list(shape)}", "chunks inside their tensor")
            info = storage.get(dcp_md.MetadataIndex(name, chunk.offsets))
            if info is None:
                raise bad(f"a chunk of {name[:60]!r} at {list(offsets)} is in no file", "a slice for every chunk")
            if math.prod(sizes_) * props.dtype.itemsize > info.length:
                raise bad(f"a chunk of {name[:60]!r} of {list(sizes_)} x {props.dtype} is larger than its slice of "
                          f"{info.length} bytes", "chunks no larger than the bytes stored for them")
            held += info.length
        if math.prod(shape) * props.dtype.itemsize > held:
            raise bad(f"{name[:60]!r} of size {list(shape)} x {props.dtype} needs more bytes than its chunks hold "
                      f"({held})", "tensors no larger than the bytes stored for them")


def _data_file(rel: Any, folder: Path, path: Path) -> str:
    """`rel`, a data file named by the metadata: a relative path inside `folder` (checked on the name), reaching a
    regular file under folders; the folder's own links are followed (a Hub download is links into ../../blobs)."""
    parts = PurePosixPath(rel).parts if type(rel) is str and rel and "\\" not in rel and "\0" not in rel else ()
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise MetadataError(f"{path}: names the data file {str(rel)[:80]!r}; allowed: a file inside {folder}")
    current = folder
    for i, part in enumerate(parts):
        current = current / part
        try:
            mode = os.stat(current).st_mode
        except OSError as exc:
            raise MetadataError(f"{current}: named by {path} but cannot be read ({exc.strerror})") from None
        wanted = stat.S_ISREG if i == len(parts) - 1 else stat.S_ISDIR
        if not wanted(mode):
            kind = "file" if i == len(parts) - 1 else "folder"
            raise MetadataError(f"{current}: named by {path}, not a regular {kind}; allowed: regular files and "
                                "folders inside the checkpoint")
    return rel


# -- a tensor item of a .distcp file --------------------------------------------------------------------------

MAX_ITEM_PICKLE = 1 << 20  # a torch.save of one tensor pickles a few hundred bytes


def check_tensor_item(view: Any, source: str) -> None:
    """The bytes of one tensor item (a torch.save archive inside a .distcp file) hold one tensor and nothing else
    torch's `torch.load(weights_only=True)` would build (accel.checkpoint.torch_file); a MetadataError otherwise."""
    from accel.checkpoint.torch_file import TorchFileError, check_torch_zip

    try:
        check_torch_zip(view, f"{source}: tensor item", max_pickle=MAX_ITEM_PICKLE, single_tensor=True)
    except TorchFileError as exc:
        raise MetadataError(str(exc)) from None


# -- torch's reader and planner, with the above -----------------------------------------------------------------

class _Window:
    """The bytes [offset, offset + length) of a seekable file, as a seekable file of their own (for zipfile)."""

    def __init__(self, file: Any, offset: int, length: int):
        self.file, self.offset, self.length, self.pos = file, offset, length, 0

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.file.seek(self.offset + self.pos)
        data = self.file.read(n)
        self.pos += len(data)
        return data


class _CheckedFileSystem(FileSystem):
    """torch's file system, whose streams for reading are the checked descriptors of `opened` (a copy of each)."""

    def __init__(self, opened: CheckedFiles):
        super().__init__()
        self.opened = opened

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with self.opened.open(path) as checked, os.fdopen(os.dup(checked.fd), "rb") as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader (its storage data and data reads unchanged) whose `read_metadata` reads `.metadata`
    (or a rank's `__<rank>.metadata`) through the allow-list and checks it against the folder, whose every item
    slice is checked (`check_tensor_item`) before torch's `torch.load(weights_only=True)` reads it (weights_only
    still admits calls such as `bytearray(n)`, which a planted item could make allocate at will), and whose data
    files are read through the descriptors `check_metadata` checked (the same files)."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._opened = data_files()
        self.fs = _CheckedFileSystem(self._opened)

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        where = f"{Path(self.path) / sinfo.relative_path} (bytes {sinfo.offset}-{sinfo.offset + sinfo.length})"
        check_tensor_item(_Window(file, sinfo.offset, sinfo.length), where)
        return super()._slice_file(file, sinfo)


    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed.checkpoint.metadata as dcp_md

        path = Path(self._get_metadata_path(kwargs.get("rank")))
        checked = getattr(self, "_checked", {})
        if path not in checked:  # read once: the caller's first read names a refusal, DCP's load reuses it
            metadata = read_metadata_file(path)
            check_metadata(metadata, Path(self.path), path, self._opened)
            self._checked = {**checked, path: metadata}
        metadata = self._checked[path]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckedSafetensorsReader(HuggingFaceStorageReader):
    """torch's HuggingFaceStorageReader (the safetensors files of accel's state/ folder) reading only the files
    `names` lists (torch's reads every .safetensors file it finds there, one added after the checks included), each
    through a descriptor checked to be a regular file, the one the load checked first (`opened`, the load's
    `layout.checked_files()`); safetensors maps it by the descriptor's name (CheckedFile.name), so large files are
    not read into memory. read_metadata and read_data are torch's, over those files."""

    def __init__(self, path: str, opened: CheckedFiles, names: list[str]) -> None:
        super().__init__(path)
        self._opened, self._names = opened, list(names)

    @contextmanager
    def _safe_open(self, file_name: str) -> Iterator[Any]:
        from safetensors import safe_open

        with self._opened.open(file_name) as checked:
            handle = safe_open(checked.name, framework="pt")  # maps the checked file; the name is not used again
        with handle as f:
            yield f

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The files' tensors as DCP's metadata, read once: the caller's first read raises a refusal itself (DCP
        would wrap it in an AssertionError of several lines), DCP's load reuses it."""
        if getattr(self, "_metadata", None) is None:
            self._metadata = self._read_metadata()
        return self._metadata

    def _read_metadata(self) -> Any:
        import torch.distributed.checkpoint.metadata as dcp_md
        from safetensors.torch import _getdtype
        from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY, _HFStorageInfo

        entries: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        for name in self._names:
            file_name = str(Path(self.path) / name)
            with self._safe_open(file_name) as f:
                extra = f.metadata() or {}
                sharding = json.loads(extra[CUSTOM_METADATA_KEY]) if extra.get(CUSTOM_METADATA_KEY) else None
                for key in f.keys():
                    piece = f.get_slice(key)
                    shape, dtype = list(piece.get_shape()), _getdtype(piece.get_dtype())
                    offsets = sharding[key][SAVED_OFFSETS_KEY] if sharding is not None else [0] * len(shape)
                    _add_chunk(entries, key, shape, offsets, dtype)
                    storage[dcp_md.MetadataIndex(fqn=key, offset=offsets)] = _HFStorageInfo(
                        relative_path=file_name, shape=torch.Size(shape), dtype=dtype)
        metadata = dcp_md.Metadata(state_dict_metadata=entries, storage_data=storage)
        metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.futures import Future

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for file_name, items in per_file.items():
            with self._safe_open(file_name) as f:
                for item in items:
                    _read_item(f, item, planner)
        done: Future = Future()
        done.set_result(None)
        return done


def _add_chunk(entries: dict, key: str, shape: list, offsets: list, dtype: torch.dtype) -> None:
    """One saved piece of tensor `key` into DCP's metadata (as torch's HuggingFaceStorageReader builds it)."""
    import torch.distributed.checkpoint.metadata as dcp_md

    chunk = dcp_md.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
    whole = [n + o for n, o in zip(shape, offsets, strict=True)]
    if key not in entries:
        entries[key] = dcp_md.TensorStorageMetadata(properties=dcp_md.TensorProperties(dtype=dtype),
                                                    size=torch.Size(whole), chunks=[chunk])
        return
    entries[key].chunks.append(chunk)
    entries[key].size = torch.Size([max(a, b) for a, b in zip(entries[key].size, whole, strict=True)])


def _read_item(f: Any, item: Any, planner: Any) -> None:
    """Copy one read request's slice of a safetensors file into the planner's tensor (torch's reader does the same)."""
    slices = tuple(slice(offset, offset + length) for offset, length in zip(item.storage_offsets, item.lengths,
                                                                             strict=True))
    tensor = f.get_slice(item.storage_index.fqn)[slices]
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise ValueError(f"{item.storage_index.fqn}: a saved piece of size {list(tensor.size())}, the tensor to read "
                         f"into {list(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


class TensorsOnlyPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the saved state from the metadata, for the tensors only: a non-tensor item is a
    pickle DCP would read with `torch.load(weights_only=False)`, so it is never read. `keep(name)` narrows further
    (accel's checkpoints: the models' tensors)."""

    def __init__(self, keep=None):
        super().__init__()
        self.keep = keep

    def _should_include_key(self, key: str, metadata: Any) -> bool:
        import torch.distributed.checkpoint.metadata as dcp_md

        entry = metadata.state_dict_metadata.get(key)
        return type(entry) is dcp_md.TensorStorageMetadata and (self.keep is None or self.keep(key))

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise MetadataError(f"refused to unpickle the non-tensor item {read_item.dest_index.fqn!r}; allowed: tensors")


__all__ = ["MAX_METADATA_BYTES", "CheckedSafetensorsReader", "MetadataError", "SafeFileSystemReader",
           "TensorsOnlyPlanner", "check_metadata", "check_tensor_item", "data_files", "read_metadata_file"]
