"""Split a state tree into tensors (for safetensors) and a JSON skeleton, and put them back together.

Every non-tensor value of a checkpoint (optimizer hyper-parameters, scheduler counters, sampler position,
Python's RNG state) goes to JSON, so loading never unpickles anything. Containers are tagged where JSON
would lose their type: tuples, dicts with non-string keys, and the tensors' places.

A skeleton read back comes from a file anyone may have edited (its checksum recomputed), so `join` decodes only
what `split` writes, and nothing it builds is larger than the JSON it came from: a numpy value has a dtype of
NUMPY_DTYPES (the numbers `tolist()` gives back as JSON numbers) and its data is numbers, so its bytes are at most
8 per number in the file; `__float__` is one of the non-finite floats; `__dict__` a list of key-value pairs. Any
other value is a BadTree naming its key path, the value (shortened) and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_TENSOR, _TUPLE, _DICT, _FLOAT, _NUMPY = "__tensor__", "__tuple__", "__dict__", "__float__", "__numpy__"
# the numpy dtypes a checkpoint holds: those whose `tolist()` values are JSON numbers (not complex, strings, objects)
NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64")
_NON_FINITE = ("inf", "-inf", "nan")


class NotSerializable(TypeError):
    """A value that is neither a tensor nor representable in JSON."""


class BadTree(ValueError):
    """A skeleton value `split` never writes: one line, `key 'a.b[0]': <what>; allowed: <what is>`."""


def split(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON skeleton of `tree`; its tensors are added to `tensors` under keys starting with `prefix`."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree
        return {_TENSOR: prefix, "shape": list(tree.shape), "dtype": str(tree.dtype).removeprefix("torch.")}
    if isinstance(tree, dict):
        if all(isinstance(k, str) for k in tree) and not any(k.startswith("__") and k.endswith("__") for k in tree):
            return {k: split(v, f"{prefix}/{k}", tensors) for k, v in tree.items()}
        items = []
        for k, v in tree.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise NotSerializable(f"{prefix}: dict key {k!r} of type {type(k).__name__} cannot be saved")
            items.append([k, split(v, f"{prefix}/{k}", tensors)])
        return {_DICT: items}
    if isinstance(tree, tuple):
        return {_TUPLE: [split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]
    if isinstance(tree, float) and not math.isfinite(tree):
        return {_FLOAT: repr(tree)}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if hasattr(tree, "tolist") and hasattr(tree, "dtype"):  # numpy arrays and scalars (numpy's RNG state)
        if str(tree.dtype) not in NUMPY_DTYPES:
            raise NotSerializable(f"{prefix}: a numpy value of dtype {tree.dtype} cannot be saved; allowed: numpy "
                                  f"dtypes {', '.join(NUMPY_DTYPES)}")
        return {_NUMPY: tree.tolist(), "dtype": str(tree.dtype)}
    raise NotSerializable(f"{prefix}: value of type {type(tree).__name__} is neither a tensor nor JSON-serialisable")


def tensor_specs(skeleton: Any) -> dict[str, tuple[list[int], str]]:
    """Key -> (shape, dtype) of every tensor the skeleton refers to."""
    specs: dict[str, tuple[list[int], str]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if _TENSOR in node:
                specs[node[_TENSOR]] = (node["shape"], node["dtype"])
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(skeleton)
    return specs


def merge(skeletons: list) -> Any:
    """One skeleton from several ranks' (pipeline stages hold different tensors): dicts are united, lists of
    names (an optimizer group's parameters) united in order, other lists of equal length merged item by item;
    otherwise the first rank's value."""
    first = skeletons[0]
    if all(isinstance(s, dict) for s in skeletons) and not any(_TENSOR in s for s in skeletons):
        keys = list(dict.fromkeys(k for s in skeletons for k in s))
        return {k: merge([s[k] for s in skeletons if k in s]) for k in keys}
    if all(isinstance(s, list) for s in skeletons):
        if all(isinstance(v, str) for s in skeletons for v in s):
            return list(dict.fromkeys(v for s in skeletons for v in s))
        if len({len(s) for s in skeletons}) == 1:
            return [merge([s[i] for s in skeletons]) for i in range(len(first))]
    return first


def empty_like_spec(shape: list[int], dtype: str) -> torch.Tensor:
    return torch.empty(shape, dtype=getattr(torch, dtype))


def join(skeleton: Any, tensors: dict[str, torch.Tensor], where: tuple = ()) -> Any:
    """Rebuild the tree from its skeleton and the loaded tensors; `where` is the skeleton's key path in its file
    (for the messages). A value `split` never writes is a BadTree."""
    if isinstance(skeleton, list):
        return [join(v, tensors, (*where, i)) for i, v in enumerate(skeleton)]
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            key = skeleton[_TENSOR]
            if not isinstance(key, str):
                raise _bad(where, _TENSOR, key, "a tensor key (a string)")
            return tensors.get(key)  # None: a tensor another pipeline stage holds
        if _TUPLE in skeleton:
            items = skeleton[_TUPLE]
            if not isinstance(items, list):
                raise _bad(where, _TUPLE, items, "a list")
            return tuple(join(v, tensors, (*where, _TUPLE, i)) for i, v in enumerate(items))
        if _DICT in skeleton:
            pairs = skeleton[_DICT]
            if not isinstance(pairs, list) or not all(
                    isinstance(p, list) and len(p) == 2 and (p[0] is None or isinstance(p[0], (str, int, float)))
                    for p in pairs):
                raise _bad(where, _DICT, pairs, "a list of [key, value] pairs, each key a string, number or null")
            return {k: join(v, tensors, (*where, _DICT, i, 1)) for i, (k, v) in enumerate(pairs)}
        if _FLOAT in skeleton:
            if skeleton[_FLOAT] not in _NON_FINITE:
                raise _bad(where, _FLOAT, skeleton[_FLOAT], "'inf', '-inf' or 'nan'")
            return float(skeleton[_FLOAT])
        if _NUMPY in skeleton:
            return _numpy(skeleton, where)
        return {k: join(v, tensors, (*where, k)) for k, v in skeleton.items()}
    return skeleton


def _numpy(node: dict, where: tuple) -> Any:
    """A numpy value `split` wrote: a dtype of NUMPY_DTYPES and numbers (a rectangular nesting of lists of them),
    checked before numpy allocates anything."""
    import numpy as np

    dtype, data = node.get("dtype"), node[_NUMPY]
    if not isinstance(dtype, str) or dtype not in NUMPY_DTYPES:
        raise _bad(where, "dtype", dtype, f"a numpy dtype of {', '.join(NUMPY_DTYPES)}")
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, (int, float)):  # bool is an int
            raise _bad(where, _NUMPY, item, "numbers, or lists of numbers")
    try:
        return np.asarray(data, dtype=dtype)
    except (ValueError, OverflowError, TypeError) as exc:
        raise _bad(where, _NUMPY, data, f"a rectangular list of numbers that fit {dtype} ({exc})") from None


def _bad(where: tuple, field: str, value: Any, allowed: str) -> BadTree:
    from accel.core.safe_json import key_path, short

    return BadTree(f"key {key_path(where)!r}: {field} {short(value, 40)}; allowed: {allowed}")
