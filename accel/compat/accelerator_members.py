"""Accelerate's `Accelerator` attributes that only describe how the object was built (the kwargs handlers it found,
whether native AMP or fp8 is on, ...): read-only views of accel's own state, kept out of the facade.

Those tied to machinery accel does not have answer what Accelerate's answer when that machinery is off:
`deepspeed_engine_wrapped` None (no DeepSpeed engine: ZeRO is accel's backend), `has_lomo_optimizer` False,
`delayed_fp8_autocast` False (Transformer Engine's), and the Transformer Engine / MS-AMP / FP8 recipe handlers None
(those handlers cannot be built in accel).
"""

from __future__ import annotations

from typing import Any

from accel.config.kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    find_handler,
)


class AccelerateMembers:
    """Mixed into `Accelerator` (which provides `kwargs_handlers`, `precision` and `_trigger`)."""

    kwargs_handlers: list
    precision: Any  # accel's PrecisionPolicy (its `mode` is the mixed_precision property)
    deepspeed_engine_wrapped: Any = None
    has_lomo_optimizer: bool = False
    delayed_fp8_autocast: bool = False
    te_recipe_handler: Any = None
    fp8_recipe_handler: Any = None
    msamp_recipe_handler: Any = None

    @property
    def ddp_handler(self) -> DistributedDataParallelKwargs | None:
        return find_handler(self.kwargs_handlers, DistributedDataParallelKwargs)

    @property
    def scaler_handler(self) -> GradScalerKwargs | None:
        return find_handler(self.kwargs_handlers, GradScalerKwargs)

    @property
    def init_handler(self) -> InitProcessGroupKwargs | None:
        return find_handler(self.kwargs_handlers, InitProcessGroupKwargs)

    @property
    def autocast_handler(self) -> AutocastKwargs | None:
        return find_handler(self.kwargs_handlers, AutocastKwargs)

    @property
    def ao_recipe_handler(self) -> AORecipeKwargs | None:
        return find_handler(self.kwargs_handlers, AORecipeKwargs)

    @property
    def has_fp8_handler(self) -> bool:
        return self.ao_recipe_handler is not None

    @property
    def fp8_enabled(self) -> bool:
        return self.precision.mode == "fp8"

    @property
    def native_amp(self) -> bool:
        """Whether torch's autocast runs the forward (fp16 or bf16), as Accelerate's attribute says."""
        return self.precision.mode in ("fp16", "bf16")

    @property
    def flag_tensor(self):
        """The flag `set_trigger` raises and `check_trigger` reads (None when not raised)."""
        return self.__dict__.get("_trigger")

    @flag_tensor.setter
    def flag_tensor(self, value) -> None:
        self.__dict__["_trigger"] = value


def refuse_quantized_placement(model: Any, device: Any, distributed: bool, bnb_on_cpu: bool, on_xpu: bool) -> None:
    """Accelerate's `prepare_model` checks of a model transformers loaded in 8 or 4 bits (bitsandbytes:
    `is_loaded_in_8bit` / `is_loaded_in_4bit`) with an `hf_device_map`: it cannot be trained on several devices in a
    distributed run, on another device than this process's, nor with CPU or disk offload (a CPU entry is allowed
    where bitsandbytes' multi-backend runs on the CPU, `bnb_on_cpu`, and not on XPU, `on_xpu`). Accelerate's errors,
    word for word (its tests match them)."""
    import torch

    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    device_map = getattr(model, "hf_device_map", None)
    if not quantized or not device_map:
        return
    devices = set(device_map.values())
    if len(devices) > 1 and distributed:
        raise ValueError("You can't train a model that has been loaded in 8-bit or 4-bit precision on multiple devices "
                         "in any distributed mode. In order to use 8-bit or 4-bit models that have been loaded across "
                         "multiple GPUs the solution is to use Naive Pipeline Parallelism. Therefore you should not "
                         "specify that you are under any distributed regime in your accelerate config.")
    if len(devices) == 1:
        (placed,) = devices
        index: int | None
        if isinstance(placed, torch.device):
            index = placed.index
        elif isinstance(placed, str):
            index = None if placed == "disk" else torch.device(placed).index
        else:
            index = None if placed is None else int(placed)
        here = torch.device(device.type) if index is None else torch.device(device.type, index)
        if not (device.type == "cpu" and bnb_on_cpu) and here != device and (device.index is not None or index != 0):
            raise ValueError("You can't train a model that has been loaded in 8-bit or 4-bit precision on a different "
                             "device than the one you're training on. Make sure you loaded the model on the correct "
                             "device using for example `device_map={'':torch.cuda.current_device()}` or "
                             "`device_map={'':torch.xpu.current_device()}`")
    if ("cpu" in devices and (not bnb_on_cpu or on_xpu)) or "disk" in devices:
        raise ValueError("You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk "
                         "offload. If you want train the 8-bit or 4-bit model in CPU, please install bitsandbytes with "
                         "multi-backend, see https://huggingface.co/docs/bitsandbytes/main/en/installation#multi-backend")
