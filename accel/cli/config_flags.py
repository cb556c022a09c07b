"""The config's command-line flags, generated from the schema's field specs (accel/config/schema.py and
accel/config/parallelism.py), so a key is declared once: its flag's name, type, metavar, help and default come from
its spec, and the value is checked by the config's own rules with the other keys (case-insensitive choices, bounds).

Every config key has a flag named after it (`--tp_size` for `parallelism.tp_size`; the `fault_tolerance` section's
are `--fault_tolerance` and `--ft_<key>`), except the keys in `NO_FLAG`, each with the reason. A flag is given or
not: all default to None, so only the flags given form the flags' layer (the spec's default is named in the help).
`accel launch` places the flags in its help groups (launch.py); `accel env` and `accel config default` take the
same definitions.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from collections.abc import Callable, Mapping
from typing import Any

from accel.cli._common import add_flag
from accel.config.errors import shown
from accel.config.schema import SECTIONS, TOP_FIELDS, AccelConfig, allowed_values

# config keys with no flag of their own, and why (a flag of Accelerate's named here sets the key through its
# `accelerate launch` meaning: accelerate_flags.py)
NO_FLAG: dict[str, str] = {
    "compute_environment": "Accelerate's key, with one value (LOCAL_MACHINE)",
    "distributed_type": "derived from the processes and devices; --cpu and --multi_gpu choose it",
    "use_cpu": "--cpu sets it (a config file's distributed_type is then derived again)",
    "same_network": "Accelerate's --same_network switch sets it",
    "parallelism.offload_optimizer": "Accelerate's --offload_optimizer_device cpu sets it",
    "parallelism.offload_params": "Accelerate's --offload_param_device cpu (or --fsdp_offload_params) sets it",
    "parallelism.pp_stages_per_rank": "a config file key: its default follows --pp_schedule",
    "parallelism.pp_split_points": "module names of the model: a config file key (or ParallelismConfig argument)",
    "parallelism.tp_plan": "a mapping of module names to styles: a config file key (or ParallelismConfig argument)",
    "parallelism.zero_wrap_classes": "Accelerate's --fsdp_transformer_layer_cls_to_wrap sets it",
    "parallelism.zero_min_params": "Accelerate's --fsdp_min_num_params sets it",
    "parallelism.micro_batch_size": "DeepSpeed's train_micro_batch_size_per_gpu: from --deepspeed_config_file",
    "parallelism.train_batch_size": "DeepSpeed's train_batch_size: from --deepspeed_config_file",
    "parallelism.gradient_clipping": "Accelerate's --gradient_clipping sets it",
    "parallelism.dp_replicate_size": "Accelerate's --parallelism_config_dp_replicate_size sets it",
    "parallelism.dp_shard_size": "Accelerate's --parallelism_config_dp_shard_size sets it",
    "parallelism.cp_backend": "Accelerate's --parallelism_config_cp_backend sets it",
    "parallelism.sp_backend": "Accelerate's --parallelism_config_sp_backend sets it",
}
_LISTED_CHOICES = 4  # a metavar lists at most this many choices, then "..."


def config_keys() -> list[str]:
    """Every config key, dotted for a section's field, in the schema's order (top level first)."""
    return [*TOP_FIELDS, *(f"{section}.{name}" for section, fields in SECTIONS.items() for name in fields)]


def field_spec(key: str) -> Mapping:
    """The spec of a config key (dotted for a section's field)."""
    section, _, name = key.rpartition(".")
    return (SECTIONS[section] if section else TOP_FIELDS)[name]


def flag_name(key: str) -> str:
    """The flag of a config key: its name; in the fault_tolerance section `fault_tolerance` (for `enabled`) and
    `ft_<name>`, so the section's short names (`timeout`, `enabled`) do not read as the job's."""
    section, _, name = key.rpartition(".")
    if section == "fault_tolerance":
        return "fault_tolerance" if name == "enabled" else f"ft_{name}"
    return name


# flag -> the config key it sets, for every key with a flag
FLAG_KEYS: dict[str, str] = {flag_name(key): key for key in config_keys() if key not in NO_FLAG}
KEY_FLAGS: dict[str, str] = {key: flag for flag, key in FLAG_KEYS.items()}


def add(group: argparse._ActionsContainer, *keys: str) -> None:
    """Add the flags of `keys` (config keys, dotted for a section's field) to `group`, generated from their specs."""
    for key in keys:
        if key in NO_FLAG:
            raise ValueError(f"config key {key!r} has no flag: {NO_FLAG[key]}")
        meta = field_spec(key)
        if meta["kind"] is bool:
            add_flag(group, KEY_FLAGS[key], action="store_true", default=None, help=flag_help(key))
        else:
            add_flag(group, KEY_FLAGS[key], type=flag_type(meta), metavar=metavar(key), default=None,
                     help=flag_help(key))


def section_keys(section: str) -> list[str]:
    """The keys of one section of the config (e.g. `fault_tolerance`) that have a flag, in the schema's order."""
    return [key for key in config_keys() if key.startswith(f"{section}.") and key not in NO_FLAG]


def degree_keys() -> list[str]:
    """The parallel degrees that have a flag (`parallelism.<x>_size`), in the schema's order: a new degree's
    flag joins `accel launch`'s training group without a line in launch.py."""
    return [key for key in section_keys("parallelism") if key.endswith("_size")]


def default_of(key: str) -> Any:
    """The spec's default of a config key."""
    section, _, name = key.rpartition(".")
    cls: Any = AccelConfig
    if section:
        cls = next(f.default_factory for f in fields(AccelConfig) if f.name == section)
    default = next(f.default for f in fields(cls) if f.name == name)
    return None if default is MISSING else default


def flag_help(key: str) -> str:
    """The spec's help, with its default (a switch's default is off: not named). `%` is escaped for argparse."""
    meta, default = field_spec(key), default_of(key)
    text = meta["help"]
    if meta["kind"] is not bool and default is not None:
        text += f" (default {default:g})" if isinstance(default, float) else f" (default {default})"
    return text.replace("%", "%%")


def metavar(key: str) -> str:
    """What the help shows for the value: the choices (the first few), a small integer range, the unit, or a word."""
    meta = field_spec(key)
    choices = meta["choices"]
    small = (meta["kind"] is int and meta["lo"] is not None and not meta.get("hi_implicit")
             and meta["hi"] - meta["lo"] < 5)  # a few stages, say
    if not choices and small:
        choices = tuple(str(n) for n in range(int(meta["lo"]), int(meta["hi"]) + 1))
    if choices:
        shown_choices = list(choices[:_LISTED_CHOICES]) + (["..."] if len(choices) > _LISTED_CHOICES else [])
        return "{" + ",".join(shown_choices) + "}"
    if meta["unit"]:
        return meta["unit"].upper()
    if meta["kind"] is int:
        return "N"
    if meta["kind"] is float:
        return "X"
    return key.rpartition(".")[2].rsplit("_", 1)[-1].upper()


def flag_type(meta: Mapping) -> Callable[[str], Any] | None:
    """How a flag's text becomes a value: int, a number of seconds (whole ones stay int, so an error shows the value
    as typed), float, or the text itself. Bounds and choices are the config's rules, checked with the other keys."""
    if meta["kind"] is int:
        return int
    if meta["kind"] is float and meta["unit"]:
        return _number_of(meta)
    if meta["kind"] is float:
        return float
    return None


def _number_of(meta: Mapping) -> Callable[[str], float | int]:
    def parse(text: str) -> float | int:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad value {shown(text)}; allowed: {allowed_values(meta)}") from None
        return int(value) if value.is_integer() and abs(value) <= 2**53 else value

    parse.__name__ = meta["unit"]  # argparse names the type in its own errors
    return parse
