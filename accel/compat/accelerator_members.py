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
