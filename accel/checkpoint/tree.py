"""Split a state tree into tensors (for safetensors) and a JSON skeleton, and put them back together.

Every non-tensor value of a checkpoint (optimizer hyper-parameters, scheduler counters, sampler position,
Python's RNG state) goes to JSON, so loading never unpickles anything. Containers are tagged where JSON
would lose their type: tuples, dicts with non-string keys, and the tensors' places.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_TENSOR, _TUPLE, _DICT, _FLOAT = "__tensor__", "__tuple__", "__dict__", "__float__"


class NotSerializable(TypeError):
    """A value that is neither a tensor nor representable in JSON."""


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
        return {"__numpy__": tree.tolist(), "dtype": str(tree.dtype)}
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


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the tree from its skeleton and the loaded tensors."""
    if isinstance(skeleton, list):
        return [join(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors.get(skeleton[_TENSOR])  # None: a tensor another pipeline stage holds
        if _TUPLE in skeleton:
            return tuple(join(v, tensors) for v in skeleton[_TUPLE])
        if _DICT in skeleton:
            return {k: join(v, tensors) for k, v in skeleton[_DICT]}
        if _FLOAT in skeleton:
            return float(skeleton[_FLOAT])
        if "__numpy__" in skeleton:
            import numpy as np

            return np.asarray(skeleton["__numpy__"], dtype=skeleton["dtype"])
        return {k: join(v, tensors) for k, v in skeleton.items()}
    return skeleton
