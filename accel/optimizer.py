"""The prepared optimizer: steps and zeroes only on accumulation boundaries, under the precision policy."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from accel.checkpoint.async_save import wait_for_staging
from accel.runtime.accumulation import GradientState
from accel.planning.measure import meter_from_env
from accel.runtime.precision import PrecisionPolicy


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer (Accelerate's `AcceleratedOptimizer`); `.optimizer` is the original.

    `step()` and `zero_grad()` do nothing off the accumulation boundary; with fp16, `step()` goes through
    the grad scaler and records whether it was skipped for inf/nan gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, precision: PrecisionPolicy, gradient_state: GradientState):
        # No super().__init__: the wrapped optimizer owns param_groups and state.
        self.optimizer = optimizer
        self.precision = precision
        self.gradient_state = gradient_state
        self._is_overflow = False  # Accelerate's attribute behind step_was_skipped (its tests set it directly)
        self.before_step: Callable[[], Any] | None = None  # e.g. automatic clipping (DeepSpeed's gradient_clipping)
        self._meter = meter_from_env()  # `accel plan --measure`: stop after N real steps; None otherwise
        self._throughput: Any = None  # the throughput monitor (accel/runtime/throughput.py) when on: ticked
        self._fused_checked: list[dict] = []  # the fused groups unfuse_mixed_groups looked at (a loaded state dict
        # makes new group dicts, with the saved `fused`: they are looked at again)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped (fp16 inf/nan gradients): the prepared scheduler then does not step."""
        return self._is_overflow

    @step_was_skipped.setter
    def step_was_skipped(self, value: bool) -> None:
        self._is_overflow = bool(value)

    # -- delegated state -------------------------------------------------------------------------------------
    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):
            wait_for_staging()  # (schedule-free optimizers swap the parameters: not under an async save's copy)
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            wait_for_staging()
            self.optimizer.eval()

    # -- the step --------------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # Accelerate's: no closure's loss back
        if not self.gradient_state.sync_gradients:
            return
        note = self.gradient_state.unwindowed_note()
        if note is not None and _is_main_process():
            warnings.warn(note, UserWarning, stacklevel=2)
        wait_for_staging()  # an asynchronous save_state's copy of the parameters and state is complete first
        if self.before_step is not None:
            self.before_step()
        unfused = unfuse_mixed_groups(self.optimizer, self._fused_checked)
        if unfused:
            if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
                print(f"accel: optimizer parameter group(s) {unfused} hold tensor-parallel shards (DTensors) beside "
                      "parameters tensor parallelism keeps whole; torch's fused step takes only one kind, so these "
                      "groups step unfused", flush=True)
        if closure is not None:
            self.step_was_skipped = self.precision.step(self.optimizer, lambda: self.optimizer.step(closure))
        else:
            self.step_was_skipped = self.precision.step(self.optimizer, self.optimizer.step)
        if self._throughput is not None:
            self._throughput.step()
        if self._meter is not None:
            self._meter.tick(self)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        return self.__dict__.copy()

    def __setstate__(self, state):
        self.__dict__.update(state)


def _is_main_process() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def unfuse_mixed_groups(optimizer: torch.optim.Optimizer, checked: list[dict]) -> list[int]:
    """Turn off `fused` (and `foreach`) in the parameter groups that hold both DTensors (tensor-parallel shards) and
    plain tensors (what TP keeps whole without data parallelism, e.g. a MoE router beside its split experts):
    torch's fused kernels refuse such a list ("got mixed torch.Tensor and DTensor"). Each fused group is looked at
    once (`checked`: those seen, by identity). Returns the indices of the groups turned off."""
    from torch.distributed.tensor import DTensor

    mixed = []
    for index, group in enumerate(optimizer.param_groups):
        if not group.get("fused") or any(group is seen for seen in checked):
            continue
        checked.append(group)
        if len({isinstance(p, DTensor) for p in group["params"]}) > 1:
            group["fused"] = False
            if "foreach" in group:
                group["foreach"] = False
            mixed.append(index)
    return mixed
