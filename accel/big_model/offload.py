"""Weights kept on disk for big-model inference: one safetensors file per tensor plus ``index.json``.

Why safetensors: a file is read memory-mapped, one tensor at a time, when a hooked module runs, and nothing
is unpickled. ``index.json`` maps a tensor name to ``{"safetensors_file", "weight_name", "dtype", "shape"}``;
``safetensors_file`` is relative to the offload folder for files written there, or absolute for a tensor
read in place from a checkpoint's own safetensors file (no copy is written when it already holds the tensor
in the wanted dtype). A relative entry not in the offload folder is read from the working directory, as
Accelerate reads it (transformers records its files that way). The names and signatures follow
``accelerate.utils.offload``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from accel.checkpoint.layout import atomic_write, write_json

__all__ = [
    "OFFLOAD_INDEX_NAME",
    "offload_weight",
    "save_offload_index",
    "load_offload_index",
    "load_offloaded_weight",
    "offload_state_dict",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
]

OFFLOAD_INDEX_NAME = "index.json"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None
) -> dict:
    """Write ``weight`` to ``offload_folder/<weight_name>.safetensors`` and return ``index`` with its entry."""
    from safetensors.torch import save_file

    if not isinstance(weight_name, str) or not weight_name or any(c in weight_name for c in "/\\\0"):
        raise ValueError(f"offload_weight: weight name {str(weight_name)[:200]!r} cannot name a file in the offload "
                         f"folder {str(offload_folder)!r}; allowed: tensor names without '/', '\\' or NUL")
    folder = Path(offload_folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensor = weight.detach().to("cpu").contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # a view of a bigger storage: write only what it shows
    file_name = f"{weight_name}.safetensors"
    # a new file renamed over the name: a link already there is replaced, never written through (no fsync: scratch)
    tmp = folder / f".{file_name}.{secrets.token_hex(6)}.tmp"
    try:
        save_file({weight_name: tensor}, str(tmp))
        os.replace(tmp, folder / file_name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    index = {} if index is None else index
    index[weight_name] = {"safetensors_file": file_name, "weight_name": weight_name,
                          "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}
    return index


def load_offload_index(offload_folder: str | os.PathLike) -> dict:
    """The folder's ``index.json`` ({} when there is none), read with accel's bounded JSON reader and every entry
    checked before anything is read or allocated: ``dtype`` a torch dtype name, ``shape`` a list of at most 64 sizes
    whose product fits 2**62, ``safetensors_file`` / ``weight_name`` strings. A refusal is one ValueError line
    naming the file, the key, the value and what is allowed."""
    from accel.core.safe_json import read_json

    path = Path(offload_folder) / OFFLOAD_INDEX_NAME
    if not path.is_file():
        return {}
    index = read_json(path)
    for name, entry in index.items():
        _check_entry(path, name, entry)
    return index


_MAX_ELEMENTS = 2**62


def _torch_dtypes() -> dict[str, torch.dtype]:
    return {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def _check_entry(path: Path, name: str, entry) -> None:
    """One index entry as accel and Accelerate write it (Accelerate's ``.dat`` entries have no file name)."""
    import math

    from accel.core.safe_json import key_path, short

    def refuse(key: str | None, value, allowed: str) -> ValueError:
        where = key_path([name] if key is None else [name, key])
        return ValueError(f"{path}: key {where!r}: {short(value, 40)}; allowed: {allowed}")

    if not isinstance(entry, dict):
        raise refuse(None, entry, "an object of safetensors_file, weight_name, dtype and shape")
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if dtype is not None and (not isinstance(dtype, str) or dtype not in _torch_dtypes()):
        raise refuse("dtype", dtype, "a torch dtype name (float32, bfloat16, int8, ...)")
    if shape is not None and (not isinstance(shape, list) or len(shape) > 64
                              or not all(type(n) is int and 0 <= n < _MAX_ELEMENTS for n in shape)
                              or math.prod(shape) >= _MAX_ELEMENTS):
        raise refuse("shape", shape, "a list of at most 64 sizes >= 0 whose product is below 2**62")
    for key in ("safetensors_file", "weight_name"):
        if key in entry and not isinstance(entry[key], str):
            raise refuse(key, entry[key], "a string")


def save_offload_index(index: Mapping[str, dict], offload_folder: str | os.PathLike) -> None:
    """Merge ``index`` into the folder's ``index.json`` (written atomically)."""
    if not index:
        return
    folder = Path(offload_folder)
    folder.mkdir(parents=True, exist_ok=True)
    merged = {**load_offload_index(folder), **index}
    atomic_write(folder, OFFLOAD_INDEX_NAME, lambda tmp: write_json(tmp, merged))


def _entry_path(file: str | os.PathLike, offload_folder: str | os.PathLike | None) -> Path:
    """Where an index entry's ``safetensors_file`` is: an absolute path as it is; a relative one inside the offload
    folder (accel writes names relative to it), else relative to the working directory, as Accelerate reads it
    (transformers' ``from_pretrained`` records the checkpoint's and its own offloaded files that way)."""
    path = Path(file)
    if path.is_absolute() or offload_folder is None:
        return path
    inside = Path(offload_folder) / path
    return inside if inside.is_file() or not path.is_file() else path


def load_offloaded_weight(
    weight_info: Mapping, offload_folder: str | os.PathLike | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Read one tensor an index entry describes (memory-mapped, then released), in the entry's dtype. The file is
    opened through a descriptor checked to be a regular file (a pipe or device in its place is one CheckpointError
    line, never a hang)."""
    from accel.checkpoint.weights_files import safe_open_checked

    path = _entry_path(weight_info["safetensors_file"], offload_folder)
    if not path.is_file():
        raise FileNotFoundError(
            f"Offloaded weight {weight_info.get('weight_name')!r}: file {str(path)!r} is missing "
            "(was the offload folder or the checkpoint moved or deleted?)."
        )
    wanted, shape = weight_info.get("dtype"), weight_info.get("shape")
    dtypes = _torch_dtypes()
    if wanted and wanted not in dtypes:
        raise ValueError(f"Offloaded weight {weight_info.get('weight_name')!r}: dtype {str(wanted)[:40]!r}; allowed: a "
                         "torch dtype name")
    with safe_open_checked(path, device=str(device or "cpu")) as f:
        name = weight_info["weight_name"]
        held = f.get_slice(name).get_shape() if shape is not None else None  # the header only: nothing read yet
        if held is not None and shape is not None and list(held) != list(shape):
            raise ValueError(f"Offloaded weight {name!r}: the index gives shape {list(shape)}, but {str(path)!r} holds "
                             f"{list(held)}; allowed: the shape the file holds (an index written for another file?)")
        tensor = f.get_tensor(name)
    if wanted and _dtype_name(tensor.dtype) != wanted:
        tensor = tensor.to(dtypes[wanted])
    return tensor


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """Write every tensor of ``state_dict`` to ``save_dir`` and merge them into its index; returns the entries."""
    index: dict = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)
    return index


class OffloadedWeightsLoader(Mapping):
    """Read-only name -> tensor view over CPU tensors (``state_dict``) and an offload folder's index.

    A disk tensor is read only when asked for and not kept: the caller holds it for one forward call.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping[str, dict] | None = None,
        device: torch.device | str | None = None,
    ):
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("OffloadedWeightsLoader needs a state_dict, a save_folder or an index.")
        self.state_dict = dict(state_dict or {})
        self.save_folder = save_folder
        self.index = dict(load_offload_index(save_folder) if index is None and save_folder is not None else index or {})
        self.all_keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self.device = device

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        if key not in self.index:
            raise KeyError(key)
        return load_offloaded_weight(self.index[key], self.save_folder, self.device)

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


class PrefixedDataset(Mapping):
    """The entries of ``dataset`` whose names start with ``prefix``, under the rest of their name."""

    def __init__(self, dataset: Mapping[str, torch.Tensor], prefix: str):
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.dataset[self.prefix + key]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self.prefix + key) in self.dataset

    def __iter__(self) -> Iterator[str]:
        return (key[len(self.prefix):] for key in self.dataset if key.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def extract_submodules_state_dict(state_dict: Mapping[str, torch.Tensor], submodule_names: list[str]) -> dict:
    """The entries of ``state_dict`` under any of ``submodule_names`` (``name`` itself or ``name.*``; ``h.1`` does
    not take ``h.10``'s)."""
    return {key: value for name in submodule_names for key, value in state_dict.items()
            if key == name or key.startswith(name + ".")}
