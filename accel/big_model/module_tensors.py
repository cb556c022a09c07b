"""A module's tensors by name (Accelerate's `utils.modeling` helpers): listing them, moving one to a device or a
dtype, tied parameters found, checked and tied again, and a module whose weights are offloaded by hooks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import cast

import torch
from torch import nn

from accel.checkpoint.model_reader import resolve_dtype


logger = logging.getLogger(__name__)  # a plain logger, as Accelerate's: these helpers run without a process state

Device = int | str | torch.device


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


def _torch_device(device: Device) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


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
