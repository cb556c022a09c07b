"""The collective-device check's own parts (accel/core/collective_check.py); what it refuses in a real process
group is tests/unit/runtime/test_gpu_paths.py."""

from __future__ import annotations

import collections

import torch
from torch.utils._pytree import tree_flatten

from accel.core import collective_check as cc


def _pytree_tensors(value) -> list:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def test_the_tensors_found_in_arguments_are_pytrees_in_the_same_order():
    a, b, c, d = (torch.ones(1) * i for i in range(4))
    pair = collections.namedtuple("pair", "x y")
    values = [
        a, (a, 1, "s", None), [a, [b, (c,)]], {"k": a, "j": [b, 2.0]}, collections.OrderedDict(x=a, y=b),
        pair(a, b), torch.max(torch.arange(4.0).reshape(2, 2), dim=1), (torch.Size([2, 3]), torch.float32, a),
        {"deep": {"er": (d, [c])}}, torch.nn.Parameter(torch.ones(2)), slice(1, 2), Ellipsis, torch.device("cpu"),
    ]
    for value in values:
        found = cc._tensors(value, [])
        assert [id(t) for t in found] == [id(t) for t in _pytree_tensors(value)], value
    args, kwargs = (a, [b, 3], {"c": c}), {"out": d, "dim": 1}
    found = cc._tensors(kwargs, cc._tensors(args, []))
    assert [id(t) for t in found] == [id(t) for t in _pytree_tensors((args, kwargs))]


def test_each_function_is_classified_once_and_as_before():
    assert cc._role(torch.Tensor.device.__get__) == ("device", "")  # a fresh method-wrapper each access
    assert cc._role(torch.Tensor.backward)[0] == "backward"
    assert cc._role(torch.Tensor.to) == ("to", "to")
    assert cc._role(torch.Tensor.cpu) == ("host", "cpu")
    assert cc._role(torch.Tensor.pin_memory) == ("host", "pin_memory")
    assert cc._role(torch.Tensor.cuda) == ("accelerator", "cuda")
    assert cc._role(torch.add) == ("other", "add")
    assert cc._role(torch.ops._c10d_functional.all_reduce.default)[0] == "collective"
    assert cc._role(torch.ops._c10d_functional.wait_tensor.default)[0] == "other"
    assert torch.add in cc._ROLES

    class Unhashable:
        __name__ = "cpu"
        __hash__ = None  # type: ignore[assignment]

    assert cc._role(Unhashable()) == ("host", "cpu")  # classified each time, never kept
