"""Module sizes in bytes, computed from parameter shapes alone (so they work on a model built on the meta device):
per module, per splittable layer, with tied weights counted once; and sizes written as "5GB".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from accel.checkpoint.model_reader import resolve_dtype
from accel.big_model.module_tensors import named_module_tensors


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


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """(bytes of the model, (bytes, names) of its largest layer): what must fit in memory at once. A transformers
    model's ``_no_split_modules`` are layers that are never split."""
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    return sizes[""], get_max_layer_size(_entries(model, ""), sizes, no_split)
