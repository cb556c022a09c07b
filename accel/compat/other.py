"""Accelerate's `accelerate.utils.other` helpers that scripts and transformers import."""

from __future__ import annotations

import collections
import functools
import pickle
import platform
import re
import secrets
import socket
import sys
import types
from typing import cast

import torch

from accel.core.probes import is_torch_distributed_available

from accel.runtime.logging import get_logger

logger = get_logger(__name__)


# -- compiled modules ---------------------------------------------------------------------------------------------
def _optimized_module_class():
    """torch.compile's wrapper class, or None while torch._dynamo is not imported (then nothing is compiled, and
    the probes below do not pay for importing it)."""
    if "torch._dynamo" not in sys.modules:
        return None
    return sys.modules["torch._dynamo"].eval_frame.OptimizedModule


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether `module` is a `torch.compile` wrapper (OptimizedModule)."""
    optimized = _optimized_module_class()
    return optimized is not None and isinstance(module, optimized)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether some submodule of `module` (or `module`, when it has children) is a `torch.compile` wrapper, as after
    `compile_regions`."""
    optimized = _optimized_module_class()
    if optimized is None or not module._modules:
        return False
    return any(isinstance(sub, optimized) for sub in module.modules())


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """A non-empty `nn.ModuleList` whose members are all of the first one's class (a stack of blocks)."""
    return (isinstance(module, torch.nn.ModuleList) and len(module) > 0
            and all(isinstance(m, type(module[0])) for m in module))


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether a stack of blocks (`is_repeated_blocks`) is anywhere inside `module`."""
    return bool(module._modules) and any(is_repeated_blocks(sub) for sub in module.modules())


def compile_regions(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Regional compilation, as Accelerate does it: a new module in which each member of every stack of blocks is
    `torch.compile`d on its own (blocks of one class hit the compiler's cache), and so is each other subtree that
    holds no stack; `module` itself is left as it is and kept as the result's `_orig_mod` (unwrapped by
    `extract_model_from_parallel(keep_torch_compile=False)`). Parameters are shared with `module`.

    (`Accelerator(dynamo_plugin=TorchDynamoPlugin(use_regional_compilation=True))` compiles the blocks of a
    prepared model in place instead, keeping its type and parameter names.)"""

    def compiled(sub: torch.nn.Module) -> torch.nn.Module:
        # torch.compile of a module gives a module (OptimizedModule); its stubs say only a callable
        if is_repeated_blocks(sub):
            blocks = cast(torch.nn.ModuleList, sub)
            return torch.nn.ModuleList(cast(torch.nn.Module, torch.compile(block, **compile_kwargs))
                                       for block in blocks)
        if not has_repeated_blocks(sub):
            return cast(torch.nn.Module, torch.compile(sub, **compile_kwargs))
        copy = type(sub).__new__(type(sub))
        copy.__dict__.update(sub.__dict__)
        for name, value in list(copy.__dict__.items()):  # methods bound to `sub` are bound to the copy
            if hasattr(value, "__func__") and getattr(value, "__self__", None) is sub:
                copy.__dict__[name] = types.MethodType(value.__func__, copy)
        copy._modules = {}
        for name, child in sub.named_children():
            copy.add_module(name, compiled(child))
        return copy

    new_module = compiled(module)
    if "_orig_mod" not in new_module.__dict__:
        new_module.__dict__["_orig_mod"] = module
    return new_module


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether some parameter of `model` is a DTensor (sharded by FSDP2 or tensor parallelism); False on a torch
    built without distributed support."""
    if not is_torch_distributed_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _unwrap_original_forward(model: torch.nn.Module) -> None:
    """Accelerate's convention: a model whose `forward` was wrapped (convert_outputs_to_fp32, autocast) keeps the
    original in `_original_forward`; follow `__wrapped__` back to it and put it back (the class's own forward is
    simply uncovered again, so the model pickles)."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    forward = model.forward
    while hasattr(forward, "__wrapped__") and forward != original:
        forward = forward.__wrapped__
    if getattr(forward, "__self__", None) is model and getattr(forward, "__func__", None) is type(model).forward:
        model.__dict__.pop("forward", None)
    else:
        model.forward = forward if getattr(forward, "__self__", None) is model else types.MethodType(forward, model)


def strip_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside torch's DistributedDataParallel / DataParallel wrappers (`.module`, nested ones too)."""
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = cast(torch.nn.Module, model.module)
    return model


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                                keep_torch_compile: bool = True, recursive: bool = False) -> torch.nn.Module:
    """The user's module inside DDP (`.module`) and, unless `keep_torch_compile`, a `torch.compile` wrapper (or the
    module `compile_regions` started from); with `keep_fp32_wrapper=False`, without accel's autocast forward."""
    from accel.runtime.precision import PrecisionPolicy

    compiled = None
    if is_compiled_module(model):
        compiled, inner = model, cast(torch.nn.Module, model._orig_mod)
    elif has_compiled_regions(model) and "_orig_mod" in model.__dict__:
        compiled, inner = model, model.__dict__["_orig_mod"]
    else:
        inner = model
    inner = strip_data_parallel(inner)
    if not keep_fp32_wrapper:
        PrecisionPolicy.unwrap_forward(inner)
        _unwrap_original_forward(inner)
    if compiled is None or not keep_torch_compile:
        return inner
    if is_compiled_module(compiled):
        compiled._orig_mod = inner
    else:
        compiled.__dict__["_orig_mod"] = inner  # a plain attribute, not a submodule (state_dict stays the same)
    return compiled


# -- processes and files ----------------------------------------------------------------------------------------
def wait_for_everyone() -> None:
    """A barrier: every process waits here until all have reached it (a no-op on one process)."""
    from accel.runtime.state import PartialState

    PartialState().wait_for_everyone()


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """`state_dict` without aliases, for safetensors: of the names that share one storage (tied weights) only the
    first stays (the others are deleted from `state_dict` itself, with a warning), and every tensor is made
    contiguous in the dict returned. String entries (bitsandbytes' serialization) are kept."""
    from accel.big_model.modeling import id_tensor_storage

    by_storage = collections.defaultdict(list)
    for name, tensor in state_dict.items():
        if not isinstance(tensor, str):
            by_storage[id_tensor_storage(tensor)].append(name)
    removed = set()
    for names in by_storage.values():
        for name in names[1:]:
            removed.add(name)
            del state_dict[name]
    if removed:
        logger.warning(f"Removed shared tensor {removed} while saving. This should be OK, but check by verifying that "
                       "you don't receive any warning while reloading")
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


def save(obj, f, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """`torch.save` (or safetensors' `save_file` with `safe_serialization`, `obj` then a dict of tensors) on the main
    process only, or on each machine's local main process with `save_on_each_node`. An `OrderedDict` (a
    `state_dict()`) written with safetensors loses its aliases first (`clean_state_dict_for_safetensors`).
    There is no barrier: call `wait_for_everyone()` before reading the file on another process."""
    from accel.runtime.state import PartialState

    state = PartialState()  # first, as in Accelerate: the warning about removed aliases logs through the state
    if safe_serialization:
        from safetensors.torch import save_file

        def write(data, target):
            save_file(data, target, metadata={"format": "pt"})

        if isinstance(obj, collections.OrderedDict):
            obj = clean_state_dict_for_safetensors(obj)
    else:
        write = torch.save
    if state.is_local_main_process if save_on_each_node else state.is_main_process:
        write(obj, f)


class _NDArrayName:
    """What the name `numpy.ndarray` gives a pickle read by `load`: a marker `_reconstruct` takes (torch would let a
    pickle call `numpy.ndarray(shape)` itself, which allocates any shape, zero-filled for object arrays)."""

    def __new__(cls, *args, **kwargs):
        raise pickle.UnpicklingError("numpy.ndarray(...) refused; allowed: numpy arrays as numpy pickles them")


def _bounded_reconstruct(subtype, shape, dtype):
    """numpy's `_reconstruct` for what numpy itself pickles: an empty array (shape (0,)) that the pickle's BUILD then
    fills from bytes present in the file (numpy checks their size). numpy's own allocates any shape a pickle names."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    if subtype is not _NDArrayName or tuple(shape) != (0,):
        raise pickle.UnpicklingError(f"numpy _reconstruct({getattr(subtype, '__name__', subtype)}, {str(shape)[:40]}) "
                                     "refused; allowed: numpy arrays as numpy pickles them (shape (0,))")
    return core.multiarray._reconstruct(np.ndarray, (0,), dtype)


_HIDDEN_NAME = f"accel_never_pickled_{secrets.token_hex(16)}.ndarray"  # ndarray for BUILD, unnameable by a pickle


def _load_safe_globals() -> list:
    """What `load` allows `torch.load(weights_only=True)` to rebuild beyond tensors: numpy arrays and dtypes (the
    numpy RNG state in a checkpoint) and `codecs.encode` (how numpy pickles its arrays' bytes). `_reconstruct` and
    `numpy.ndarray` are admitted bounded (`_bounded_reconstruct`): an array's bytes come from the file."""
    import codecs

    import numpy as np

    allowed: list = [codecs.encode, np.dtype, (np.ndarray, _HIDDEN_NAME)]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        allowed.append((_bounded_reconstruct, f"{module}._reconstruct"))
    allowed.append((_NDArrayName, "numpy.ndarray"))
    for name in ("BoolDType", "Int8DType", "Int16DType", "Int32DType", "Int64DType", "UInt8DType", "UInt16DType",
                 "UInt32DType", "UInt64DType", "Float16DType", "Float32DType", "Float64DType"):
        if hasattr(getattr(np, "dtypes", None), name):  # numeric arrays' dtypes (numpy >= 1.25 pickles their class)
            allowed.append(getattr(np.dtypes, name))
    return allowed


def load(f, map_location=None, **kwargs):
    """`torch.load` with `weights_only=True` unless given otherwise, numpy arrays allowed (for the duration of the
    call only: torch's list of allowed globals is as it was afterwards). With weights_only the file is checked first
    (`accel.checkpoint.torch_file.check_torch_zip`): weights_only still lets a pickle call `bytearray(n)`, so what
    it would build beyond tensors views of their records, containers, numbers and numpy arrays is refused in one
    ValueError line naming the file. A path is opened once, checked on its descriptor (a pipe or device there is one
    CheckpointError line, never a hang), and the check and torch read that same file."""
    import os

    if isinstance(f, (str, os.PathLike)):
        from accel.checkpoint.layout import checked_files

        with checked_files().open(f) as checked:
            return _load_checked(checked.name, str(f), map_location, kwargs)
    return _load_checked(f, getattr(f, "name", None) or "the file given to load", map_location, kwargs)


def _load_checked(f, source: str, map_location, kwargs: dict):
    """`load` of `f` (a name or a file), checked first with weights_only; `source` names it in a refusal."""
    from accel.checkpoint.torch_file import check_torch_zip

    saved = torch.serialization.get_safe_globals()
    kwargs.setdefault("weights_only", True)
    if kwargs["weights_only"]:
        if isinstance(f, str):
            check_torch_zip(f, source, numpy=True)
        elif hasattr(f, "seek") and hasattr(f, "tell"):
            start = f.tell()
            check_torch_zip(f, source, numpy=True)
            f.seek(start)
    try:
        torch.serialization.add_safe_globals(_load_safe_globals())
        return torch.load(f, map_location=map_location, **kwargs)
    finally:
        torch.serialization.clear_safe_globals()
        if saved:
            torch.serialization.add_safe_globals(saved)


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on `port` (default 29500, torch.distributed's) on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", 29500 if port is None else port)) == 0


def check_os_kernel() -> None:
    """Warn (main process) when a Linux kernel is older than 5.5.0: processes can hang on older ones."""
    info = platform.uname()
    if info.system != "Linux":
        return
    from accel.core.probes import compare_versions

    version = re.split(r"(\d+\.\d+\.\d+)", info.release)[1]
    if compare_versions(version, "<", "5.5.0"):
        logger.warning(f"Detected kernel version {version}, which is below the recommended minimum of 5.5.0; this can "
                       "cause the process to hang. It is recommended to upgrade the kernel to the minimum version or "
                       "higher.", main_process_only=True)


# -- small pure helpers -----------------------------------------------------------------------------------------
def get_pretty_name(obj) -> str:
    """`obj`'s qualified name (or its class's, for an instance)."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    if hasattr(obj, "__qualname__"):
        return obj.__qualname__
    if hasattr(obj, "__name__"):
        return obj.__name__
    return str(obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge `source` into `destination` (in place, nested dicts merged key by key; returns `destination`)."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def convert_bytes(size) -> str:
    """`size` bytes in the largest unit below 1024 of it, e.g. `"1.5 MB"` (units of 1024)."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def recursive_getattr(obj, attr: str):
    """`getattr` along a dotted path: `recursive_getattr(model, "encoder.layer")`."""
    return functools.reduce(getattr, attr.split("."), obj)


def get_module_children_bottom_up(model: torch.nn.Module, return_fqns: bool = False) -> list:
    """Every module of `model`, children before their parent (`model` last); with `return_fqns`, as
    `(qualified name, module)` pairs. The order is Accelerate's (a depth-first walk, reversed)."""
    stack = [("", model)]
    ordered = []
    while stack:
        name, module = stack.pop()
        for child_name, child in module.named_children():
            if isinstance(child, torch.nn.Module):
                stack.append((f"{name}.{child_name}" if name else child_name, child))
        ordered.append((name, module) if return_fqns else module)
    return ordered[::-1]


def get_model_tp_size(model: torch.nn.Module) -> int | None:
    """The tensor-parallel degree a transformers model was loaded with (`tp_plan`), or None: transformers < 5 keeps
    it on the model (`model.tp_size`), 5 on `model.config.distributed_config` (an object, or a dict after JSON)."""
    size = getattr(model, "tp_size", None)
    if size is not None:
        return size
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    return distributed.get("tp_size") if isinstance(distributed, dict) else getattr(distributed, "tp_size", None)


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` (inside DDP or torch.compile) is a ``peft.PeftModel``; False without peft installed."""
    from accel.core.probes import is_peft_available

    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


def has_transformer_engine_layers(model: torch.nn.Module) -> bool:
    """Whether `model` holds Transformer Engine layers (Accelerate's check); an ImportError without
    transformer_engine installed, as in Accelerate (accel's own fp8 is torchao's and never adds them)."""
    from accel.core.probes import is_transformer_engine_available

    if not is_transformer_engine_available():
        raise ImportError("Using `has_transformer_engine_layers` requires transformer_engine to be installed.")
    import transformer_engine.pytorch as te

    kinds = (te.LayerNorm, te.Linear, te.TransformerLayer)
    return any(isinstance(module, kinds) for module in model.modules())
