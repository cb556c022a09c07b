"""Checking a `torch.save` file before `torch.load(weights_only=True)` reads it.

weights_only refuses arbitrary globals, but what it admits can still allocate at a pickle's word: `bytearray(n)`
(zero-filled: a 150-byte record takes 256 MiB for n = 2**28), `numpy.ndarray(shape)` or numpy's `_reconstruct`
with any shape where numpy is admitted. `check_torch_zip` reads the archive's `data.pkl` with `_Scanner`, the
pure-Python unpickler (its memo is a dict) that builds nothing: every global is a stand-in that checks its
arguments, so it admits tensors (`_rebuild_tensor_v2/v3`, `_rebuild_parameter`) that are views inside a storage
record of exactly their size, containers, numbers, strings, bytes, `torch.Size`, `torch.device`, dtypes, and with
`numpy=True` numpy arrays as numpy pickles them (an empty array filled from bytes present in the file). Anything
else, and archives whose records are compressed, named twice or missing, is one TorchFileError line naming the
file. The caller then lets torch read the same bytes.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections import OrderedDict
from typing import Any

import torch

MAX_DIMS = 64
ALLOWED = ("tensors (views of their storage records), containers, numbers, strings, bytes, torch.Size, "
           "torch.device, dtypes")


class TorchFileError(pickle.UnpicklingError, ValueError):
    """A torch.save file (or item) refused before torch reads it; one line naming it. An UnpicklingError, as
    torch.load's weights_only refusals are."""


class _Storage:
    def __init__(self, itemsize: int, numel: int):
        self.itemsize, self.numel = itemsize, numel


class _Tensor:
    """Stands in for a tensor the checked pickle rebuilds."""


class _NDArray:
    """Stands in for a numpy array until its BUILD state (shape, dtype, bytes) is checked."""


class _DType:
    def __init__(self, itemsize: int):
        self.itemsize = itemsize


class _NDArrayName:
    """What `numpy.ndarray` names inside a checked pickle: only `_reconstruct` takes it."""


def _storage_types() -> dict[tuple[str, str], int]:
    import warnings

    found = {("torch.storage", "UntypedStorage"): 1, ("torch", "UntypedStorage"): 1}
    with warnings.catch_warnings():  # "TypedStorage is deprecated": only their names and element sizes are used
        warnings.simplefilter("ignore")
        for name in dir(torch):
            cls = getattr(torch, name, None)
            if name.endswith("Storage") and isinstance(cls, type):
                try:
                    found[("torch", name)] = cls.dtype.itemsize  # type: ignore[attr-defined]
                except (AttributeError, TypeError):
                    continue
    return found


class _Scanner(pickle._Unpickler):
    """Walks a torch.save pickle with stand-ins for everything it may call; builds nothing large."""

    dispatch = dict(pickle._Unpickler.dispatch)
    stack: list[Any]

    def __init__(self, file: Any, source: str, records: dict[str, int], numpy: bool):
        super().__init__(file)
        self.source, self.records, self.numpy = source, records, numpy
        self.storages = _storage_types()
        self.dtypes = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
        self.callables: set = {self._rebuild, self._parameter, self._size, self._device, self._complex, self._set,
                               self._encode, self._reconstruct, self._numpy_dtype, OrderedDict}

    def refuse(self, what: str) -> None:
        raise TorchFileError(f"{self.source}: refused {what}; allowed: {ALLOWED}"
                             f"{', numpy arrays as numpy pickles them' if self.numpy else ''}")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.storages:
            return ("storage", self.storages[(module, name)])
        if module == "builtins" or module == "__builtin__":
            module = "builtins"
        found = {("torch._utils", "_rebuild_tensor_v2"): self._rebuild,
                 ("torch._utils", "_rebuild_tensor_v3"): self._rebuild,
                 ("torch._utils", "_rebuild_parameter"): self._parameter,
                 ("collections", "OrderedDict"): OrderedDict, ("torch", "Size"): self._size,
                 ("torch", "device"): self._device, ("builtins", "complex"): self._complex,
                 ("builtins", "set"): self._set, ("_codecs", "encode"): self._encode}.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in self.dtypes:
            return self.dtypes[name]
        if self.numpy and module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return self._reconstruct
        if self.numpy and (module, name) == ("numpy", "ndarray"):
            return _NDArrayName
        if self.numpy and (module, name) == ("numpy", "dtype"):
            return self._numpy_dtype
        if self.numpy and module == "numpy.dtypes" and name.endswith("DType"):
            return _DType
        self.refuse(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and type(pid[1]) is tuple
                and type(pid[2]) is str and type(pid[4]) is int and pid[4] >= 0):
            self.refuse(f"a persistent id {str(pid)[:60]}")
        itemsize, key, numel = pid[1][1], pid[2], pid[4]
        if self.records.get(f"data/{key}") != numel * itemsize:
            self.refuse(f"storage {key[:20]!r} of {numel} x {itemsize} bytes, not the size of its record")
        return _Storage(itemsize, numel)

    # -- the stand-ins ---------------------------------------------------------------------------------------
    def _rebuild(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
        if type(storage) is not _Storage or not all(type(v) is tuple for v in (size, stride)):
            self.refuse("a tensor that is not a view of a storage record")
        numbers = [offset, *size, *stride]
        if len(size) != len(stride) or len(size) > MAX_DIMS or not all(type(n) is int and n >= 0 for n in numbers):
            self.refuse(f"a tensor of size {str(size)[:60]} and stride {str(stride)[:60]}")
        if 0 not in size:
            itemsize = rest[2].itemsize if len(rest) >= 3 and isinstance(rest[2], torch.dtype) else storage.itemsize
            last = offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
            if (last + 1) * itemsize > storage.numel * storage.itemsize:
                self.refuse(f"a tensor of size {list(size)} reaching past its storage of {storage.numel} elements")
        return _Tensor()

    def _parameter(self, data: Any, *rest: Any) -> _Tensor:
        if type(data) is not _Tensor:
            self.refuse("a parameter that is not a tensor")
        return data

    def _size(self, items: Any = ()) -> tuple:
        if type(items) not in (tuple, list) or len(items) > MAX_DIMS or not all(type(n) is int for n in items):
            self.refuse(f"torch.Size({str(items)[:60]})")
        return tuple(items)

    def _device(self, *args: Any) -> str:
        if not (0 < len(args) <= 2 and all(type(a) in (str, int) and len(str(a)) <= 32 for a in args)):
            self.refuse(f"torch.device{str(args)[:60]}")
        return "device"

    def _complex(self, *args: Any) -> complex:
        if len(args) > 2 or not all(type(a) in (int, float) for a in args):
            self.refuse(f"complex{str(args)[:60]}")
        return complex(*args)

    def _set(self, items: Any = ()) -> list:
        if type(items) is not list:
            self.refuse("a set of something other than a list")
        return items

    def _encode(self, text: Any, encoding: Any = "utf-8", *rest: Any) -> bytes:
        if type(text) is not str or encoding not in ("latin1", "latin-1", "utf-8", "utf8") or rest:
            self.refuse(f"_codecs.encode(..., {str(encoding)[:20]!r})")
        return text.encode(encoding)

    def _reconstruct(self, subtype: Any, shape: Any, typecode: Any) -> _NDArray:
        if subtype is not _NDArrayName or tuple(shape) != (0,):
            self.refuse(f"numpy _reconstruct of shape {str(shape)[:40]} (numpy pickles arrays as shape (0,))")
        return _NDArray()

    def _numpy_dtype(self, name: Any, *rest: Any) -> _DType:
        import numpy as np

        if type(name) is not str or len(name) > 32:
            self.refuse(f"numpy dtype {str(name)[:40]!r}")
        try:
            dtype = np.dtype(name)
        except TypeError:
            self.refuse(f"numpy dtype {name!r}")
        if dtype.hasobject:
            self.refuse(f"numpy dtype {name!r} (objects)")
        return _DType(dtype.itemsize)

    # -- the opcodes that call or set state ------------------------------------------------------------------
    def _op_reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        if func is _NDArrayName:
            self.refuse("numpy.ndarray(...) (an array of any shape the pickle names)")
        if func not in self.callables or type(args) is not tuple:
            self.refuse(f"a call of {getattr(func, '__qualname__', type(func).__name__)}")
        if func is OrderedDict and args != ():
            self.refuse("OrderedDict(...) with arguments")
        pickle._Unpickler.load_reduce(self)  # type: ignore[attr-defined]

    def _op_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) is OrderedDict and type(state) is dict:  # a state_dict's `_metadata`
            self.stack.pop()
            return
        if type(inst) is _DType and type(state) is tuple:
            self.stack.pop()
            return
        if type(inst) is _NDArray and type(state) is tuple and len(state) == 5:
            _version, shape, dtype, _fortran, raw = state
            if (type(shape) is not tuple or len(shape) > MAX_DIMS or not all(type(n) is int and n >= 0 for n in shape)
                    or type(dtype) is not _DType or type(raw) is not bytes
                    or len(raw) != math.prod(shape) * dtype.itemsize):
                self.refuse(f"a numpy array of shape {str(shape)[:40]} whose bytes are not its size")
            self.stack.pop()
            return
        self.refuse(f"setting the state of {type(inst).__name__}")

    def _op_refused(self) -> None:
        self.refuse("an object built by NEWOBJ/INST/OBJ")


_S: dict[int, Any] = _Scanner.dispatch
_S[pickle.REDUCE[0]] = _Scanner._op_reduce
_S[pickle.BUILD[0]] = _Scanner._op_build
for _op in (pickle.INST, pickle.OBJ, pickle.NEWOBJ, pickle.NEWOBJ_EX):
    _S[_op[0]] = _Scanner._op_refused


def check_torch_zip(file: Any, source: str, *, numpy: bool = False, max_pickle: int = 64 << 20,
                    single_tensor: bool = False) -> None:
    """Refuse (TorchFileError naming `source`) a torch.save archive in `file` (a path or a seekable binary file)
    whose pickle would build anything beyond what the module says; records stored uncompressed, each name once.
    With `single_tensor`, the pickle must be one tensor (a DCP item)."""
    try:
        with zipfile.ZipFile(file) as archive:
            infos = archive.infolist()
            names = [i.filename for i in infos]
            prefix = names[0].split("/", 1)[0] + "/" if names and "/" in names[0] else ""
            if len(set(names)) != len(names) or not all(n.startswith(prefix) for n in names):
                raise TorchFileError(f"{source}: records named twice or outside {prefix!r}; allowed: one torch.save "
                                     "archive")
            if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
                raise TorchFileError(f"{source}: compressed records; allowed: records stored as torch.save writes "
                                     "them")
            records = {i.filename[len(prefix):]: i.file_size for i in infos}
            if records.get("data.pkl", max_pickle + 1) > max_pickle:
                raise TorchFileError(f"{source}: no data.pkl of at most {max_pickle} bytes; allowed: a torch.save "
                                     "archive")
            data = archive.read(prefix + "data.pkl")
    except zipfile.BadZipFile as exc:
        raise TorchFileError(f"{source}: not a torch.save archive ({str(exc)[:80]}); allowed: torch.save's zip "
                             "format") from None
    except (OSError, ValueError, EOFError) as exc:
        if isinstance(exc, TorchFileError):
            raise
        raise TorchFileError(f"{source}: damaged ({str(exc)[:120]})") from None
    try:
        result = _Scanner(io.BytesIO(data), source, records, numpy).load()
    except TorchFileError:
        raise
    except Exception as exc:  # a malformed pickle
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise TorchFileError(f"{source}: damaged ({detail})") from None
    if single_tensor and type(result) is not _Tensor:
        raise TorchFileError(f"{source}: holds a {type(result).__name__}; allowed: one tensor")


__all__ = ["TorchFileError", "check_torch_zip"]
