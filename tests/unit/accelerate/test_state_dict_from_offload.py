"""get_state_dict_from_offload against the real Accelerate: an offloaded layer's entries filled with its weights."""

from __future__ import annotations

import pytest
import torch

from accel.hooks import attach_align_device_hook
from accel.utils.modeling import get_state_dict_from_offload

real = pytest.importorskip("accelerate.utils.modeling")


def test_matches_accelerate():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    plain = get_state_dict_from_offload(model[1], "1.weight", {"1.weight": "x", "1.bias": "x", "0.weight": "x"})
    assert torch.equal(plain["1.weight"], expected["1.weight"]) and plain["0.weight"] == "x"
    theirs = real.get_state_dict_from_offload(model[1], "1.weight", {"1.weight": "x", "1.bias": "x"})
    assert torch.equal(theirs["1.bias"], plain["1.bias"])
    attach_align_device_hook(model, execution_device="cpu", offload=True)
    assert model[0].weight.device.type == "meta"
    filled = get_state_dict_from_offload(model[0], "0.weight", {"0.weight": "x", "0.bias": "x"})
    assert torch.equal(filled["0.weight"], expected["0.weight"]) and torch.equal(filled["0.bias"], expected["0.bias"])
    assert model[0].weight.device.type == "meta"  # sent back after the copy
