"""The typed config tree: its fields, their allowed values and the rules that involve several keys.

Kept apart from reading files and from precedence so the backends, the CLI and the plugins can check a
value, or name what is allowed, without pulling in YAML or file handling.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
# Accelerate's DynamoBackend names (lower case, as torch.compile takes them); which ones this torch really has is
# checked when the Accelerator is built (torch._dynamo.list_backends)
DYNAMO_BACKENDS = ("no", "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs", "ofi",
                   "fx2trt", "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torchxla_trace_once", "ipex", "tvm",
                   "hpu_backend")
DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


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
    dynamo_backend: str = _spec("no", str, choices=DYNAMO_BACKENDS,
                                help="torch.compile backend; no: eager (Accelerate's key and flag)")
    dynamo_mode: str = _spec("default", str, choices=DYNAMO_MODES)
    dynamo_use_fullgraph: bool = _spec(False, bool)
    dynamo_use_dynamic: bool | None = _spec(None, bool, optional=True, help="null: torch.compile decides")
    dynamo_use_regional_compilation: bool = _spec(False, bool,
                                                  help="compile each repeated block instead of the whole model")
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)

    def __post_init__(self) -> None:
        if isinstance(self.parallelism, dict):
            self.parallelism = ParallelismConfig(**self.parallelism)
        _validate_fields(self, "AccelConfig")

    # -- conversions -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> AccelConfig:
        """Validate `data` as one layer (Accelerate's keys included) over the built-in defaults."""
        from accel.config.resolve import build_config, parse_layer  # resolve imports this module

        return build_config([parse_layer(data, source)], source)

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

def allowed_values(meta: dict) -> str:
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


def check_value(value: Any, meta: dict, key: str, source: str) -> Any:
    """Return `value` in canonical form, or raise ConfigError naming source/key/value/allowed."""

    def fail() -> None:
        raise ConfigError(f"{source}: key '{key}': bad value {value!r}; allowed: {allowed_values(meta)}")

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
            setattr(obj, f.name, check_value(getattr(obj, f.name), f.metadata, f.name, source))


def _field_specs(cls: type) -> dict[str, dict]:
    return {f.name: f.metadata for f in dataclasses.fields(cls) if "kind" in f.metadata}


TOP_FIELDS = _field_specs(AccelConfig)
PARALLEL_FIELDS = _field_specs(ParallelismConfig)

def unknown_key(key: str, known: tuple[str, ...] | list[str], source: str, where: str = "") -> ConfigError:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"{source}: unknown key '{where}{key}'{hint}")


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
    model_parallel = model_parallel_size(cfg.parallelism.tp_size, cfg.parallelism.pp_size)
    if cfg.num_processes > 1 and not divides_world(cfg.num_processes, cfg.parallelism.tp_size, cfg.parallelism.pp_size):
        raise ConfigError(f"{source}: key 'num_processes': {cfg.num_processes} is not divisible by tp_size x pp_size = "
                          f"{model_parallel}; allowed: a multiple of tp_size x pp_size")
    gpu_ids = compact_gpu_ids(cfg.gpu_ids)
    if gpu_ids.lower() != "all" and not all(part.isdigit() for part in gpu_ids.split(",")):
        raise ConfigError(f"{source}: key 'gpu_ids': bad value {cfg.gpu_ids!r}; allowed: \"all\" or a comma-separated "
                          "list of GPU indices like \"0,1\"")
    if cfg.mixed_precision == "fp8" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{source}: key 'mixed_precision': fp8 needs torchao, which is not installed; install it with "
                          "pip install 'accel[fp8]', or allowed now: no, bf16, fp16")



# ---------------------------------------------------------------------------------------------------------
# derived values: each computed here only, so launch, the backends and the topology agree
# ---------------------------------------------------------------------------------------------------------

def model_parallel_size(tp_size: int, pp_size: int) -> int:
    """Processes one model copy spans (tp x pp); the data-parallel degree is the world size over this."""
    return tp_size * pp_size


def divides_world(world_size: int, tp_size: int, pp_size: int) -> bool:
    """Whether tp x pp divides the world size: every data-parallel replica needs a whole model-parallel group."""
    return world_size % model_parallel_size(tp_size, pp_size) == 0


def compact_gpu_ids(gpu_ids: str) -> str:
    """`gpu_ids` without spaces ("0, 1" -> "0,1"), the form it is checked and exported in."""
    return gpu_ids.replace(" ", "")


def cuda_visible_devices(cfg: AccelConfig) -> str | None:
    """The CUDA_VISIBLE_DEVICES value `gpu_ids` asks for, or None ("all", or running on the CPU)."""
    gpu_ids = compact_gpu_ids(cfg.gpu_ids)
    if cfg.use_cpu or gpu_ids.lower() == "all":
        return None
    return gpu_ids
