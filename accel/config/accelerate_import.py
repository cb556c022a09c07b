"""Reading Accelerate's config files and DeepSpeed JSONs into accel's config layers.

Accelerate's sections (`deepspeed_config:`, `fsdp_config:`, `parallelism_config:`) and DeepSpeed's JSON keys
are translated onto accel's own fields here, so the precedence code (`resolve.py`) only sees accel's keys.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel.config.errors import MAX_NESTING, nesting_depth, shown
from accel.config.schema import (
    ACCELERATE_CP_COMM_STRATEGIES,
    PARALLEL_FIELDS,
    TOP_FIELDS,
    ConfigError,
    UnknownKeys,
    check_value,
    unknown_key,
)
from accel.config.text_file import read_text

# ---------------------------------------------------------------------------------------------------------
# Accelerate's config sections
# ---------------------------------------------------------------------------------------------------------

# Keys of Accelerate's config files that carry nothing accel acts on; accepted so their files load.
ACCELERATE_IGNORED_KEYS = frozenset({
    "debug", "downcast_bf16", "enable_cpu_affinity", "main_training_function", "tpu_env", "tpu_use_cluster",
    "tpu_use_sudo", "tpu_name", "tpu_zone", "tpu_vm", "commands", "command_file",
    "ipex_config", "mpirun_config", "megatron_lm_config", "use_mps_device",
    "num_cpu_threads_per_process", "ipex", "mpirun_hostfile",
})
ACCELERATE_SECTIONS = ("deepspeed_config", "fsdp_config", "parallelism_config", "dynamo_config", "fp8_config")
DEEPSPEED_FILE_KEY = "deepspeed_config_file"  # a DeepSpeed JSON to read (top level, or in `deepspeed_config:`)
KNOWN_TOP_KEYS = (tuple(TOP_FIELDS) + ("parallelism", "fault_tolerance", DEEPSPEED_FILE_KEY) + ACCELERATE_SECTIONS
                  + tuple(sorted(ACCELERATE_IGNORED_KEYS)))

_FSDP_STRATEGY_TO_STAGE = {
    "FULL_SHARD": 3, "1": 3, "SHARD_GRAD_OP": 2, "2": 2, "NO_SHARD": 0, "3": 0,
    "HYBRID_SHARD": 3, "4": 3, "HYBRID_SHARD_ZERO2": 2, "5": 2,
}


def from_deepspeed_section(section: dict, source: str) -> tuple[dict, dict]:
    """Accelerate's `deepspeed_config:` YAML section -> (parallelism fields, top-level fields).

    Its `deepspeed_config_file` (a DeepSpeed JSON) is read by `parse_layer`, not here."""
    where = "deepspeed_config."
    par: dict = {}
    top: dict = {}
    if "zero_stage" in section:
        par["zero_stage"] = check_value(section["zero_stage"], PARALLEL_FIELDS["zero_stage"], where + "zero_stage",
                                         source)
    for src_key, dst_key in (("offload_optimizer_device", "offload_optimizer"),
                             ("offload_param_device", "offload_params")):
        if src_key in section:
            device = str(section[src_key]).lower()
            if device not in ("none", "cpu", "nvme"):
                raise ConfigError(f"{source}: key '{where}{src_key}': bad value {shown(section[src_key])}; "
                                  "allowed: none, cpu, nvme")
            if device == "nvme":
                raise ConfigError(f"{source}: key '{where}{src_key}': 'nvme' offload is not supported by accel; "
                                  "allowed: none, cpu")
            par[dst_key] = device == "cpu"
    gas = section.get("gradient_accumulation_steps")
    if gas is not None and gas != "auto":
        top["gradient_accumulation_steps"] = check_value(gas, TOP_FIELDS["gradient_accumulation_steps"],
                                                          where + "gradient_accumulation_steps", source)
    clip = section.get("gradient_clipping")
    if clip is not None and clip != "auto":
        par["gradient_clipping"] = check_value(clip, PARALLEL_FIELDS["gradient_clipping"],
                                                where + "gradient_clipping", source)
    return par, top


def from_fsdp_section(section: dict, source: str) -> dict:
    """Accelerate's `fsdp_config:` YAML section -> parallelism fields (FSDP sharding maps onto ZeRO stages)."""
    where = "fsdp_config."
    par: dict = {"zero_stage": 3}

    def stage_of(key: str, allowed: str) -> int:
        value = section[key]
        stage = _FSDP_STRATEGY_TO_STAGE.get(str(value).upper())
        if stage is None:
            raise ConfigError(f"{source}: key '{where}{key}': bad value {shown(value)}; allowed: {allowed}")
        return stage

    if section.get("fsdp_sharding_strategy") is not None:
        par["zero_stage"] = stage_of("fsdp_sharding_strategy",
                                     "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2")
    if "fsdp_reshard_after_forward" in section:
        reshard = section["fsdp_reshard_after_forward"]
        if isinstance(reshard, bool):
            par["zero_stage"] = 3 if reshard else 2
        else:  # FSDP1-style strategy names are also accepted here by Accelerate
            par["zero_stage"] = stage_of("fsdp_reshard_after_forward", "true, false or a sharding strategy name")
    if "fsdp_offload_params" in section:
        offload = check_value(section["fsdp_offload_params"], PARALLEL_FIELDS["offload_params"],
                               where + "fsdp_offload_params", source)
        par["offload_params"] = offload
        par["offload_optimizer"] = offload  # FSDP's CPU offload keeps the optimizer state on the CPU too
    if "fsdp_activation_checkpointing" in section:
        checkpointing = check_value(section["fsdp_activation_checkpointing"], PARALLEL_FIELDS["offload_params"],
                                     where + "fsdp_activation_checkpointing", source)  # a bool, like offload
        par["activation_checkpointing"] = "full" if checkpointing else "no"
    par.update(_fsdp_wrapping(section, source))
    return par


_FSDP_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")


def _fsdp_wrapping(section: dict, source: str) -> dict:
    """FSDP's wrap units -> accel's ZeRO blocks: the class names (`fsdp_transformer_layer_cls_to_wrap`, unless the
    policy wraps by size or not at all) are `zero_wrap_classes`; `fsdp_min_num_params` under SIZE_BASED_WRAP is
    `zero_min_params`. Without names accel shards each repeated block, as TRANSFORMER_BASED_WRAP does with the
    model's `_no_split_modules`."""
    where = "fsdp_config."
    policy = section.get("fsdp_auto_wrap_policy")
    if policy is not None and str(policy).upper() not in _FSDP_WRAP_POLICIES:
        raise ConfigError(f"{source}: key '{where}fsdp_auto_wrap_policy': bad value {shown(policy)}; allowed: "
                          f"{', '.join(_FSDP_WRAP_POLICIES)}")
    policy = str(policy or "TRANSFORMER_BASED_WRAP").upper()
    out: dict = {}
    classes = section.get("fsdp_transformer_layer_cls_to_wrap")
    if isinstance(classes, (list, tuple)):
        classes = ",".join(map(str, classes))
    if classes and policy == "TRANSFORMER_BASED_WRAP":
        out["zero_wrap_classes"] = check_value(classes, PARALLEL_FIELDS["zero_wrap_classes"],
                                               where + "fsdp_transformer_layer_cls_to_wrap", source)
    min_params = section.get("fsdp_min_num_params")
    if min_params is not None and policy == "SIZE_BASED_WRAP":
        if min_params == 0 and not isinstance(min_params, bool):  # FSDP's "every module": every one with parameters
            min_params = 1
        out["zero_min_params"] = check_value(min_params, PARALLEL_FIELDS["zero_min_params"],
                                             where + "fsdp_min_num_params", source)
    return out


# Accelerate's `parallelism_config:` keys (what `accelerate config` writes, and `accelerate launch`'s
# --parallelism_config_* flags): short name -> accel's ParallelismConfig field (the same names), or None for the
# options of DeepSpeed's Ulysses that accel's needs not (it takes any sequence length, whatever the attention
# kernel), accepted and unused.
_PARALLELISM_CONFIG_KEYS = {
    "dp_replicate_size": "dp_replicate_size", "dp_shard_size": "dp_shard_size", "tp_size": "tp_size",
    "cp_size": "cp_size", "cp_backend": "cp_backend", "sp_size": "sp_size", "sp_backend": "sp_backend",
    "cp_comm_strategy": "cp_comm_strategy", "sp_seq_length": None, "sp_seq_length_is_variable": None,
    "sp_attn_implementation": None,
}
_PARALLELISM_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


def from_parallelism_config_section(section: dict, source: str) -> dict:
    """Accelerate's `parallelism_config:` section (parallelism_config_dp_replicate_size, ..._dp_shard_size,
    ..._tp_size, ..._cp_size, ...) -> the ParallelismConfig fields of the same names, which map onto accel's as
    Accelerate's do (dp_shard_size > 1: FSDP2, zero_stage 3 unless given; with dp_replicate_size > 1: HSDP).

    Every size 1 (what `accelerate config` writes by default) describes no layout (Accelerate then replicates over
    every process): the data-parallel sizes are left out, so accel's fields decide. cp_size/sp_size above 1 are
    accel's context/sequence parallelism (which combinations run: accel.backends.check_available), with
    cp_comm_strategy; DeepSpeed's Ulysses options (sp_seq_length, ...) are accepted and unused."""
    where = "parallelism_config."
    par: dict = {}
    unknown = UnknownKeys(source)
    for key, value in section.items():
        with unknown.check():
            short = key.removeprefix("parallelism_config_")
            if short not in _PARALLELISM_CONFIG_KEYS or short == key:
                raise unknown_key(key, [f"parallelism_config_{name}" for name in _PARALLELISM_CONFIG_KEYS], source,
                                  where)
            field = _PARALLELISM_CONFIG_KEYS[short]
            if field is None or value is None:  # None: Accelerate's "not given"
                continue
            meta = PARALLEL_FIELDS[field]
            if field in _PARALLELISM_SIZES:
                meta = {**meta, "optional": False}
            if field == "cp_comm_strategy":  # Accelerate's names too: allgather, alltoall (torch's ring rotation)
                meta = {**meta, "choices": tuple(dict.fromkeys((*meta["choices"], *ACCELERATE_CP_COMM_STRATEGIES)))}
            par[field] = check_value(value, meta, where + key, source)
            if field == "cp_comm_strategy":
                par[field] = ACCELERATE_CP_COMM_STRATEGIES.get(par[field], par[field])
    unknown.raise_found()
    if all(par.get(name, 1) == 1 for name in _PARALLELISM_SIZES):
        par.pop("dp_replicate_size", None)
        par.pop("dp_shard_size", None)
    return par


DYNAMO_KEYS = ("dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
               "dynamo_use_regional_compilation")


def from_dynamo_section(section: dict, source: str) -> dict:
    """Accelerate's `dynamo_config:` section (dynamo_backend: INDUCTOR, dynamo_mode, dynamo_use_fullgraph, ...):
    the same names as accel's top-level keys."""
    out = {}
    unknown = UnknownKeys(source)
    for key, value in section.items():
        with unknown.check():
            if key not in DYNAMO_KEYS:
                raise unknown_key(key, DYNAMO_KEYS, source, "dynamo_config.")
            out[key] = check_value(value, TOP_FIELDS[key], f"dynamo_config.{key}", source)
    unknown.raise_found()
    return out


# Transformer Engine's and MS-AMP's settings: Accelerate keeps them in fp8_config whichever backend is chosen
_FP8_OTHER_BACKENDS_KEYS = ("fp8_format", "amax_history_len", "amax_compute_algo", "margin", "interval",
                            "override_linear_precision", "use_autocast_during_eval", "opt_level")


def check_fp8_section(section: dict, source: str) -> None:
    """Accelerate's `fp8_config:` section: accel's fp8 is torchao's (`backend: AO`); Transformer Engine (TE) and
    MS-AMP are refused in one line, their tuning keys are accepted and not used."""
    unknown = UnknownKeys(source)
    for key, value in section.items():
        with unknown.check():
            if key == "backend":
                if str(value).upper() != "AO":
                    raise ConfigError(f"{source}: key 'fp8_config.backend': {shown(value)} is not supported by "
                                      "accel; allowed: AO (torchao's float8 training)")
            elif key not in _FP8_OTHER_BACKENDS_KEYS:
                raise unknown_key(key, ("backend",) + _FP8_OTHER_BACKENDS_KEYS, source, "fp8_config.")
    unknown.raise_found()


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed JSON files
# ---------------------------------------------------------------------------------------------------------

class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed JSON holds keys accel does not act on (they are listed, then ignored)."""


_AUTO = "auto"  # DeepSpeed's "take it from elsewhere": the other layers decide
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# DeepSpeed JSON key -> (section of the tree or None for the top level, field)
_DS_SCALARS = {
    "gradient_accumulation_steps": (None, "gradient_accumulation_steps"),
    "train_micro_batch_size_per_gpu": ("parallelism", "micro_batch_size"),
    "train_batch_size": ("parallelism", "train_batch_size"),
    "gradient_clipping": ("parallelism", "gradient_clipping"),
}
_DS_PRECISION_SECTIONS = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}  # bfloat16: DeepSpeed's old name


def _ds_meta(meta: Mapping) -> dict:
    return {**meta, "auto": True}


def _no_duplicate_keys(source: str):
    def hook(pairs: list) -> dict:
        seen: dict = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"{source}: key '{key}' appears twice in one JSON object; allowed: each key once")
            seen[key] = value
        return seen

    return hook


def read_deepspeed_json(path: str | os.PathLike, referenced_by: str | None = None) -> dict:
    """A DeepSpeed JSON file's contents (a dict), or a one-line ConfigError naming the file.

    `referenced_by` is where the path was given (e.g. "my.yaml: key 'deepspeed_config.deepspeed_config_file'"),
    named when the file is missing."""
    path = Path(path).expanduser()
    try:
        text = read_text(path, "DeepSpeed config file", "a DeepSpeed JSON file")
    except ConfigError as exc:
        if referenced_by and str(exc).endswith("not found"):
            raise ConfigError(f"{referenced_by}: {exc}") from None
        raise
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys(str(path)))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        data = None  # nested too deeply even to read: refused below
        depth = MAX_NESTING + 1
    except ValueError as exc:  # ConfigError (a duplicate key), or an integer of thousands of digits
        if isinstance(exc, ConfigError):
            raise
        problem = " ".join(str(exc).split(";")[0].split())[:160]
        raise ConfigError(f"{path}: not valid JSON: {problem}; allowed: a DeepSpeed JSON object") from None
    else:
        depth = nesting_depth(data)
    if depth > MAX_NESTING:
        raise ConfigError(f"{path}: nested more than {MAX_NESTING} levels deep; allowed: a DeepSpeed JSON object of at "
                          f"most {MAX_NESTING} levels")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of DeepSpeed keys at the top level, "
                          f"got {type(data).__name__}")
    return data


def deepspeed_json_layer(data: Any, source: str, builds_optimizer: bool = False) -> dict:
    """Map a DeepSpeed config (the JSON's dict) onto a config layer, as `parse_layer` returns one.

    Mapped: zero_optimization.stage / .offload_optimizer.device / .offload_param.device, gradient_accumulation_steps,
    fp16.enabled / bf16.enabled, train_micro_batch_size_per_gpu, train_batch_size, gradient_clipping. "auto" means
    "from the other layers" and is skipped. Every other key is ignored and named in one DeepSpeedConfigWarning.
    With `builds_optimizer` (the JSON reaches `prepare()`: DeepSpeedPlugin, or carried from a config file or
    `accel launch --deepspeed_config_file`) `optimizer` and `scheduler` are kept for `DummyOptim`/`DummyScheduler`
    (accel/compat/deepspeed.py) and not named.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object of DeepSpeed keys at the top level, "
                          f"got {type(data).__name__}")
    top: dict = {}
    par: dict = {}
    ignored: list[str] = []

    def mapping(value: Any, key: str) -> dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}': expected a JSON object, got {shown(value)}")
        return value

    precision: dict[str, bool] = {}
    for key, value in data.items():
        if key in _DS_SCALARS:
            section, name = _DS_SCALARS[key]
            if value is None or value == _AUTO:
                continue
            fields = TOP_FIELDS if section is None else PARALLEL_FIELDS
            checked = check_value(value, _ds_meta({**fields[name], "optional": False}), key, source)
            (top if section is None else par)[name] = checked
        elif key in _DS_PRECISION_SECTIONS:
            if value is None:
                continue
            for sub in mapping(value, key):
                if sub != "enabled":
                    ignored.append(f"{key}.{sub}")
            enabled = value.get("enabled")
            if enabled is None or enabled == _AUTO:
                continue
            if not isinstance(enabled, bool):
                raise ConfigError(f"{source}: key '{key}.enabled': bad value {shown(enabled)}; "
                                  "allowed: true, false or \"auto\"")
            precision[_DS_PRECISION_SECTIONS[key]] = precision.get(_DS_PRECISION_SECTIONS[key], False) or enabled
        elif key == "zero_optimization":
            if value is None:
                continue
            par.update(_from_deepspeed_zero(mapping(value, key), source, ignored))
        elif key == "activation_checkpointing" and value:  # DeepSpeed checkpoints whole layers: accel's "full"
            par["activation_checkpointing"] = "full"
            ignored.extend(f"{key}.{sub}" for sub in mapping(value, key))  # partitioning, CPU copies: not used
        elif key in ("optimizer", "scheduler") and builds_optimizer:
            if value is not None:
                mapping(value, key)  # built (and checked further) by prepare()
        else:  # optimizer/scheduler that reach no prepare(): the warning explains them
            ignored.append(key)
    if precision.get("fp16") and precision.get("bf16"):
        raise ConfigError(f"{source}: keys 'fp16.enabled' and 'bf16.enabled' are both true; allowed: at most one "
                          "of them true (fp16 or bf16 mixed precision)")
    for name in ("fp16", "bf16"):
        if precision.get(name):
            top["mixed_precision"] = name
    if ignored:
        note = ""
        if "optimizer" in ignored or "scheduler" in ignored:
            note = ("; 'optimizer'/'scheduler': accel builds them for DummyOptim/DummyScheduler only from a JSON "
                    "that reaches prepare() (DeepSpeedPlugin(hf_ds_config=...), a config file's deepspeed_config_file "
                    "or accel launch --deepspeed_config_file); here it uses the optimizer and scheduler your script "
                    "creates and passes to prepare()")
        warnings.warn(f"{source}: DeepSpeed keys accel does not use, ignored: {', '.join(ignored)}{note}",
                      DeepSpeedConfigWarning, stacklevel=2)
    if par:
        top["parallelism"] = par
    return top


def _from_deepspeed_zero(zero: dict, source: str, ignored: list[str]) -> dict:
    """`zero_optimization` -> parallelism fields; the keys accel does not use are appended to `ignored`."""
    par: dict = {}
    for key, value in zero.items():
        where = f"zero_optimization.{key}"
        if key == "stage":
            if value is not None and value != _AUTO:
                par["zero_stage"] = check_value(value, _ds_meta(PARALLEL_FIELDS["zero_stage"]), where, source)
        elif key in ("offload_optimizer", "offload_param"):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: key '{where}': expected a JSON object, got {shown(value)}")
            for sub in value:
                if sub != "device":
                    ignored.append(f"{where}.{sub}")
            device = value.get("device")
            if device is None or device == _AUTO:
                continue
            if not isinstance(device, str) or device.lower() not in OFFLOAD_DEVICES:
                raise ConfigError(f"{source}: key '{where}.device': bad value {shown(device)}; allowed: none, cpu, "
                                  "nvme")
            if device.lower() == "nvme":
                raise ConfigError(f"{source}: key '{where}.device': 'nvme' offload is not supported by accel; "
                                  "allowed: none, cpu")
            par["offload_optimizer" if key == "offload_optimizer" else "offload_params"] = device.lower() == "cpu"
        elif key == "cpu_offload":  # DeepSpeed's older spelling of offload_optimizer.device: cpu
            if value is None or value == _AUTO:
                continue
            par.setdefault("offload_optimizer",
                           check_value(value, PARALLEL_FIELDS["offload_optimizer"], where, source))
        else:
            ignored.append(where)
    return par


def read_deepspeed_config(path: str | os.PathLike, referenced_by: str | None = None, carry: bool = False) -> dict:
    """Read a DeepSpeed JSON file into a config layer (see `deepspeed_json_layer`); errors name the file.

    With `carry` (a config file's or `accel launch --deepspeed_config_file`'s JSON) the layer also holds the JSON
    itself and its path (`deepspeed_json`, `deepspeed_json_path`: AccelConfig carries them to the workers, whose
    Accelerator builds Accelerate's automatic DeepSpeedPlugin from them), so its `optimizer`/`scheduler` reach
    `prepare()` and are not named as ignored."""
    shown = os.path.normpath(Path(path).expanduser())  # "conf/../ds.json" reads "ds.json" in messages
    data = read_deepspeed_json(path, referenced_by)
    layer = deepspeed_json_layer(data, shown, builds_optimizer=carry)
    if carry:
        layer.update(deepspeed_json=data, deepspeed_json_path=shown)
    return layer


def deepspeed_path(value: Any, key: str, source: str, base_dir: Path | None) -> Path | None:
    """The JSON path a `deepspeed_config_file` key names (relative: against `base_dir`, else the current
    directory), or None for an empty value or Accelerate's "none"."""
    if value is None or value == "" or (isinstance(value, str) and value.lower() == "none"):
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{source}: key '{key}': bad value {shown(value)}; allowed: the path of a DeepSpeed JSON "
                          "file")
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return path

