"""A MoE block's `accel_expert_plan` that names what its block does not have is one line naming the plan, the
field and what is allowed (no process group is needed: sharding the experts only slices them)."""

from __future__ import annotations

import re

import pytest
import torch

from accel.parallel.expert import ExpertPlan, shard_experts
from accel.config import ConfigError


def block(plan):
    class Block(torch.nn.Module):
        accel_expert_plan = plan

        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(4, 4)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
            self.stacked = torch.nn.Module()
            self.stacked.w = torch.nn.Parameter(torch.zeros(4, 4, 4))

    return torch.nn.Sequential(Block())


@pytest.mark.parametrize("plan, message", [
    (ExpertPlan(router="nope", experts="experts"),
     "Block.accel_expert_plan: router='nope' is not a submodule of Block; allowed: the name of one of its "
     "submodules (router, experts, stacked)"),
    (ExpertPlan(router="router", experts="missing"), "experts='missing' is not a submodule"),
    (ExpertPlan(router="router", experts="experts", shared="nope"), "shared='nope' is not a submodule"),
    (ExpertPlan(router="router", experts="stacked", params=("v",), call=lambda m, j, x: x),
     "params ['v'] are not parameters of 'stacked'; allowed: its own parameters (w)"),
    (ExpertPlan(router="router", experts="stacked"), "experts 'stacked' is not an nn.ModuleList; allowed: give"),
    ({"router": "router", "expert": "experts"}, "Block.accel_expert_plan: .*unexpected keyword argument 'expert'; "
                                                "allowed keys: router, experts, params, call, shared"),
    ("router", "Block.accel_expert_plan: bad value 'router'; allowed: an ExpertPlan"),
])
def test_a_bad_plan_is_one_line(plan, message):
    with pytest.raises(ConfigError, match=message if ".*" in message else re.escape(message)):
        shard_experts(block(plan), 2, 0, None)


def test_a_good_plan_keeps_this_ranks_experts():
    model = block(ExpertPlan(router="router", experts="stacked", params=("w",), call=lambda m, j, x: x))
    layout = shard_experts(model, 2, 1, None)
    assert list(layout.params) == ["0.stacked.w"] and layout.params["0.stacked.w"].shape == (2, 4, 4)
