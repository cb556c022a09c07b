"""The mixed-precision policy, resolved once: autocast dtype, loss scaling, and the skipped-step record.

`no`: float32 throughout. `bf16`: autocast to bfloat16, no scaling (bf16 has float32's range).
`fp16`: autocast to float16 plus dynamic loss scaling; a step with inf/nan gradients is skipped.
`fp8`: the recipe converts the chosen Linear layers to torchao's Float8Linear (float8 matmuls with dynamic
scales); everything else runs as `bf16`.
`fp16` on a CPU under `import accelerate` (the shim): float32 without scaling, as Accelerate runs it (it turns fp16
on only off the CPU); under `import accel`, float16 autocast with a CPU GradScaler. Either way one line says which.
Master weights stay float32 in every mode. Works on CPU and CUDA alike.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

from accel.config import MIXED_PRECISIONS, ConfigError
from accel.runtime.ops import recursively_apply

_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class PrecisionPolicy:
    """One object that answers every precision question for the Accelerator and the backends."""

    def __init__(self, mode: str, device: torch.device, scaler_kwargs: dict | None = None,
                 autocast_kwargs: dict | None = None, float8_recipe=None, as_accelerate: bool = False) -> None:
        if mode not in MIXED_PRECISIONS:
            raise ConfigError(f"mixed_precision: bad value {mode!r}; allowed: one of {', '.join(MIXED_PRECISIONS)}")
        self.mode = mode
        self.device_type = torch.device(device).type
        self.dtype: torch.dtype | None = _DTYPES[mode]
        # Accelerate turns fp16 on only off the CPU (`mode` still reads fp16, as its `mixed_precision` does)
        self.float32_fp16 = mode == "fp16" and self.device_type == "cpu" and as_accelerate
        if self.float32_fp16:
            self.dtype = None
        self.autocast_kwargs = dict(autocast_kwargs or {})
        self.float8 = _float8_settings(torch.device(device), float8_recipe) if mode == "fp8" else None
        self.scaler = None
        self.scaler_kwargs = dict(scaler_kwargs or {})
        if mode == "fp16" and not self.float32_fp16:
            self.scaler = torch.amp.GradScaler(self.device_type, **self.scaler_kwargs)

    def cpu_fp16_note(self) -> str | None:
        """What fp16 runs on a CPU, in one line (None elsewhere): it differs between Accelerate and accel."""
        if self.mode != "fp16" or self.device_type != "cpu":
            return None
        if self.float32_fp16:
            return ("accel: mixed_precision fp16 on a CPU runs in float32 without loss scaling, as Accelerate runs it "
                    "(it turns fp16 on only off the CPU); bf16 runs half precision on a CPU")
        return ("accel: mixed_precision fp16 on a CPU runs float16 autocast with a CPU GradScaler (Accelerate runs "
                "float32 here, and so does accel under `import accelerate`)")

    def fsdp_policy(self):
        """FSDP2's `MixedPrecisionPolicy` for this policy (None in fp32): parameters gathered in the compute dtype,
        gradients reduced in fp32."""
        if self.dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def choose_scaler(self, partial_gradients: bool) -> None:
        """Decided once, from what the backend says: where a rank holds only part of the gradients (sharded or
        split across processes), fp16 loss scaling uses torch's ShardedGradScaler, so every rank agrees on an
        inf/nan and skips the same steps."""
        if self.scaler is not None and partial_gradients:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device_type, **self.scaler_kwargs)

    # -- forward --------------------------------------------------------------------------------------------
    def autocast(self, **overrides: Any):
        """The autocast context of this policy (a no-op context for `no`)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        kwargs = {**self.autocast_kwargs, **overrides}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, **kwargs)

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """Run `model.forward` under autocast and hand float32 outputs back (Accelerate's behaviour)."""
        if self.dtype is None or hasattr(model, "_accel_original_forward"):
            return
        original = model.forward
        autocast = self.autocast

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with autocast():
                outputs = original(*args, **kwargs)
            return self.outputs_to_float32(outputs)

        model._accel_original_forward = original  # type: ignore[assignment]  # a plain attribute
        model.forward = forward

    @staticmethod
    def outputs_to_float32(outputs: Any) -> Any:
        """Low-precision tensors in a model's outputs, as float32 (what a wrapped forward returns)."""
        return recursively_apply(_to_float32, outputs, test_type=_is_low_precision)

    @staticmethod
    def unwrap_forward(model: torch.nn.Module) -> None:
        original = model.__dict__.pop("_accel_original_forward", None)
        if original is not None:
            if getattr(original, "__self__", None) is model and original.__func__ is type(model).forward:
                model.__dict__.pop("forward", None)
            else:
                model.forward = original

    # -- backward and step ------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place, once per step (clip_grad_norm_ then step must not unscale twice)."""
        if self.scaler is None:
            return
        stage = self.scaler._per_optimizer_states[id(optimizer)]["stage"]
        if stage.name == "READY":
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[], Any]) -> bool:
        """Run the optimizer step under loss scaling; return True when it was skipped (inf/nan gradients)."""
        if self.scaler is None:
            step_fn()
            return False
        stepped = []
        original_step = optimizer.step
        own = optimizer.__dict__.get("step")  # an LR scheduler may have wrapped it on the instance

        def tracking_step(*args, **kwargs):
            stepped.append(True)
            return original_step(*args, **kwargs)

        optimizer.step = tracking_step  # type: ignore[method-assign]  # GradScaler calls optimizer.step only when the gradients are finite
        try:
            self.scaler.step(optimizer)
        finally:
            if own is None:
                del optimizer.step
            else:
                optimizer.step = own  # type: ignore[method-assign]  # the instance's own, put back
        self.scaler.update()
        return not stepped


def _float8_settings(device: torch.device, recipe):
    """torchao's settings for fp8 (accel/backends/float8.py converts the layers): emulated where the device has no
    float8 matmul (the CPU); refused in one line on a GPU without one, or without torchao."""
    from accel.runtime.float8 import INSTALL, Float8Settings
    from accel.core.probes import is_torchao_available

    if not is_torchao_available():
        raise ConfigError(f"mixed_precision: fp8 needs torchao; install it with {INSTALL}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"mixed_precision: fp8 needs a GPU with float8 matmuls (compute capability 8.9+, e.g. L4, "
                          f"H100), this one has {torch.cuda.get_device_capability(device)}; allowed: bf16 or fp16")
    return Float8Settings(config=getattr(recipe, "config", None),
                          module_filter=getattr(recipe, "module_filter_func", None), emulate=device.type != "cuda")


def _is_low_precision(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and obj.dtype in (torch.float16, torch.bfloat16)


def _to_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float()
