"""Memory budgets and device maps: how much each device may hold (`get_max_memory`, `get_balanced_memory`), where
each module goes (`infer_auto_device_map`), and a map checked against its model before anything is loaded.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import cast

import torch
from torch import nn

from accel.checkpoint.model_files import parse_size
from accel.checkpoint.model_reader import format_keys
from accel.core.probes import is_cuda_available  # NVML: asking does not initialise CUDA (forks stay usable)
from accel.big_model.module_tensors import (
    Device,
    _all_tensor_names,
    _torch_device,
    check_tied_parameters_in_config,
    find_tied_parameters,
)
from accel.big_model.sizes import (
    _entries,
    _splittable,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    get_max_layer_size,
    get_module_size_with_ties,
)


logger = logging.getLogger(__name__)  # a plain logger, as Accelerate's: these helpers run without a process state
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


# ------------------------------------------------------------------------------------------ devices


def _gpu_count() -> int:
    return torch.cuda.device_count() if is_cuda_available() else 0


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
