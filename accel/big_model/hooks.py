"""Hooks around a module's ``forward`` that move its inputs and weights where it runs (Accelerate's names).

Why hooks and not ``.to()``: in a dispatched model each module runs where its weights are, and offloaded
weights are on the meta device between calls; a hook moves the inputs to the module's execution device and,
for offloaded modules, brings the weights in just before ``forward`` and drops them right after. The
hook replaces the instance's ``forward`` (not ``register_forward_hook``), so calls to ``module.forward(...)``
from a parent are hooked too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from accel.core import constants
from accel.runtime.ops import send_to_device
from accel.big_model.offload import PrefixedDataset

__all__ = [
    "ModelHook",
    "SequentialHook",
    "AlignDevicesHook",
    "CpuOffload",
    "UserCpuOffloadHook",
    "LayerwiseCastingHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "attach_align_device_hook",
    "attach_execution_device_hook",
]


class ModelHook:
    """Base hook: override what you need. ``no_grad`` runs the wrapped forward under ``torch.no_grad()``."""

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module


class SequentialHook(ModelHook):
    """Several hooks in order (post_forward in the same order, as Accelerate does)."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = list(hooks)

    def init_hook(self, module):
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module, *args, **kwargs):
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module, output):
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module):
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: nn.Module, *args, **kwargs):
    hook = cast(ModelHook, module._hf_hook)  # plain attributes that add_hook_to_module set
    forward = cast(Callable[..., Any], module._old_forward)
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = forward(*args, **kwargs)
    else:
        output = forward(*args, **kwargs)
    return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Wrap ``module.forward`` with ``hook`` (replacing an existing hook, or chained after it with ``append``)."""
    if getattr(module, "_hf_hook", None) is not None:
        old = cast(ModelHook, module._hf_hook)
        remove_hook_from_module(module)
        if append:
            hook = SequentialHook(old, hook)
    module = hook.init_hook(module)
    original = module.forward
    module._hf_hook = hook  # type: ignore[assignment]  # a plain attribute (Accelerate's name)
    module._old_forward = original  # type: ignore[assignment]  # likewise
    module.forward = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Undo :func:`add_hook_to_module` (the hook's ``detach_hook`` runs first); with ``recurse`` for children too."""
    hook = getattr(module, "_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
        del module._hf_hook
    if hasattr(module, "_old_forward"):
        old = cast(Callable[..., Any], module._old_forward)
        if getattr(old, "__self__", None) is module and getattr(old, "__func__", None) is type(module).forward:
            module.__dict__.pop("forward", None)  # the class's own forward again
        else:
            module.forward = old
        del module._old_forward
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of ``module`` and all its submodules."""
    remove_hook_from_module(module, recurse=True)


class CpuOffload(ModelHook):
    """Keeps a whole model on the CPU until its forward, then leaves it on `execution_device` (default: the process's
    device) until `UserCpuOffloadHook.offload()`; moves a previous model of a pipeline back first (Accelerate's)."""

    def __init__(self, execution_device=None, prev_module_hook: UserCpuOffloadHook | None = None):
        from accel.runtime.state import PartialState

        self.prev_module_hook = prev_module_hook
        self.execution_device = execution_device if execution_device is not None else PartialState().default_device

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        from accel.runtime.ops import send_to_device

        previous = self.prev_module_hook
        if previous is not None and next(previous.model.parameters()).device != torch.device("cpu"):
            previous.offload()
        if next(module.parameters()).device != _as_device(self.execution_device):
            module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


class UserCpuOffloadHook:
    """What `cpu_offload_with_hook` returns: `offload()` moves the model back to the CPU, `remove()` drops the hook."""

    def __init__(self, model: nn.Module, hook: CpuOffload):
        self.model, self.hook = model, hook

    def offload(self) -> None:
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        remove_hook_from_module(self.model)


# the layers attach_layerwise_casting_hooks casts (Accelerate's accelerate.utils.constants list)
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = constants.SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING


class LayerwiseCastingHook(ModelHook):
    """Stores a module's weights in a small dtype (e.g. float8) and casts them to ``compute_dtype`` only for its
    forward, so the memory held between calls is the storage dtype's (Accelerate's; quality may drop)."""

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool = False):
        self.storage_dtype, self.compute_dtype, self.non_blocking = storage_dtype, compute_dtype, non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


def _find_device(data) -> torch.device | None:
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, Mapping):
        data = data.values()
    if isinstance(data, (list, tuple, type({}.values()))):
        for item in data:
            found = _find_device(item)
            if found is not None:
                return found
    return None


class AlignDevicesHook(ModelHook):
    """Runs a module on ``execution_device``: inputs are moved there; with ``offload`` its weights stay on the
    meta device between calls and are read from ``weights_map`` (names relative to the module) for each call.

    ``place_submodules``: the hook handles the tensors of all submodules, else only the module's own ones
    (or just ``tensor_names``, an accel extension for a module whose own tensors are split by a device map).
    Buffers are offloaded only with ``offload_buffers``; otherwise they are put on the execution device.
    ``io_same_device``: outputs go back to the device of the first input tensor. ``tied_params_map`` is a
    dict shared by the hooks of one model so that a tensor tied across modules is moved once and stays tied.
    Removing the hook puts offloaded weights back from ``weights_map`` where they came from (weights that
    were only on the meta device, i.e. read from disk, stay there).
    """

    def __init__(
        self,
        execution_device: int | str | torch.device | None = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | Sequence[str] | None = None,
        tied_params_map: dict | None = None,
        tensor_names: Iterable[str] | None = None,
    ):
        self.execution_device = None if execution_device is None else _as_device(execution_device)
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = {} if tied_params_map is None else tied_params_map
        self.tensor_names = None if tensor_names is None else list(tensor_names)
        self.input_device = None
        self._slots: list[tuple[str, nn.Module, str, bool]] = []  # (name, owner, attribute, is_parameter)
        self._offloaded: list[tuple[str, nn.Module, str, bool, torch.Tensor]] = []  # + its meta placeholder
        self._original_devices: dict[str, torch.device] = {}

    def __repr__(self) -> str:
        return (f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
                f"io_same_device={self.io_same_device}, place_submodules={self.place_submodules})")

    def init_hook(self, module: nn.Module) -> nn.Module:
        self._slots = list(_tensor_slots(module, self.tensor_names, self.place_submodules))
        # offload without an execution_device (as Accelerate allows): each call brings the weights in where
        # weights_map holds them (the CPU copies made here)
        if self.offload:
            keep = [] if self.offload_buffers else [s for s in self._slots if not s[3]]
            offloaded = [s for s in self._slots if s not in keep]
            current = {name: _tensor_at(owner, attr, is_param) for name, owner, attr, is_param in offloaded}
            self._original_devices = {name: t.device for name, t in current.items()}
            if self.weights_map is None:
                self.weights_map = {name: t.detach().to("cpu") for name, t in current.items()}
            absent = [n for n in current if n not in self.weights_map]
            if absent:
                raise ValueError(f"Offloaded tensor(s) {absent} of {type(module).__name__} have no stored weights.")
            self._offloaded = []
            for name, owner, attr, is_param in offloaded:
                placeholder = current[name].to("meta")
                if is_param:
                    placeholder = nn.Parameter(placeholder, requires_grad=current[name].requires_grad)
                self._offloaded.append((name, owner, attr, is_param, placeholder))
                _put(owner, attr, is_param, placeholder)
            self._slots = keep
        if self.execution_device is not None:
            for _name, owner, attr, is_param in self._slots:
                _move(owner, attr, is_param, self.execution_device, self.tied_params_map)
        return module

    def pre_forward(self, module, *args, **kwargs):
        if self.io_same_device:
            self.input_device = _find_device([args, kwargs])
        for name, owner, attr, is_param, placeholder in self._offloaded:
            value = self.weights_map[name].to(self.execution_device)
            _put(owner, attr, is_param, nn.Parameter(value, placeholder.requires_grad) if is_param else value)
        if self.execution_device is None:
            return args, kwargs
        return (send_to_device(args, self.execution_device),
                send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys))

    def post_forward(self, module, output):
        for _, owner, attr, is_param, placeholder in self._offloaded:
            _put(owner, attr, is_param, placeholder)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        weights = cast(Mapping[str, torch.Tensor], self.weights_map)  # set by init_hook when it offloaded
        for name, owner, attr, is_param, placeholder in self._offloaded:
            device = self._original_devices.get(name)
            if device is not None and device.type != "meta":
                value = weights[name].to(device)
                _put(owner, attr, is_param, nn.Parameter(value, placeholder.requires_grad) if is_param else value)
        self._offloaded = []
        return module


def _as_device(device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _tensor_slots(module: nn.Module, names: list[str] | None, recurse: bool):
    """(name, owner, attribute, is_parameter) of the tensors a hook handles; tied aliases each once."""
    if names is not None:
        for name in names:
            is_param = name in module._parameters
            yield name, module, name, is_param
        return
    owners = module.named_modules(remove_duplicate=False) if recurse else [("", module)]
    for prefix, owner in owners:
        dot = f"{prefix}." if prefix else ""
        yield from ((dot + a, owner, a, True) for a, p in owner._parameters.items() if p is not None)
        yield from ((dot + a, owner, a, False) for a, b in owner._buffers.items() if b is not None)


def _store(owner: nn.Module, is_param: bool) -> dict[str, Any]:
    """The module's own dict of parameters or of buffers."""
    return owner._parameters if is_param else owner._buffers


def _tensor_at(owner: nn.Module, attr: str, is_param: bool) -> torch.Tensor:
    """A slot's tensor (slots are only made for entries that hold one, never None)."""
    return _store(owner, is_param)[attr]


def _put(owner: nn.Module, attr: str, is_param: bool, tensor: torch.Tensor) -> None:
    _store(owner, is_param)[attr] = tensor


def _move(owner: nn.Module, attr: str, is_param: bool, device: torch.device, moved: dict) -> None:
    """Put one resident tensor on ``device``; ``moved`` (id -> new tensor) keeps tied tensors tied."""
    store = _store(owner, is_param)
    tensor = store[attr]
    if tensor.device == device:
        return
    if tensor.device.type == "meta":
        raise ValueError(f"{type(owner).__name__}.{attr} is on the meta device (no data) and cannot go to {device}.")
    if id(tensor) not in moved:
        with torch.no_grad():
            new = tensor.detach().to(device)
        moved[id(tensor)] = nn.Parameter(new, requires_grad=tensor.requires_grad) if is_param else new
    store[attr] = moved[id(tensor)]


def _has_tensors(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device,
    skip_keys: str | Sequence[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Give every submodule holding tensors (and no hook yet) a hook moving its inputs to ``execution_device``:
    a container such as ``nn.ModuleList`` never runs ``forward``, so its children are called directly."""
    if not hasattr(module, "_hf_hook") and _has_tensors(module):
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys,
                                                    tied_params_map=tied_params_map))
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, tied_params_map)


def attach_align_device_hook(
    module: nn.Module,
    execution_device: int | str | torch.device | None = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Hook every submodule that has tensors of its own, so each loads only its own weights when it runs
    (a module whose class is in ``preload_module_classes`` loads its whole subtree at once, for modules
    that use a child's weights directly). ``weights_map`` is keyed by names under ``module_name``;
    submodules with no tensors of their own get an input-moving hook."""
    preload = set(preload_module_classes or [])
    whole = type(module).__name__ in preload
    own = any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])
    prefix = f"{module_name}." if module_name else ""
    if whole or own:
        hook = AlignDevicesHook(
            execution_device, offload=offload, offload_buffers=offload_buffers, place_submodules=whole,
            weights_map=None if weights_map is None else PrefixedDataset(weights_map, prefix),
            skip_keys=skip_keys, tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
        if whole:
            return
    elif execution_device is not None and _has_tensors(module):
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys), append=True)
    for name, child in module.named_children():
        attach_align_device_hook(child, execution_device, offload, weights_map, offload_buffers, prefix + name,
                                 skip_keys, preload_module_classes, tied_params_map)
