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


def test_a_move_to_the_device_a_tensor_is_on_returns_it_as_on_a_gpu():
    """`.to(device)` returns the tensor itself when it is already there (CUDA's behaviour, which code may rely on
    for aliasing), and copies between the two pretended devices, in every way of naming them."""
    with cc._Tracker():
        acc, host = torch.ones(2, device=cc.ACCELERATOR), torch.ones(2)
        assert (acc.device, host.device) == (cc.ACCELERATOR, cc.HOST)
        for same in (acc.to(cc.ACCELERATOR), acc.to("cpu:0"), acc.to(device=cc.ACCELERATOR), acc.to(acc)):
            assert same is acc
        assert host.to("cpu") is host and host.to(host) is host
        converted = acc.to(cc.ACCELERATOR, torch.float64)
        assert converted is not acc and converted.dtype == torch.float64 and converted.device == cc.ACCELERATOR
        copied = acc.to(cc.ACCELERATOR, copy=True)
        assert copied is not acc and copied.device == cc.ACCELERATOR
        for moved_on in (host.to(cc.ACCELERATOR), host.to(device="cpu:0"), host.to(acc)):
            assert moved_on is not host and moved_on.device == cc.ACCELERATOR
        for moved_off in (acc.to("cpu"), acc.cpu(), acc.to(host)):
            assert moved_off is not acc and moved_off.device == cc.HOST
        assert host.device == cc.HOST and acc.device == cc.ACCELERATOR  # the sources keep their devices


def test_results_are_where_their_inputs_are():
    with cc._Tracker():
        acc, host = torch.ones(2, 2, device=cc.ACCELERATOR), torch.ones(2, 2)
        assert (acc + acc).device == cc.ACCELERATOR and (host * 2).device == cc.HOST
        assert (host + acc).device == cc.ACCELERATOR  # any accelerator input: the accelerator's result
        assert torch.cat([host, acc]).device == cc.ACCELERATOR and torch.stack([host, host]).device == cc.HOST
        assert torch.zeros(3).device == cc.HOST and torch.zeros(3, device="cpu:0").device == cc.ACCELERATOR
        assert torch.zeros_like(acc).device == cc.ACCELERATOR and torch.zeros_like(host).device == cc.HOST
        assert host[0].device == cc.HOST and acc[0].device == cc.ACCELERATOR
        assert host.expand_as(acc).device == cc.HOST  # a view of a host tensor stays one (its storage's)
        values, indices = torch.max(host, dim=0)
        assert values.device == indices.device == cc.HOST
        host.add_(acc[0, 0])  # in place: the tensor stays where it is
        assert host.device == cc.HOST
