"""The one typed config tree: YAML load/save, validation, Accelerate-file import, and precedence.

Precedence, lowest first: built-in defaults < the packaged `default_config.yaml` < the user's config file
(`--config_file`, else `$ACCEL_CONFIG_FILE`, else `~/.cache/accel/default_config.yaml`) < `accel launch`
flags < `Accelerator(...)` arguments. `accel launch` resolves the first four layers once and hands the
result to every worker through one variable, `ACCEL_LAUNCH_CONFIG` (JSON); workers read it once. A DeepSpeed
JSON named by a config file (`deepspeed_config_file`) or by `accel launch --deepspeed_config_file` counts as
a layer just above that config file.

Every layer is validated on its own, so an error names the file (or flag) that holds the bad value.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


LAUNCH_ENV = "ACCEL_LAUNCH_CONFIG"
USER_CONFIG_ENV = "ACCEL_CONFIG_FILE"
PACKAGED_DEFAULT = Path(__file__).with_name("default_config.yaml")


def default_user_config_path() -> Path:
    """Where `accel config` saves and where accel looks when no file is named."""
    return Path(os.path.expanduser("~")) / ".cache" / "accel" / "default_config.yaml"


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the source, the key, the value and what is allowed."""


def _spec(default: Any, kind: type, *, choices: tuple = (), lo: float | None = None, hi: float | None = None,
          optional: bool = False, help: str = "") -> Any:
    meta = {"kind": kind, "choices": choices, "lo": lo, "hi": hi, "optional": optional, "help": help}
    return field(default=default, metadata=meta)


# torch.distributed.pipelining's schedules: one stage per process, then several (looped) per process. The V-shaped
# ones (ZBVZeroBubble, DualPipeV) are left out: they cannot run forward only (evaluation) on torch 2.13.
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")
RDZV_BACKENDS = ("static", "c10d")
ACTIVATION_CHECKPOINTING = ("no", "full", "selective")


@dataclass
class ParallelismConfig:
    """Parallel degrees and sharding options (the `parallelism:` section of the config file)."""

    zero_stage: int = _spec(0, int, lo=0, hi=3, help="ZeRO stage: 0 (plain DDP), 1, 2 or 3")
    offload_optimizer: bool = _spec(False, bool, help="keep optimizer state on the CPU (ZeRO)")
    offload_params: bool = _spec(False, bool, help="keep parameters on the CPU between uses (ZeRO)")
    tp_size: int = _spec(1, int, lo=1, help="tensor-parallel degree")
    pp_size: int = _spec(1, int, lo=1, help="pipeline-parallel degree")
    pp_schedule: str = _spec("1F1B", str, choices=PP_SCHEDULES, help="pipeline schedule")
    pp_microbatches: int | None = _spec(None, int, lo=1, optional=True, help="micro-batches per step (default: pp_size)")
    pp_stages_per_rank: int | None = _spec(
        None, int, lo=1, optional=True,
        help="model stages each process holds (default: 1; 2 for the interleaved, looped and V schedules)")
    pp_split_points: list | None = _spec(
        None, list, optional=True,
        help="names of the modules where a new stage begins, e.g. [layers.4] (default: balanced by parameter count)")
    tp_plan: dict | None = _spec(
        None, dict, optional=True,
        help="tensor-parallel plan: module name (wildcards allowed) -> colwise | rowwise | sequence_parallel | replicate")
    activation_checkpointing: str = _spec(
        "no", str, choices=ACTIVATION_CHECKPOINTING,
        help="recompute each repeated block's activations in backward: no, full (keep only the block's input) or "
             "selective (keep matmul and attention outputs, recompute the cheap rest)")
    zero_wrap_classes: str | None = _spec(
        None, str, optional=True,
        help="comma-separated module class names that ZeRO 2/3 shard one by one (default: nn.ModuleList members)")
    zero_min_params: int | None = _spec(
        None, int, lo=1, optional=True,
        help="without repeated blocks, ZeRO 2/3 shards submodules with at least this many parameters (default 1e8)")
    # Batch sizes and clipping as a DeepSpeed JSON states them (train_micro_batch_size_per_gpu, train_batch_size,
    # gradient_clipping), so the Accelerator and the ZeRO backend can read them.
    micro_batch_size: int | None = _spec(
        None, int, lo=1, optional=True,
        help="per-process batch size (DeepSpeed's train_micro_batch_size_per_gpu); informational: for the backend "
             "to check against the data loader's batch size")
    train_batch_size: int | None = _spec(
        None, int, lo=1, optional=True,
        help="samples per optimizer step over all processes = micro_batch_size x gradient_accumulation_steps x "
             "data-parallel size (DeepSpeed's train_batch_size); informational: checked by the backend")
    gradient_clipping: float | None = _spec(
        None, float, lo=0, optional=True,
        help="the total norm DeepSpeed clips gradients to at every optimizer step, automatically (DeepSpeed's "
             "gradient_clipping), carried for the Accelerator to apply; null or 0: no automatic clipping")

    def __post_init__(self) -> None:
        _validate_fields(self, "ParallelismConfig")

    def requested_features(self) -> list[str]:
        """Human names of the parallel features this config asks for beyond plain data parallelism."""
        wanted = []
        if self.zero_stage:
            wanted.append(f"ZeRO (zero_stage={self.zero_stage})")
        elif self.offload_optimizer or self.offload_params:
            wanted.append("CPU offload (offload_optimizer/offload_params)")
        if self.tp_size > 1:
            wanted.append(f"tensor parallelism (tp_size={self.tp_size})")
        if self.pp_size > 1:
            wanted.append(f"pipeline parallelism (pp_size={self.pp_size})")
        return wanted


@dataclass
class AccelConfig:
    """The whole resolved config. Key names follow Accelerate's config file."""

    compute_environment: str = _spec("LOCAL_MACHINE", str, choices=("LOCAL_MACHINE",))
    distributed_type: str | None = _spec(None, str, choices=DISTRIBUTED_TYPES, optional=True,
                                         help="derived from num_processes and use_cpu when omitted")
    num_processes: int = _spec(1, int, lo=1, help="total processes over all machines")
    num_machines: int = _spec(1, int, lo=1)
    machine_rank: int = _spec(0, int, lo=0)
    main_process_ip: str | None = _spec(None, str, optional=True)
    main_process_port: int | None = _spec(None, int, lo=1, hi=65535, optional=True)
    use_cpu: bool = _spec(False, bool)
    gpu_ids: str = _spec("all", str, help='"all" or a comma-separated list like "0,1"')
    mixed_precision: str = _spec("no", str, choices=MIXED_PRECISIONS)
    gradient_accumulation_steps: int = _spec(1, int, lo=1)
    rdzv_backend: str = _spec("static", str, choices=RDZV_BACKENDS)
    same_network: bool = _spec(True, bool)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)

    def __post_init__(self) -> None:
        if isinstance(self.parallelism, dict):
            self.parallelism = ParallelismConfig(**self.parallelism)
        _validate_fields(self, "AccelConfig")

    # -- conversions -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "AccelConfig":
        layer = parse_layer(data, source)
        return build_config([layer], source)

    def to_yaml(self) -> str:
        import yaml  # imported here: workers get their config as JSON and never pay for yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write as YAML atomically (temp file + rename) and return the path."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".yaml", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.to_yaml())
        os.replace(tmp, path)
        return path

    # -- derived values --------------------------------------------------------------------------------
    def resolved_distributed_type(self, cuda_available: bool | None = None) -> str:
        """`distributed_type` as given, else derived: NO for one process, MULTI_GPU with CUDA, MULTI_CPU."""
        if self.distributed_type is not None:
            return self.distributed_type
        if self.num_processes <= 1:
            return "NO"
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        return "MULTI_GPU" if cuda_available and not self.use_cpu else "MULTI_CPU"

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines


# ---------------------------------------------------------------------------------------------------------
# field validation
# ---------------------------------------------------------------------------------------------------------

def _allowed(meta: dict) -> str:
    kind, choices, lo, hi = meta["kind"], meta["choices"], meta["lo"], meta["hi"]
    if choices:
        text = "one of " + ", ".join(choices)
    elif kind is bool:
        text = "true or false"
    elif kind is dict:
        text = "a mapping of module names to style names"
    elif kind is list:
        text = "a list of module names"
    elif kind in (int, float):
        noun = "an integer" if kind is int else "a number"
        if lo is not None and hi is not None:
            text = f"{noun} from {lo} to {hi}"
        elif lo is not None:
            text = f"{noun} >= {lo}"
        else:
            text = noun
    else:
        text = "a string"
    if meta.get("auto"):
        text += ' or "auto"'
    return text + (" (or null)" if meta["optional"] else "")


def _check_value(value: Any, meta: dict, key: str, source: str) -> Any:
    """Return `value` in canonical form, or raise ConfigError naming source/key/value/allowed."""

    def fail() -> None:
        raise ConfigError(f"{source}: key '{key}': bad value {value!r}; allowed: {_allowed(meta)}")

    kind = meta["kind"]
    if value is None:
        if meta["optional"]:
            return None
        fail()
    if kind is bool:
        if not isinstance(value, bool):
            fail()
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail()
        if (meta["lo"] is not None and value < meta["lo"]) or (meta["hi"] is not None and value > meta["hi"]):
            fail()
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail()
        if (meta["lo"] is not None and value < meta["lo"]) or (meta["hi"] is not None and value > meta["hi"]):
            fail()
        return float(value)
    if kind is list:  # of names; a comma-separated string is accepted too (launch flags)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            fail()
        return list(value)
    if kind is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            fail()
        return dict(value)
    # strings
    if key.endswith("gpu_ids") and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        fail()
    if meta["choices"]:
        for choice in meta["choices"]:
            if value.lower() == choice.lower():
                return choice
        fail()
    return value


def _validate_fields(obj: Any, source: str) -> None:
    for f in dataclasses.fields(obj):
        if "kind" in f.metadata:
            setattr(obj, f.name, _check_value(getattr(obj, f.name), f.metadata, f.name, source))


def _field_specs(cls: type) -> dict[str, dict]:
    return {f.name: f.metadata for f in dataclasses.fields(cls) if "kind" in f.metadata}


TOP_FIELDS = _field_specs(AccelConfig)
PARALLEL_FIELDS = _field_specs(ParallelismConfig)

# Keys of Accelerate's config files that carry nothing accel acts on; accepted so their files load.
ACCELERATE_IGNORED_KEYS = frozenset({
    "debug", "downcast_bf16", "enable_cpu_affinity", "main_training_function", "tpu_env", "tpu_use_cluster",
    "tpu_use_sudo", "tpu_name", "tpu_zone", "tpu_vm", "commands", "command_file", "dynamo_config",
    "ipex_config", "mpirun_config", "megatron_lm_config", "fp8_config", "use_mps_device", "dynamo_backend",
    "num_cpu_threads_per_process", "ipex", "mpirun_hostfile",
})
ACCELERATE_SECTIONS = ("deepspeed_config", "fsdp_config", "parallelism_config")
DEEPSPEED_FILE_KEY = "deepspeed_config_file"  # a DeepSpeed JSON to read (top level, or in `deepspeed_config:`)
KNOWN_TOP_KEYS = (tuple(TOP_FIELDS) + ("parallelism", DEEPSPEED_FILE_KEY) + ACCELERATE_SECTIONS
                  + tuple(sorted(ACCELERATE_IGNORED_KEYS)))


def _unknown_key(key: str, known: tuple[str, ...] | list[str], source: str, where: str = "") -> ConfigError:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"{source}: unknown key '{where}{key}'{hint}")


# ---------------------------------------------------------------------------------------------------------
# Accelerate's config sections
# ---------------------------------------------------------------------------------------------------------

_FSDP_STRATEGY_TO_STAGE = {
    "FULL_SHARD": 3, "1": 3, "SHARD_GRAD_OP": 2, "2": 2, "NO_SHARD": 0, "3": 0,
    "HYBRID_SHARD": 3, "4": 3, "HYBRID_SHARD_ZERO2": 2, "5": 2,
}


def _from_deepspeed_section(section: dict, source: str) -> tuple[dict, dict]:
    """Accelerate's `deepspeed_config:` YAML section -> (parallelism fields, top-level fields).

    Its `deepspeed_config_file` (a DeepSpeed JSON) is read by `parse_layer`, not here."""
    where = "deepspeed_config."
    par: dict = {}
    top: dict = {}
    if "zero_stage" in section:
        par["zero_stage"] = _check_value(section["zero_stage"], PARALLEL_FIELDS["zero_stage"], where + "zero_stage", source)
    for src_key, dst_key in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_params")):
        if src_key in section:
            device = str(section[src_key]).lower()
            if device not in ("none", "cpu", "nvme"):
                raise ConfigError(f"{source}: key '{where}{src_key}': bad value {section[src_key]!r}; allowed: none, cpu, nvme")
            if device == "nvme":
                raise ConfigError(f"{source}: key '{where}{src_key}': 'nvme' offload is not supported by accel; allowed: none, cpu")
            par[dst_key] = device == "cpu"
    gas = section.get("gradient_accumulation_steps")
    if gas is not None and gas != "auto":
        top["gradient_accumulation_steps"] = _check_value(gas, TOP_FIELDS["gradient_accumulation_steps"],
                                                          where + "gradient_accumulation_steps", source)
    clip = section.get("gradient_clipping")
    if clip is not None and clip != "auto":
        par["gradient_clipping"] = _check_value(clip, PARALLEL_FIELDS["gradient_clipping"],
                                                where + "gradient_clipping", source)
    return par, top


def _from_fsdp_section(section: dict, source: str) -> dict:
    """Accelerate's `fsdp_config:` YAML section -> parallelism fields (FSDP sharding maps onto ZeRO stages)."""
    where = "fsdp_config."
    par: dict = {"zero_stage": 3}

    def stage_of(key: str, allowed: str) -> int:
        value = section[key]
        stage = _FSDP_STRATEGY_TO_STAGE.get(str(value).upper())
        if stage is None:
            raise ConfigError(f"{source}: key '{where}{key}': bad value {value!r}; allowed: {allowed}")
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
        offload = _check_value(section["fsdp_offload_params"], PARALLEL_FIELDS["offload_params"],
                               where + "fsdp_offload_params", source)
        par["offload_params"] = offload
        par["offload_optimizer"] = offload  # FSDP's CPU offload keeps the optimizer state on the CPU too
    if "fsdp_activation_checkpointing" in section:
        checkpointing = _check_value(section["fsdp_activation_checkpointing"], PARALLEL_FIELDS["offload_params"],
                                     where + "fsdp_activation_checkpointing", source)  # a bool, like offload
        par["activation_checkpointing"] = "full" if checkpointing else "no"
    return par


def _from_parallelism_config_section(section: dict, source: str) -> dict:
    """Accelerate's `parallelism_config:` section (parallelism_config_tp_size, ..._dp_shard_size, ...)."""
    where = "parallelism_config."
    par: dict = {}
    sizes = {}
    for key, value in section.items():
        short = key.removeprefix("parallelism_config_")
        if short in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"):
            sizes[short] = _check_value(value, {"kind": int, "choices": (), "lo": 1, "hi": None, "optional": False},
                                        where + key, source)
        elif short in ("cp_backend", "cp_comm_strategy", "sp_backend", "sp_size", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"):
            continue
        else:
            raise _unknown_key(key, ["parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size",
                                     "parallelism_config_tp_size", "parallelism_config_cp_size"], source, where)
    if sizes.get("cp_size", 1) > 1:
        raise ConfigError(f"{source}: key '{where}parallelism_config_cp_size': {sizes['cp_size']}: context "
                          "parallelism is not supported by accel; allowed: 1")
    if "tp_size" in sizes:
        par["tp_size"] = sizes["tp_size"]
    if sizes.get("dp_shard_size", 1) > 1:
        par["zero_stage"] = 3
    return par


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed JSON files
# ---------------------------------------------------------------------------------------------------------

class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed JSON holds keys accel does not act on (they are listed, then ignored)."""


_AUTO = "auto"  # DeepSpeed's "take it from elsewhere": the other layers decide
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# DeepSpeed JSON key -> (section of the tree or None for the top level, field)
_DS_SCALARS = {
    "gradient_accumulation_steps": (None, "gradient_accumulation_steps"),
    "train_micro_batch_size_per_gpu": ("parallelism", "micro_batch_size"),
    "train_batch_size": ("parallelism", "train_batch_size"),
    "gradient_clipping": ("parallelism", "gradient_clipping"),
}
_DS_PRECISION_SECTIONS = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}  # bfloat16: DeepSpeed's old name


def _ds_meta(meta: dict) -> dict:
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
    if not path.is_file():
        where = f"{referenced_by}: " if referenced_by else ""
        raise ConfigError(f"{where}{path}: DeepSpeed config file not found")
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys(str(path)))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text (UTF-8) JSON file: {exc.reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of DeepSpeed keys at the top level, "
                          f"got {type(data).__name__}")
    return data


def deepspeed_json_layer(data: Any, source: str) -> dict:
    """Map a DeepSpeed config (the JSON's dict) onto a config layer, as `parse_layer` returns one.

    Mapped: zero_optimization.stage / .offload_optimizer.device / .offload_param.device, gradient_accumulation_steps,
    fp16.enabled / bf16.enabled, train_micro_batch_size_per_gpu, train_batch_size, gradient_clipping. "auto" means
    "from the other layers" and is skipped. Every other key is ignored and named in one DeepSpeedConfigWarning.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object of DeepSpeed keys at the top level, "
                          f"got {type(data).__name__}")
    top: dict = {}
    par: dict = {}
    ignored: list[str] = []

    def mapping(value: Any, key: str) -> dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}': expected a JSON object, got {value!r}")
        return value

    precision: dict[str, bool] = {}
    for key, value in data.items():
        if key in _DS_SCALARS:
            section, name = _DS_SCALARS[key]
            if value is None or value == _AUTO:
                continue
            fields = TOP_FIELDS if section is None else PARALLEL_FIELDS
            checked = _check_value(value, _ds_meta({**fields[name], "optional": False}), key, source)
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
                raise ConfigError(f"{source}: key '{key}.enabled': bad value {enabled!r}; "
                                  "allowed: true, false or \"auto\"")
            precision[_DS_PRECISION_SECTIONS[key]] = precision.get(_DS_PRECISION_SECTIONS[key], False) or enabled
        elif key == "zero_optimization":
            if value is None:
                continue
            par.update(_from_deepspeed_zero(mapping(value, key), source, ignored))
        elif key == "activation_checkpointing" and value:  # DeepSpeed checkpoints whole layers: accel's "full"
            par["activation_checkpointing"] = "full"
            ignored.extend(f"{key}.{sub}" for sub in mapping(value, key))  # partitioning, CPU copies: not used
        else:  # optimizer/scheduler too: the warning explains them
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
            note = ("; 'optimizer'/'scheduler': DeepSpeed would build them, accel uses the optimizer and scheduler "
                    "your script creates and passes to prepare()")
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
                par["zero_stage"] = _check_value(value, _ds_meta(PARALLEL_FIELDS["zero_stage"]), where, source)
        elif key in ("offload_optimizer", "offload_param"):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: key '{where}': expected a JSON object, got {value!r}")
            for sub in value:
                if sub != "device":
                    ignored.append(f"{where}.{sub}")
            device = value.get("device")
            if device is None or device == _AUTO:
                continue
            if not isinstance(device, str) or device.lower() not in _OFFLOAD_DEVICES:
                raise ConfigError(f"{source}: key '{where}.device': bad value {device!r}; allowed: none, cpu, nvme")
            if device.lower() == "nvme":
                raise ConfigError(f"{source}: key '{where}.device': 'nvme' offload is not supported by accel; "
                                  "allowed: none, cpu")
            par["offload_optimizer" if key == "offload_optimizer" else "offload_params"] = device.lower() == "cpu"
        elif key == "cpu_offload":  # DeepSpeed's older spelling of offload_optimizer.device: cpu
            if value is None or value == _AUTO:
                continue
            par.setdefault("offload_optimizer",
                           _check_value(value, PARALLEL_FIELDS["offload_optimizer"], where, source))
        else:
            ignored.append(where)
    return par


def read_deepspeed_config(path: str | os.PathLike, referenced_by: str | None = None) -> dict:
    """Read a DeepSpeed JSON file into a config layer (see `deepspeed_json_layer`); errors name the file."""
    shown = os.path.normpath(Path(path).expanduser())  # "conf/../ds.json" reads "ds.json" in messages
    return deepspeed_json_layer(read_deepspeed_json(path, referenced_by), shown)


def _deepspeed_path(value: Any, key: str, source: str, base_dir: Path | None) -> Path | None:
    """The JSON path a `deepspeed_config_file` key names (relative: against `base_dir`, else the current
    directory), or None for an empty value or Accelerate's "none"."""
    if value is None or value == "" or (isinstance(value, str) and value.lower() == "none"):
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{source}: key '{key}': bad value {value!r}; allowed: the path of a DeepSpeed JSON file")
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return path


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
    for key, value in raw.items():
        if key == DEEPSPEED_FILE_KEY:
            path = _deepspeed_path(value, key, source, base)
            if path is not None:
                ds_files.append((path, key))
            continue
        if key in TOP_FIELDS:
            if key == "distributed_type" and isinstance(value, str) and value.upper() in ("DEEPSPEED", "FSDP"):
                accelerate_type = value.upper()
                continue
            if key == "distributed_type" and isinstance(value, str) and value.upper() not in DISTRIBUTED_TYPES:
                raise ConfigError(f"{source}: key 'distributed_type': bad value {value!r}; allowed: "
                                  f"{', '.join(DISTRIBUTED_TYPES)} (Accelerate's DEEPSPEED and FSDP also load)")
            out[key] = _check_value(value, TOP_FIELDS[key], key, source)
        elif key == "parallelism":
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: key 'parallelism': expected a mapping, got {value!r}")
            for pkey, pvalue in value.items():
                if pkey not in PARALLEL_FIELDS:
                    raise _unknown_key(pkey, tuple(PARALLEL_FIELDS), source, "parallelism.")
                par[pkey] = _check_value(pvalue, PARALLEL_FIELDS[pkey], f"parallelism.{pkey}", source)
        elif key in ACCELERATE_SECTIONS:
            if not value:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: key '{key}': expected a mapping, got {value!r}")
            if key == "deepspeed_config":
                if str(raw.get("distributed_type") or "DEEPSPEED").upper() != "DEEPSPEED":
                    continue  # Accelerate keeps inactive sections around; only the active one counts
                path = _deepspeed_path(value.get(DEEPSPEED_FILE_KEY), f"{key}.{DEEPSPEED_FILE_KEY}", source, base)
                if path is not None:
                    ds_files.append((path, f"{key}.{DEEPSPEED_FILE_KEY}"))
                ds_par, ds_top = _from_deepspeed_section(value, source)
                par.update(ds_par)
                out.update({k: v for k, v in ds_top.items() if k not in raw})
            elif key == "fsdp_config":
                if str(raw.get("distributed_type", "FSDP")).upper() != "FSDP":
                    continue
                par.update(_from_fsdp_section(value, source))
            else:
                par.update(_from_parallelism_config_section(value, source))
        elif key in ACCELERATE_IGNORED_KEYS:
            continue
        else:
            raise _unknown_key(key, KNOWN_TOP_KEYS, source)
    if accelerate_type is not None and "zero_stage" not in par and not ds_files:
        par["zero_stage"] = 3 if accelerate_type == "FSDP" else 2  # Accelerate's default stage for DeepSpeed
    if par:
        out["parallelism"] = par
    if len(ds_files) > 1:
        raise ConfigError(f"{source}: keys '{ds_files[0][1]}' and '{ds_files[1][1]}' both name a DeepSpeed config "
                          "file; allowed: one of them")
    if ds_files:  # the JSON is a layer just above the file that names it: its values (not "auto") win
        path, key = ds_files[0]
        out = merge_layers([out, read_deepspeed_config(path, f"{source}: key '{key}'")])
    return out


def merge_layers(layers: list[dict]) -> dict:
    """Later layers win, key by key (the parallelism section merges field by field)."""
    merged: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if key == "parallelism":
                merged.setdefault("parallelism", {}).update(value)
            else:
                merged[key] = value
    return merged


def build_config(layers: list[dict], source: str = "config") -> AccelConfig:
    """Merge validated layers over the built-in defaults and check the cross-field rules."""
    merged = merge_layers(layers)
    cfg = AccelConfig(**{k: v for k, v in merged.items() if k != "parallelism"},
                      parallelism=ParallelismConfig(**merged.get("parallelism", {})))
    check_consistency(cfg, source)
    return cfg


def check_consistency(cfg: AccelConfig, source: str = "config") -> None:
    """Rules that involve more than one key."""
    if cfg.num_processes % cfg.num_machines:
        raise ConfigError(f"{source}: key 'num_processes': {cfg.num_processes} is not divisible by num_machines="
                          f"{cfg.num_machines}; allowed: a multiple of num_machines (it is the total over all machines)")
    if cfg.machine_rank >= cfg.num_machines:
        raise ConfigError(f"{source}: key 'machine_rank': {cfg.machine_rank} is out of range for num_machines="
                          f"{cfg.num_machines}; allowed: 0 to {cfg.num_machines - 1}")
    if cfg.num_machines > 1 and not cfg.main_process_ip:
        raise ConfigError(f"{source}: key 'main_process_ip': required when num_machines={cfg.num_machines}; "
                          "allowed: the address of the machine with machine_rank 0")
    if cfg.use_cpu and cfg.distributed_type == "MULTI_GPU":
        raise ConfigError(f"{source}: key 'distributed_type': MULTI_GPU contradicts use_cpu=true; allowed: NO or MULTI_CPU")
    if cfg.distributed_type == "NO" and cfg.num_processes > 1:
        raise ConfigError(f"{source}: key 'distributed_type': NO contradicts num_processes={cfg.num_processes}; "
                          "allowed: MULTI_CPU or MULTI_GPU (or omit it)")
    model_parallel = cfg.parallelism.tp_size * cfg.parallelism.pp_size
    if cfg.num_processes > 1 and cfg.num_processes % model_parallel:
        raise ConfigError(f"{source}: key 'num_processes': {cfg.num_processes} is not divisible by tp_size x pp_size = "
                          f"{model_parallel}; allowed: a multiple of tp_size x pp_size")
    gpu_ids = cfg.gpu_ids.replace(" ", "")
    if gpu_ids.lower() != "all" and not all(part.isdigit() for part in gpu_ids.split(",")):
        raise ConfigError(f"{source}: key 'gpu_ids': bad value {cfg.gpu_ids!r}; allowed: \"all\" or a comma-separated "
                          "list of GPU indices like \"0,1\"")


def read_config_file(path: str | os.PathLike) -> dict:
    """Read and validate one YAML (or JSON) config file into a layer."""
    import yaml

    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_layer(raw, str(path), base_dir=path.parent)


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
    return path if path.is_file() else None


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
    ds_path = _deepspeed_path(ds_file, DEEPSPEED_FILE_KEY, overrides_source, None)
    if ds_path is not None:
        layers.append(read_deepspeed_config(ds_path, f"{overrides_source}: key '{DEEPSPEED_FILE_KEY}'"))
        source = f"{source} + {ds_path}"
    if overrides:
        layers.append(parse_layer(overrides, overrides_source))
        source = f"{source} + {overrides_source}"
    return build_config(layers, source)


def launched_config() -> AccelConfig | None:
    """The config `accel launch` resolved for this worker, or None when not started by `accel launch`."""
    text = os.environ.get(LAUNCH_ENV)
    if not text:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"${LAUNCH_ENV}: not valid JSON ({exc.msg}); it is written by accel launch") from None
    return AccelConfig.from_dict(data, f"${LAUNCH_ENV}")


def encode_for_workers(cfg: AccelConfig) -> str:
    """The single value `accel launch` puts in `ACCEL_LAUNCH_CONFIG`."""
    return json.dumps(cfg.to_dict(), separators=(",", ":"))


def worker_config(overrides: dict | None = None) -> AccelConfig:
    """What an `Accelerator` starts from: the launched config if any, else the files; then its own arguments."""
    launched = launched_config()
    if launched is None:
        layers = file_layers()
        source = str(user_config_path() or PACKAGED_DEFAULT)
    else:
        layers = [parse_layer(launched.to_dict(), f"${LAUNCH_ENV}")]
        source = f"${LAUNCH_ENV}"
    if overrides:
        layers.append(parse_layer(overrides, "Accelerator(...) arguments"))
        source = f"{source} + Accelerator(...) arguments"
    return build_config(layers, source)
