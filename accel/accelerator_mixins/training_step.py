"""The step around `backward`: the gradient-accumulation state, the precision policy's scaler, unscaling and
clipping, autocast and the profiler. `backward`, `accumulate` and `no_sync` themselves are the facade's."""

from __future__ import annotations

import contextlib
import os

import torch

from accel.accelerator_mixins.process import ProcessControl
from accel.config.kwargs import AutocastKwargs, ProfileKwargs, find_handler
from accel.optimizer import AcceleratedOptimizer


class TrainingStep(ProcessControl):
    """The Accelerator's members of the training step, delegated to the backend, the precision policy and the
    gradient state."""

    @property
    def mixed_precision(self) -> str:
        return self.precision.mode

    @property
    def scaler(self):
        return self.precision.scaler

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = value

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def step(self) -> int:
        """Micro-steps counted by `accumulate` (saved and restored by save_state/load_state)."""
        return self.gradient_state.step

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 found inf/nan gradients)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    def unscale_gradients(self, optimizer=None) -> None:
        """Divide fp16 gradients by the loss scale (once per step; a no-op otherwise)."""
        targets = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer else self._optimizers
        for opt in targets:
            self.precision.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0,
                        foreach: bool | None = None) -> torch.Tensor:
        """Unscale, clip the gradients' global norm to `max_norm`, and return the norm before clipping. `foreach`
        is torch's clip_grad_norm_'s (None: the foreach kernels where the device has them)."""
        self.unscale_gradients()
        return self.backend.clip_grad_norm_(list(parameters), max_norm, norm_type, foreach)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        """The precision policy's autocast context, for code outside the prepared model's forward."""
        return self.precision.autocast(**(autocast_handler.to_kwargs() if autocast_handler else {}))

    @property
    def profile_handler(self) -> ProfileKwargs | None:
        """The `ProfileKwargs` given in kwargs_handlers, if any (Accelerate's attribute)."""
        return find_handler(self.kwargs_handlers, ProfileKwargs)

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None):
        """Profile the block with `torch.profiler` (yields the profiler: `prof.step()`, `prof.key_averages()`).
        With `output_trace_dir`, each process then writes its Chrome trace there as `profile_<process_index>.json`
        (Accelerate's name), and the processes wait for each other. `profile_handler` overrides the Accelerator's."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json"))
        self.wait_for_everyone()

    def trigger_sync_in_backward(self, model: torch.nn.Module):
        """Inside `no_sync`, make the next backward reduce the gradients (the model ran several forwards)."""
        return self.backend.sync_in_backward(model)
