"""accel/runtime/replaced_parameters.py on one process: which parameters `prepare` replaced, and
the one line for an optimizer that cannot train the prepared model.

The registry is driven by hand (a parameter swapped for a new object, as FSDP2 and tensor parallelism do), and
through the Accelerator with a meta-device model, which `prepare` materializes into new parameters on one process
too. The multi-process layouts (ZeRO-2/3, TP, EP; DDP and ZeRO-1 quiet) are in
tests/multiproc/training/test_unprepared_optimizer.py."""

from __future__ import annotations

import gc
import pickle
from types import SimpleNamespace

import pytest
import torch

from accel import Accelerator
from accel.runtime import replaced_parameters
from accel.runtime.replaced_parameters import ReplacedParameters, UnpreparedOptimizerError, bare_name, layout_name


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCEL_LAUNCH_CONFIG", raising=False)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def replace(model: torch.nn.Module, name: str) -> None:
    """Give `model` a new parameter object under `name` (what sharding does)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    setattr(module, leaf, torch.nn.Parameter(getattr(module, leaf).detach().clone()))


def parallelism(**sizes) -> SimpleNamespace:
    fields = dict(pp_size=1, zero_stage=0, tp_size=1, cp_size=1, sp_size=1, ep_size=1)
    return SimpleNamespace(**{**fields, **sizes})


@pytest.mark.parametrize("config,sizes,expected", [
    (parallelism(zero_stage=3), {"dp": 2, "dp_replicate": 1, "dp_shard": 2}, "ZeRO-3"),
    (parallelism(zero_stage=2), {"dp": 2, "dp_replicate": 1, "dp_shard": 2}, "ZeRO-2"),
    (parallelism(zero_stage=3), {"dp": 4, "dp_replicate": 2, "dp_shard": 2},
     "HSDP (dp_replicate_size=2 x dp_shard_size=2, ZeRO-3)"),
    (parallelism(tp_size=2), {"dp": 1}, "tensor parallelism (tp_size=2)"),
    (parallelism(zero_stage=3, tp_size=2), {"dp": 2, "dp_shard": 2}, "ZeRO-3 + tensor parallelism (tp_size=2)"),
    (parallelism(ep_size=2), {"dp": 2, "dp_replicate": 2}, "expert parallelism (ep_size=2)"),
    (parallelism(pp_size=2, zero_stage=3), {"dp": 2, "dp_shard": 2},
     "pipeline parallelism (pp_size=2) + ZeRO-3"),
    (parallelism(), {"dp": 2, "dp_replicate": 2}, "data parallelism (DDP)"),
    (parallelism(), {"dp": 1, "dp_replicate": 1}, "one process"),
])
def test_the_layout_in_words(config, sizes, expected):
    assert layout_name(config, sizes) == expected


def test_bare_names_drop_the_wrappers_segments():
    assert bare_name("_orig_mod.blocks.0._checkpoint_wrapped_module.fc.weight") == "blocks.0.fc.weight"
    assert bare_name("module.my_orig_mod.weight") == "module.my_orig_mod.weight"  # only whole segments


def test_replaced_parameters_are_noted_by_name_and_weakly():
    model = net()
    registry = ReplacedParameters("ZeRO-3")
    before = registry.snapshot(model)
    old = model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replace(model, "0.weight")
    registry.record(before, model)
    try:
        assert registry.replaced == ["0.weight"] and registry.unchecked
        assert registry.held(optimizer) == ["0.weight"]
        assert registry.held(torch.optim.SGD(model.parameters(), lr=0.1)) == []  # built on the new ones
        del optimizer, old, before
        gc.collect()
        assert all(ref() is None for ref, _ in registry._originals.values())  # the old weight is not kept alive
    finally:
        registry.clear()


def test_a_parameter_gone_or_frozen_is_not_replaced():
    """Another pipeline stage's parameter (gone from the prepared model) is not this process's to update; a frozen
    one is not trained."""
    model = net()
    model[2].bias.requires_grad_(False)
    registry = ReplacedParameters("pipeline parallelism (pp_size=2)")
    before = registry.snapshot(model)
    model[2] = torch.nn.Identity()  # its weight gone
    replace(model, "0.bias")
    registry.record(before, model)
    try:
        assert registry.replaced == ["0.bias"]
    finally:
        registry.clear()


def test_nothing_replaced_installs_nothing():
    model = net()
    registry = ReplacedParameters("data parallelism (DDP)")
    registry.record(registry.snapshot(model), model)
    assert registry.replaced == [] and not registry.unchecked
    assert registry not in replaced_parameters._WATCHED


def test_backward_with_no_prepared_optimizer_is_refused_once_one_is_prepared_it_passes():
    model = net()
    registry = ReplacedParameters("ZeRO-3")
    before = registry.snapshot(model)
    replace(model, "0.weight")
    registry.record(before, model)
    try:
        with pytest.raises(UnpreparedOptimizerError) as caught:
            registry.check_backward()
        message = str(caught.value)
        assert "\n" not in message and isinstance(caught.value, ValueError)
        assert message.startswith("accelerator.backward: under ZeRO-3, prepare gave the model new parameters (1, e.g. "
                                  "'0.weight') but no optimizer was prepared")
        assert "accelerator.prepare(model, optimizer, ...)" in message
        assert not registry.unchecked  # checked once
        prepared = torch.optim.SGD(model.parameters(), lr=0.1)
        registry.check_prepared(prepared)
        registry.check_backward()
    finally:
        registry.clear()


def test_an_optimizer_holding_old_parameters_is_refused_at_its_first_step():
    model = net()
    registry = ReplacedParameters("tensor parallelism (tp_size=2)")
    before = registry.snapshot(model)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    replace(model, "0.weight")
    replace(model, "2.weight")
    registry.record(before, model)
    try:
        assert registry in replaced_parameters._WATCHED  # torch's hook before every optimizer's step
        with pytest.raises(UnpreparedOptimizerError, match=r"^SGD\.step: under tensor parallelism \(tp_size=2\), "
                           r"prepare gave the model new parameters, and this optimizer \(SGD\) holds 2 of the old "
                           r"ones \(e\.g\. '0\.weight'\).*pass the optimizer to prepare with the model"):
            stale.step()
        with pytest.raises(UnpreparedOptimizerError):  # caught and stepped again: still refused
            stale.step()
        fresh = torch.optim.SGD(model.parameters(), lr=0.1)
        fresh.step()  # holds the new parameters: steps
        assert fresh in registry._stepped  # looked at once
    finally:
        registry.clear()
    assert not replaced_parameters._HOOK  # the hook goes with the last registry that needed it
    stale.step()


def test_a_prepared_optimizer_still_holding_old_parameters_says_to_prepare_it_with_its_model():
    """A backend that could not re-point the optimizer (ZeRO-1's sharded optimizer prepared before its model under
    expert parallelism): prepared, so the advice is the order of prepare."""
    model = net()
    registry = ReplacedParameters("ZeRO-1 + expert parallelism (ep_size=2)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    registry.check_prepared(optimizer)  # nothing replaced yet
    before = registry.snapshot(model)
    replace(model, "0.weight")
    registry.record(before, model)
    try:
        with pytest.raises(UnpreparedOptimizerError, match=r"^AdamW\.step: .*prepare the optimizer in the same call as "
                                                            r"its model, or after it"):
            optimizer.step()
        with pytest.raises(UnpreparedOptimizerError, match=r"^accelerator\.prepare: "):
            registry.check_prepared(optimizer)
    finally:
        registry.clear()


def test_the_registry_pickles_without_its_identities():
    model = net()
    registry = ReplacedParameters("ZeRO-3")
    before = registry.snapshot(model)
    replace(model, "0.weight")
    registry.record(before, model)
    try:
        copied = pickle.loads(pickle.dumps(registry))
        assert copied.layout == "ZeRO-3" and copied.replaced == [] and not copied.unchecked
    finally:
        registry.clear()


# -- through the Accelerator: a meta-device model gets new (materialized) parameters at prepare ---------------------
def meta_net() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def step(accelerator, model, optimizer) -> None:
    loss = model(torch.randn(2, 3)).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def test_accelerator_refuses_the_first_backward_when_no_optimizer_was_prepared():
    accelerator = Accelerator(cpu=True)
    model = meta_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model = accelerator.prepare(model)
    try:
        with pytest.raises(UnpreparedOptimizerError, match=r"^accelerator\.backward: under one process, prepare gave "
                                                            r"the model new parameters \(4, e\.g\. '0\.weight'\)"):
            step(accelerator, model, optimizer)
    finally:
        accelerator.free_memory()
    assert not replaced_parameters._HOOK


def test_accelerator_refuses_the_step_of_an_unprepared_optimizer_beside_a_prepared_one():
    accelerator = Accelerator(cpu=True)
    first, second = meta_net(), meta_net()
    second_optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    first_optimizer = torch.optim.SGD(first.parameters(), lr=0.1)
    first, second, first_optimizer = accelerator.prepare(first, second, first_optimizer)
    try:
        loss = (first(torch.randn(2, 3)) + second(torch.randn(2, 3))).square().mean()
        accelerator.backward(loss)
        first_optimizer.step()
        with pytest.raises(UnpreparedOptimizerError, match=r"^SGD\.step: .*holds 4 of the old ones"):
            second_optimizer.step()
    finally:
        accelerator.free_memory()


@pytest.mark.parametrize("order", ["together", "optimizer later", "optimizer first", "built after"])
def test_accelerator_says_nothing_when_the_optimizer_is_prepared_in_any_order(order):
    accelerator = Accelerator(cpu=True)
    model = meta_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if order == "together":
        model, optimizer = accelerator.prepare(model, optimizer)
    elif order == "optimizer later":
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(optimizer)
    elif order == "optimizer first":
        optimizer = accelerator.prepare(optimizer)
        model = accelerator.prepare(model)
    else:
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        before = [p.detach().clone() for p in model.parameters()]
        step(accelerator, model, optimizer)
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # it learns
        assert not accelerator._replaced.unchecked  # the backward check ran once
    finally:
        accelerator.free_memory()


def test_accelerator_says_nothing_where_prepare_keeps_the_parameters():
    """One process, a model on the CPU: prepare keeps its parameters, so an optimizer never prepared steps them."""
    accelerator = Accelerator(cpu=True)
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = accelerator.prepare(model)
    before = model[0].weight.detach().clone()
    step(accelerator, model, optimizer)
    assert not torch.equal(before, model[0].weight)
    assert not accelerator._replaced.replaced and not replaced_parameters._HOOK
