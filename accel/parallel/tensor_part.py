"""Tensor parallelism (tp_size > 1) as a part: its plan is chosen on the whole model (before a pipeline cuts it,
or at prepare), then applied in the recipe's slot after float8 conversion, where DTensor splits the planned layers
over the `tp` sub-mesh (tensor.py); full state dicts put fused projections back in the model's order (fused.py)."""

from __future__ import annotations

import torch

from accel.parallel import fused
from accel.parallel.part import Part
from accel.parallel.tensor import apply_tensor_parallel, held_part, plan_for


class TensorPart(Part):
    name = "tensor"
    title = "tensor parallelism"
    replaces_parameters = True
    save_pretrained_note = "split by tensor parallelism"

    def __init__(self, topology, state, parallelism, data_parallel) -> None:
        self.topology, self.state, self.parallelism = topology, state, parallelism
        self.fixed_plan: dict[str, str] | None = None  # the whole model's (a pipeline's stages take their part)
        self._pending: dict[int, tuple] = {}  # id(model) -> (its plan, the tp mesh), from prepare to transform

    @property
    def splits_state(self) -> bool:
        return True

    def _plan(self, model: torch.nn.Module) -> dict[str, str]:
        return plan_for(model, self.parallelism, self.topology.tp_size, self.state.is_main_process)

    def plan_whole_model(self, model: torch.nn.Module) -> None:
        """The plan is checked (ties, divisibility) and printed once, on the whole model."""
        self.fixed_plan = self._plan(model)

    def prepare(self, model: torch.nn.Module, recipe) -> None:
        mesh = self.topology.submesh("tp", self.state.device.type)
        plan = self._plan(model) if self.fixed_plan is None else held_part(self.fixed_plan, model)
        self._pending[id(model)] = (plan, mesh)

    def transform(self, model: torch.nn.Module, recipe) -> None:
        """Split the planned layers, except those another part keeps whole (`recipe.kept_whole`)."""
        plan, mesh = self._pending.pop(id(model))
        whole = recipe.kept_whole
        if whole:
            plan = {name: style for name, style in plan.items()
                    if not any(name == owner or name.startswith(f"{owner}.") for owner in whole)}
        apply_tensor_parallel(model, mesh, plan)

    def full_state(self, model: torch.nn.Module, state: dict) -> dict:
        return fused.to_model_order(state, model)

    def forget(self) -> None:
        self._pending.clear()
