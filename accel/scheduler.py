"""The prepared LR scheduler: steps only when the optimizers really stepped (Accelerate's semantics)."""

from __future__ import annotations

import functools

from accel.runtime.accumulation import GradientState


def retarget_scheduler(scheduler, optimizer) -> None:
    """Point a scheduler built on one optimizer at the optimizer that replaced it (same param groups).

    torch's schedulers also watch `optimizer.step` to warn about call order; watch the new one the same way.
    """
    scheduler.optimizer = optimizer
    original = optimizer.step

    @functools.wraps(original)
    def step(*args, **kwargs):
        optimizer._opt_called = True
        return original(*args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # torch's LR scheduler reads this mark
    optimizer.step = step


class AcceleratedScheduler:
    """Wraps a torch LR scheduler; `.scheduler` is the original.

    With `step_with_optimizer` (the default) `step()` does nothing off the accumulation boundary or after
    a skipped fp16 step, and otherwise steps `num_processes` times (once with `split_batches`): the
    schedule is written for one process's batch, and each step consumed `num_processes` of them.
    """

    def __init__(self, scheduler, optimizers: list, gradient_state: GradientState, num_processes: int,
                 step_with_optimizer: bool = True, split_batches: bool = False) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.num_processes = num_processes
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        for _ in range(1 if self.split_batches else self.num_processes):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises past its end
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self):
        return self.scheduler.get_lr()

    def print_lr(self, *args, **kwargs):
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str):
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
