"""Big-model inference: build a model without memory, load it one tensor at a time, run it across GPUs, CPU
and disk (Accelerate's ``accelerate.big_modeling`` names and semantics).

Why: a model larger than a device (or than RAM) can still run when each module's weights live where a
device map puts them and are brought to the execution device only while that module runs.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from accel.big_model.hooks import (
    AlignDevicesHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_execution_device_hook,
)
from accel.big_model.checkpoint_loading import load_checkpoint_in_model
from accel.big_model.device_map import (
    DEVICE_MAP_STRATEGIES,
    _checked_device_map,
    _map_key,
    _resolve_device,
    get_balanced_memory,
    infer_auto_device_map,
)
from accel.big_model.module_tensors import _all_tensor_names
from accel.big_model.offload import OffloadedWeightsLoader, PrefixedDataset, load_offload_index, offload_state_dict

_logger = logging.getLogger(__name__)

__all__ = [
    "cpu_offload_with_hook",
    "init_empty_weights",
    "init_on_device",
    "cpu_offload",
    "disk_offload",
    "dispatch_model",
    "load_checkpoint_and_dispatch",
    "attach_layerwise_casting_hooks",
]


@contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Models built inside get their parameters (and buffers, with ``include_buffers``) on the meta device:
    shapes and dtypes only, no memory. Fill them with :func:`load_checkpoint_and_dispatch`."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextmanager
def init_on_device(device: int | str | torch.device, include_buffers: bool = False) -> Iterator[None]:
    """Models built inside get their parameters (and buffers, with ``include_buffers``) created on ``device``.

    Parameters are moved as they are registered, so a layer's initialisation then runs on ``device`` (a
    no-op on meta). With ``include_buffers`` every tensor created inside goes there (``torch.device`` as
    default device), so buffers computed at construction hold no values on meta.
    """
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device != device:  # one already there (a tied weight) is kept as is
            extra = dict(param.__dict__)
            moved = param.data.to(device)
            if type(param) is nn.Parameter:
                module._parameters[name] = nn.Parameter(moved, requires_grad=param.requires_grad)
            else:
                module._parameters[name] = type(param)(moved, requires_grad=param.requires_grad, **extra)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign, assignment]  # undone below
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]  # torch's own, put back


def _named_tensors(module: nn.Module, include_buffers: bool = True, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every parameter (and buffer) under ``module`` by full name, tied aliases included."""
    found: dict[str, torch.Tensor] = {prefix + n: p for n, p in module.named_parameters(remove_duplicate=False)}
    if include_buffers:
        found.update({prefix + n: b for n, b in module.named_buffers(remove_duplicate=False)})
    return found


def _first_device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _disk_index(offload_dir, tensors: Mapping[str, torch.Tensor], index: dict | None = None) -> dict:
    """The offload index covering ``tensors``: entries already in ``offload_dir`` (or ``index``) with the right
    shape (and dtype, for real tensors) are reused, the other real tensors are written there."""
    index = dict(load_offload_index(offload_dir) if index is None and offload_dir is not None else index or {})

    def covered(name: str, tensor: torch.Tensor) -> bool:
        entry = index.get(name)
        if entry is None or list(entry.get("shape", tensor.shape)) != list(tensor.shape):
            return False
        return tensor.device.type == "meta" or entry.get("dtype") == str(tensor.dtype).removeprefix("torch.")

    absent = {n: t for n, t in tensors.items() if not covered(n, t)}
    empty = [n for n, t in absent.items() if t.device.type == "meta"]
    if empty:
        raise ValueError(
            f"Offloaded tensors {empty[:10]}{' ...' if len(empty) > 10 else ''} ({len(empty)}) are on the meta "
            f"device and not in offload folder {str(offload_dir)!r}: load them first (load_checkpoint_and_dispatch)."
        )
    if absent:
        if offload_dir is None:
            raise ValueError(f"Tensors {list(absent)[:10]} must be written to disk: pass offload_dir=<a folder>.")
        index.update(offload_state_dict(offload_dir, absent))
    return index


def cpu_offload(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: Sequence[str] | None = None,
) -> nn.Module:
    """Keep the weights on the CPU (in ``state_dict``) and bring each module's weights to ``execution_device``
    (default: where the parameters are) only while it runs; outputs return to the input's device."""
    if state_dict is None:
        state_dict = {n: t.detach().to("cpu") for n, t in _named_tensors(model, offload_buffers).items()}
    return _offload_every_module(model, execution_device, state_dict, offload_buffers, preload_module_classes)


def cpu_offload_with_hook(model: nn.Module, execution_device: int | str | torch.device | None = None,
                          prev_module_hook=None):
    """Keep `model` on the CPU until it runs; it then stays on `execution_device` until the returned hook's
    `offload()` (or the next model's forward, given this hook as its `prev_module_hook`). Returns (model, hook)."""
    from accel.big_model.hooks import CpuOffload, UserCpuOffloadHook, add_hook_to_module

    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: int | str | torch.device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Sequence[str] | None = None,
) -> nn.Module:
    """Write the weights to ``offload_dir`` (safetensors, unless its ``index.json`` already holds them) and read
    each module's weights from there, memory-mapped, only while it runs; between calls they are on meta."""
    index = _disk_index(offload_dir, _named_tensors(model, offload_buffers))
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir, index=index)
    return _offload_every_module(model, execution_device, weights_map, offload_buffers, preload_module_classes)


def _offload_every_module(model, execution_device, weights_map, offload_buffers, preload_module_classes):
    """Hooks for cpu_offload/disk_offload: each module loads its own weights from ``weights_map`` as it runs."""
    execution_device = _first_device(model) if execution_device is None else execution_device
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(model, execution_device, offload=True, weights_map=weights_map,
                             offload_buffers=offload_buffers, preload_module_classes=preload_module_classes)
    return model


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, int | str | torch.device],
    main_device: int | str | torch.device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: Mapping[str, dict] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place ``model`` as ``device_map`` says and hook it so that ``model(x)`` runs across those devices.

    GPU entries stay resident on their GPU. ``"disk"`` entries (and ``"cpu"`` ones when the main device is a
    GPU) are offloaded: their weights are on the meta device between calls and brought to the main device
    (``main_device``, else the first GPU of the map, else the CPU) while their module runs; CPU ones come
    from ``state_dict`` (default: the model's CPU tensors), disk ones from ``offload_dir/index.json`` (or
    ``offload_index``), written there first if absent. Inputs move to each module's device, outputs come
    back to the device of the input. A map with one resident device just moves the model (no hooks unless
    ``force_hooks``). Sets ``model.hf_device_map``; undo with ``remove_hook_from_submodules``.
    """
    resolved = _checked_device_map(model, device_map)
    if main_device is None:
        main = next((d for d in resolved.values() if d not in ("cpu", "disk")), "cpu")
    else:
        main = _resolve_device(main_device, "main_device")
        if main == "disk":
            raise ValueError("main_device='disk' is not a device modules can run on: use a GPU or 'cpu'.")
    offloaded = ("disk",) if main == "cpu" else ("cpu", "disk")
    for name in _all_tensor_names(model):  # non-persistent buffers the map leaves out: on the main device
        if _map_key(name, resolved) is None:
            resolved[name] = main
    distinct = set(resolved.values())
    if len(distinct) == 1 and not force_hooks and next(iter(distinct)) not in offloaded:
        model.to(next(iter(distinct)))
        model.hf_device_map = dict(device_map)  # type: ignore[assignment]  # a plain attribute (transformers')
        return model

    tensors_of = {key: _tensors_of_entry(model, key, offload_buffers) for key in resolved}
    disk = {n: t for k, d in resolved.items() if d == "disk" for n, t in tensors_of[k].items()}
    if disk and offload_dir is None and offload_index is None:
        raise ValueError(
            f"device_map sends {sorted(k for k, d in resolved.items() if d == 'disk')} to 'disk': pass "
            "offload_dir=<a folder> (offload_folder= for load_checkpoint_and_dispatch)."
        )
    cpu_state = dict(state_dict or {})
    for key, device in resolved.items():
        if device == "cpu" and "cpu" in offloaded:
            for name, tensor in tensors_of[key].items():
                if name not in cpu_state:
                    if tensor.device.type == "meta":
                        raise ValueError(f"{name!r} is mapped to 'cpu' but is on the meta device (no data).")
                    cpu_state[name] = tensor.detach().to("cpu")
    index = _disk_index(offload_dir, disk, None if offload_index is None else dict(offload_index)) if disk else {}
    weights = OffloadedWeightsLoader(state_dict=cpu_state, save_folder=offload_dir, index=index)

    moved: dict = {}  # shared by all hooks: tied tensors are moved once
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True, skip_keys=skip_keys))
    by_parent: dict[str, list[str]] = {}
    for key, device in resolved.items():
        run_on = main if device in ("cpu", "disk") else device
        if not _is_module(model, key):
            by_parent.setdefault(key.rpartition(".")[0], []).append(key)
        elif device in offloaded:
            attach_align_device_hook(model.get_submodule(key), run_on, offload=True, weights_map=weights,
                                     offload_buffers=offload_buffers, module_name=key, skip_keys=skip_keys,
                                     preload_module_classes=preload_module_classes, tied_params_map=moved)
        else:
            module = model.get_submodule(key)
            add_hook_to_module(module, AlignDevicesHook(run_on, place_submodules=True, skip_keys=skip_keys,
                                                        tied_params_map=moved), append=True)
            attach_execution_device_hook(module, run_on, skip_keys=skip_keys, tied_params_map=moved)
    for parent, keys in by_parent.items():  # a module whose own tensors have entries of their own
        groups: dict[tuple, list[str]] = {}
        for key in keys:
            device = resolved[key]
            groups.setdefault((main if device in ("cpu", "disk") else device, device in offloaded), []).append(key)
        prefix = f"{parent}." if parent else ""
        for (run_on, offload), names in groups.items():
            hook = AlignDevicesHook(run_on, offload=offload, offload_buffers=offload_buffers, skip_keys=skip_keys,
                                    weights_map=PrefixedDataset(weights, prefix), tied_params_map=moved,
                                    tensor_names=[n[len(prefix):] for n in names])
            add_hook_to_module(model.get_submodule(parent), hook, append=True)
    model.hf_device_map = dict(device_map)  # type: ignore[assignment]  # a plain attribute (transformers')
    return model


def _is_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def _tensors_of_entry(model: nn.Module, key: str, include_buffers: bool) -> dict[str, torch.Tensor]:
    """The tensors a device-map entry (a module or one tensor) would offload, by full name."""
    if _is_module(model, key):
        return _named_tensors(model.get_submodule(key), include_buffers, f"{key}." if key else "")
    path, _, attr = key.rpartition(".")
    owner = model.get_submodule(path)
    if attr in owner._parameters:
        return {key: cast(torch.Tensor, owner._parameters[attr])}  # a name in the dict: a tensor, not None
    return {key: cast(torch.Tensor, owner._buffers[attr])} if include_buffers else {}


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | Mapping[str, int | str | torch.device] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
) -> nn.Module:
    """Load ``checkpoint`` (a safetensors/.bin file or a folder, sharded or not, as ``save_model`` writes it)
    into ``model`` (typically built under :func:`init_empty_weights`) and dispatch it.

    ``device_map`` is a dict, or ``"auto"``/``"balanced"`` (even over the GPUs), ``"balanced_low_0"`` (GPU 0
    kept light) or ``"sequential"`` (fill GPUs in order), computed within ``max_memory`` by
    :func:`infer_auto_device_map`; without GPUs these fill the CPU, then the disk (``offload_folder``).
    Tensors stream one at a time to their device or offload entry (see ``load_checkpoint_in_model``), so
    peak memory is about what stays resident plus one tensor. Without ``device_map`` the model is loaded on
    the CPU and returned without hooks.
    """
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ValueError(
                f"device_map={device_map!r} is not a known strategy: use one of "
                f"{', '.join(map(repr, DEVICE_MAP_STRATEGIES))} or a dict of module name to device."
            )
        memory: Mapping[Any, int | str] | None = max_memory  # device -> bytes (Mapping's keys are invariant)
        if device_map != "sequential":
            memory = get_balanced_memory(model, memory, no_split_module_classes, dtype=dtype,
                                         low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, memory, no_split_module_classes, dtype=dtype,
                                           offload_buffers=offload_buffers)
    if offload_state_dict is None:
        offload_state_dict = device_map is not None and "disk" in device_map.values()
    if device_map is None:
        load_checkpoint_in_model(model, checkpoint, dtype=dtype, strict=strict)
        return model
    load_checkpoint_in_model(model, checkpoint, dtype=dtype, strict=strict, device_map=device_map,
                             offload_folder=offload_folder, offload_state_dict=offload_state_dict,
                             offload_buffers=offload_buffers)
    return dispatch_model(model, device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
                          skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks)


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | Sequence[str] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Keep the weights of every Linear/Conv layer under ``module`` in ``storage_dtype`` and cast them to
    ``compute_dtype`` only while that layer runs (a ``LayerwiseCastingHook`` each), to save memory without
    quantizing. Layers whose name matches a regex of ``skip_modules_pattern`` (searched, as ``re.search``) or
    that are instances of ``skip_modules_classes`` are left as they are, with everything under them."""
    from accel.big_model.hooks import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING, LayerwiseCastingHook

    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else tuple(skip_modules_pattern or ())
    skip_classes = tuple(skip_modules_classes or ())
    todo = [("", module)]
    while todo:
        name, sub = todo.pop()
        if (skip_classes and isinstance(sub, skip_classes)) or any(re.search(p, name) for p in patterns):
            _logger.debug(f"Skipping layerwise casting for layer {name!r}")
            continue
        if isinstance(sub, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
            hook = LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking)
            add_hook_to_module(sub, hook, append=True)
            continue
        todo.extend((f"{name}.{child}" if name else child, m) for child, m in reversed(list(sub.named_children())))


def _refuse_recurrent_layers_under_sequence_parallelism(model: nn.Module) -> None:
    """ValueError for a model whose config lists linear-attention layers (``layer_types``): under sequence
    parallelism each rank would restart their recurrent state at its shard, giving wrong gradients silently.
    (Accelerate's private check, kept under its name since its test module imports it.)"""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    recurrent = sorted({t for t in getattr(config, "layer_types", None) or [] if "linear_attention" in t})
    if recurrent:
        raise ValueError(
            f"Sequence parallelism does not support layer_types {recurrent} of {type(model).__name__}: their "
            "recurrent state spans the sequence (linear_attention), so sharding the sequence gives wrong "
            "gradients; use a full-attention model or turn sequence parallelism off."
        )
