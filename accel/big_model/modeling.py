"""Sizes, memory budgets and device maps for big-model inference (the names of ``accelerate.utils.modeling``).

A device map sends each module (or tensor) name to a GPU index, ``"cpu"`` or ``"disk"``. It is computed from
parameter sizes only, so it works on a model built under ``init_empty_weights`` (meta tensors), and it is
used to load a checkpoint one tensor at a time straight to where each tensor will live, so that a model
larger than memory never has to be materialised whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import cast

import torch
from torch import nn

from accel.checkpoint import model_io
from accel.checkpoint.model_io import (
    CheckpointPlan,
    TensorLoader,
    format_keys,
    parse_size,
    resolve_dtype,
    unwrap_model,
)
from accel.big_model.offload import _dtype_name, offload_weight, save_offload_index
from accel.core.probes import is_cuda_available  # NVML: asking does not initialise CUDA (forks stay usable)

logger = logging.getLogger(__name__)  # a plain logger, as Accelerate's: these helpers run without a process state

__all__ = [
    "get_state_dict_from_offload",
    "named_module_tensors",
    "set_module_tensor_to_device",
    "find_tied_parameters",
    "compute_module_sizes",
    "get_max_layer_size",
    "get_max_memory",
    "get_balanced_memory",
    "infer_auto_device_map",
    "clean_device_map",
    "check_device_map",
    "load_checkpoint_with_device_map",
    "load_checkpoint_in_model",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "id_tensor_storage",
    "calculate_maximum_sizes",
    "has_offloaded_params",
    "align_module_device",
    "check_tied_parameters_in_config",
    "check_tied_parameters_on_same_device",
    "retie_parameters",
    "get_grad_scaler",
    "get_mixed_precision_context_manager",
    "load_offloaded_weights",
    "load_state_dict",
    "ensure_weights_retied",
    "get_non_persistent_buffers",
    "compute_module_total_buffer_size",
    "get_module_size_with_ties",
    "get_state_dict_offloaded_model",
    "fallback_allocate",
]

Device = int | str | torch.device
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


# ------------------------------------------------------------------------------------------ tensors


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers (if ``include_buffers``), each tied tensor once under its first name."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = _non_persistent_buffers(module, recurse) if remove_non_persistent else set()
        for name, buf in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buf


def _non_persistent_buffers(module: nn.Module, recurse: bool) -> set[str]:
    found: set[str] = set()
    for prefix, sub in module.named_modules() if recurse else [("", module)]:
        found.update(f"{prefix}.{n}" if prefix else n for n in sub._non_persistent_buffers_set)
    return found


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers left out of ``state_dict`` (``persistent=False``): ``module``'s own, or with ``recurse``
    those of every submodule too, by their attribute name (Accelerate's default) or, with ``fqns``, by their full
    dotted name. A new set: the modules' own sets are not touched."""
    if not recurse:
        return set(module._non_persistent_buffers_set)
    if fqns:
        return _non_persistent_buffers(module, recurse=True)
    return {name for sub in module.modules() for name in sub._non_persistent_buffers_set}


def _all_tensor_names(model: nn.Module, persistent_only: bool = False) -> list[str]:
    """Every parameter and buffer name, tied aliases included (``persistent_only``: state-dict names)."""
    skip = _non_persistent_buffers(model, recurse=True) if persistent_only else set()
    return [n for n, _ in model.named_parameters(remove_duplicate=False)] + [
        n for n, _ in model.named_buffers(remove_duplicate=False) if n not in skip
    ]


def _owner(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    path, _, attr = tensor_name.rpartition(".")
    owner = module.get_submodule(path) if path else module
    if attr not in owner._parameters and attr not in owner._buffers:
        raise ValueError(f"{type(module).__name__} has no parameter or buffer named {tensor_name!r}.")
    return owner, attr


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: Device,
    value: torch.Tensor | None = None,
    dtype: torch.dtype | str | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Replace the parameter/buffer ``tensor_name`` of ``module`` by ``value`` (or its current data) on ``device``.

    The replacement keeps the Parameter class and ``requires_grad``; without ``dtype`` a floating-point
    ``value`` takes the dtype the tensor had. Only this one place is changed (tied aliases keep theirs).

    Accelerate's other keywords: ``non_blocking`` is the copy's (``Tensor.to``); ``clear_cache`` empties the
    accelerator's cache after a move to it; ``tied_params_map`` ({data_ptr of a tied tensor: {device: tensor already
    there}}, as the dispatch hooks keep it) reuses the tensor already on ``device`` instead of a second copy, and
    records the new one where its source's pointer is a key; ``fp16_statistics`` is set as the new parameter's
    ``SCB`` (bitsandbytes' 8-bit statistics; accel quantizes nothing itself, the tensor is only kept with the weight).
    """
    owner, attr = _owner(module, tensor_name)
    is_param = attr in owner._parameters
    old = cast(torch.Tensor, owner._parameters[attr] if is_param else owner._buffers[attr])  # an entry, not None
    given_device = device
    device = _torch_device(device)
    tied = _tied_on_device(tied_params_map, (value, old), (given_device, device))
    if tied is not None:
        owner._parameters[attr] = tied
        return
    if value is None:
        if old.device.type == "meta" and device.type != "meta":
            raise ValueError(f"{tensor_name!r} is on the meta device: a value is needed to put it on {device}.")
        value = old
    elif value.shape != old.shape:
        raise ValueError(f'Trying to set a tensor of shape {value.shape} in "{attr}" (which has shape {old.shape}), '
                         "this looks incorrect.")  # Accelerate's words (its tests compare them)
    dtype = resolve_dtype(dtype)
    if dtype is None and value.is_floating_point() and old.is_floating_point():
        dtype = old.dtype
    with torch.no_grad():
        new = value.detach().to(device=device, dtype=dtype, non_blocking=non_blocking)
    if is_param:
        new = nn.Parameter(new, requires_grad=old.requires_grad)
        if fp16_statistics is not None:
            new.SCB = fp16_statistics.to(device, non_blocking=non_blocking)  # type: ignore[attr-defined]
        owner._parameters[attr] = new
    else:
        owner._buffers[attr] = new
    if clear_cache and device.type not in ("cpu", "meta"):
        from accel.core.memory import clear_device_cache

        clear_device_cache()
    if tied_params_map is not None:
        for source in (old, value):
            if source is not None and source.device.type != "meta":
                entry = tied_params_map.get(source.data_ptr())
                if entry is not None and given_device not in entry:
                    entry[given_device] = new
                    break


def _tied_on_device(tied_params_map: dict | None, sources: tuple, devices: tuple) -> torch.Tensor | None:
    """The tensor of `tied_params_map` already on the device for the first source (value, then the old tensor)
    whose data pointer is a key."""
    if not tied_params_map:
        return None
    for source in sources:
        if source is None or source.device.type == "meta":
            continue
        entry = tied_params_map.get(source.data_ptr())
        if entry is not None:
            for device in devices:
                if device in entry:
                    return entry[device]
    return None


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that hold the very same Parameter (tied weights), e.g.
    [["embed.weight", "head.weight"]]."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [sorted(names) for names in groups.values() if len(names) > 1]


# ------------------------------------------------------------------------------------------ sizes


def compute_module_sizes(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Bytes under every name prefix: ``""`` (the model), each module and each tensor; tied tensors once.

    With ``dtype`` floating-point tensors are sized in that dtype (the one they will be loaded in);
    ``special_dtypes`` overrides it for given tensor names. ``buffers_only``: count the buffers alone.
    """
    dtype = resolve_dtype(dtype)
    special = {name: resolve_dtype(d) for name, d in (special_dtypes or {}).items()}
    sizes: dict[str, int] = defaultdict(int)  # as Accelerate's: a name with no tensors of its own sizes 0
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        wanted = special.get(name) or (dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)
        size = tensor.numel() * wanted.itemsize
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            sizes[prefix] = sizes.get(prefix, 0) + size
    sizes.setdefault("", 0)
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
) -> int:
    """Bytes of all of ``model``'s buffers (sized as ``compute_module_sizes`` does): what stays on the execution
    device of an offloaded module whose buffers are not offloaded."""
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True)[""]


def get_module_size_with_ties(
    tied_params: list[str],
    module_size: int,
    module_sizes: Mapping[str, int],
    modules_to_treat: list[tuple[str, nn.Module | torch.Tensor]],
) -> tuple[int, list[str], list[nn.Module | torch.Tensor]]:
    """(bytes, names, objects) of a module placed together with the entries of ``modules_to_treat`` that hold the
    parameters in ``tied_params`` (tied to one inside it): each such entry adds its size less the tied parameter,
    which is already counted. An entry holds a parameter when the name is under it (``"1"`` never takes
    ``"10.weight"``); a parameter no entry holds is already placed and adds nothing."""
    total, names, objects = module_size, [], []
    for param in tied_params:
        holder = next(((n, o) for n, o in modules_to_treat if param.startswith(n + ".")), None)
        if holder is None:
            continue
        names.append(holder[0])
        objects.append(holder[1])
        total += module_sizes.get(holder[0], 0) - module_sizes.get(param, 0)  # an alias is sized under its first name
    return total, names, objects


def _entries(obj: nn.Module, prefix: str) -> list[tuple[str, nn.Module | torch.Tensor]]:
    """What a module splits into: its own parameters, its children, its own buffers (Accelerate's order)."""
    dot = f"{prefix}." if prefix else ""
    return (
        [(dot + n, p) for n, p in obj.named_parameters(recurse=False)]
        + [(dot + n, c) for n, c in obj.named_children()]
        + [(dot + n, b) for n, b in obj.named_buffers(recurse=False)]
    )


def _splittable(obj, no_split: set[str]) -> bool:
    return isinstance(obj, nn.Module) and type(obj).__name__ not in no_split and next(obj.children(), None) is not None


def get_max_layer_size(
    modules: list[tuple[str, nn.Module | torch.Tensor]],
    module_sizes: Mapping[str, int],
    no_split_module_classes: Iterable[str],
) -> tuple[int, list[str]]:
    """Size and names (in model order) of the largest layer among ``modules``: a module that is never split (no
    children, or a class in ``no_split_module_classes``) or a lone tensor. It is what gets moved in at once. A
    split module's own parameters are not layers of their own here (Accelerate's rule)."""
    no_split = set(no_split_module_classes or ())
    best, names, todo = 0, [], list(modules)
    while todo:
        name, obj = todo.pop(0)
        children = list(obj.named_children()) if isinstance(obj, nn.Module) else []
        if children and type(obj).__name__ not in no_split:
            todo = [(f"{name}.{n}", c) for n, c in children] + todo
            continue
        size = module_sizes.get(name, 0)
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


# ------------------------------------------------------------------------------------------ devices


def _gpu_count() -> int:
    return torch.cuda.device_count() if is_cuda_available() else 0


def _torch_device(device: Device) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


def _allowed_devices() -> str:
    n = _gpu_count()
    gpus = f"GPU indices 0..{n - 1} or 'cuda:i'" if n else "no GPU index (this machine has no GPU)"
    return f"'cpu', 'disk', {gpus}"


def _resolve_device(value, what: str, planning: bool = False) -> str | torch.device:
    """``"cpu"``, ``"disk"`` or a CUDA ``torch.device``; ValueError naming ``what`` otherwise.

    With ``planning`` (sizing a device map, nothing is moved) a GPU index this machine lacks is accepted with a
    warning, as Accelerate does; otherwise the GPU must exist here, since tensors are about to go there.
    """
    if value == "disk" or value == "cpu":
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        raise ValueError(f"{what} = {value!r} is not a device: allowed are {_allowed_devices()}.")
    try:
        device = _torch_device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{what} = {value!r} is not a known device: allowed are {_allowed_devices()}.") from None
    if device.type == "cpu":
        return "cpu"
    index = device.index or 0
    if device.type == "cuda" and 0 <= index < _gpu_count():
        return torch.device("cuda", index)
    if device.type == "cuda" and index >= 0 and planning:
        logger.warning(f"Device {index} is not available, available devices are {list(range(_gpu_count()))}")
        return torch.device("cuda", index)
    raise ValueError(f"{what} = {value!r} is not a device this machine has: allowed are {_allowed_devices()}.")


def _available_cpu_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def get_max_memory(max_memory: Mapping[Device, int | str] | None = None) -> dict[int | str, int]:
    """Bytes usable per device, ordered GPUs (by index), ``"cpu"``, ``"disk"``.

    Without ``max_memory``: the free memory of every GPU and the available RAM. Otherwise only the devices
    given, with sizes as ints or floats (bytes) or strings such as ``"2GiB"``, ``"500MB"`` (see ``parse_size``);
    keys are GPU indices (``"cuda:i"`` is accepted), ``"cpu"`` and ``"disk"``.
    """
    if max_memory is None:
        found: dict[int | str, int] = {i: torch.cuda.mem_get_info(i)[0] for i in range(_gpu_count())}
        found["cpu"] = _available_cpu_memory()
        return found
    if not isinstance(max_memory, Mapping):
        raise ValueError(f"max_memory must be a dict of device to size, got {max_memory!r}.")
    result: dict[int | str, int] = {}
    for key, size in list(max_memory.items()):
        device = _resolve_device(key, f"max_memory key {key!r}", planning=True)
        name = device if isinstance(device, str) else device.index
        try:  # a float count of bytes too: transformers passes 90% of the available memory
            result[name] = int(size) if isinstance(size, float) and 0 <= size < float("inf") else parse_size(size)
        except ValueError as exc:
            raise ValueError(f"max_memory[{key!r}]: {exc}") from None
        if isinstance(size, str) and isinstance(max_memory, dict):
            max_memory[key] = result[name]  # as Accelerate: callers (transformers) then compare ints with ints
    gpus = sorted(k for k in result if isinstance(k, int))
    return {k: result[k] for k in gpus + [k for k in ("cpu", "disk") if k in result]}


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    low_zero: bool = False,
) -> dict[int | str, int]:
    """A ``max_memory`` that spreads the model evenly over the GPUs (``low_zero``: as little as possible on GPU 0).

    Each GPU but the last gets its share plus a margin (1.25 x the larger of the biggest no-split block and
    the mean leaf module), so layers are not pushed off the end; with no GPU ``max_memory`` is returned as is.
    """
    user_set = max_memory is not None
    memory = get_max_memory(max_memory)
    gpus = [k for k, v in memory.items() if isinstance(k, int) and v > 0]
    if not gpus:
        return memory
    if len(gpus) == 1:
        low_zero = False
        if not user_set:  # keep 10% free for activations when the budget was not chosen by the user
            memory[gpus[0]] = int(memory[gpus[0]] * 0.9)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))
    no_split = set(no_split_module_classes or [])
    modules = dict(model.named_modules())
    block = max((sizes.get(n, 0) for n, m in modules.items() if n and type(m).__name__ in no_split), default=0)
    leaves = [n for n, m in modules.items() if n in sizes and n and not any(
        f"{n}.{c}" in sizes for c, _ in m.named_children())]
    mean_leaf = sum(sizes[n] for n in leaves) // max(len(leaves), 1)
    per_gpu += int(1.25 * max(block, mean_leaf))
    for index in gpus[:-1]:  # the last GPU keeps its whole budget, in case the margin was not enough
        memory[index] = min(memory[index] if low_zero and index == gpus[0] else per_gpu, memory[index])
    if low_zero:
        memory[gpus[0]] = min(max(0, sizes[""] - sum(memory[i] for i in gpus[1:])), memory[gpus[0]])
    return memory


# ------------------------------------------------------------------------------------------ device maps


def _inside(name: str, tensor_name: str) -> bool:
    return tensor_name == name or tensor_name.startswith(name + ".")


def _outside_ties(name: str, tied: list[list[str]]) -> list[str]:
    """Parameters tied to one under ``name`` that are not under ``name`` themselves."""
    groups = [g for g in tied if any(_inside(name, t) for t in g) and not all(_inside(name, t) for t in g)]
    return [t for g in groups for t in g if not _inside(name, t)]


def _split(name: str, obj, no_split: set[str]) -> list[tuple[str, nn.Module | torch.Tensor]] | None:
    """What ``obj`` is replaced by when it is split (its own parameters, children and buffers), or None when it
    cannot be: a tensor, a module without children or one whose class is in ``no_split``."""
    if not _splittable(obj, no_split):
        return None
    return _entries(obj, name)


def _modules_only(queue):
    return [(n, o) for n, o in queue if isinstance(o, nn.Module)]


def fallback_allocate(
    modules: list[tuple[str, nn.Module | torch.Tensor]],
    module_sizes: Mapping[str, int],
    size_limit: int | str,
    no_split_module_classes: Iterable[str] | None = None,
    tied_parameters: list[list[str]] | None = None,
) -> tuple[str | None, nn.Module | torch.Tensor | None, list[tuple[str, nn.Module | torch.Tensor]]]:
    """The first entry (depth first, splitting modules as needed) of ``modules`` that fits in ``size_limit`` with
    its ties, and ``modules`` with it taken out (its ancestors there replaced by their parts); ``(None, None,
    modules)`` when nothing fits. It lets ``infer_auto_device_map(fallback_allocation=True)`` put something on a
    device the next module in order is too big for."""
    try:
        size_limit = convert_file_size_to_int(size_limit)
    except ValueError:
        return None, None, modules
    no_split = set(no_split_module_classes or ())
    tied = tied_parameters or []
    search, found = list(modules), None
    while search:
        name, obj = search.pop(0)
        size, _, _ = get_module_size_with_ties(_outside_ties(name, tied), module_sizes.get(name, 0), module_sizes,
                                               search)
        if size <= size_limit:
            found = name
            break
        parts = _split(name, obj, no_split)
        if parts is not None:
            search = parts + search
    if found is None:
        return None, None, modules
    queue = list(modules)
    for depth in range(1, found.count(".") + 1):  # open the ancestors of `found` that are still whole in the queue
        ancestor = ".".join(found.split(".")[:depth])
        at = next((i for i, (n, _) in enumerate(queue) if n == ancestor), None)
        if at is not None:
            queue[at:at + 1] = _entries(cast(nn.Module, queue[at][1]), ancestor)  # an ancestor: a module
    at = next(i for i, (n, _) in enumerate(queue) if n == found)
    name, obj = queue.pop(at)
    return name, obj, queue


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: Iterable[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, int | str]:
    """A device map filling the GPUs in order, then ``"cpu"``, then ``"disk"``, from sizes alone (Accelerate's rules).

    Modules are taken in definition order. One that does not fit where the filling stands is split into its
    parameters, children and buffers unless its class name is in ``no_split_module_classes`` (or it has no
    children), in which case it starts the next device. Entries holding a tensor tied to one in the module go with
    it (one of them is split first when only the module itself fits). GPU 0 (or the CPU when there is no GPU) and
    the CPU keep room for the largest layer still to place, since offloaded layers are brought there to run.
    ``fallback_allocation``: a device that the next module does not fit gets the first later entry that does,
    rather than nothing. Without ``offload_buffers`` the buffers of offloaded modules stay on the execution device:
    a warning says so when they fit no GPU. GPU indices need not exist here: the map is only planned.
    """
    memory = get_max_memory(max_memory)
    no_split = {no_split_module_classes} if isinstance(no_split_module_classes, str) else set(
        no_split_module_classes or ())
    devices = list(memory) + ([] if "disk" in memory else ["disk"])
    gpus = [d for d in devices if isinstance(d, int)]
    main_devices = {gpus[0], "cpu"} if gpus else {"cpu"}
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    tied = find_tied_parameters(model)
    if check_tied_parameters_in_config(model) and not tied:
        logger.warning("The model weights are not tied. Please use the `tie_weights` method before using the "
                       "`infer_auto_device` function.")
    say = print if verbose else (lambda *_: None)

    queue = _entries(model, "")
    device_map: dict[str, int | str] = {}
    used = dict.fromkeys(devices, 0)
    buffers_on: dict[int | str, int] = {}
    too_small: dict[int | str, int] = {}
    layer_size, layer_names = get_max_layer_size(queue, sizes, no_split)
    current = 0
    while queue:
        name, obj = queue.pop(0)
        layer_names = [n for n in layer_names if not _inside(name, n)]
        if not layer_names:  # the largest layer left was this module: find the next largest
            layer_size, layer_names = get_max_layer_size(_modules_only(queue), sizes, no_split)
        ties = _outside_ties(name, tied)
        device = devices[current]
        reserved = layer_size if device in main_devices else 0
        limit = None if device == "disk" else memory[device] - reserved
        size = sizes.get(name, 0)
        with_ties, tie_names, tie_objs = get_module_size_with_ties(ties, size, sizes, queue)

        if limit is None or used[device] + with_ties <= limit:
            say(f"Putting {name}{' and ' + str(tie_names) if tie_names else ''} ({with_ties} bytes) on {device!r}.")
            used[device] += with_ties
            for placed in [name, *tie_names]:
                device_map[placed] = device
            queue = [(n, o) for n, o in queue if n not in tie_names]
            if not offload_buffers and isinstance(obj, nn.Module):
                buffers_on[device] = buffers_on.get(device, 0) + compute_module_total_buffer_size(
                    obj, dtype=dtype, special_dtypes=special_dtypes)
            continue

        if ties and used[device] + size <= limit:  # the module fits alone: split one of the entries tied to it
            position = {n: i for i, (n, _) in enumerate(queue)}
            splittable = [(position[n], _split(n, o, no_split)) for n, o in zip(tie_names, tie_objs, strict=True)
                          if n in position and _split(n, o, no_split) is not None]
            at, parts = splittable[0] if splittable else (None, None)
            if parts is not None:
                say(f"Splitting {queue[at][0]} (tied to {name}) to fit {name} on {device!r}.")
                queue = [(name, obj)] + queue[:at] + parts + queue[at + 1:]
                layer_size, layer_names = get_max_layer_size(_modules_only(queue), sizes, no_split)
                continue

        if used[device] + size >= limit:
            parts = _split(name, obj, no_split)
            if parts is not None:
                say(f"Splitting {name}: {size} bytes do not fit in {limit - used[device]} on {device!r}.")
                queue = parts + queue
                layer_size, layer_names = get_max_layer_size(_modules_only(queue), sizes, no_split)
                continue

        if fallback_allocation and used[device] == 0 and device != "disk":
            room = memory[device] - max(layer_size, with_ties)
            found, found_obj, rest = fallback_allocate(queue, sizes, room, no_split, tied)
            if found is not None:
                say(f"Fallback: {found} goes on {device!r} before {name}.")
                queue = [(found, found_obj), (name, obj)] + rest
                continue

        if used[device] == 0:
            too_small[device] = with_ties + reserved
        say(f"{name} ({with_ties} bytes) does not fit on {device!r}: next device.")
        used[device] += reserved
        current += 1
        queue.insert(0, (name, obj))

    if clean_result:
        device_map = clean_device_map(device_map)
    _warn_offloaded_buffers(buffers_on, used, memory, gpus, offload_buffers)
    if too_small:
        needs = "\n".join(f"  - {device}: {need} bytes required" for device, need in too_small.items())
        logger.info("Based on the current allocation process, no modules could be assigned to the following devices "
                    f"due to insufficient memory:\n{needs}\nThese minimum requirements are specific to this allocation "
                    "attempt and may vary; give these devices more memory or adjust the model config.")
    return device_map


def _warn_offloaded_buffers(buffers_on, used, max_memory, gpus, offload_buffers) -> None:
    """Warn when the buffers of CPU/disk-offloaded modules (kept on the execution device without
    ``offload_buffers``) fit in no GPU's remaining memory."""
    offloaded = buffers_on.get("cpu", 0) + buffers_on.get("disk", 0)
    if offload_buffers or not offloaded or not gpus:
        return
    if not any(max_memory[g] >= offloaded + used.get(g, 0) for g in gpus):
        warnings.warn(f"Current model requires {offloaded} bytes of buffers for its offloaded layers on the execution "
                      "device, more than any GPU has left in this map: pass offload_buffers=True if it runs out of "
                      "memory.", stacklevel=1)


def clean_device_map(device_map: dict[str, Device], module_name: str = "") -> dict[str, Device]:
    """Merge the entries under a module into one entry for the module wherever they all share a device."""
    prefix = f"{module_name}." if module_name else ""
    under = [k for k in device_map if k == module_name or k.startswith(prefix)]
    values = {repr(device_map[k]) for k in under}
    if len(under) > 1 and len(values) == 1:
        value = device_map[under[0]]
        for k in under:
            del device_map[k]
        device_map[module_name] = value
        return device_map
    depth = len(module_name.split(".")) + 1 if module_name else 1
    for child in dict.fromkeys(".".join(k.split(".")[:depth]) for k in under if k != module_name):
        clean_device_map(device_map, child)
    return device_map


def _map_key(name: str, keys: Mapping[str, object]) -> str | None:
    """The entry of a device map that covers tensor or module ``name`` (itself or its closest ancestor)."""
    while True:
        if name in keys:
            return name
        if not name:
            return None
        name = name.rpartition(".")[0]


def check_device_map(model: nn.Module, device_map: Mapping[str, Device]) -> None:
    """Accelerate's check of a planned map: a ``UserWarning`` names keys that are no module or tensor of
    ``model``, and a ``ValueError`` names the parameters and persistent buffers no entry covers. Devices are not
    checked (a map may be planned for GPUs this machine lacks); dispatching checks them."""
    if not isinstance(device_map, Mapping):
        raise ValueError(f"device_map must be a dict of module name to device, got {device_map!r}.")
    names = {n for n, _ in model.named_modules(remove_duplicate=False)} | set(_all_tensor_names(model))
    unknown = [k for k in device_map if k not in names]
    if unknown:
        warnings.warn(f"The following device_map keys do not match any submodules in the model: {unknown}",
                      UserWarning, stacklevel=2)
    unassigned = [n for n in _all_tensor_names(model, persistent_only=True) if _map_key(n, device_map) is None]
    if unassigned:
        raise ValueError(f"device_map leaves {format_keys(unassigned)} without a device; add entries for them.")


def _checked_device_map(model: nn.Module, device_map: Mapping[str, Device]) -> dict[str, str | torch.device]:
    """``device_map`` with every value resolved (``"cpu"``, ``"disk"`` or a CUDA device), for loading or
    dispatching, after checking that each key names a module or tensor of ``model``, keys do not nest, every
    device exists here and every parameter and persistent buffer is covered (non-persistent buffers left out run
    on the main device). Raises ``ValueError`` naming what is wrong."""
    if not isinstance(device_map, Mapping):
        raise ValueError(
            "device_map must be a dict of module name to device or one of "
            f"{', '.join(map(repr, DEVICE_MAP_STRATEGIES))}; got {device_map!r}."
        )
    names = {n for n, _ in model.named_modules(remove_duplicate=False)} | set(_all_tensor_names(model))
    resolved: dict[str, str | torch.device] = {}
    for key, value in device_map.items():
        if not isinstance(key, str) or key not in names:
            raise ValueError(f"device_map key {key!r} names no module, parameter or buffer of {type(model).__name__}.")
        resolved[key] = _resolve_device(value, f"device_map[{key!r}]")
    for key in resolved:
        parent = _map_key(key.rpartition(".")[0], resolved) if key else None
        if parent is not None:
            raise ValueError(f"device_map keys {parent!r} and {key!r} overlap: give each module one entry.")
    unassigned = [n for n in _all_tensor_names(model, persistent_only=True) if _map_key(n, resolved) is None]
    if unassigned:
        raise ValueError(f"device_map leaves {format_keys(unassigned)} without a device; add entries for them.")
    return resolved


# ------------------------------------------------------------------------------------------ loading


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
        if any((path / name).is_file() for name in model_io._FOLDER_CANDIDATES):
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
        index = model_io.read_json(path)
    except OSError:
        return path  # model_io names the problem
    if not isinstance(index, dict) or "weight_map" in index or not index or not all(
            isinstance(v, str) for v in index.values()):
        return path
    keys = {entry: key for key, entry in index.items()}
    return [model_io._checked_shard_path(path.parent, entry, path, key) for entry, key in keys.items()]


def _load_shards(model, shards: list[Path], device_map, **kwargs) -> tuple[list[str], list[str]]:
    """Load the shards of a bare index one file at a time; a key is missing when no shard holds it."""
    missing: list[str] | None = None
    unexpected: list[str] = []
    for shard in shards:
        if device_map is None:
            lacked, extra = model_io.load_checkpoint_in_model(model, shard, dtype=kwargs["dtype"])
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
    :func:`accel.checkpoint.model_io.load_checkpoint_in_model`; with one, each tensor goes straight to its mapped
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
            missing, unexpected = model_io.load_checkpoint_in_model(model, checkpoint, dtype=dtype, strict=strict)
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


# ------------------------------------------------------------------------------------------ Accelerate's small helpers


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes in ``size``: an int as it is, or a string with a unit as Accelerate reads it: ``"5GB"``/``"5MB"``/
    ``"5KB"`` powers of 1000, ``"5GiB"``/``"5MiB"``/``"5KiB"`` powers of 1024, and a lower-case ``b`` (``"5Gb"``)
    for bits (an eighth). Anything else is a ValueError."""
    error = (f"`size` {size} is not in a valid format. Use an integer for bytes, or a string with an unit "
             "(like '5.0GB').")
    binary = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10}
    decimal = {"GB": 10**9, "MB": 10**6, "KB": 10**3}
    result = -1
    try:
        if isinstance(size, int):
            result = size
        elif size.upper()[-3:] in binary:
            result = int(float(size[:-3]) * binary[size.upper()[-3:]])
        elif size.upper()[-2:] in decimal:
            result = int(float(size[:-2]) * decimal[size.upper()[-2:]])
            if size.endswith("b"):  # bits
                result //= 8
    except ValueError:
        raise ValueError(error) from None
    if result < 0:
        raise ValueError(error)
    return result


_CUSTOM_DTYPE_BYTES = {"int2": 1 / 4, "int4": 1 / 2, "fp8": 1}


def dtype_byte_size(dtype: torch.dtype) -> int | float:
    """Bytes one element of ``dtype`` takes: ``1/8`` for bool, fractions for ``CustomDtype.INT2``/``INT4``, else
    torch's ``itemsize`` (Accelerate 1.16's rule: packed 4-bit dtypes such as ``uint4`` count 1 byte, not 0)."""
    import enum

    if dtype == torch.bool:
        return 1 / 8
    if isinstance(dtype, enum.Enum) and type(dtype).__name__ == "CustomDtype":
        return _CUSTOM_DTYPE_BYTES[dtype.value]
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"`dtype` is not a valid dtype: {dtype}.")
    return dtype.itemsize


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """(device, storage address, storage bytes): equal for tensors that share memory (tied weights, views) while
    both live. Every meta tensor has address 0."""
    try:
        storage = tensor.untyped_storage()
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except Exception:
        try:
            storage = tensor.storage()
            return tensor.device, storage.data_ptr(), storage.size() * tensor.element_size()
        except NotImplementedError:
            return tensor.device, 0, tensor.nelement() * tensor.element_size()


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """(bytes of the model, (bytes, names) of its largest layer): what must fit in memory at once. A transformers
    model's ``_no_split_modules`` are layers that are never split."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    return sizes[""], get_max_layer_size(_entries(model, ""), sizes, no_split)


def has_offloaded_params(module: nn.Module) -> bool:
    """Whether ``module`` has an ``AlignDevicesHook`` with offloading on (its weights live elsewhere between calls)."""
    from accel.big_model.hooks import AlignDevicesHook

    hook = getattr(module, "_hf_hook", None)
    return isinstance(hook, AlignDevicesHook) and bool(hook.offload)



@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: Device | None = None):
    """Inside the block ``module``'s own parameters are on ``execution_device``: an offloaded module's weights are
    brought in by its hook (to the hook's execution device if none is given) and sent back after; a plain module's
    parameters are moved there and back. Without either, nothing changes."""
    if has_offloaded_params(module):
        hook = module._hf_hook
        original = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = original
    elif execution_device is not None:
        devices = {name: p.device for name, p in module.named_parameters(recurse=False)}
        try:
            for name in devices:
                set_module_tensor_to_device(module, name, execution_device)
            yield
        finally:
            for name, device in devices.items():
                set_module_tensor_to_device(module, name, device)
    else:
        yield


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a transformers model says some weights are tied: ``tie_word_embeddings`` with output embeddings,
    ``tie_encoder_decoder`` on an encoder-decoder, or a module with ``_tie_weights``. False for other models."""
    import inspect

    if "PreTrainedModel" not in [c.__name__ for c in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    text_config = None
    if config is not None:
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    word_embeddings = bool(text_config is not None and getattr(text_config, "tie_word_embeddings", False)
                           and model.get_output_embeddings())
    encoder_decoder = bool(config is not None and getattr(config, "is_encoder_decoder", False)
                           and getattr(config, "tie_encoder_decoder", False))
    return word_embeddings or encoder_decoder or any(hasattr(m, "_tie_weights") for m in model.modules())


def _device_of(name: str, device_map: Mapping[str, Device]) -> Device:
    """The device ``device_map`` gives ``name`` (itself or its nearest listed parent module)."""
    while name not in device_map:
        parent = name.rpartition(".")[0]
        if parent == name:
            raise ValueError(f"The `device_map` does not contain the module {name}.")
        name = parent
    return device_map[name]


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: Mapping[str, Device]) -> None:
    """Warn for each group of tied parameters that ``device_map`` puts on more than one device."""
    for group in tied_params:
        devices = {name: _device_of(name, device_map) for name in group}
        if len(set(devices.values())) > 1:
            logger.warning(f"Tied parameters are on different devices: {devices}. Please modify your custom device "
                           "map or set `device_map='auto'`. ")


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Tie again the groups of ``tied_params`` (``find_tied_parameters``' answer) whose link was broken: every name of
    a group gets the group's first parameter that is not on the meta device (groups all on meta stay as they are)."""
    for group in tied_params:
        params = (_get_attr_path(model, name) for name in group)
        keep = next((p for p in params if p.device != torch.device("meta")), None)
        if keep is None:
            continue
        for name in group:
            path, _, attr = name.rpartition(".")
            setattr(_get_attr_path(model, path) if path else model, attr, keep)


def _get_attr_path(model: nn.Module, name: str):
    obj = model
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def get_grad_scaler(distributed_type=None, **kwargs):
    """A new GradScaler for fp16: torch's ShardedGradScaler for ``DistributedType.FSDP``, else ``torch.amp``'s for
    this machine's accelerator (XPU, MPS, else CUDA: as in Accelerate, a CUDA scaler is disabled where there is no
    GPU). ``kwargs`` go to the scaler."""
    from accel.core.probes import is_mps_available, is_torch_version, is_xpu_available

    if distributed_type == "FSDP":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)
    if is_xpu_available():
        return torch.amp.GradScaler("xpu", **kwargs)
    if is_mps_available():
        if not is_torch_version(">=", "2.8.0"):
            raise ValueError("Grad Scaler with MPS device requires a Pytorch >= 2.8.0")
        return torch.amp.GradScaler("mps", **kwargs)
    return torch.amp.GradScaler("cuda", **kwargs)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs=None):
    """The autocast context for the run's ``mixed_precision`` (the Accelerator's, else $ACCELERATE_MIXED_PRECISION)
    on its device: float16 for fp16, bfloat16 for bf16 and fp8, the device's default otherwise; a no-op context
    unless ``native_amp``. ``autocast_kwargs`` (an ``AutocastKwargs``) adds torch.autocast's arguments."""
    from accel.runtime.state import AcceleratorState

    if not native_amp:
        return contextlib.nullcontext()
    state = AcceleratorState()
    kwargs = {} if autocast_kwargs is None else autocast_kwargs.to_kwargs()
    mixed_precision = state.__dict__.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    mixed_precision = str(getattr(mixed_precision, "value", mixed_precision)).lower()
    device_type = state.device.type
    if mixed_precision == "fp16":
        return torch.autocast(device_type=device_type, dtype=torch.float16, **kwargs)
    if mixed_precision in ("bf16", "fp8"):  # every distributed type accel runs is one Accelerate autocasts in bf16
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16, **kwargs)
    return torch.autocast(device_type=device_type, **kwargs)


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
    model_io.verify_saved_file(checkpoint_file, opened)
    checkpoint_file = str(checkpoint_file)
    if not checkpoint_file.endswith(".safetensors"):
        return model_io.torch_load_weights(checkpoint_file, opened)
    with model_io.safe_open_checked(checkpoint_file, opened) as f:
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
        with model_io.safe_open_checked(checkpoint_file, opened, device=device) as f:
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
        with model_io.safe_open_checked(checkpoint_file, opened, device=device) as f:
            for key in wanted[device]:
                tensors[key] = f.get_tensor(key)
    return tensors


def ensure_weights_retied(param_init_fn, model: nn.Module, device: torch.device):
    """``param_init_fn`` (FSDP's per-module initialiser) wrapped so the weights a transformers model lists in
    ``_tied_weights_keys`` are tied again after it re-creates them: every use gets the first one re-created.
    Without such keys ``param_init_fn`` is returned as it is."""
    tied_names = getattr(model, "_tied_weights_keys", None)
    if not tied_names:
        return param_init_fn
    tied: dict[int, nn.Parameter | None] = {}
    for name in tied_names:
        path, _, attr = name.rpartition(".")
        tied[id(getattr(model.get_submodule(path), attr))] = None

    def init_and_retie(module: nn.Module) -> nn.Module:
        to_tie: dict[int, list[str]] = {}
        for name, param in module.named_parameters(recurse=False):
            if id(param) in tied:
                to_tie.setdefault(id(param), []).append(name)
        module = param_init_fn(module)
        for key, names in to_tie.items():
            for name in names:
                if tied[key] is None:
                    tied[key] = getattr(module, name)  # the first re-created one is what the others use
                else:
                    setattr(module, name, tied[key])
        return module

    return init_and_retie


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
