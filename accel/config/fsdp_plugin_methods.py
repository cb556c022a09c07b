"""The methods of Accelerate's `FullyShardedDataParallelPlugin` that scripts call on a plugin before handing it to the
`Accelerator` (`set_auto_wrap_policy`, `set_mixed_precision`, `set_state_dict_type`, `set_cpu_offload` and the two
`validate_*`), with Accelerate's semantics on the plugin's fields, and the effect on accel's config layer:

* `set_auto_wrap_policy(model)`: a transformer-based policy without class names takes the model's
  `_no_split_modules` (each must name a module class of the model, else ValueError), and becomes torch's
  `transformer_auto_wrap_policy` bound to those classes; they are ZeRO's wrap units (`zero_wrap_classes`). A
  size-based one binds `min_num_params` (`zero_min_params`); 0 means no policy.
* `set_mixed_precision(mp)`: the FSDP2 `MixedPrecisionPolicy` (FSDP1's `MixedPrecision` for fsdp_version=1) of
  the dtype, and the plugin's layer asks for that mixed precision (the Accelerator's own argument still wins).
  accel runs mixed precision its one way (autocast over fp32 weights): the policy object is for readers.
* `set_state_dict_type(t)`: torch's `StateDictType` and the matching state dict configs, as Accelerate sets them.
  accel's checkpoints have one layout whatever the type (see accel.checkpoint.fsdp_compat).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

_PRECISIONS = {"fp8": torch.bfloat16, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_CONFIG_VALUE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "no"}


def _torch_policy(name: str):
    from torch.distributed.fsdp import wrap

    return getattr(wrap, name)


def wrap_policy_name(policy: Any) -> Any:
    """torch's transformer/size-based policy (or a functools.partial of one) as Accelerate's policy name; a string
    or None as given; any other callable as given (Accelerate's own policy: kept, not applied)."""
    if policy is None or isinstance(policy, str):
        return policy
    func = policy.func if isinstance(policy, functools.partial) else policy
    for name, torch_name in (("TRANSFORMER_BASED_WRAP", "transformer_auto_wrap_policy"),
                             ("SIZE_BASED_WRAP", "size_based_auto_wrap_policy")):
        if func is _torch_policy(torch_name):
            return name
    return policy


def _module_class(model: torch.nn.Module, name: str) -> type | None:
    for module in model.modules():
        if type(module).__name__ == name:
            return type(module)
    return None


class FsdpPluginMethods:
    """Mixed into `FullyShardedDataParallelPlugin` (its fields and `_build_layer`)."""

    fsdp_version: Any
    auto_wrap_policy: Any
    transformer_cls_names_to_wrap: Any
    min_num_params: Any
    mixed_precision_policy: Any
    cpu_offload: Any
    state_dict_type: Any
    state_dict_config: Any
    optim_state_dict_config: Any
    _precision: str | None

    def _build_layer(self) -> None:
        raise NotImplementedError

    @property
    def _version(self) -> int:
        return 1 if self.fsdp_version == 1 else 2  # accel's sharding is FSDP2's

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Bind the policy to `model`: see the module's docstring."""
        name = wrap_policy_name(self.auto_wrap_policy)
        name = name.upper() if isinstance(name, str) else name
        if name == "TRANSFORMER_BASED_WRAP":
            if self.transformer_cls_names_to_wrap is None:
                self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
            names = self.transformer_cls_names_to_wrap
            names = names.split(",") if isinstance(names, str) else list(names)
            classes = set()
            for layer_class in names:
                found = _module_class(model, layer_class.strip())
                if found is None:
                    raise ValueError(f"Could not find the transformer layer class {layer_class} in the model.")
                classes.add(found)
            self.auto_wrap_policy = functools.partial(_torch_policy("transformer_auto_wrap_policy"),
                                                      transformer_layer_cls=classes)
        elif name == "SIZE_BASED_WRAP":
            if self.min_num_params:
                self.auto_wrap_policy = functools.partial(_torch_policy("size_based_auto_wrap_policy"),
                                                          min_num_params=self.min_num_params)
            else:
                self.auto_wrap_policy = None
        elif name == "NO_WRAP":
            self.auto_wrap_policy = None
        self._build_layer()

    def set_mixed_precision(self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False) -> None:
        """The mixed precision policy of `mixed_precision` ("fp16", "bf16", "fp32", "fp8" or a torch dtype)."""
        dtype = mixed_precision
        if isinstance(mixed_precision, str):
            dtype = _PRECISIONS.get(mixed_precision)
            if dtype is None:
                raise ValueError(f"Invalid mixed precision: {mixed_precision}. Must be one of {list(_PRECISIONS)}")
        elif not isinstance(mixed_precision, torch.dtype) or mixed_precision not in _PRECISIONS.values():
            raise ValueError(f"Invalid mixed precision: {mixed_precision}. Must be one of "
                             f"{list(_PRECISIONS.values())}")
        if self._version == 1:
            from torch.distributed.fsdp import MixedPrecision as policy_cls

            extra = "buffer_dtype"
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy as policy_cls  # type: ignore[assignment]

            extra = "output_dtype"
        if override or self.mixed_precision_policy is None:
            args = {"param_dtype": dtype, "reduce_dtype": dtype,
                    extra: (torch.float32 if buffer_autocast and extra == "buffer_dtype" else dtype)}
            self.mixed_precision_policy = policy_cls(**args)
        elif isinstance(self.mixed_precision_policy, dict):
            valid = ["param_dtype", "reduce_dtype", extra]
            policy = self.mixed_precision_policy
            if any(k not in policy for k in valid) or any(v not in _PRECISIONS.values() for v in policy.values()):
                raise ValueError(f"Invalid mixed precision policy: {policy}. Must be a `dict` with keys {valid}."
                                 f"Values must be one of {list(_PRECISIONS.values())}")
            self.mixed_precision_policy = policy_cls(**policy)
        param_dtype = getattr(self.mixed_precision_policy, "param_dtype", dtype)
        self._precision = (mixed_precision if mixed_precision == "fp8" else _CONFIG_VALUE.get(param_dtype, "no"))
        self._build_layer()

    def validate_mixed_precision_policy(self) -> None:
        if self._version == 2:
            from torch.distributed.fsdp import MixedPrecisionPolicy as policy_cls
        else:
            from torch.distributed.fsdp import MixedPrecision as policy_cls  # type: ignore[assignment]
        if not isinstance(self.mixed_precision_policy, policy_cls):
            required = ("`torch.distributed.fsdp.MixedPrecisionPolicy`" if self._version == 2
                        else "`torch.distributed.fsdp.MixedPrecision`")
            raise ValueError(f"mixed_precision_policy must be an instance of {required}.")

    def set_cpu_offload(self) -> None:
        """A bool `cpu_offload` as torch's object (FSDP2's CPUOffloadPolicy/OffloadPolicy, FSDP1's CPUOffload)."""
        if not isinstance(self.cpu_offload, bool):
            return
        if self._version == 2:
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

            self.cpu_offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        else:
            from torch.distributed.fsdp import CPUOffload

            self.cpu_offload = CPUOffload(offload_params=self.cpu_offload)

    def validate_cpu_offload(self) -> None:
        if self._version == 2:
            from torch.distributed.fsdp import OffloadPolicy

            if not isinstance(self.cpu_offload, OffloadPolicy):
                raise ValueError("`cpu_offload` must be an instance of `torch.distributed.fsdp.OffloadPolicy` in "
                                 f"FSDP2, got {self.cpu_offload}")
        else:
            from torch.distributed.fsdp import CPUOffload

            if not isinstance(self.cpu_offload, CPUOffload):
                raise ValueError("`cpu_offload` must be an instance of `torch.distributed.fsdp.CPUOffload` in FSDP1, "
                                 f"got {self.cpu_offload}")

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """torch's StateDictType from a name, number or the enum (None: $FSDP_STATE_DICT_TYPE, else FULL for FSDP1 and
        SHARDED for FSDP2), with the state dict configs Accelerate pairs with it."""
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        if self.state_dict_type is None:
            self.state_dict_type = os.environ.get(
                "FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT" if self._version == 1 else "SHARDED_STATE_DICT")
        if isinstance(self.state_dict_type, str):
            text = self.state_dict_type
            self.state_dict_type = StateDictType(int(text)) if text.isdigit() else StateDictType[text.upper()]
        if self.state_dict_type == StateDictType.FULL_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
        elif self.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = ShardedStateDictConfig(offload_to_cpu=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = ShardedOptimStateDictConfig(offload_to_cpu=True)
        if self._version == 2 and self.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            raise ValueError("FSDP2 does not support LOCAL_STATE_DICT. Please set `fsdp_state_dict_type` to "
                             "`SHARDED_STATE_DICT` or `FULL_STATE_DICT`.")
