"""save_state(safe_serialization=False), as Accelerate's tests and scripts call it: accepted, the checkpoint still
safetensors + JSON (no pickle file), one warning per process, and load_state restores the same weights."""

from __future__ import annotations

import warnings

import torch

import accel.accelerator_mixins.checkpointing
from accel import Accelerator


def test_pickle_flag_writes_safetensors(tmp_path, monkeypatch):
    monkeypatch.setattr(accel.accelerator_mixins.checkpointing, "_SAFETENSORS_ONLY_WARNED", [])
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    net = torch.nn.Linear(4, 3)
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.save_state(str(tmp_path / "a"), safe_serialization=False)
        accelerator.save_state(str(tmp_path / "b"), safe_serialization=False)
    said = [w for w in caught if "never writes pickle" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    names = [p.name for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert any(n.endswith(".safetensors") for n in names), names
    assert not [n for n in names if n.endswith((".bin", ".pkl", ".pt", ".pth"))], names
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(str(tmp_path / "a"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def _train(save_dir=None, load_dir=None):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(net, torch.optim.Adam(net.parameters(), lr=0.1))
    if save_dir is not None:
        accelerator.save_state(save_dir)
    if load_dir is not None:
        accelerator.load_state(load_dir)
    assert not optimizer.state  # a save or load before the first step leaves the optimizer fresh
    for _ in range(3):
        accelerator.backward(model(torch.ones(2, 3)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    return model.weight.detach().clone(), optimizer.state_dict()["state"][0]["step"].item()


def test_save_before_first_step_changes_nothing(tmp_path):
    """torch's DCP helpers give a fresh optimizer state with a zero step (Adam's count 1): the run after the save,
    and one resumed from it, must equal the run without it (plain Adam, bit for bit)."""
    plain = _train()
    assert plain[1] == 3
    for result in (_train(save_dir=str(tmp_path / "c")), _train(load_dir=str(tmp_path / "c"))):
        assert result[1] == 3 and torch.equal(result[0], plain[0])
