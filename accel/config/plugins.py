"""Accelerate's `DeepSpeedPlugin` and `FullyShardedDataParallelPlugin`, as config layers.

accel has one config tree; a plugin is only another way to write part of it. `to_layer()` returns the
layer (the shape `accel.config.parse_layer` returns) that the plugin means, and the `Accelerator` applies
it with the precedence of its own arguments. Neither DeepSpeed nor FSDP's own classes are needed:

* `DeepSpeedPlugin`: `hf_ds_config` (a DeepSpeed JSON path or dict, read exactly as
  `accel launch --deepspeed_config_file` reads one) plus `zero_stage`, `offload_optimizer_device`,
  `offload_param_device`, `gradient_accumulation_steps`, `gradient_clipping`;
* `FullyShardedDataParallelPlugin`: `sharding_strategy` / `reshard_after_forward` (onto ZeRO stages:
  FULL_SHARD and HYBRID_SHARD 3, SHARD_GRAD_OP 2, NO_SHARD 0), `cpu_offload`, and the wrap units
  (`transformer_cls_names_to_wrap`, `min_num_params` under SIZE_BASED_WRAP: `zero_wrap_classes`, `zero_min_params`);
* `TorchTensorParallelPlugin`: `tp_size`.

Arguments that only tune how Accelerate wraps or prefetches (`auto_wrap_policy`, `backward_prefetch`,
`use_orig_params`, `zero3_init_flag`, ...) are accepted and kept as attributes. Arguments whose meaning
accel cannot honour (`mixed_precision_policy`, `activation_checkpointing`, nvme paths, MS-AMP, ...) are an
error naming the argument when set to anything but their default; unknown argument names are a TypeError.
"""

from __future__ import annotations

import enum
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from accel.config.accelerate_import import (
    OFFLOAD_DEVICES,
    DeepSpeedConfigWarning,
    deepspeed_json_layer,
    read_deepspeed_json,
)
from accel.config.errors import ConfigError, shown
from accel.config.fsdp_plugin_methods import FsdpPluginMethods, wrap_policy_name
from accel.config.parallelism import requested_zero_stage
from accel.config.resolve import merge_layers, worker_layers
from accel.config.schema import DYNAMO_BACKENDS, PARALLEL_FIELDS, TOP_FIELDS, AccelConfig, allowed_values, check_value

# FSDP sharding strategy -> ZeRO stage; numbers are torch's ShardingStrategy values (and Accelerate's 1-5)
_STRATEGY_STAGE = {
    "FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "HYBRID_SHARD_ZERO2": 2,
    "_HYBRID_SHARD_ZERO2": 2,
}
_STRATEGY_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
_STRATEGY_ALLOWED = "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 (a name, 1-5 or the enum)"


def _unsupported(plugin: Any, accepted: dict[str, tuple], why: dict[str, str]) -> None:
    """A one-line ConfigError for the first argument set to something other than its default(s)."""
    for name, values in accepted.items():
        value = getattr(plugin, name)
        if not any(value is ok or (type(value) is type(ok) and value == ok) for ok in values):
            allowed = " or ".join(repr(ok) for ok in values)
            raise ConfigError(f"{plugin._NAME}: argument '{name}': {value!r} is not supported by accel; allowed: "
                              f"{allowed} (leave it unset){why.get(name, '')}")


def _argument(owner: str, name: str, value: Any, meta: Mapping) -> Any:
    """`value` checked against a config field's rules; errors name the argument."""
    try:
        return check_value(value, meta, name, owner)
    except ConfigError:
        raise ConfigError(f"{owner}: argument '{name}': bad value {shown(value)}; allowed: "
                          f"{allowed_values(meta, value)}") from None


def _stage_unset_default(layer: dict, stage: int, base_stage: int) -> dict:
    """A plugin that names no stage means Accelerate's default `stage` unless the other layers (the config file or
    launched config) already ask for ZeRO/FSDP sharding (`base_stage` above 0), whose stage then stays."""
    if base_stage > 0:
        return layer
    return merge_layers([{"parallelism": {"zero_stage": stage}}, layer])


# -------------------------------------------------------------------------------------------------------------
# DeepSpeed
# -------------------------------------------------------------------------------------------------------------

# DeepSpeedPlugin argument -> (section, key) of the layer it sets
_DS_ARGUMENTS = {
    "gradient_accumulation_steps": (None, "gradient_accumulation_steps"),
    "gradient_clipping": ("parallelism", "gradient_clipping"),
    "zero_stage": ("parallelism", "zero_stage"),
    "offload_optimizer_device": ("parallelism", "offload_optimizer"),
    "offload_param_device": ("parallelism", "offload_params"),
}

@dataclass
class DeepSpeedPlugin:
    """Accelerate's DeepSpeedPlugin, mapped onto accel's ZeRO settings (DeepSpeed itself is not needed).

    `hf_ds_config`: a path to a DeepSpeed JSON file or its dict. The other arguments, when given, must agree
    with the file (or the file must say "auto" there). No stage at all (neither `zero_stage` nor the file's
    `zero_optimization.stage`, and no `hf_ds_config`) means ZeRO stage 2 as in Accelerate, unless the config
    file/launch already asks for a ZeRO stage, which is then kept. The JSON's `optimizer` / `scheduler` sections
    are built by `Accelerator.prepare` for `DummyOptim` / `DummyScheduler` (accel/compat/deepspeed.py).
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: Any = None
    gradient_clipping: Any = None
    zero_stage: Any = None
    is_train_batch_min: bool = True
    offload_optimizer_device: Any = None
    offload_param_device: Any = None
    offload_optimizer_nvme_path: Any = None
    offload_param_nvme_path: Any = None
    zero3_init_flag: Any = None
    zero3_save_16bit_model: Any = None
    transformer_moe_cls_names: Any = None
    enable_msamp: Any = None
    msamp_opt_level: Any = None
    deepspeed_config: dict = field(init=False, repr=False, default_factory=dict)

    _NAME = "DeepSpeedPlugin"

    def __post_init__(self) -> None:
        _unsupported(self, {
            "offload_optimizer_nvme_path": (None,), "offload_param_nvme_path": (None,),
            "transformer_moe_cls_names": (None,), "enable_msamp": (None, False), "msamp_opt_level": (None,),
        }, {
            "offload_optimizer_nvme_path": "; nvme offload is not supported, use offload_optimizer_device='cpu'",
            "offload_param_nvme_path": "; nvme offload is not supported, use offload_param_device='cpu'",
            "enable_msamp": "; use Accelerator(mixed_precision=...)",
            "msamp_opt_level": "; use Accelerator(mixed_precision=...)",
        })
        if self.hf_ds_config is None:
            source = f"{self._NAME}(...)"
            self.deepspeed_config = {}
        elif isinstance(self.hf_ds_config, dict):
            source = f"{self._NAME}(hf_ds_config=...)"
            self.deepspeed_config = self.hf_ds_config
        elif isinstance(self.hf_ds_config, (str, os.PathLike)):
            path = Path(self.hf_ds_config).expanduser()
            source = os.path.normpath(path)
            self.deepspeed_config = read_deepspeed_json(path, f"{self._NAME}: argument 'hf_ds_config'")
        else:
            raise ConfigError(f"{self._NAME}: argument 'hf_ds_config': bad value of type "
                              f"{type(self.hf_ds_config).__name__}; allowed: a DeepSpeed JSON file's path or its dict")
        file_layer = (deepspeed_json_layer(self.deepspeed_config, source, builds_optimizer=True)
                      if self.hf_ds_config is not None else {})  # its optimizer/scheduler: see accel.compat.deepspeed
        args_layer = self._layer_of_arguments()  # validated now, not at Accelerator()
        for arg, (section, key) in _DS_ARGUMENTS.items():  # an argument and the file must agree
            mine = (args_layer.get(section, {}) if section else args_layer).get(key)
            theirs = (file_layer.get(section, {}) if section else file_layer).get(key)
            if mine is not None and theirs is not None and mine != theirs:
                raise ConfigError(f"{self._NAME}: argument '{arg}' gives {key}={mine!r} but {source} gives "
                                  f"{theirs!r}; allowed: the same value, or leave one unset (or \"auto\" in the JSON)")
        self._layer = merge_layers([file_layer, args_layer])

    def _layer_of_arguments(self) -> dict:
        owner = self._NAME
        top: dict = {}
        par: dict = {}
        if self.gradient_accumulation_steps not in (None, "auto"):
            top["gradient_accumulation_steps"] = _argument(owner, "gradient_accumulation_steps",
                                                           self.gradient_accumulation_steps,
                                                           TOP_FIELDS["gradient_accumulation_steps"])
        if self.gradient_clipping not in (None, "auto"):
            par["gradient_clipping"] = _argument(owner, "gradient_clipping", self.gradient_clipping,
                                                 {**PARALLEL_FIELDS["gradient_clipping"], "optional": False})
        if self.zero_stage not in (None, "auto"):
            par["zero_stage"] = _argument(owner, "zero_stage", self.zero_stage, PARALLEL_FIELDS["zero_stage"])
        for arg, key in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_params")):
            device = getattr(self, arg)
            if device is None or device == "auto":
                continue
            device = getattr(device, "value", device)  # an enum of devices
            if not isinstance(device, str) or device.lower() not in OFFLOAD_DEVICES:
                raise ConfigError(f"{owner}: argument '{arg}': bad value {device!r}; allowed: none, cpu")
            if device.lower() == "nvme":
                raise ConfigError(f"{owner}: argument '{arg}': 'nvme' offload is not supported by accel; "
                                  "allowed: none, cpu")
            par[key] = device.lower() == "cpu"
        if par:
            top["parallelism"] = par
        return top

    def to_layer(self, base: AccelConfig | None = None) -> dict:
        """The config layer this plugin means (apply it with `Accelerator(...)`-argument precedence).

        `base` is the config the other layers resolve to (files or the launched config); it only decides
        the stage when nothing here names one (see the class docstring)."""
        return self.layer_over(base.parallelism.zero_stage if base is not None else 0)

    @property
    def names_stage(self) -> bool:
        """Whether the plugin decides the ZeRO stage itself (a JSON, or `zero_stage`), whatever the other layers ask."""
        return self.hf_ds_config is not None or "zero_stage" in self._layer.get("parallelism", {})

    def layer_over(self, base_stage: int) -> dict:
        """`to_layer` over other layers that ask for ZeRO stage `base_stage` (0: none)."""
        layer = merge_layers([self._layer])  # a copy
        return layer if self.names_stage else _stage_unset_default(layer, 2, base_stage)

    @property
    def selected(self) -> bool:
        """Accelerate's flag: whether this is the active plugin of `Accelerator(deepspeed_plugins=...)`."""
        return self.__dict__.get("_selected", False)


# -------------------------------------------------------------------------------------------------------------
# FSDP
# -------------------------------------------------------------------------------------------------------------

def _strategy_stage(value: Any, arg: str, owner: str) -> int:
    """A ShardingStrategy enum, its name (any case) or its number (1-5) -> ZeRO stage."""
    name = getattr(value, "name", None)
    if name is None:
        if isinstance(value, int) and not isinstance(value, bool):
            name = _STRATEGY_NUMBERS.get(value)
        elif isinstance(value, str):
            text = value.strip()
            name = _STRATEGY_NUMBERS.get(int(text)) if text.isdigit() else text.upper()
    stage = _STRATEGY_STAGE.get(str(name).upper()) if name is not None else None
    if stage is None:
        raise ConfigError(f"{owner}: argument '{arg}': bad value {value!r}; allowed: {_STRATEGY_ALLOWED}")
    return stage


def _offload_flag(value: Any, owner: str) -> bool:
    """cpu_offload: a bool, torch's CPUOffload(offload_params=...), or FSDP2's CPUOffloadPolicy/OffloadPolicy."""
    if isinstance(value, bool):
        return value
    if hasattr(value, "offload_params"):
        return bool(value.offload_params)
    kind = type(value).__name__
    if kind == "CPUOffloadPolicy":
        return True
    if kind == "OffloadPolicy":
        return False
    raise ConfigError(f"{owner}: argument 'cpu_offload': bad value {value!r}; allowed: true, false, "
                      "CPUOffload(offload_params=...) or CPUOffloadPolicy()")


@dataclass
class FullyShardedDataParallelPlugin(FsdpPluginMethods):
    """Accelerate's FSDP plugin, mapped onto accel's ZeRO stages: sharding parameters, gradients and optimizer
    state is stage 3 (FULL_SHARD, HYBRID_SHARD, reshard_after_forward=True), gradients and optimizer state
    stage 2 (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2, reshard_after_forward=False), none stage 0 (NO_SHARD).

    No strategy given means FULL_SHARD (stage 3) as in Accelerate, unless the config file/launch already
    asks for a ZeRO stage, which is then kept. `cpu_offload` turns on both offload_params and
    offload_optimizer (FSDP's CPU offload moves both).
    """

    fsdp_version: Any = None  # the fields in Accelerate's order (its positional arguments)
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: Any = True
    use_orig_params: Any = None
    param_init_fn: Any = None
    sync_module_states: Any = None
    forward_prefetch: Any = None
    activation_checkpointing: Any = None
    activation_checkpointing_offload: Any = None
    cpu_ram_efficient_loading: Any = None
    transformer_cls_names_to_wrap: Any = None
    min_num_params: Any = None

    _NAME = "FullyShardedDataParallelPlugin"

    def __post_init__(self) -> None:
        _unsupported(self, {
            "mixed_precision_policy": (None,), "ignored_modules": (None,), "state_dict_config": (None,),
            "optim_state_dict_config": (None,), "param_init_fn": (None,),
            "activation_checkpointing_offload": (None, False),
        }, {
            "mixed_precision_policy": "; use Accelerator(mixed_precision=...) or set_mixed_precision()",
            "param_init_fn": "; a model built on the meta device is materialized by the ZeRO backend itself",
            "activation_checkpointing_offload": "; checkpointed activations stay on the device",
        })
        self._precision: str | None = None  # set_mixed_precision's, as a config value
        self._build_layer()

    def _build_layer(self) -> None:
        """The config layer of the current fields (again after a set_* method changed them)."""
        owner = self._NAME
        if self.fsdp_version is not None and self.fsdp_version not in (1, 2):
            raise ConfigError(f"{owner}: argument 'fsdp_version': bad value {self.fsdp_version!r}; allowed: 1 or 2")
        par: dict = {}
        if self.sharding_strategy is not None:
            par["zero_stage"] = _strategy_stage(self.sharding_strategy, "sharding_strategy", owner)
        if self.reshard_after_forward is not None:
            if isinstance(self.reshard_after_forward, bool):
                stage = 3 if self.reshard_after_forward else 2
            else:  # Accelerate also takes FSDP1 strategy names here
                stage = _strategy_stage(self.reshard_after_forward, "reshard_after_forward", owner)
            if "zero_stage" in par and par["zero_stage"] != stage:
                raise ConfigError(f"{owner}: arguments 'sharding_strategy' ({self.sharding_strategy!r}) and "
                                  f"'reshard_after_forward' ({self.reshard_after_forward!r}) disagree (ZeRO stage "
                                  f"{par['zero_stage']} vs {stage}); allowed: give one of them")
            par["zero_stage"] = stage
        if self.activation_checkpointing not in (None, False, True):
            raise ConfigError(f"{owner}: argument 'activation_checkpointing': bad value "
                              f"{self.activation_checkpointing!r}; allowed: true or false")
        if self.activation_checkpointing:
            par["activation_checkpointing"] = "full"  # each repeated block, as FSDP's checkpoint wrapper does
        if self.cpu_offload is not None:
            offload = _offload_flag(self.cpu_offload, owner)
            par["offload_params"] = offload
            par["offload_optimizer"] = offload
        par.update(self._wrapping())
        self._layer: dict[str, Any] = {"parallelism": par} if par else {}
        if self._precision is not None:
            self._layer["mixed_precision"] = self._precision

    def _wrapping(self) -> dict:
        """`transformer_cls_names_to_wrap` / `min_num_params` (what transformers' `fsdp_config` passes) -> the ZeRO
        blocks, as a config file's `fsdp_config` keys map (a callable policy is Accelerate's own: kept, unused)."""
        from accel.config.accelerate_import import _fsdp_wrapping
        from accel.core.constants import FSDP_AUTO_WRAP_POLICY

        policy = wrap_policy_name(self.auto_wrap_policy)
        if policy is not None and not isinstance(policy, str):
            return {}
        if policy is not None and policy.upper() not in FSDP_AUTO_WRAP_POLICY:
            raise ConfigError(f"{self._NAME}: argument 'auto_wrap_policy': bad value {policy!r}; allowed: "
                              f"{', '.join(FSDP_AUTO_WRAP_POLICY)} or a callable policy")
        section = {"fsdp_auto_wrap_policy": policy, "fsdp_min_num_params": self.min_num_params,
                   "fsdp_transformer_layer_cls_to_wrap": self.transformer_cls_names_to_wrap}
        return _fsdp_wrapping(section, self._NAME)

    def to_layer(self, base: AccelConfig | None = None) -> dict:
        """The config layer this plugin means (apply it with `Accelerator(...)`-argument precedence).

        `base` is the config the other layers resolve to; it only decides the stage when no strategy is given."""
        return self.layer_over(base.parallelism.zero_stage if base is not None else 0)

    @property
    def names_stage(self) -> bool:
        """Whether a sharding strategy (or `reshard_after_forward`) decides the ZeRO stage."""
        return "zero_stage" in self._layer.get("parallelism", {})

    def layer_over(self, base_stage: int) -> dict:
        """`to_layer` over other layers that ask for ZeRO stage `base_stage` (0: none)."""
        layer = merge_layers([self._layer])  # a copy
        return layer if self.names_stage else _stage_unset_default(layer, 3, base_stage)


# -------------------------------------------------------------------------------------------------------------
# tensor parallelism
# -------------------------------------------------------------------------------------------------------------

@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's `TorchTensorParallelPlugin` (deprecated there for `ParallelismConfig(tp_size=...)`): `tp_size`
    is accel's tp_size. `torch_device_mesh` is ignored, as Accelerate 1.15 ignores it: the mesh is built from the
    sizes."""

    tp_size: int = 1
    torch_device_mesh: Any = None

    _NAME = "TorchTensorParallelPlugin"

    def __post_init__(self) -> None:
        self._layer = {"parallelism": {"tp_size": _argument(self._NAME, "tp_size", self.tp_size,
                                                            PARALLEL_FIELDS["tp_size"])}}

    def to_layer(self) -> dict:
        return merge_layers([self._layer])


def tp_plugin_layer(argument_layer: dict, torch_tp_plugin: Any = None) -> dict:
    """`Accelerator(torch_tp_plugin=...)`: its tp_size under the other arguments, so `parallelism_config=` wins
    (Accelerate reads the plugin only without a parallelism_config). Warns as Accelerate does (deprecated)."""
    if torch_tp_plugin is None:
        return argument_layer
    if not isinstance(torch_tp_plugin, TorchTensorParallelPlugin):
        raise ConfigError("Accelerator: argument 'torch_tp_plugin': expected accel.utils.TorchTensorParallelPlugin, "
                          f"got {type(torch_tp_plugin).__name__}")
    warnings.warn("`TorchTensorParallelPlugin` is deprecated and will be removed in a future version of Accelerate. "
                  "Please use the `ParallelismConfig` with `tp_size` instead.", FutureWarning, stacklevel=3)
    return merge_layers([torch_tp_plugin.to_layer(), argument_layer])


# -------------------------------------------------------------------------------------------------------------
# several DeepSpeed plugins
# -------------------------------------------------------------------------------------------------------------

def active_deepspeed_plugin(deepspeed_plugin: Any = None, deepspeed_plugins: Any = None) -> tuple[Any, Any]:
    """Accelerate's `deepspeed_plugin` / `deepspeed_plugins` (one is an alias of the other): a DeepSpeedPlugin, or
    a dict name -> DeepSpeedPlugin whose first entry is the active one. Returns (active plugin, what was given).

    accel applies one ZeRO config to every model: with several plugins the first is applied (a warning says so)
    and `AcceleratorState().select_deepspeed_plugin(other)` is refused (see `deepspeed_state_members`)."""
    if deepspeed_plugin is not None and deepspeed_plugins is not None:
        raise ConfigError("Accelerator: deepspeed_plugin and deepspeed_plugins are both given; allowed: one of them")
    name = "deepspeed_plugins" if deepspeed_plugins is not None else "deepspeed_plugin"
    given = deepspeed_plugins if deepspeed_plugins is not None else deepspeed_plugin
    if not isinstance(given, dict):
        return given, given
    bad = {key: type(p).__name__ for key, p in given.items() if not isinstance(p, DeepSpeedPlugin)}
    if not given or bad:
        raise ConfigError(f"Accelerator: argument '{name}': bad value {bad or given!r}; allowed: a DeepSpeedPlugin or "
                          "a non-empty dict of name -> DeepSpeedPlugin")
    first = next(iter(given))
    if len(given) > 1:
        warnings.warn(f"Accelerator({name}=...): accel applies the first plugin ({first!r}) to every model; "
                      "selecting another (AcceleratorState().select_deepspeed_plugin) is not available yet",
                      stacklevel=3)
    return given[first], given


def deepspeed_state_members(active: Any, given: Any) -> dict:
    """Accelerate's AcceleratorState members for DeepSpeed plugins: `deepspeed_plugins`, and the name -> plugin table
    that `PartialState.get_deepspeed_plugin`/`select_deepspeed_plugin` read (plain data, so the state pickles)."""
    plugins = {} if active is None else given if isinstance(given, dict) else {"default": given}
    if active is not None:
        active.__dict__["_selected"] = True
    return {"deepspeed_plugins": given, "_deepspeed_plugin_table": plugins}


# -------------------------------------------------------------------------------------------------------------
# for the Accelerator
# -------------------------------------------------------------------------------------------------------------

def apply_plugins(argument_layer: dict, deepspeed_plugin: Any = None, fsdp_plugin: Any = None,
                  base_layers: list[dict] | None = None) -> dict:
    """The `Accelerator(...)` layer with a plugin applied: the plugin's layer under the plain arguments
    (`mixed_precision=`, `gradient_accumulation_steps=` win), except that the plugin's parallelism keys win
    over `parallelism_config=` (which sets every field). `base_layers` are the layers under the Accelerator's
    arguments (the files or the launched config, read once by the caller, `worker_layers()`); they are only read
    when the plugin names no stage (the stage they ask for decides its default, without building a config from
    them), and when omitted then, read here."""
    if deepspeed_plugin is None and fsdp_plugin is None:
        return argument_layer
    if deepspeed_plugin is not None and fsdp_plugin is not None:
        raise ConfigError("Accelerator: deepspeed_plugin and fsdp_plugin are both given; allowed: one of them")
    plugin = deepspeed_plugin if deepspeed_plugin is not None else fsdp_plugin
    name = "deepspeed_plugin" if deepspeed_plugin is not None else "fsdp_plugin"
    if isinstance(plugin, dict):
        raise ConfigError(f"Accelerator: argument '{name}': a dict of several plugins (one per model) is not "
                          "supported by accel; allowed: one plugin")
    if not hasattr(plugin, "layer_over"):
        raise ConfigError(f"Accelerator: argument '{name}': expected accel.DeepSpeedPlugin or "
                          f"accel.FullyShardedDataParallelPlugin, got {type(plugin).__name__}")
    base_stage = 0
    if not plugin.names_stage:
        layers = worker_layers()[0] if base_layers is None else base_layers
        base_stage = requested_zero_stage(merge_layers(layers).get("parallelism", {}))
    layer = plugin.layer_over(base_stage)
    merged = merge_layers([layer, argument_layer])
    if "parallelism" in layer and "parallelism" in argument_layer:
        merged["parallelism"].update(layer["parallelism"])
    return merged


def carried_deepspeed_plugin(config: AccelConfig) -> DeepSpeedPlugin | None:
    """Accelerate's automatic DeepSpeedPlugin: `accelerate launch --deepspeed_config_file ds.json` (or a config file's
    `deepspeed_config_file`) makes the Accelerator build one when the script passes none. Here it is
    `DeepSpeedPlugin(hf_ds_config=<the JSON's dict>)` from the JSON the resolved `config` carries, or None.

    It is only exposed (`accelerator.deepspeed_plugin`, `state.deepspeed_plugin`, DummyOptim/DummyScheduler); its
    layer is not applied: the JSON's keys are already in `config` under the launch flags that beat them. Its ignored
    keys were reported when the file was read, so the warning is not repeated."""
    if config.deepspeed_json is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        plugin = DeepSpeedPlugin(hf_ds_config=config.deepspeed_json)
    plugin.__dict__["_source"] = config.deepspeed_json_path  # named in DummyOptim/DummyScheduler errors
    return plugin


# -------------------------------------------------------------------------------------------------------------
# torch.compile
# -------------------------------------------------------------------------------------------------------------

# Accelerate's names for torch.compile backends (DynamoBackend.INDUCTOR == "inductor"), from the config's list
DynamoBackend = enum.Enum("DynamoBackend", {name.upper(): name for name in DYNAMO_BACKENDS}, type=str)  # type: ignore[misc]  # names from the list


@dataclass
class TorchDynamoPlugin:
    """Accelerate's `TorchDynamoPlugin`: the config's `dynamo_*` keys, given in code. Unset arguments leave the
    config's values (files, `accel launch` flags) as they are; `options` goes to torch.compile as is."""

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    _NAME = "TorchDynamoPlugin"

    def __post_init__(self) -> None:
        if self.options is not None and not isinstance(self.options, dict):
            raise ConfigError(f"{self._NAME}: argument 'options': expected a dict of torch.compile options, got "
                              f"{type(self.options).__name__}")

    def to_layer(self) -> dict:
        if self.disable:
            return {"dynamo_backend": "no"}
        given = {"dynamo_backend": self.backend, "dynamo_mode": self.mode, "dynamo_use_fullgraph": self.fullgraph,
                 "dynamo_use_dynamic": self.dynamic, "dynamo_use_regional_compilation": self.use_regional_compilation}
        names = {"dynamo_backend": "backend", "dynamo_mode": "mode", "dynamo_use_fullgraph": "fullgraph",
                 "dynamo_use_dynamic": "dynamic", "dynamo_use_regional_compilation": "use_regional_compilation"}
        layer = {}
        for key, value in given.items():
            if value is not None:
                value = value.value if isinstance(value, enum.Enum) else value
                layer[key] = _argument(self._NAME, names[key], value, TOP_FIELDS[key])
        return layer

    def to_dict(self) -> dict:
        """The fields as Accelerate's plugin holds them: an unset one read from $ACCELERATE_DYNAMO_* (what `accel
        launch` / `accelerate launch` export), else Accelerate's default; the backend as its lower-case name."""
        from accel.core.probes import str_to_bool

        env = os.environ.get

        def flag(name: str) -> bool | None:
            value = env("ACCELERATE_DYNAMO_" + name)
            return None if value is None else str_to_bool(value, to_bool=True)

        backend = self.backend if self.backend is not None else env("ACCELERATE_DYNAMO_BACKEND", "no")
        regional = self.use_regional_compilation
        return {"backend": str(backend.value if isinstance(backend, enum.Enum) else backend).lower(),
                "mode": self.mode if self.mode is not None else env("ACCELERATE_DYNAMO_MODE", "default"),
                "fullgraph": self.fullgraph if self.fullgraph is not None else bool(flag("USE_FULLGRAPH")),
                "dynamic": self.dynamic if self.dynamic is not None else flag("USE_DYNAMIC"),
                "options": self.options, "disable": self.disable,
                "use_regional_compilation":
                    regional if regional is not None else bool(flag("USE_REGIONAL_COMPILATION"))}

    def to_kwargs(self) -> dict:
        """Accelerate's: the `to_dict()` entries that differ from a plugin built in a clean environment (the
        torch.compile arguments asked for), `use_regional_compilation` left out (it is not a torch.compile one)."""
        defaults = {"backend": "no", "mode": "default", "fullgraph": False, "dynamic": None, "options": None,
                    "disable": False}
        return {key: value for key, value in self.to_dict().items() if key in defaults and value != defaults[key]}


def dynamo_layer(dynamo_backend: Any = None, dynamo_plugin: TorchDynamoPlugin | None = None) -> dict:
    """`Accelerator(dynamo_backend=...)` or `Accelerator(dynamo_plugin=...)` as a config layer (not both, as in
    Accelerate)."""
    if dynamo_backend is not None and dynamo_plugin is not None:
        raise ConfigError("Accelerator: dynamo_backend and dynamo_plugin are both given; allowed: one of them")
    if dynamo_plugin is not None:
        if not isinstance(dynamo_plugin, TorchDynamoPlugin):
            raise ConfigError(f"Accelerator: argument 'dynamo_plugin': expected accel.utils.TorchDynamoPlugin, got "
                              f"{type(dynamo_plugin).__name__}")
        return dynamo_plugin.to_layer()
    if dynamo_backend is None:
        return {}
    return TorchDynamoPlugin(backend=dynamo_backend).to_layer()
