"""Precedence: which layer wins, where the files are, and how `accel launch` hands the result to workers.

Lowest first: built-in defaults < the packaged `default_config.yaml` < the user's config file
(`--config_file`, else `$ACCEL_CONFIG_FILE`, else `~/.cache/accel/default_config.yaml`) < `accel launch`
flags < `Accelerator(...)` arguments. `accel launch` resolves the first four layers once and hands the
result to every worker through one variable, `ACCEL_LAUNCH_CONFIG` (JSON); workers read it once. A DeepSpeed
JSON named by a config file (`deepspeed_config_file`) or by `accel launch --deepspeed_config_file` counts as
a layer just above that config file; the JSON itself is carried too (a later layer's replaces an earlier one's),
so the workers' Accelerator exposes it as Accelerate's DeepSpeedPlugin. Every layer is validated on its own, so an
error names its source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from accel.config.accelerate_import import (
    ACCELERATE_IGNORED_KEYS,
    ACCELERATE_SECTIONS,
    DEEPSPEED_FILE_KEY,
    KNOWN_TOP_KEYS,
    check_fp8_section,
    deepspeed_path,
    from_deepspeed_section,
    from_dynamo_section,
    from_fsdp_section,
    from_parallelism_config_section,
    read_deepspeed_config,
)
from accel.config.errors import shown
from accel.config.schema import (
    CARRIED_KEYS,
    DISTRIBUTED_TYPES,
    FAULT_TOLERANCE_FIELDS,
    PARALLEL_FIELDS,
    TOP_FIELDS,
    AccelConfig,
    ConfigError,
    ParallelismConfig,
    UnknownKeys,
    check_carried_deepspeed_json,
    check_consistency,
    check_value,
    unknown_key,
)

LAUNCH_ENV = "ACCEL_LAUNCH_CONFIG"
USER_CONFIG_ENV = "ACCEL_CONFIG_FILE"
PACKAGED_DEFAULT = Path(__file__).parent.parent / "default_config.yaml"  # accel/default_config.yaml (package data)


def default_user_config_path() -> Path:
    """Where `accel config` saves and where accel looks when no file is named."""
    return Path(os.path.expanduser("~")) / ".cache" / "accel" / "default_config.yaml"


# ---------------------------------------------------------------------------------------------------------
# layers and precedence
# ---------------------------------------------------------------------------------------------------------

def parse_layer(raw: Any, source: str, base_dir: str | os.PathLike | None = None) -> dict:
    """Validate one layer (a file's contents, the launch flags, ...) into a canonical partial nested dict.

    Only the keys present are returned, so layers can be merged by precedence. Accelerate's keys and
    sections are translated here. A `deepspeed_config_file` (top level or in `deepspeed_config:`) is read
    as if it were a layer just above this one (its values win, except "auto"): a relative path is taken
    against `base_dir` (the config file's folder), else the current directory.
    """
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys to values at the top level, got {type(raw).__name__}")
    base = Path(base_dir) if base_dir is not None else None
    out: dict = {}
    par: dict = {}
    accelerate_type = None
    ds_files: list[tuple[Path, str]] = []  # (path, the key that names it)
    unknown = UnknownKeys(source)  # every unknown key named at once
    for key, value in raw.items():
        with unknown.check():
            if key == DEEPSPEED_FILE_KEY:
                path = deepspeed_path(value, key, source, base)
                if path is not None:
                    ds_files.append((path, key))
                continue
            if key in TOP_FIELDS:
                if key == "distributed_type" and isinstance(value, str) and value.upper() in ("DEEPSPEED", "FSDP"):
                    accelerate_type = value.upper()
                    continue
                if key == "distributed_type" and isinstance(value, str) and value.upper() not in DISTRIBUTED_TYPES:
                    raise ConfigError(f"{source}: key 'distributed_type': bad value {shown(value)}; allowed: "
                                      f"{', '.join(DISTRIBUTED_TYPES)} (Accelerate's DEEPSPEED and FSDP also load)")
                out[key] = check_value(value, TOP_FIELDS[key], key, source)
            elif key in _CHECKED_SECTIONS:
                if value is None:
                    continue
                checked = _checked_section(key, value, source)
                if key == "parallelism":
                    par.update(checked)
                elif checked:
                    out.setdefault(key, {}).update(checked)
            elif key in ACCELERATE_SECTIONS:
                if not value:
                    continue
                if not isinstance(value, dict):
                    raise ConfigError(f"{source}: key '{key}': expected a mapping, got {shown(value)}")
                if key == "deepspeed_config":
                    if str(raw.get("distributed_type") or "DEEPSPEED").upper() != "DEEPSPEED":
                        continue  # Accelerate keeps inactive sections around; only the active one counts
                    path = deepspeed_path(value.get(DEEPSPEED_FILE_KEY), f"{key}.{DEEPSPEED_FILE_KEY}", source, base)
                    if path is not None:
                        ds_files.append((path, f"{key}.{DEEPSPEED_FILE_KEY}"))
                    ds_par, ds_top = from_deepspeed_section(value, source)
                    par.update(ds_par)
                    out.update({k: v for k, v in ds_top.items() if k not in raw})
                elif key == "fsdp_config":
                    if str(raw.get("distributed_type", "FSDP")).upper() != "FSDP":
                        continue
                    par.update(from_fsdp_section(value, source))
                elif key == "fp8_config":
                    check_fp8_section(value, source)
                elif key == "dynamo_config":  # the top-level keys of the same names win
                    out.update({k: v for k, v in from_dynamo_section(value, source).items() if k not in raw})
                else:
                    par.update(from_parallelism_config_section(value, source))
            elif key in ACCELERATE_IGNORED_KEYS:
                continue
            else:
                raise unknown_key(key, KNOWN_TOP_KEYS, source)
    unknown.raise_found()
    if accelerate_type is not None and "zero_stage" not in par and not ds_files:
        par["zero_stage"] = 3 if accelerate_type == "FSDP" else 2  # Accelerate's default stage for DeepSpeed
    if par:
        out["parallelism"] = par
    if len(ds_files) > 1:
        raise ConfigError(f"{source}: keys '{ds_files[0][1]}' and '{ds_files[1][1]}' both name a DeepSpeed config "
                          "file; allowed: one of them")
    if ds_files:  # the JSON is a layer just above the file that names it: its values (not "auto") win
        path, key = ds_files[0]
        out = merge_layers([out, read_deepspeed_config(path, f"{source}: key '{key}'", carry=True)])
    return out


_CHECKED_SECTIONS = {"parallelism": PARALLEL_FIELDS, "fault_tolerance": FAULT_TOLERANCE_FIELDS}


def _checked_section(name: str, value: Any, source: str) -> dict:
    """A section of typed fields (`parallelism`, `fault_tolerance`), each key known and each value checked."""
    fields = _CHECKED_SECTIONS[name]
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: key '{name}': expected a mapping, got {shown(value)}")
    checked = {}
    unknown = UnknownKeys(source)
    for field, field_value in value.items():
        with unknown.check():
            if field not in fields:
                raise unknown_key(field, tuple(fields), source, f"{name}.")
            checked[field] = check_value(field_value, fields[field], f"{name}.{field}", source)
    unknown.raise_found()
    return checked


def merge_layers(layers: list[dict]) -> dict:
    """Later layers win, key by key (the parallelism and fault_tolerance sections merge field by field)."""
    merged: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if key in _CHECKED_SECTIONS:
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    return merged


def build_config(layers: list[dict], source: str = "config") -> AccelConfig:
    """Merge validated layers over the built-in defaults and check the cross-field rules."""
    merged = merge_layers(layers)
    try:
        parallelism = ParallelismConfig(**merged.get("parallelism", {}))
    except ConfigError as exc:  # a rule over several parallelism keys ("parallelism: ..."): name the source too
        raise ConfigError(f"{source}: {exc}") from None
    cfg = AccelConfig(**{k: v for k, v in merged.items() if k != "parallelism"}, parallelism=parallelism)
    check_consistency(cfg, source)
    return cfg



def config_from_dict(data: dict, source: str = "config") -> AccelConfig:
    """Validate `data` as one layer (Accelerate's keys included) over the built-in defaults; a `AccelConfig.to_dict()`
    result's carried DeepSpeed JSON (`deepspeed_json`, `deepspeed_json_path`) is taken as it is."""
    data = dict(data)
    carried = {key: data.pop(key) for key in CARRIED_KEYS if key in data}
    check_carried_deepspeed_json(carried.get("deepspeed_json"), carried.get("deepspeed_json_path"), source)
    return build_config([{**parse_layer(data, source), **carried}], source)


def read_config_file(path: str | os.PathLike) -> dict:
    """Read and validate one YAML (or JSON) config file into a layer."""
    from accel.config.yaml_file import load_yaml_file  # yaml is imported only where files are read

    path = Path(path).expanduser()
    layer = parse_layer(load_yaml_file(path), str(path), base_dir=path.parent)
    if path.resolve() == PACKAGED_DEFAULT.resolve():
        # Its `zero_stage: 0` shows the default; as a layer it would be a request, contradicting a user's
        # dp_shard_size (which, with zero_stage left out, means 3). Left out, zero_stage is derived.
        layer.get("parallelism", {}).pop("zero_stage", None)
    return layer


def config_save_path(config_file: str | os.PathLike | None = None) -> Path:
    """Where the user's config lives: `config_file`, else `$ACCEL_CONFIG_FILE`, else the default path."""
    if config_file:
        return Path(config_file).expanduser()
    env_file = os.environ.get(USER_CONFIG_ENV)
    if env_file:
        return Path(env_file).expanduser()
    return default_user_config_path()


def user_config_path(config_file: str | os.PathLike | None = None) -> Path | None:
    """The user's config file to read, or None when there is none (explicitly named files must exist)."""
    path = config_save_path(config_file)
    if config_file or os.environ.get(USER_CONFIG_ENV):
        return path
    return path if os.path.isfile(path) else None


def file_layers(config_file: str | os.PathLike | None = None) -> list[dict]:
    """The packaged default and the user's config file, as validated layers (lowest precedence first)."""
    layers = [read_config_file(PACKAGED_DEFAULT)]
    user = user_config_path(config_file)
    if user is not None:
        layers.append(read_config_file(user))
    return layers


def resolve_config(config_file: str | os.PathLike | None = None, overrides: dict | None = None,
                   overrides_source: str = "accel launch flags", *, layers: list[dict] | None = None) -> AccelConfig:
    """Resolve defaults < packaged default < user file < `overrides` (the raw launch flags).

    A `deepspeed_config_file` among the overrides (`accel launch --deepspeed_config_file`) is read as its own
    layer between the files and the other overrides: it beats the config file, the other flags beat it. A
    relative path is taken against the current directory. `layers` are the file layers when already read.
    """
    layers = list(file_layers(config_file) if layers is None else layers)
    source = str(user_config_path(config_file) or PACKAGED_DEFAULT)
    overrides = dict(overrides or {})
    ds_file = overrides.pop(DEEPSPEED_FILE_KEY, None)
    ds_path = deepspeed_path(ds_file, DEEPSPEED_FILE_KEY, overrides_source, None)
    if ds_path is not None:
        layers.append(read_deepspeed_config(ds_path, f"{overrides_source}: key '{DEEPSPEED_FILE_KEY}'", carry=True))
        source = f"{source} + {ds_path}"
    if overrides:
        layers.append(parse_layer(overrides, overrides_source))
        source = f"{source} + {overrides_source}"
    return build_config(layers, source)


def resolve_launch_config(config_file: str | os.PathLike | None, overrides: dict,
                          overrides_source: str = "accel launch flags") -> AccelConfig:
    """What `accel launch` resolves: the files, then its flag layer (`overrides`, raw). A file's
    `distributed_type: NO` (which Accelerate writes for single-process configs) yields to a `num_processes`
    above 1 among the overrides instead of contradicting it: it is derived again."""
    layers = file_layers(config_file)
    more_processes = "distributed_type" not in overrides and (overrides.get("num_processes") or 0) > 1
    if more_processes and merge_layers(layers).get("distributed_type") == "NO":
        overrides = {**overrides, "distributed_type": None}
    return resolve_config(config_file, overrides, overrides_source, layers=layers)


def launched_config() -> AccelConfig | None:
    """The config `accel launch` resolved for this worker, or None when not started by `accel launch`."""
    text = os.environ.get(LAUNCH_ENV)
    if not text:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"${LAUNCH_ENV}: not valid JSON ({exc.msg}); it is written by accel launch") from None
    return config_from_dict(data, f"${LAUNCH_ENV}")


def encode_for_workers(cfg: AccelConfig) -> str:
    """The single value `accel launch` puts in `ACCEL_LAUNCH_CONFIG`."""
    return json.dumps(cfg.to_dict(), separators=(",", ":"))


def worker_layers() -> tuple[list[dict], str]:
    """The layers an `Accelerator` starts from (the launched config if any, else the files) and their source."""
    launched = launched_config()
    if launched is None:
        return file_layers(), str(user_config_path() or PACKAGED_DEFAULT)
    data = launched.to_dict()
    carried = {key: data.pop(key) for key in CARRIED_KEYS if key in data}  # the DeepSpeed JSON, as read at launch
    return [{**parse_layer(data, f"${LAUNCH_ENV}"), **carried}], f"${LAUNCH_ENV}"


def worker_config(overrides: dict | None = None, base: tuple[list[dict], str] | None = None) -> AccelConfig:
    """What an `Accelerator` runs with: `base` (worker_layers(), read once by the caller) or the launched config or
    files; then its own arguments."""
    layers, source = base if base is not None else worker_layers()
    layers = list(layers)
    if overrides:
        layers.append(parse_layer(overrides, "Accelerator(...) arguments"))
        source = f"{source} + Accelerator(...) arguments"
    return build_config(layers, source)
