"""Sizes, memory budgets and device maps for big-model inference (the names of ``accelerate.utils.modeling``).

A device map sends each module (or tensor) name to a GPU index, ``"cpu"`` or ``"disk"``. It is computed from
parameter sizes only, so it works on a model built under ``init_empty_weights`` (meta tensors), and it is
used to load a checkpoint one tensor at a time straight to where each tensor will live, so that a model
larger than memory never has to be materialised whole.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

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
from accel.utils.offload import _dtype_name, offload_weight, save_offload_index

__all__ = [
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
    found = set()
    for prefix, sub in module.named_modules() if recurse else [("", module)]:
        found.update(f"{prefix}.{n}" if prefix else n for n in sub._non_persistent_buffers_set)
    return found


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
) -> None:
    """Replace the parameter/buffer ``tensor_name`` of ``module`` by ``value`` (or its current data) on ``device``.

    The replacement keeps the Parameter class and ``requires_grad``; without ``dtype`` a floating-point
    ``value`` takes the dtype the tensor had. Only this one place is changed (tied aliases keep theirs).
    """
    owner, attr = _owner(module, tensor_name)
    is_param = attr in owner._parameters
    old = owner._parameters[attr] if is_param else owner._buffers[attr]
    device = _torch_device(device)
    if value is None:
        if old.device.type == "meta" and device.type != "meta":
            raise ValueError(f"{tensor_name!r} is on the meta device: a value is needed to put it on {device}.")
        value = old
    dtype = resolve_dtype(dtype)
    if dtype is None and value.is_floating_point() and old.is_floating_point():
        dtype = old.dtype
    with torch.no_grad():
        new = value.detach().to(device=device, dtype=dtype)
    if is_param:
        new = nn.Parameter(new, requires_grad=old.requires_grad)
        owner._parameters[attr] = new
    else:
        owner._buffers[attr] = new


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that hold the very same Parameter (tied weights), e.g. [["embed.weight", "head.weight"]]."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [sorted(names) for names in groups.values() if len(names) > 1]


# ------------------------------------------------------------------------------------------ sizes


def compute_module_sizes(
    model: nn.Module, dtype: torch.dtype | str | None = None, special_dtypes: Mapping[str, torch.dtype | str] | None = None
) -> dict[str, int]:
    """Bytes under every name prefix: ``""`` (the model), each module and each tensor; tied tensors once.

    With ``dtype`` floating-point tensors are sized in that dtype (the one they will be loaded in);
    ``special_dtypes`` overrides it for given tensor names.
    """
    dtype = resolve_dtype(dtype)
    special = {name: resolve_dtype(d) for name, d in (special_dtypes or {}).items()}
    sizes: dict[str, int] = {}
    for name, tensor in named_module_tensors(model, recurse=True):
        wanted = special.get(name) or (dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)
        size = tensor.numel() * wanted.itemsize
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            sizes[prefix] = sizes.get(prefix, 0) + size
    sizes.setdefault("", 0)
    return sizes


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
    modules: list[tuple[str, nn.Module | torch.Tensor]], module_sizes: Mapping[str, int], no_split_module_classes: Iterable[str]
) -> tuple[int, list[str]]:
    """Size and names of the largest layer among ``modules``: a module that is never split (no children, or
    a class in ``no_split_module_classes``) or a lone tensor. It is what gets moved in at once."""
    no_split = set(no_split_module_classes)
    best, names, todo = 0, [], list(modules)
    while todo:
        name, obj = todo.pop()
        if _splittable(obj, no_split):
            todo.extend(_entries(obj, name))
            continue
        size = module_sizes.get(name, 0)
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


# ------------------------------------------------------------------------------------------ devices


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torch_device(device: Device) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


def _allowed_devices() -> str:
    n = _gpu_count()
    gpus = f"GPU indices 0..{n - 1} or 'cuda:i'" if n else "no GPU index (this machine has no GPU)"
    return f"'cpu', 'disk', {gpus}"


def _resolve_device(value, what: str) -> str | torch.device:
    """``"cpu"``, ``"disk"`` or a CUDA ``torch.device`` that exists here; ValueError naming ``what`` otherwise."""
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
    if device.type == "cuda" and (device.index or 0) < _gpu_count() and (device.index or 0) >= 0:
        return torch.device("cuda", device.index or 0)
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
    given, with sizes as ints (bytes) or strings such as ``"2GiB"``, ``"500MB"`` (see ``parse_size``); keys are
    GPU indices (``"cuda:i"`` is accepted), ``"cpu"`` and ``"disk"``.
    """
    if max_memory is None:
        found: dict[int | str, int] = {i: torch.cuda.mem_get_info(i)[0] for i in range(_gpu_count())}
        found["cpu"] = _available_cpu_memory()
        return found
    if not isinstance(max_memory, Mapping):
        raise ValueError(f"max_memory must be a dict of device to size, got {max_memory!r}.")
    result: dict[int | str, int] = {}
    for key, size in max_memory.items():
        device = _resolve_device(key, f"max_memory key {key!r}")
        name = device if isinstance(device, str) else device.index
        try:
            result[name] = parse_size(size)
        except ValueError as exc:
            raise ValueError(f"max_memory[{key!r}]: {exc}") from None
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
    max_memory = get_max_memory(max_memory)
    gpus = [k for k, v in max_memory.items() if isinstance(k, int) and v > 0]
    if not gpus:
        return max_memory
    if len(gpus) == 1:
        low_zero = False
        if not user_set:  # keep 10% free for activations when the budget was not chosen by the user
            max_memory[gpus[0]] = int(max_memory[gpus[0]] * 0.9)
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
        max_memory[index] = min(max_memory[index] if low_zero and index == gpus[0] else per_gpu, max_memory[index])
    if low_zero:
        max_memory[gpus[0]] = min(max(0, sizes[""] - sum(max_memory[i] for i in gpus[1:])), max_memory[gpus[0]])
    return max_memory


# ------------------------------------------------------------------------------------------ device maps


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
) -> dict[str, int | str]:
    """A device map filling the GPUs in order, then ``"cpu"``, then ``"disk"``, from sizes alone.

    Modules are taken in definition order; one that does not fit where the filling stands is split into its
    parameters, children and buffers unless its class name is in ``no_split_module_classes`` (or it has no
    children), in which case it starts the next device. Tensors tied to one in the module go with it. GPU 0
    (or the CPU when there is no GPU) and the CPU keep room for the largest layer still to place, since
    offloaded layers are brought there to run. ``offload_buffers`` is accepted for Accelerate compatibility;
    buffers are sized with their module either way.
    """
    del offload_buffers
    max_memory = get_max_memory(max_memory)
    no_split = set(no_split_module_classes or [])
    devices = list(max_memory) + ([] if "disk" in max_memory else ["disk"])
    gpus = [d for d in devices if isinstance(d, int)]
    reserve_on = {gpus[0], "cpu"} if gpus else {"cpu"}
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    tied = find_tied_parameters(model)
    layer_size: dict[str, int] = {}

    def largest_layer(name: str, obj) -> int:
        if name not in layer_size:
            layer_size[name] = get_max_layer_size([(name, obj)], sizes, no_split)[0]
        return layer_size[name]

    def inside(name: str, tensor_name: str) -> bool:
        return name == "" or tensor_name == name or tensor_name.startswith(name + ".")

    device_map: dict[str, int | str] = {}
    used = dict.fromkeys(devices, 0)
    queue = _entries(model, "")
    current = 0
    while queue:
        name, obj = queue.pop(0)
        device = devices[current]
        # queue entries holding a tensor tied to one inside `name`: they go wherever `name` goes
        outside = {t for group in tied if any(inside(name, t) for t in group) for t in group if not inside(name, t)}
        ties = [n for n, _ in queue if any(inside(n, t) for t in outside)]
        need = sizes.get(name, 0) + sum(sizes.get(n, 0) for n in ties)
        limit = None
        if device != "disk":
            reserve = max((largest_layer(n, o) for n, o in queue if n not in ties), default=0)
            limit = max_memory[device] - (reserve if device in reserve_on else 0)
        if limit is None or used[device] + need <= limit:
            for placed in [name, *ties]:
                device_map[placed] = device
            if verbose:
                print(f"{name}{' with ' + ', '.join(ties) if ties else ''} ({need} bytes) -> {device!r}")
            queue = [(n, o) for n, o in queue if n not in ties]
            used[device] += need
        elif _splittable(obj, no_split):
            queue = _entries(obj, name) + queue
        else:
            if verbose:
                print(f"{name} ({need} bytes) does not fit on {device!r} (limit {limit}): next device")
            queue.insert(0, (name, obj))
            current += 1
    return clean_device_map(device_map) if clean_result else device_map


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


def check_device_map(model: nn.Module, device_map: Mapping[str, Device]) -> dict[str, str | torch.device]:
    """``device_map`` with every value resolved (``"cpu"``, ``"disk"`` or a CUDA device), after checking that
    each key names a module or tensor of ``model``, keys do not nest, every device exists and every parameter
    and persistent buffer is covered (non-persistent buffers left out run on the main device). Raises
    ``ValueError`` naming what is wrong."""
    if not isinstance(device_map, Mapping):
        raise ValueError(
            f"device_map must be a dict of module name to device or one of {', '.join(map(repr, DEVICE_MAP_STRATEGIES))};"
            f" got {device_map!r}."
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
) -> tuple[list[str], list[str]]:
    """Stream a checkpoint into ``model`` following ``device_map``; returns ``(missing_keys, unexpected_keys)``.

    One file is open at a time and one tensor read at a time: a tensor mapped to a device goes straight
    there; one mapped to ``"disk"`` (buffers only with ``offload_buffers``) stays on the meta device and is
    recorded in ``offload_folder/index.json``, pointing into the checkpoint's own safetensors file when it
    holds the tensor in the wanted dtype, else written there as a safetensors file. So peak memory is about
    one tensor (one ``.bin`` shard) over what stays resident. ``offload_state_dict`` is accepted for
    Accelerate compatibility and changes nothing (nothing is held but the current tensor). Weights the
    model needs (on the meta device) that the checkpoint lacks raise ``ValueError``; other missing or
    unexpected keys warn, or raise ``RuntimeError`` with ``strict``.
    """
    del offload_state_dict
    model = unwrap_model(model)
    resolved = check_device_map(model, device_map)
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
    empty = [k for k in plan.missing if loader.current(k).device.type == "meta"]
    if empty:
        raise ValueError(f"Checkpoint {str(checkpoint)!r} lacks weights the model has no data for: {format_keys(empty)}.")
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


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    strict: bool = False,
    *,
    device_map: Mapping[str, Device] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
) -> tuple[list[str], list[str]]:
    """Accelerate's ``load_checkpoint_in_model``: without ``device_map`` the plain load of
    :func:`accel.checkpoint.model_io.load_checkpoint_in_model`; with one (keyword only), each tensor goes
    straight to its mapped device and "disk" ones to ``offload_folder`` (:func:`load_checkpoint_with_device_map`).
    It lives here, above ``model_io``, so that ``model_io`` never imports device-map code."""
    if device_map is None:
        return model_io.load_checkpoint_in_model(model, checkpoint, dtype=dtype, strict=strict)
    return load_checkpoint_with_device_map(
        model, checkpoint, device_map, offload_folder=offload_folder, dtype=dtype, strict=strict,
        offload_state_dict=offload_state_dict, offload_buffers=offload_buffers,
    )
