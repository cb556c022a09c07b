"""The typed config tree: its fields, their allowed values and the rules that involve several keys.

Kept apart from reading files and from precedence so the backends, the CLI and the plugins can check a
value, or name what is allowed, without pulling in YAML or file handling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from accel.config.degrees import (  # noqa: F401 (re-exported: accel.config's names)
    check_data_parallel_layout,
    data_parallel_sizes,
    divides_world,
    model_parallel_size,
    shards_data_parallel,
)
from accel.config.errors import ConfigError, shown
from accel.config.topology import Topology


# The ranges every config value is checked against, where it enters (a file, a flag, an answer, an argument), so a
# value no consumer can take never reaches a worker or torchrun:
C_INT_MAX = 2**31 - 1  # a C int: what torch and torchrun take for sizes, ranks, counts (every int key's default bound)
INT64_MAX = 2**63 - 1  # counts of parameters
# processes `accel launch` starts on one machine: more than the largest machines have cores (a typo such as 1000000
# would fork that many processes before anything could fail)
MAX_PROCESSES_PER_MACHINE = 4096
# Seconds: a year. timedelta, threading.Timer (at most threading.TIMEOUT_MAX), time.sleep and torch's millisecond
# timeouts (int64) all take it; beyond it a value is a mistake (1e308, a duration in milliseconds, ...).
MAX_SECONDS = 365 * 24 * 3600
# a host name, IPv4 or IPv6 address as torchrun's rendezvous endpoint takes it ([\w.:-]+, brackets for IPv6); not
# starting with "-" (it would read as an option of torchrun or ssh)
HOST_PATTERN = r"(?!-)[\w.:-]{1,253}|\[[0-9A-Fa-f:.%\w]{1,251}\]"


def _spec(default: Any, kind: type, *, choices: tuple = (), lo: float | None = None, hi: float | None = None,
          optional: bool = False, help: str = "", unit: str = "", pattern: str = "", what: str = "") -> Any:
    """A config field: its kind and allowed values. An int without `hi` is bounded by C_INT_MAX (named in a message
    only to a value above it); `unit` names what a number counts ("seconds"); a string with `pattern` must match it
    whole, and `what` says in words what it must be."""
    meta = {"kind": kind, "choices": choices, "lo": lo, "hi": hi, "optional": optional, "help": help, "unit": unit,
            "pattern": pattern, "what": what}
    if kind is int and hi is None:
        meta.update(hi=C_INT_MAX, hi_implicit=True)
    return field(default=default, metadata=meta)


# torch.distributed.pipelining's schedules: one stage per process, then several (looped: stage s on rank s mod p) per
# process, then the V-shaped zero-bubble ones (exactly 2 stages per process, rank r holding stages r and 2p-1-r;
# evaluation runs them through a forward-only pass over the same V placement, accel/backends/pipeline.py).
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")
RDZV_BACKENDS = ("static", "c10d")
ACTIVATION_CHECKPOINTING = ("no", "full", "selective")
# Accelerate's DynamoBackend names (lower case, as torch.compile takes them); which ones this torch really has is
# checked when the Accelerator is built (torch._dynamo.list_backends)
DYNAMO_BACKENDS = ("no", "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs", "ofi",
                   "fx2trt", "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torchxla_trace_once", "ipex", "tvm",
                   "hpu_backend")
# how context parallelism's attention exchanges keys and values (accel/backends/sequence.py)
CP_COMM_STRATEGIES = ("allgather", "ring")
# Accelerate's names (torch's ring attention's rotate methods: `alltoall` passes K/V shards around the ring) -> accel's
ACCELERATE_CP_COMM_STRATEGIES = {"allgather": "allgather", "alltoall": "ring"}
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


@dataclass
class ParallelismConfig:
    """Parallel degrees and sharding options (the `parallelism:` section of the config file).

    It also takes Accelerate's `ParallelismConfig` fields (dp_replicate_size, dp_shard_size, tp_size, cp_size,
    cp_backend, sp_size, sp_backend and the tp/cp/sp handlers) and exposes its read-only members (dp_dim_names,
    fsdp_dim_names, total_size, data_parallel_size, dp_shard_enabled, ..., build_device_mesh), so Accelerate code
    runs unchanged. How they map onto accel's fields: dp_shard_size > 1 is FSDP2 sharding (zero_stage 3 when
    zero_stage is left out; 2 keeps parameters gathered between forward and backward); dp_replicate_size > 1
    alone is DDP (zero_stage 0, or 1 for ZeRO-1's optimizer); both > 1 is HSDP (a 2-D data-parallel mesh:
    shards within a dp_shard group, all-reduce across the dp_replicate groups). See `data_parallel_sizes` for the
    sizes left out.

    Long sequences: sp_size > 1 is sequence parallelism (Ulysses: each rank holds a contiguous slice of every
    sequence; attention all-to-alls to head-sharded full sequences), cp_size > 1 context parallelism (sequences cut
    into 2 x cp_size chunks, rank i holding chunks i and 2*cp_size-1-i; attention all-gathers K and V, or torch's
    ring attention with cp_comm_strategy ring). At most one of them is above 1. Their ranks share one batch, like
    tp's (Accelerate's `non_dp_dim_names`), and reduce gradients with the data-parallel ranks: ZeRO 2/3 shard over
    dp x cp/sp (FSDP2, as torchtitan does). `sp_backend: deepspeed` (Accelerate's only value) is accel's own Ulysses,
    without DeepSpeed. Which combinations run: `accel.backends.check_available`.
    """

    zero_stage: int = _spec(
        None, int, lo=0, hi=3,
        help="ZeRO stage: 0 (plain DDP), 1, 2 or 3 (left out: 3 when dp_shard_size > 1, else 0)")
    offload_optimizer: bool = _spec(False, bool, help="keep optimizer state on the CPU (ZeRO)")
    offload_params: bool = _spec(False, bool, help="keep parameters on the CPU between uses (ZeRO)")
    tp_size: int = _spec(1, int, lo=1, help="tensor-parallel degree")
    pp_size: int = _spec(1, int, lo=1, help="pipeline-parallel degree")
    pp_schedule: str = _spec("1F1B", str, choices=PP_SCHEDULES, help="pipeline schedule")
    pp_microbatches: int | None = _spec(None, int, lo=1, optional=True,
                                        help="micro-batches per step (default: pp_size)")
    pp_stages_per_rank: int | None = _spec(
        None, int, lo=1, optional=True,
        help="model stages each process holds (default: 1; 2 for the interleaved, looped and V schedules)")
    pp_split_points: list | None = _spec(
        None, list, optional=True,
        help="names of the modules where a new stage begins, e.g. [layers.4] (default: balanced by parameter count)")
    tp_plan: dict | None = _spec(
        None, dict, optional=True,
        help="tensor-parallel plan: module name (wildcards allowed) -> colwise | rowwise | colwise_rep | rowwise_rep "
             "| fused_qkv | experts | sequence_parallel | replicate")
    activation_checkpointing: str = _spec(
        "no", str, choices=ACTIVATION_CHECKPOINTING,
        help="recompute each repeated block's activations in backward: no, full (keep only the block's input) or "
             "selective (keep matmul and attention outputs, recompute the cheap rest)")
    zero_wrap_classes: str | None = _spec(
        None, str, optional=True,
        help="comma-separated module class names that ZeRO 2/3 shard one by one (default: nn.ModuleList members)")
    zero_min_params: int | None = _spec(
        None, int, lo=1, hi=INT64_MAX, optional=True,
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
    # Accelerate's fields (accelerate.parallelism_config.ParallelismConfig); null: left out
    dp_replicate_size: int | None = _spec(
        None, int, lo=1, optional=True,
        help="data-parallel replicas (Accelerate's name): alone, DDP; with dp_shard_size > 1, HSDP (default 1)")
    dp_shard_size: int | None = _spec(
        None, int, lo=1, optional=True,
        help="ranks each replica's parameters are sharded over (FSDP2; Accelerate's name); null: 1, or with "
             "zero_stage 2/3 or TP the data-parallel ranks dp_replicate_size leaves")
    cp_size: int = _spec(
        1, int, lo=1,
        help="context-parallel degree: sequences cut into 2 x cp_size chunks, rank i holds chunks i and "
             "2*cp_size-1-i; attention all-gathers K/V (1: none)")
    cp_backend: str | None = _spec(None, str, choices=("torch",), optional=True,
                                   help="Accelerate's context-parallel backend name; accel's own runs either way")
    cp_comm_strategy: str = _spec(
        "allgather", str, choices=CP_COMM_STRATEGIES,
        help="how context parallelism's attention gets the other ranks' keys and values: allgather (each rank "
             "all-gathers K and V over the cp ranks; gloo and NCCL, any mask) or ring (torch's ring attention on "
             "CUDA where it applies: SDPA with a causal mask or none; elsewhere allgather)")
    sp_size: int = _spec(
        1, int, lo=1,
        help="sequence-parallel degree (Ulysses): each rank holds a contiguous slice of every sequence; attention "
             "all-to-alls to head-sharded full sequences (1: none)")
    ep_size: int = _spec(
        1, int, lo=1,
        help="expert-parallel degree: each MoE layer's experts are divided among ep_size data-parallel ranks, tokens "
             "reach them by all-to-all (taken from the data-parallel ranks: it divides dp; 1: none)")
    sp_backend: str | None = _spec(None, str, choices=("deepspeed",), optional=True,
                                   help="Accelerate's sequence-parallel backend name: deepspeed (ALST/Ulysses) is "
                                        "accel's own Ulysses; DeepSpeed is not needed")
    # Accelerate's handlers: Python-only options of TP/CP/SP, taken and kept on the object (not config keys, so
    # not fields: the Accelerator's layer of this object, dataclasses.asdict, leaves them out). accel's TP, CP and
    # SP take their options from the fields above, so the handlers are kept but not read.
    tp_handler: InitVar[Any] = None
    cp_handler: InitVar[Any] = None
    sp_handler: InitVar[Any] = None

    device_mesh: ClassVar[Any] = None  # Accelerate's: set by get_device_mesh (the Accelerator's is its own)

    def __post_init__(self, tp_handler: Any, cp_handler: Any, sp_handler: Any) -> None:
        self._sizes_from_env()
        for name in ("tp_size", "cp_size", "sp_size"):  # Accelerate's None: the size 1
            if getattr(self, name) is None:
                setattr(self, name, 1)
        derive_stage = self.zero_stage is None
        if derive_stage:
            self.zero_stage = 0
        if cp_handler is None and self.cp_size > 1:  # Accelerate's default handler: the field's strategy, else the
            from accel.config.parallel_handlers import TorchContextParallelConfig  # environment's (its error if bad)

            known = self.cp_comm_strategy in ("allgather", "alltoall", "ring")
            cp_handler = TorchContextParallelConfig(self.cp_comm_strategy if known else None)
        strategy = getattr(cp_handler, "cp_comm_strategy", None)  # Accelerate's TorchContextParallelConfig
        if isinstance(strategy, str) and self.cp_comm_strategy == "allgather":
            self.cp_comm_strategy = strategy
        if isinstance(self.cp_comm_strategy, str):
            self.cp_comm_strategy = ACCELERATE_CP_COMM_STRATEGIES.get(self.cp_comm_strategy, self.cp_comm_strategy)
        _validate_fields(self, "ParallelismConfig")
        if derive_stage and self.dp_shard_size is not None and self.dp_shard_size > 1:
            self.zero_stage = 3  # sharded data parallelism is FSDP2's full sharding unless a stage says otherwise
        # Accelerate's attributes, kept from the InitVars (which mypy takes for no attribute)
        self.tp_handler, self.cp_handler, self.sp_handler = tp_handler, cp_handler, sp_handler  # type: ignore[attr-defined]
        self._resolved: tuple[int, int] | None = None  # (dp_replicate, dp_shard) of the run, set by the Topology
        if self.dp_shard_size is not None:  # what needs no world size is checked now; the rest at start-up
            check_data_parallel_layout(self, self.dp_replicate_size or 1, self.dp_shard_size)

    def _sizes_from_env(self) -> None:
        """Accelerate's PARALLELISM_CONFIG_* variables (what `accelerate launch --parallelism_config_*` exports) for
        the sizes, backends and cp_comm_strategy left out (a size at its default 1, the strategy at its default
        allgather count as left out)."""
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "cp_backend", "sp_backend",
                     "cp_comm_strategy"):
            text = os.environ.get("PARALLELISM_CONFIG_" + name.upper())
            if text is None or getattr(self, name) not in (None, 1, "allgather"):
                continue
            if name.endswith(("_backend", "_strategy")):
                setattr(self, name, text)
                continue
            try:
                setattr(self, name, int(text))
            except ValueError:
                raise ConfigError(f"PARALLELISM_CONFIG_{name.upper()}={text!r}: not a whole number; allowed: a "
                                  "size >= 1") from None

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
        if self.cp_size > 1:
            wanted.append(f"context parallelism (cp_size={self.cp_size})")
        if self.sp_size > 1:
            wanted.append(f"sequence parallelism (sp_size={self.sp_size})")
        if self.ep_size > 1:
            wanted.append(f"expert parallelism (ep_size={self.ep_size})")
        return wanted

    # -- Accelerate's read-only members -----------------------------------------------------------------------
    # Sizes as Accelerate reads them: what was given (left out: 1) until an Accelerator resolves the layout for
    # its processes (e.g. plain DDP on 4 processes: dp_replicate 4), as Accelerate's _validate_accelerator does.
    def _size(self, name: str) -> int:
        if name in ("dp_replicate", "dp_shard"):
            if self._resolved is not None:
                return self._resolved[name == "dp_shard"]
            return getattr(self, f"{name}_size") or 1
        return getattr(self, f"{name}_size")

    @property
    def dp_replicate_enabled(self) -> bool:
        return self._size("dp_replicate") > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self._size("dp_shard") > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled data-parallel mesh dimensions (dp_replicate, dp_shard)."""
        return [name for name in ("dp_replicate", "dp_shard") if self._size(name) > 1]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose ranks get the same batch, in Accelerate's order: tp, cp, sp (the sequence
        ranks each keep their slice of it)."""
        return [name for name, on in (("tp", self.tp_enabled), ("cp", self.cp_enabled), ("sp", self.sp_enabled))
                if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The enabled dimensions flattened into `dp_shard_cp`, which FSDP2 shards the model over: dp_shard, cp."""
        return [name for name, on in (("dp_shard", self.dp_shard_enabled), ("cp", self.cp_enabled)) if on]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The enabled dimensions the loss is averaged over: the data-parallel ones and cp."""
        return self.dp_dim_names + (["cp"] if self.cp_enabled else [])

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions FSDP2 shards over: Accelerate's ["dp_replicate", "dp_shard_cp"] (HSDP) or
        ["dp_shard_cp"] (a flattened alias of dp_shard in the mesh, as Accelerate builds it)."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def total_size(self) -> int:
        """Processes the layout spans: dp_replicate x dp_shard x tp x cp x sp (x pp, accel's)."""
        return self.data_parallel_size * self.non_data_parallel_size

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one data shard: tp x cp x sp (x pp, accel's)."""
        return self.tp_size * self.pp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self._size("dp_replicate") * self._size("dp_shard")

    def _get_mesh(self) -> tuple:
        """Accelerate's `(mesh_dim_names, mesh_shape)` of the enabled dimensions, in its order (dp_replicate,
        dp_shard, cp, sp, tp); () when none is."""
        dims = [(name, self._size(name)) for name in ("dp_replicate", "dp_shard", "cp", "sp", "tp")
                if self._size(name) > 1]
        return tuple(zip(*dims, strict=True))

    def build_device_mesh(self, device_type: str):
        """A DeviceMesh of this layout over the running processes, as Accelerate builds it: init_device_mesh over
        the enabled dimensions (`_get_mesh`), then the flattened `dp`, `dp_shard_cp` and `dp_cp`; None when no
        dimension is above 1. With accel's pipeline stages (pp_size > 1) it is accel's topology mesh. The
        Accelerator's own mesh is `accelerator.torch_device_mesh`: this builds another (new process groups)."""
        if self.pp_size > 1:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            return Topology.for_config(world, self, accelerate_names=True).mesh(device_type)
        mesh = self._get_mesh()
        if not mesh:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = mesh
        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for dims, flat in ((self.dp_dim_names, "dp"), (self.dp_shard_cp_dim_names, "dp_shard_cp"),
                           (self.dp_cp_dim_names, "dp_cp")):
            if dims:
                device_mesh[dims]._flatten(flat)  # type: ignore[index]  # a list, as Accelerate indexes it
        return device_mesh

    def get_device_mesh(self, device_type: str | None = None):
        """Accelerate's cached `build_device_mesh`."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("ParallelismConfig.get_device_mesh: no mesh yet; allowed: a device_type such as "
                                 "'cuda' or 'cpu' to build it")
            self.device_mesh = self.build_device_mesh(device_type)  # type: ignore[misc]  # Accelerate's, not a field
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(f"ParallelismConfig.get_device_mesh: the mesh was built for {self.device_mesh.device_type}"
                             f", got device_type {device_type!r}; allowed: {self.device_mesh.device_type!r}")
        return self.device_mesh


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

    enabled: bool = _spec(False, bool,
                          help="train as replica groups under torchft (needs pip install 'accel-train[ft]')")
    group_size: int = _spec(2, int, lo=1, help="replica groups (torchtitan's group_size); each group runs "
                                               "num_processes / group_size processes")
    replica_id: int | None = _spec(None, int, lo=0, optional=True,
                                   help="this group's index (set by accel launch for each group it starts; give it "
                                        "only when starting the groups yourself)")
    min_replicas: int = _spec(1, int, lo=1, help="live replica groups a step needs to commit (torchft's "
                                                 "min_replica_size)")
    lighthouse: str = _spec("start", str, pattern=r"start|" + LIGHTHOUSE_PATTERN, what='"start" or host:port',
                            help='"start": accel launch starts torchft\'s lighthouse (on machine_rank 0); or the '
                                 "host:port of a running one")
    lighthouse_port: int | None = _spec(None, int, lo=1, hi=65535, optional=True,
                                        help="the port of the lighthouse accel launch starts (null: a free port on "
                                             f"one machine, {DEFAULT_LIGHTHOUSE_PORT} across machines)")
    semi_sync_method: str | None = _spec(None, str, choices=SEMI_SYNC_METHODS, optional=True,
                                         help="null: every step all-reduces gradients over the groups; local_sgd or "
                                              "diloco: the groups synchronise every sync_steps steps (slow links)")
    sync_steps: int = _spec(20, int, lo=1, help="optimizer steps between two synchronisations (semi_sync_method)")
    outer_lr: float = _spec(0.7, float, lo=0, help="DiLoCo's outer SGD learning rate (Nesterov momentum 0.9)")
    timeout: float = _spec(60.0, float, lo=1, hi=MAX_SECONDS, unit="seconds",
                           help="seconds an all-reduce, commit or healing transfer over the groups may take")
    quorum_timeout: float = _spec(60.0, float, lo=1, hi=MAX_SECONDS, unit="seconds",
                                  help="seconds a group waits for a quorum of the live groups")
    heartbeat_timeout: float = _spec(5.0, float, lo=0.1, hi=MAX_SECONDS, unit="seconds",
                                     help="seconds without a heartbeat after which the lighthouse accel launch "
                                          "starts counts a group as gone (the live groups wait this long after a "
                                          "failure)")
    start_timeout: float = _spec(300.0, float, lo=0, hi=MAX_SECONDS, unit="seconds",
                                 help="seconds the first step waits for every replica group to come (so a job "
                                      "without failures is DDP whatever the start skew); a group not come by then "
                                      "is left behind and heals when it comes")
    check_every: int = _spec(100, int, lo=0, help="committed steps between two comparisons of the groups' weight "
                                                  "fingerprints (and one at the end); a difference stops the job "
                                                  "(exit code 76); 0: never")

    def __post_init__(self) -> None:
        _validate_fields(self, "FaultToleranceConfig")


@dataclass
class AccelConfig:
    """The whole resolved config. Key names follow Accelerate's config file."""

    compute_environment: str = _spec("LOCAL_MACHINE", str, choices=("LOCAL_MACHINE",),
                                      help="Accelerate's key; accel runs on the local machine(s) only")
    distributed_type: str | None = _spec(None, str, choices=DISTRIBUTED_TYPES, optional=True,
                                         help="null derives it: NO for one process, MULTI_GPU with CUDA (and not "
                                              "use_cpu), else MULTI_CPU")
    num_processes: int = _spec(1, int, lo=1, help="total processes over all machines")
    num_machines: int = _spec(1, int, lo=1, help="machines the job spans (each runs num_processes / num_machines)")
    machine_rank: int = _spec(0, int, lo=0, help="this machine's index, 0 at main_process_ip (with rdzv_backend c10d: "
                                                 "only which machine hosts the rendezvous)")
    main_process_ip: str | None = _spec(None, str, optional=True, pattern=HOST_PATTERN,
                                        what="a host name or IP address",
                                        help="the rendezvous address: machine 0 (required with num_machines > 1)")
    main_process_port: int | None = _spec(None, int, lo=1, hi=65535, optional=True,
                                          help="the rendezvous port (null: a free port on one machine)")
    use_cpu: bool = _spec(False, bool, help="run on the CPU (gloo) even where GPUs are present")
    gpu_ids: str = _spec("all", str, help='"all" or a comma-separated list like "0,1" (becomes CUDA_VISIBLE_DEVICES)')
    mixed_precision: str = _spec("no", str, choices=MIXED_PRECISIONS,
                                  help="no (fp32), bf16 or fp16 (autocast; fp16 with loss scaling), fp8 (torchao)")
    gradient_accumulation_steps: int = _spec(1, int, lo=1, help="batches per optimizer step")
    rdzv_backend: str = _spec("static", str, choices=RDZV_BACKENDS,
                              help="static: machine_rank is the node rank; c10d: ranks in arrival order")
    same_network: bool = _spec(True, bool, help="Accelerate's key: the machines share a network (accepted)")
    dynamo_backend: str = _spec("no", str, choices=DYNAMO_BACKENDS,
                                help="torch.compile backend; no: eager (Accelerate's key and flag)")
    dynamo_mode: str = _spec("default", str, choices=DYNAMO_MODES, help="torch.compile's mode")
    dynamo_use_fullgraph: bool = _spec(False, bool, help="torch.compile(fullgraph=True): a graph break is an error")
    dynamo_use_dynamic: bool | None = _spec(None, bool, optional=True, help="null: torch.compile decides")
    dynamo_use_regional_compilation: bool = _spec(False, bool,
                                                  help="compile each repeated block instead of the whole model")
    collective_timeout: float = _spec(
        DEFAULT_COLLECTIVE_TIMEOUT, float, lo=1, hi=MAX_SECONDS, unit="seconds",
        help="seconds a collective may wait for every process; then the job stops and names the ones that never came")
    checkpoint_async: str = _spec(
        "no", str, choices=("no", "thread", "process"),
        help="save_state writes in the background: no (the loop waits), thread, or process (torch's own process)")
    preemption_signal: str | None = _spec(
        None, str, choices=PREEMPTION_SIGNALS, optional=True,
        help="a signal that, like SIGTERM, asks the workers to save and stop (accelerator.preemption_requested)")
    grace_period: float = _spec(
        DEFAULT_GRACE_PERIOD, float, lo=1, hi=MAX_SECONDS, unit="seconds",
        help="seconds the workers get to save and stop after a preemption request; then they are stopped")
    requeue: bool = _spec(False, bool, help="after the workers stopped for a preemption request, `scontrol requeue` "
                                            "the SLURM job")
    throughput_monitor: bool = _spec(
        False, bool, help="log samples/s, tokens/s, step time, peak memory and MFU through the trackers and the "
                          "progress bar every throughput_log_every optimizer steps (accel/planning/throughput.py)")
    throughput_log_every: int = _spec(10, int, lo=1, help="optimizer steps per throughput report")
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
        _validate_fields(self, "AccelConfig")
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


# ---------------------------------------------------------------------------------------------------------
# field validation
# ---------------------------------------------------------------------------------------------------------

def allowed_values(meta: Mapping, value: Any = None) -> str:
    """What a field allows, in words. An int's implicit bound (C_INT_MAX) is named only when `value` is above it."""
    kind, choices, lo, hi = meta["kind"], meta["choices"], meta["lo"], meta["hi"]
    if meta.get("hi_implicit") and not (isinstance(value, int) and not isinstance(value, bool) and value > hi):
        hi = None
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
        if meta.get("unit"):
            noun = f"a finite number of {meta['unit']}" if kind is float else f"a number of {meta['unit']}"
        if lo is not None and hi is not None:
            text = f"{noun} from {lo} to {hi}"
        elif lo is not None:
            text = f"{noun} >= {lo}"
        else:
            text = noun
    else:
        text = meta.get("what") or "a string"
    if meta.get("auto"):
        text += ' or "auto"'
    return text + (" (or null)" if meta["optional"] else "")


def check_value(value: Any, meta: Mapping, key: str, source: str) -> Any:
    """Return `value` in canonical form, or raise ConfigError naming source/key/value/allowed."""

    def fail() -> None:
        raise ConfigError(f"{source}: key '{key}': bad value {shown(value)}; allowed: {allowed_values(meta, value)}")

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
    if meta.get("pattern") and not re.fullmatch(meta["pattern"], value):
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


def _field_specs(cls: type) -> dict[str, Mapping]:
    return {f.name: f.metadata for f in dataclasses.fields(cls) if "kind" in f.metadata}


TOP_FIELDS = _field_specs(AccelConfig)
PARALLEL_FIELDS = _field_specs(ParallelismConfig)
FAULT_TOLERANCE_FIELDS = _field_specs(FaultToleranceConfig)
SECTIONS = {"parallelism": PARALLEL_FIELDS, "fault_tolerance": FAULT_TOLERANCE_FIELDS}  # nested sections of a file
CARRIED_KEYS = ("deepspeed_json", "deepspeed_json_path")  # AccelConfig fields carried to workers, not file keys


def check_carried_deepspeed_json(data: Any, path: Any, source: str) -> None:
    """The carried DeepSpeed JSON is a JSON object (or None) and its path a string (or None); ConfigError otherwise."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{source}: key 'deepspeed_json': bad value of type {type(data).__name__}; allowed: a "
                          "DeepSpeed JSON object (or null)")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"{source}: key 'deepspeed_json_path': bad value {shown(path)}; allowed: a path (or null)")


@dataclass(frozen=True)
class _Unknown:
    name: str                # as shown, with its section (`parallelism.tp_sise`)
    close: str | None        # the known key it most likely meant
    where: str               # the section ("parallelism."), "" at the top level
    known: tuple[str, ...]   # the keys known there


class UnknownKeyError(ConfigError):
    """One or more unknown keys of one source, named in one line: `unknown_key` makes one, `UnknownKeys` joins those
    of a whole layer so that every typo is named at once."""

    def __init__(self, source: str, unknown: list[_Unknown]):
        self.source, self.unknown = source, unknown
        super().__init__(_unknown_message(source, unknown))


def _unknown_message(source: str, unknown: list[_Unknown]) -> str:
    if len(unknown) == 1:
        one = unknown[0]
        hint = f"did you mean '{one.close}'?" if one.close else f"known keys: {', '.join(sorted(one.known))}"
        return f"{source}: unknown key '{one.name}'; {hint}"
    names = ", ".join(f"'{u.name}'" + (f" (did you mean '{u.close}'?)" if u.close else "") for u in unknown)
    known = {u.where: u.known for u in unknown if not u.close}  # one list per section with a key matching nothing
    tails = [f"known {where.rstrip('.') + ' ' if where else ''}keys: {', '.join(sorted(keys))}"
             for where, keys in known.items()]
    return f"{source}: unknown keys {names}" + "".join(f"; {tail}" for tail in tails)


def unknown_key(key: str, known: tuple[str, ...] | list[str], source: str, where: str = "") -> UnknownKeyError:
    name = str(key) if isinstance(key, str) and len(key) <= 60 and key.isprintable() else shown(key).strip("'\"")
    close = difflib.get_close_matches(str(key)[:100], list(known), n=1, cutoff=0.6)
    return UnknownKeyError(source, [_Unknown(f"{where}{name}", close[0] if close else None, where, tuple(known))])


class UnknownKeys:
    """Every unknown key of a layer, named at once: run each key's check under `check()`; an unknown key is kept and
    the next key checked. Once one was found, another mistake (a bad value) is not raised: the unknown keys came
    first and are what `raise_found()` names, in one line."""

    def __init__(self, source: str):
        self.source = source
        self.found: list[_Unknown] = []

    @contextlib.contextmanager
    def check(self):
        try:
            yield
        except UnknownKeyError as exc:
            self.found.extend(exc.unknown)
        except ConfigError:
            if not self.found:
                raise

    def raise_found(self) -> None:
        if self.found:
            raise UnknownKeyError(self.source, self.found)


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
