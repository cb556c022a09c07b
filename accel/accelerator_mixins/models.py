"""The Accelerator's prepared models: the user's module inside the backend's wrappers, device-mapped models, and
forgetting what was prepared."""

from __future__ import annotations

import gc
from typing import Any, cast

import torch

from accel.accelerator_mixins.process import ProcessControl
from accel.compat.other import strip_data_parallel
from accel.runtime.precision import PrecisionPolicy


class ModelHandling(ProcessControl):
    """Unwraps prepared models (the backend's, torch's, the precision policy's and torch.compile's wrappers) and
    releases everything prepared."""

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's own module, without the backend's wrapper or torch's DDP/DataParallel (and optionally the
        autocast wrapper). A `torch.compile` wrapper is kept with `keep_torch_compile` (as Accelerate does): the same
        one when it holds the module directly, else a new wrapper of the module with the same compile settings (the
        prepared model's own wrapper is left as it is, still around its DDP)."""
        compiled = model if hasattr(model, "_orig_mod") else None
        inner = self.backend.unwrap_model(cast(torch.nn.Module, model._orig_mod) if compiled is not None else model)
        inner = strip_data_parallel(inner)  # torch's DDP/DataParallel a script wrapped itself, as Accelerate unwraps
        if not keep_fp32_wrapper:
            PrecisionPolicy.unwrap_forward(inner)
        if compiled is None or not keep_torch_compile:
            return inner
        if inner is model._orig_mod:
            return model
        context = getattr(model, "dynamo_ctx", None)
        return cast(torch.nn.Module, type(model)(inner, context) if context is not None else torch.compile(inner))

    @staticmethod
    def verify_device_map(model: torch.nn.Module) -> bool:
        """Whether `model` (or a submodule) was dispatched by a `device_map` with more than one entry (Accelerate's
        test: `hf_device_map` of length > 1); such a model is not moved by `prepare`, nor trained on several
        processes."""
        return any(len(getattr(m, "hf_device_map", None) or ()) > 1 for m in model.modules())

    def free_memory(self, *objects: Any) -> list:
        """Forget every prepared object (and empty the CUDA cache); returns `None` for each argument."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._replaced_optimizers.clear()
        self._replaced.clear()
        self.backend.forget()
        self.gradient_state.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None for _ in objects]

    clear = free_memory
