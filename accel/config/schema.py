"""The typed config tree: its fields, their allowed values and the rules that involve several keys.

Kept apart from reading files and from precedence so the backends, the CLI and the plugins can check a
value, or name what is allowed, without pulling in YAML or file handling. The field machinery (`spec`, value checks,
unknown keys) is accel/config/fields.py and the `parallelism:` section accel/config/parallelism.py; their names are
importable from here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accel.config.degrees import (  # noqa: F401 (re-exported: accel.config's names)
    check_data_parallel_layout,
    data_parallel_sizes,
    divides_world,
    model_parallel_size,
    shards_data_parallel,
)
from accel.config.errors import ConfigError, shown
from accel.config.fields import (  # noqa: F401 (re-exported: the field machinery's names, as before the split)
    C_INT_MAX,
    HOST_PATTERN,
    INT64_MAX,
    MAX_SECONDS,
    UnknownKeyError,
    UnknownKeys,
    _Unknown,
    _unknown_message,
    allowed_values,
    check_value,
    field_specs,
    spec,
    unknown_key,
    validate_fields,
)
from accel.config.parallelism import (  # noqa: F401 (re-exported: the parallelism section's names)
    ACCELERATE_CP_COMM_STRATEGIES,
    ACTIVATION_CHECKPOINTING,
    CP_COMM_STRATEGIES,
    PP_SCHEDULES,
    ParallelismConfig,
)

# processes `accel launch` starts on one machine: more than the largest machines have cores (a typo such as 1000000
# would fork that many processes before anything could fail)
MAX_PROCESSES_PER_MACHINE = 4096
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")
RDZV_BACKENDS = ("static", "c10d")
# Accelerate's DynamoBackend names (lower case, as torch.compile takes them); which ones this torch really has is
# checked when the Accelerator is built (torch._dynamo.list_backends)
DYNAMO_BACKENDS = ("no", "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs", "ofi",
                   "fx2trt", "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torchxla_trace_once", "ipex", "tvm",
                   "hpu_backend")
DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Seconds a collective may wait for the slowest process before the job stops and names the stuck one. 600 is torch's own
# NCCL default (every GPU job lives with it already) and a third of its gloo default: room for a process that is late on
# purpose (saving a checkpoint, compiling, evaluating on the main process) while a hung CPU job is named after 10
# minutes, not 30. Longer deliberate waits (a dataset prepared under main_process_first) need a larger value.
DEFAULT_COLLECTIVE_TIMEOUT = 600.0
# Preemption (accel/runtime/preemption.py): SIGTERM always asks the workers to save and stop; one more signal may
# (SLURM's `--signal=B:USR1@120`). How long they get before they are stopped: the scheduler's own deadline usually
# comes first; this one only ends a job whose workers never reach their check.
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
DEFAULT_GRACE_PERIOD = 300.0


SEMI_SYNC_METHODS = ("local_sgd", "diloco")
# a lighthouse address as torchft's clients take it: host:port, with or without http://
LIGHTHOUSE_PATTERN = r"(https?://)?(" + HOST_PATTERN + r"):\d{1,5}"
DEFAULT_LIGHTHOUSE_PORT = 29510  # torchft's own default, used across machines (one machine: a free port)


@dataclass
class FaultToleranceConfig:
    """Fault tolerance without restarts (the `fault_tolerance:` section; torchft, accel/fault_tolerance/).

    The processes are cut into `group_size` replica groups (torchtitan's name), each its own torchrun job with its
    own restarts; torchft's Lighthouse forms a quorum of the live groups at every step and the optimizer commits only
    when the all-reduce over it succeeded. A group that died heals from a live one (weights and optimizer state sent
    over the network), without a checkpoint. `num_processes` stays the total: each group has num_processes /
    group_size processes (in the config of one group, the one with a replica_id, it is that group's)."""

    enabled: bool = spec(False, bool,
                         help="train as replica groups under torchft (needs pip install 'accel-train[ft]')",
                         ask="Fault tolerance without restarts (torchft: replica groups; a failed group heals from a "
                             "live one, the others keep training)?")
    group_size: int = spec(2, int, lo=1, help="replica groups (torchtitan's group_size); each group runs "
                                              "num_processes / group_size processes",
                           ask="How many replica groups (each runs num_processes / N processes)?")
    replica_id: int | None = spec(None, int, lo=0, optional=True,
                                  help="this group's index (set by accel launch for each group it starts; give it "
                                       "only when starting the groups yourself)")
    min_replicas: int = spec(1, int, lo=1, help="live replica groups a step needs to commit (torchft's "
                                                "min_replica_size)",
                             ask="How many live groups must a step have to commit?")
    lighthouse: str = spec("start", str, pattern=r"start|" + LIGHTHOUSE_PATTERN, what='"start" or host:port',
                           help='"start": accel launch starts torchft\'s lighthouse (on machine_rank 0); or the '
                                "host:port of a running one",
                           ask="torchft's lighthouse: start one with the job (start), or the host:port of a running "
                               "one?")
    lighthouse_port: int | None = spec(None, int, lo=1, hi=65535, optional=True,
                                       help="the port of the lighthouse accel launch starts (null: a free port on "
                                            f"one machine, {DEFAULT_LIGHTHOUSE_PORT} across machines)")
    semi_sync_method: str | None = spec(None, str, choices=SEMI_SYNC_METHODS, optional=True,
                                        help="null: every step all-reduces gradients over the groups; local_sgd or "
                                             "diloco: the groups synchronise every sync_steps steps (slow links)")
    sync_steps: int = spec(20, int, lo=1, help="optimizer steps between two synchronisations (semi_sync_method)")
    outer_lr: float = spec(0.7, float, lo=0, help="DiLoCo's outer SGD learning rate (Nesterov momentum 0.9)")
    timeout: float = spec(60.0, float, lo=1, hi=MAX_SECONDS, unit="seconds",
                          help="seconds an all-reduce, commit or healing transfer over the groups may take")
    quorum_timeout: float = spec(60.0, float, lo=1, hi=MAX_SECONDS, unit="seconds",
                                 help="seconds a group waits for a quorum of the live groups")
    heartbeat_timeout: float = spec(5.0, float, lo=0.1, hi=MAX_SECONDS, unit="seconds",
                                    help="seconds without a heartbeat after which the lighthouse accel launch "
                                         "starts counts a group as gone (the live groups wait this long after a "
                                         "failure)")
    start_timeout: float = spec(300.0, float, lo=0, hi=MAX_SECONDS, unit="seconds",
                                help="seconds the first step waits for every replica group to come (so a job "
                                     "without failures is DDP whatever the start skew); a group not come by then "
                                     "is left behind and heals when it comes")
    check_every: int = spec(100, int, lo=0, help="committed steps between two comparisons of the groups' weight "
                                                 "fingerprints (and one at the end); a difference stops the job "
                                                 "(exit code 76); 0: never")

    def __post_init__(self) -> None:
        validate_fields(self, "FaultToleranceConfig")


@dataclass
class AccelConfig:
    """The whole resolved config. Key names follow Accelerate's config file."""

    compute_environment: str = spec("LOCAL_MACHINE", str, choices=("LOCAL_MACHINE",),
                                     help="Accelerate's key; accel runs on the local machine(s) only")
    distributed_type: str | None = spec(None, str, choices=DISTRIBUTED_TYPES, optional=True,
                                        help="null derives it: NO for one process, MULTI_GPU with CUDA (and not "
                                             "use_cpu), else MULTI_CPU")
    num_processes: int = spec(1, int, lo=1, help="total processes over all machines",
                              ask="How many processes in total, over all machines?")
    num_machines: int = spec(1, int, lo=1, help="machines the job spans (each runs num_processes / num_machines)",
                             ask="How many machines will you use (1 for this machine only)?")
    machine_rank: int = spec(0, int, lo=0, help="this machine's index, 0 at main_process_ip (with rdzv_backend c10d: "
                                                "only which machine hosts the rendezvous)",
                             ask="What is the rank of this machine (0 for the main machine)?")
    main_process_ip: str | None = spec(None, str, optional=True, pattern=HOST_PATTERN,
                                       what="a host name or IP address",
                                       help="the rendezvous address: machine 0 (required with num_machines > 1)",
                                       ask="What is the IP address of the main machine (machine_rank 0)?")
    main_process_port: int | None = spec(None, int, lo=1, hi=65535, optional=True,
                                         help="the rendezvous port (null: a free port on one machine, 29500 across "
                                              "machines)",
                                         ask="Which port should the main machine use for the rendezvous?")
    use_cpu: bool = spec(False, bool, help="run on the CPU (gloo) even where GPUs are present",
                         ask="Run on the CPU only, even if GPUs are available?")
    gpu_ids: str = spec("all", str, help='"all" or a comma-separated list like "0,1" (becomes CUDA_VISIBLE_DEVICES)',
                        ask="Which GPUs should be used (\"all\" or ids like 0,1)?")
    mixed_precision: str = spec("no", str, choices=MIXED_PRECISIONS,
                                 help="no (fp32), bf16 or fp16 (autocast; fp16 with loss scaling), fp8 (torchao)",
                                ask="Mixed precision?")
    gradient_accumulation_steps: int = spec(1, int, lo=1, help="batches per optimizer step",
                                            ask="How many gradient accumulation steps?")
    rdzv_backend: str = spec("static", str, choices=RDZV_BACKENDS,
                             help="static: machine_rank is the node rank; c10d: ranks in arrival order",
                             ask="Which rendezvous backend (static: machine_rank is the node rank; c10d)?")
    same_network: bool = spec(True, bool, help="Accelerate's key: the machines share a network (accepted)")
    dynamo_backend: str = spec("no", str, choices=DYNAMO_BACKENDS,
                               help="torch.compile backend; no: eager (Accelerate's key and flag)")
    dynamo_mode: str = spec("default", str, choices=DYNAMO_MODES, help="torch.compile's mode")
    dynamo_use_fullgraph: bool = spec(False, bool, help="torch.compile(fullgraph=True): a graph break is an error")
    dynamo_use_dynamic: bool | None = spec(None, bool, optional=True,
                                           help="torch.compile(dynamic=True): compile for dynamic shapes (null: "
                                                "torch.compile decides)")
    dynamo_use_regional_compilation: bool = spec(False, bool,
                                                 help="compile each repeated block instead of the whole model")
    collective_timeout: float = spec(
        DEFAULT_COLLECTIVE_TIMEOUT, float, lo=1, hi=MAX_SECONDS, unit="seconds",
        help="seconds a collective may wait for every process; then the job stops and names the ones that never came")
    checkpoint_async: str = spec(
        "no", str, choices=("no", "thread", "process"),
        help="save_state writes in the background: no (the loop waits), thread, or process (torch's own process)")
    preemption_signal: str | None = spec(
        None, str, choices=PREEMPTION_SIGNALS, optional=True,
        help="a signal that, like SIGTERM, asks the workers to save and stop (accelerator.preemption_requested)")
    grace_period: float = spec(
        DEFAULT_GRACE_PERIOD, float, lo=1, hi=MAX_SECONDS, unit="seconds",
        help="seconds the workers get to save and stop after a preemption request; then they are stopped")
    requeue: bool = spec(False, bool, help="after the workers stopped for a preemption request, `scontrol requeue` "
                                           "the SLURM job (exit code 75 either way)")
    throughput_monitor: bool = spec(
        False, bool, help="log samples/s, tokens/s, step time, peak memory and MFU through the trackers and the "
                          "progress bar every throughput_log_every optimizer steps (accel/planning/throughput.py)")
    throughput_log_every: int = spec(10, int, lo=1, help="optimizer steps per throughput report")
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    # A DeepSpeed JSON named by a config file or `accel launch --deepspeed_config_file`, carried as read (its dict and
    # the path it was read from) so every worker's Accelerator exposes it as Accelerate's automatic DeepSpeedPlugin
    # (`DummyOptim`/`DummyScheduler` build its optimizer/scheduler). Its DeepSpeed keys are already mapped onto the
    # fields above; these are not config-file keys (no "kind": not in TOP_FIELDS), and are left out of to_dict()
    # when unset.
    deepspeed_json: dict | None = None
    deepspeed_json_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.parallelism, dict):
            self.parallelism = ParallelismConfig(**self.parallelism)
        if isinstance(self.fault_tolerance, dict):
            self.fault_tolerance = FaultToleranceConfig(**self.fault_tolerance)
        validate_fields(self, "AccelConfig")
        check_carried_deepspeed_json(self.deepspeed_json, self.deepspeed_json_path, "AccelConfig")

    # -- conversions -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for key in CARRIED_KEYS:
            if data[key] is None:
                del data[key]
        return data

    def to_yaml(self) -> str:
        """The config-file form: the carried DeepSpeed JSON is left out (a file names it: `deepspeed_config_file`)."""
        import yaml  # imported here: workers get their config as JSON and never pay for yaml

        data = self.to_dict()
        for key in CARRIED_KEYS:
            data.pop(key, None)
        return yaml.safe_dump(data, sort_keys=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write as YAML atomically (temp file + rename) and return the path."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".yaml", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(self.to_yaml())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:  # a failed write or rename (the target is a folder, say) leaves no temporary behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path

    # -- derived values --------------------------------------------------------------------------------
    def resolved_distributed_type(self, cuda_available: bool | None = None) -> str:
        """`distributed_type` as given, else derived: NO for one process, MULTI_GPU with CUDA, MULTI_CPU."""
        if self.distributed_type is not None:
            return self.distributed_type
        if self.num_processes <= 1:
            return "NO"
        if cuda_available is None:
            from accel.core.probes import is_cuda_available  # NVML: CUDA stays uninitialised (forks stay usable)

            cuda_available = is_cuda_available()
        return "MULTI_GPU" if cuda_available and not self.use_cpu else "MULTI_CPU"

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines



TOP_FIELDS = field_specs(AccelConfig)
PARALLEL_FIELDS = field_specs(ParallelismConfig)
FAULT_TOLERANCE_FIELDS = field_specs(FaultToleranceConfig)
SECTIONS = {"parallelism": PARALLEL_FIELDS, "fault_tolerance": FAULT_TOLERANCE_FIELDS}  # nested sections of a file
CARRIED_KEYS = ("deepspeed_json", "deepspeed_json_path")  # AccelConfig fields carried to workers, not file keys


def check_carried_deepspeed_json(data: Any, path: Any, source: str) -> None:
    """The carried DeepSpeed JSON is a JSON object (or None) and its path a string (or None); ConfigError otherwise."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{source}: key 'deepspeed_json': bad value of type {type(data).__name__}; allowed: a "
                          "DeepSpeed JSON object (or null)")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"{source}: key 'deepspeed_json_path': bad value {shown(path)}; allowed: a path (or null)")



def check_consistency(cfg: AccelConfig, source: str = "config") -> None:
    """Rules that involve more than one key."""
    if cfg.num_processes % cfg.num_machines:
        raise ConfigError(f"{source}: key 'num_processes': {cfg.num_processes} is not divisible by num_machines="
                          f"{cfg.num_machines}; allowed: a multiple of num_machines (it is the total over all "
                          "machines)")
    if cfg.processes_per_machine > MAX_PROCESSES_PER_MACHINE:
        if cfg.num_machines == 1:
            raise ConfigError(f"{source}: key 'num_processes': bad value {cfg.num_processes}; allowed: at most "
                              f"{MAX_PROCESSES_PER_MACHINE} processes on one machine")
        raise ConfigError(f"{source}: key 'num_processes': {cfg.num_processes} over num_machines={cfg.num_machines} "
                          f"is {cfg.processes_per_machine} processes per machine; allowed: at most "
                          f"{MAX_PROCESSES_PER_MACHINE} per machine (num_processes is the total over all machines)")
    if cfg.machine_rank >= cfg.num_machines:
        raise ConfigError(f"{source}: key 'machine_rank': {cfg.machine_rank} is out of range for num_machines="
                          f"{cfg.num_machines}; allowed: 0 to {cfg.num_machines - 1}")
    if cfg.num_machines > 1 and not cfg.main_process_ip:
        raise ConfigError(f"{source}: key 'main_process_ip': required when num_machines={cfg.num_machines}; "
                          "allowed: the address of the machine with machine_rank 0")
    if cfg.use_cpu and cfg.distributed_type == "MULTI_GPU":
        raise ConfigError(f"{source}: key 'distributed_type': MULTI_GPU contradicts use_cpu=true; "
                          "allowed: NO or MULTI_CPU")
    if cfg.distributed_type == "NO" and cfg.num_processes > 1:
        raise ConfigError(f"{source}: key 'distributed_type': NO contradicts num_processes={cfg.num_processes}; "
                          "allowed: MULTI_CPU or MULTI_GPU (or omit it)")
    model_parallel = model_parallel_size(cfg.parallelism.tp_size, cfg.parallelism.pp_size)
    if cfg.num_processes > 1 and not divides_world(cfg.num_processes, cfg.parallelism.tp_size, cfg.parallelism.pp_size):
        raise ConfigError(f"{source}: key 'num_processes': {cfg.num_processes} is not divisible by tp_size x pp_size = "
                          f"{model_parallel}; allowed: a multiple of tp_size x pp_size")
    if cfg.num_processes > 1:
        data_parallel_sizes(cfg.parallelism, cfg.num_processes, f"{source}: parallelism")
    gpu_ids = compact_gpu_ids(cfg.gpu_ids)
    if gpu_ids.lower() != "all":
        parts = gpu_ids.split(",")
        if not all(part.isascii() and part.isdigit() and int(part) <= C_INT_MAX for part in parts):
            raise ConfigError(f"{source}: key 'gpu_ids': bad value {shown(cfg.gpu_ids)}; allowed: \"all\" or a "
                              "comma-separated list of GPU indices like \"0,1\"")
        if len({int(part) for part in parts}) < len(parts):
            raise ConfigError(f"{source}: key 'gpu_ids': bad value {shown(cfg.gpu_ids)}: a GPU is listed twice; "
                              "allowed: each GPU index once, like \"0,1\"")
    check_fault_tolerance(cfg, source)
    if cfg.mixed_precision == "fp8" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{source}: key 'mixed_precision': fp8 needs torchao, which is not installed; install it "
                          "with pip install 'accel-train[fp8]', or allowed now: no, bf16, fp16")



def compact_gpu_ids(gpu_ids: str) -> str:
    """`gpu_ids` without spaces ("0, 1" -> "0,1"), the form it is checked and exported in."""
    return gpu_ids.replace(" ", "")


def cuda_visible_devices(cfg: AccelConfig) -> str | None:
    """The CUDA_VISIBLE_DEVICES value `gpu_ids` asks for, or None ("all", or running on the CPU)."""
    gpu_ids = compact_gpu_ids(cfg.gpu_ids)
    if cfg.use_cpu or gpu_ids.lower() == "all":
        return None
    return gpu_ids


def check_fault_tolerance(cfg: AccelConfig, source: str = "config") -> None:
    """The fault_tolerance section against the rest: groups of whole processes placed whole on machines, what
    composes with it (plain data parallelism), and torchft installed."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return
    where = f"{source}: key 'fault_tolerance."
    if ft.replica_id is None and cfg.num_processes % ft.group_size:  # with replica_id: the group's own processes
        raise ConfigError(f"{where}group_size': {ft.group_size} groups do not divide num_processes="
                          f"{cfg.num_processes}; allowed: a divisor of num_processes (each group runs "
                          "num_processes / group_size processes)")
    if ft.replica_id is None and ft.group_size % cfg.num_machines:
        raise ConfigError(f"{where}group_size': {ft.group_size} groups cannot be spread over num_machines="
                          f"{cfg.num_machines}; allowed: a multiple of num_machines (each machine runs whole groups)")
    if ft.min_replicas > ft.group_size:
        raise ConfigError(f"{where}min_replicas': bad value {ft.min_replicas}; allowed: an integer from 1 to "
                          f"group_size={ft.group_size}")
    if ft.replica_id is not None and ft.replica_id >= ft.group_size:
        raise ConfigError(f"{where}replica_id': bad value {ft.replica_id}; allowed: an integer from 0 to "
                          f"{ft.group_size - 1} (group_size={ft.group_size})")
    par = cfg.parallelism
    others = [f"{key}={getattr(par, key)}" for key in ("tp_size", "pp_size", "cp_size", "sp_size", "ep_size")
              if getattr(par, key) > 1]
    if par.zero_stage == 1 or par.offload_optimizer or par.offload_params:  # ZeRO-2/3: FSDP2 inside each group
        others.insert(0, f"zero_stage={par.zero_stage}" if par.zero_stage == 1 else "CPU offload")
    if (par.dp_shard_size or 1) > 1 or (par.dp_replicate_size or 1) > 1:
        others.append("dp_shard_size/dp_replicate_size")
    if others:
        raise ConfigError(f"{source}: key 'fault_tolerance.enabled': fault tolerance with {', '.join(others)} is not "
                          "available yet in accel; allowed: DDP or ZeRO-2/3 (FSDP2) inside each group (zero_stage 0, 2 "
                          "or 3, other sizes 1)")
    try:
        installed = importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):  # a module of that name set to None (a test's "not installed")
        installed = False
    if not installed:
        raise ConfigError(f"{where}enabled': fault tolerance needs torchft, which is not installed; install it with "
                          "pip install 'accel-train[ft]', or allowed now: false")
