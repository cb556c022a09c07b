"""Checkpoints loaded into a model one tensor at a time, each straight to where a device map puts it (a GPU, the
CPU or disk offload), so a model larger than memory is never materialised whole; and the state of an offloaded
model read back.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from accel.checkpoint import model_files, model_reader, weights_files
from accel.checkpoint.model_reader import CheckpointPlan, TensorLoader, format_keys, resolve_dtype
from accel.checkpoint.model_state import unwrap_model
from accel.big_model.offload import _dtype_name, offload_weight, save_offload_index
from accel.big_model.device_map import _checked_device_map, _map_key
from accel.big_model.module_tensors import (
    Device,
    align_module_device,
    has_offloaded_params,
    set_module_tensor_to_device,
)


logger = logging.getLogger(__name__)  # a plain logger, as Accelerate's: these helpers run without a process state


def load_checkpoint_with_device_map(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: Mapping[str, Device],
    offload_folder: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    strict: bool = False,
    *,
    partial: bool = False,
) -> tuple[list[str], list[str]]:
    """Stream a checkpoint into ``model`` following ``device_map``; returns ``(missing_keys, unexpected_keys)``.

    One file is open at a time and one tensor read at a time: a tensor mapped to a device goes straight
    there; one mapped to ``"disk"`` (buffers only with ``offload_buffers``) stays on the meta device and is
    recorded in ``offload_folder/index.json``, pointing into the checkpoint's own safetensors file when it
    holds the tensor in the wanted dtype, else written there as a safetensors file. So peak memory is about
    one tensor (one ``.bin`` shard) over what stays resident. ``offload_state_dict`` is accepted for
    Accelerate compatibility and changes nothing (nothing is held but the current tensor). Weights the
    model needs (on the meta device) that the checkpoint lacks raise ``ValueError``; other missing or
    unexpected keys warn, or raise ``RuntimeError`` with ``strict``. ``partial``: the checkpoint is one shard
    of several, so weights it lacks are not an error here.
    """
    del offload_state_dict
    model = unwrap_model(model)
    resolved = _checked_device_map(model, device_map)
    loader = TensorLoader(model, resolve_dtype(dtype))
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}

    def target(name: str) -> str | torch.device:
        device = resolved[_map_key(name, resolved)]
        return "cpu" if device == "disk" and name in buffers and not offload_buffers else device

    to_disk = [n for n in loader.slots if target(n) == "disk"]
    if to_disk and offload_folder is None:
        raise ValueError(
            f"device_map sends {format_keys(to_disk)} to 'disk', so an offload folder is needed: "
            "pass offload_folder=<a folder>."
        )
    plan = CheckpointPlan(checkpoint, loader)
    empty = [] if partial else [k for k in plan.missing if loader.current(k).device.type == "meta"]
    if empty:
        raise ValueError(
            f"Checkpoint {str(checkpoint)!r} lacks weights the model has no data for: {format_keys(empty)}."
        )
    message = plan.key_problems()
    if message and strict:
        raise RuntimeError(message)
    if message:
        warnings.warn(message, stacklevel=3)

    index: dict[str, dict] = {}
    placed: set[int] = set()
    for path, key, stored, read in plan.tensors(loader):
        value = None
        for name in [n for n in (key, *plan.aliases_of.get(key, ())) if n in loader.slots]:
            device = target(name)
            if device == "disk":
                wanted = loader.target_dtype(name, stored)
                if path.suffix == ".safetensors" and stored == wanted:
                    index[name] = {"safetensors_file": str(Path(path).resolve()), "weight_name": key,
                                   "dtype": _dtype_name(wanted), "shape": list(loader.current(name).shape)}
                else:
                    value = read() if value is None else value
                    offload_weight(value.to(wanted), name, offload_folder, index=index)
            elif id(loader.current(name)) not in placed:
                value = read() if value is None else value
                loader.assign(name, value, device=device)
                placed.add(id(loader.current(name)))
        del value
    save_offload_index(index, offload_folder)
    return plan.missing, plan.unexpected


def _check_shard_keys(model, checkpoint, missing, unexpected, strict: bool, meta_is_error: bool) -> None:
    """After a shard-by-shard load: weights still on the meta device (no data anywhere) are a ValueError with a
    device map, and ``strict`` makes any missing or unexpected key a RuntimeError."""
    if meta_is_error:
        tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(
            remove_duplicate=False))
        empty = [k for k in missing if k in tensors and tensors[k].device.type == "meta"]
        if empty:
            raise ValueError(f"Checkpoint {str(checkpoint)!r} lacks weights the model has no data for: "
                             f"{format_keys(empty)}.")
    problems = [f"{what} keys {format_keys(keys)}" for what, keys in (("missing", missing),
                                                                       ("unexpected", unexpected)) if keys]
    if strict and problems:
        raise RuntimeError(f"Loading checkpoint {str(checkpoint)!r}: {'; '.join(problems)}.")


def _accelerate_index(checkpoint) -> Path | list[Path] | None:
    """What ``model_io``'s layout lookup does not cover but Accelerate reads: a folder whose only ``*.index.json``
    has another name (its path is returned), and an index that is a bare name -> shard mapping without
    ``"weight_map"`` (its shard files are returned, checked to lie in the index's folder). None otherwise."""
    path = Path(checkpoint)
    if path.is_dir():
        if any((path / name).is_file() for name in model_files._FOLDER_CANDIDATES):
            return None
        indexes = sorted(p for p in path.iterdir() if p.name.endswith(".index.json"))
        if len(indexes) > 1:
            raise ValueError(f"Checkpoint folder {str(path)!r} holds several index files "
                             f"({', '.join(p.name for p in indexes)}): keep one.")
        if not indexes:
            return None
        path = indexes[0]
    if not (path.is_file() and path.name.endswith(".json")):
        return None
    try:
        index = model_files.read_json(path)
    except OSError:
        return path  # model_io names the problem
    if not isinstance(index, dict) or "weight_map" in index or not index or not all(
            isinstance(v, str) for v in index.values()):
        return path
    keys = {entry: key for key, entry in index.items()}
    return [model_reader._checked_shard_path(path.parent, entry, path, key) for entry, key in keys.items()]


def _load_shards(model, shards: list[Path], device_map, **kwargs) -> tuple[list[str], list[str]]:
    """Load the shards of a bare index one file at a time; a key is missing when no shard holds it."""
    missing: list[str] | None = None
    unexpected: list[str] = []
    for shard in shards:
        if device_map is None:
            lacked, extra = model_reader.load_checkpoint_in_model(model, shard, dtype=kwargs["dtype"])
        else:
            lacked, extra = load_checkpoint_with_device_map(model, shard, device_map, partial=True, **kwargs)
        missing = lacked if missing is None else [k for k in missing if k in set(lacked)]
        unexpected += extra
    return missing or [], unexpected


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: Mapping[str, Device] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> tuple[list[str], list[str]]:
    """Accelerate's ``load_checkpoint_in_model`` (its argument order): without ``device_map`` the plain load of
    :func:`accel.checkpoint.model_reader.load_checkpoint_in_model`; with one, each tensor goes straight to its mapped
    device and "disk" ones to ``offload_folder`` (:func:`load_checkpoint_with_device_map`). Checkpoint keys the
    model does not use are logged as Accelerate logs them (``strict``: RuntimeError). Returns ``(missing_keys,
    unexpected_keys)``. It lives here, above ``model_io``, so that ``model_io`` never imports device-map code.

    ``keep_in_fp32_modules``, ``offload_8bit_bnb`` and ``broadcast_from_rank0`` (bitsandbytes and distributed
    loading) are not supported: anything but their defaults is a ValueError."""
    for flag, value, default in (("keep_in_fp32_modules", keep_in_fp32_modules, None),
                                 ("offload_8bit_bnb", offload_8bit_bnb, False),
                                 ("broadcast_from_rank0", broadcast_from_rank0, False)):
        if value not in (default, [], ()):
            raise ValueError(f"load_checkpoint_in_model: {flag}={value!r} is not supported by accel; leave it at "
                             f"{default!r}.")
    del full_state_dict  # every rank loads the whole checkpoint either way
    found = _accelerate_index(checkpoint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if isinstance(found, list):
            placement = {} if device_map is None else {"offload_folder": offload_folder,
                                                       "offload_buffers": offload_buffers}
            missing, unexpected = _load_shards(unwrap_model(model), found, device_map, dtype=dtype, **placement)
            _check_shard_keys(model, checkpoint, missing, unexpected, strict, meta_is_error=device_map is not None)
        elif device_map is None:
            checkpoint = found or checkpoint
            missing, unexpected = model_reader.load_checkpoint_in_model(model, checkpoint, dtype=dtype, strict=strict)
        else:
            checkpoint = found or checkpoint
            missing, unexpected = load_checkpoint_with_device_map(
                model, checkpoint, device_map, offload_folder=offload_folder, dtype=dtype, strict=strict,
                offload_state_dict=offload_state_dict, offload_buffers=offload_buffers)
    for warning in caught:  # the loaders' key report is replaced by the one below; other warnings pass through
        if not str(warning.message).startswith("Loading checkpoint "):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if missing:
        warnings.warn(f"Loading checkpoint {str(checkpoint)!r}: missing keys (in the model, not in the checkpoint): "
                      f"{format_keys(missing)}", stacklevel=2)
    if unexpected:
        logger.warning(f"Some weights of the model checkpoint at {checkpoint} were not used when initializing "
                       f"{type(model).__name__}: {format_keys(unexpected)}.")
    return missing, unexpected


def _read_dat_weight(path: str, info: Mapping) -> torch.Tensor:
    """A tensor Accelerate offloaded (a raw ``.dat`` numpy memmap; bfloat16/float8 stored as int16/int8: the bytes
    are the tensor's either way), read into the tensor's own memory through a descriptor checked to be a regular file
    of exactly the bytes its shape and dtype need (a pipe, device or shorter file is one CheckpointError line)."""
    import math

    from accel.checkpoint.layout import checked_files

    stored, shape = info.get("dtype"), info.get("shape")
    dtype = getattr(torch, stored, None) if isinstance(stored, str) else None
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, list):
        raise ValueError(f"offloaded weight {path}: dtype {str(stored)[:40]!r} and shape {str(shape)[:80]}; allowed: "
                         "a torch dtype name and a list of sizes (the offload index as Accelerate writes it)")
    tensor = torch.empty(shape, dtype=dtype)
    size = math.prod(shape) * dtype.itemsize
    with checked_files().open(path, size=size) as checked:
        if size:
            checked.read_into(tensor.view(-1).view(torch.uint8).numpy(), 0)
    return tensor


def load_offloaded_weights(model: nn.Module, index: Mapping[str, Mapping] | None, offload_folder) -> None:
    """Put every tensor ``index`` lists (an offload folder's ``index.json``) into ``model`` on the CPU. Both accel's
    entries (safetensors files) and Accelerate's (``<name>.dat`` files) are read. bitsandbytes statistics
    (``SCB`` entries) are skipped: accel has no 8-bit layers."""
    from accel.big_model.offload import load_offloaded_weight

    for name, info in (index or {}).items():
        if "SCB" in name:
            continue
        if "safetensors_file" in info:
            weight = load_offloaded_weight(info, offload_folder)
        else:
            if not name or any(c in name for c in "/\\\0") or name.startswith("."):  # names <name>.dat in the folder
                raise ValueError(f"offload index of {str(offload_folder)!r}: entry {name[:200]!r} is not a tensor name "
                                 "(its .dat file would lie outside the offload folder); allowed: dotted names such as "
                                 "'h.0.weight'")
            weight = _read_dat_weight(os.path.join(offload_folder, f"{name}.dat"), info)
        set_module_tensor_to_device(model, name, "cpu", value=weight)


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a model whose weights may be offloaded (CPU/disk hooks), on the CPU: each module's
    weights are brought in by its hook one module at a time, so only one module is materialised at once.
    Tensors still on the meta device (no data anywhere) are left out with a warning."""
    state_dict: dict[str, torch.Tensor] = {}
    on_meta: set[str] = set()
    for name, module in model.named_modules():
        if not name:
            continue
        try:
            with align_module_device(module, "cpu"):
                own = module.state_dict()
                for key, tensor in own.items():
                    full = f"{name}.{key}"
                    if tensor.device.type == "meta":
                        on_meta.add(full)
                    else:
                        state_dict[full] = tensor.to("cpu")
        except MemoryError:
            raise MemoryError(f"Module {name!r} of the offloaded model does not fit in CPU memory.") from None
    on_meta -= set(state_dict)
    if on_meta:
        logger.warning(f"The following tensors were not saved because they were still on meta device: {on_meta}")
    return state_dict


def load_state_dict(checkpoint_file, device_map: Mapping[str, Device] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file: safetensors (each tensor read straight onto the device ``device_map``
    gives its module, the rest on the CPU) or a torch file (``torch.load(weights_only=True)`` on the CPU). A
    safetensors file saved by TensorFlow/Flax is refused; one without metadata is read as PyTorch's, with a
    warning. A file of a ``save_model`` folder is first checked against its checksum (``CheckpointError`` when
    damaged; ``model_io.verify_saved_file``). The file is read through a descriptor checked to be a regular file, the
    one verified (a pipe or device that took its name is one CheckpointError line, never a hang)."""
    from accel.checkpoint.layout import checked_files

    opened = checked_files()
    weights_files.verify_saved_file(checkpoint_file, opened)
    checkpoint_file = str(checkpoint_file)
    if not checkpoint_file.endswith(".safetensors"):
        return weights_files.torch_load_weights(checkpoint_file, opened)
    with weights_files.safe_open_checked(checkpoint_file, opened) as f:
        metadata = f.metadata()
        names = list(f.keys())
    if metadata is None:
        logger.warning(
            f"The safetensors archive passed at {checkpoint_file} does not contain metadata. Make sure to save your "
            "model with the `save_pretrained` method. Defaulting to 'pt' metadata.")
        metadata = {"format": "pt"}
    if metadata.get("format") not in ("pt", "tf", "flax"):
        raise OSError(f"The safetensors archive passed at {checkpoint_file} does not contain the valid metadata. Make "
                      "sure you save your model with the `save_pretrained` method.")
    if metadata["format"] != "pt":
        raise ValueError(f"The checkpoint passed was saved with {metadata['format']}, we need a the pt format.")
    if device_map is None or len(set(device_map.values())) == 1:
        device = "cpu" if device_map is None else next(iter(device_map.values()))
        with weights_files.safe_open_checked(checkpoint_file, opened, device=device) as f:
            return {key: f.get_tensor(key) for key in names}
    devices = list(set(device_map.values()) - {"disk"})
    if "cpu" not in devices:
        devices.append("cpu")  # whatever the map does not place (or sends to disk) is read onto the CPU
    wanted: dict = {device: [] for device in devices}
    for module_name, device in device_map.items():
        if device in wanted:
            wanted[device].extend(k for k in names if k == module_name or k.startswith(module_name + "."))
    placed = {k for keys in wanted.values() for k in keys}
    wanted["cpu"].extend(k for k in names if k not in placed)
    tensors = {}
    for device in devices:
        with weights_files.safe_open_checked(checkpoint_file, opened, device=device) as f:
            for key in wanted[device]:
                tensors[key] = f.get_tensor(key)
    return tensors


def get_state_dict_from_offload(module: nn.Module, module_name: str, state_dict: dict,
                                device_to_put_offload: Device = "cpu") -> dict:
    """Accelerate's: fill `state_dict`'s entries for `module` (named by one of its tensors, `module_name` =
    "<module>.weight") with the module's real tensors, an offloaded module's brought onto `device_to_put_offload`
    for the copy; a module that is not offloaded gives its tensors where they are. Returns `state_dict`."""
    root = module_name[: module_name.rfind(".")]
    device = device_to_put_offload if has_offloaded_params(module) else None
    with align_module_device(module, device):
        for key, tensor in module.state_dict().items():
            if f"{root}.{key}" in state_dict:
                state_dict[f"{root}.{key}"] = tensor
    return state_dict
