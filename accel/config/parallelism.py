"""The `parallelism:` section of the config tree: `ParallelismConfig`, accel's degrees and sharding options and
Accelerate's `ParallelismConfig` members, with the values its choice fields allow."""

from __future__ import annotations

import os
from dataclasses import InitVar, dataclass
from collections.abc import Mapping
from typing import Any, ClassVar

from accel.config.degrees import check_data_parallel_layout
from accel.config.errors import ConfigError
from accel.config.fields import INT64_MAX, spec, validate_fields
from accel.config.mesh_layout import MeshLayout

# torch.distributed.pipelining's schedules: one stage per process, then several (looped: stage s on rank s mod p) per
# process, then the V-shaped zero-bubble ones (exactly 2 stages per process, rank r holding stages r and 2p-1-r;
# evaluation runs them through a forward-only pass over the same V placement, accel/backends/pipeline.py).
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
ACTIVATION_CHECKPOINTING = ("no", "full", "selective")
# how bf16/fp16 runs under ZeRO 2/3 (accel/parallel/data_parallel.py decides it once)
ZERO_MIXED_PRECISIONS = ("auto", "fsdp_policy", "autocast")
# how context parallelism's attention exchanges keys and values (accel/parallel/sequence.py)
CP_COMM_STRATEGIES = ("allgather", "ring")
# Accelerate's names (torch's ring attention's rotate methods: `alltoall` passes K/V shards around the ring) -> accel's
ACCELERATE_CP_COMM_STRATEGIES = {"allgather": "allgather", "alltoall": "ring"}

# the fields Accelerate's PARALLELISM_CONFIG_<NAME> variables give (what `accelerate launch --parallelism_config_*`
# exports)
ENV_FIELDS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "cp_backend", "sp_backend",
              "cp_comm_strategy")


def env_values(given: Mapping[str, Any]) -> dict:
    """The values Accelerate's PARALLELISM_CONFIG_* variables give for the fields `given` leaves out (absent, None, a
    size at its default 1, the strategy at its default allgather)."""
    values: dict = {}
    for name in ENV_FIELDS:
        text = os.environ.get("PARALLELISM_CONFIG_" + name.upper())
        if text is None or given.get(name) not in (None, 1, "allgather"):
            continue
        if name.endswith(("_backend", "_strategy")):
            values[name] = text
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise ConfigError(f"PARALLELISM_CONFIG_{name.upper()}={text!r}: not a whole number; allowed: a "
                              "size >= 1") from None
    return values


def derived_zero_stage(dp_shard_size: int | None) -> int:
    """The ZeRO stage of a layout that names none: sharded data parallelism (dp_shard_size > 1) is FSDP2's full
    sharding, 3; otherwise plain data parallelism, 0."""
    return 3 if (dp_shard_size or 1) > 1 else 0


def requested_zero_stage(parallelism: Mapping[str, Any]) -> int:
    """The ZeRO stage a (merged, validated) `parallelism` layer asks for, as `ParallelismConfig` derives it, without
    building one: its zero_stage, else `derived_zero_stage` of its dp_shard_size (or the environment's)."""
    if parallelism.get("zero_stage") is not None:
        return parallelism["zero_stage"]
    return derived_zero_stage({**parallelism, **env_values(parallelism)}.get("dp_shard_size"))


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

    zero_stage: int = spec(
        None, int, lo=0, hi=3,
        help="ZeRO stage: 0 (plain DDP), 1, 2 or 3 (left out: 3 when dp_shard_size > 1, else 0)",
        ask="ZeRO stage (0: plain DDP, 1, 2 or 3)?")
    offload_optimizer: bool = spec(False, bool, help="keep optimizer state on the CPU (ZeRO)",
                                   ask="Offload the optimizer state to the CPU?")
    offload_params: bool = spec(False, bool, help="keep parameters on the CPU between uses (ZeRO)")
    zero_mixed_precision: str = spec(
        "auto", str, choices=ZERO_MIXED_PRECISIONS,
        help="how bf16/fp16 runs under ZeRO 2/3: fsdp_policy (FSDP2's MixedPrecisionPolicy: bf16/fp16 parameters "
             "in forward and backward, fp32 master shards, fp32 gradient reduction; also on one process), autocast "
             "(fp32 parameters under autocast) or auto (the policy where Accelerate's FSDP2 takes it: several "
             "ranks, or one process off the CPU; else autocast)")
    tp_size: int = spec(1, int, lo=1, help="tensor-parallel degree",
                        ask="Tensor-parallel size (1: none)?")
    pp_size: int = spec(1, int, lo=1, help="pipeline-parallel degree",
                        ask="Pipeline-parallel size (1: none)?")
    pp_schedule: str = spec("1F1B", str, choices=PP_SCHEDULES,
                            help="pipeline schedule; the zero-bubble V schedules ZBVZeroBubble and DualPipeV hold "
                                 "2 stages per process (DualPipeV: pp_microbatches >= 2 x pp_size)",
                            ask="Pipeline schedule?")
    pp_microbatches: int | None = spec(None, int, lo=1, optional=True,
                                       help="micro-batches per step (default: pp_size)",
                                       ask="How many micro-batches per step?")
    pp_stages_per_rank: int | None = spec(
        None, int, lo=1, optional=True,
        help="model stages each process holds (default: 1; 2 for the interleaved, looped and V schedules)")
    pp_split_points: list | None = spec(
        None, list, optional=True,
        help="names of the modules where a new stage begins, e.g. [layers.4] (default: balanced by parameter count)")
    tp_plan: dict | None = spec(
        None, dict, optional=True,
        help="tensor-parallel plan: module name (wildcards allowed) -> colwise | rowwise | colwise_rep | rowwise_rep "
             "| fused_qkv | experts | sequence_parallel | replicate")
    activation_checkpointing: str = spec(
        "no", str, choices=ACTIVATION_CHECKPOINTING,
        help="recompute each repeated block's activations in backward: no, full (keep only the block's input) or "
             "selective (keep matmul and attention outputs, recompute the cheap rest)")
    zero_wrap_classes: str | None = spec(
        None, str, optional=True,
        help="comma-separated module class names that ZeRO 2/3 shard one by one (default: nn.ModuleList members)")
    zero_min_params: int | None = spec(
        None, int, lo=1, hi=INT64_MAX, optional=True,
        help="without repeated blocks, ZeRO 2/3 shards submodules with at least this many parameters (default 1e8)")
    # Batch sizes and clipping as a DeepSpeed JSON states them (train_micro_batch_size_per_gpu, train_batch_size,
    # gradient_clipping), so the Accelerator and the ZeRO backend can read them.
    micro_batch_size: int | None = spec(
        None, int, lo=1, optional=True,
        help="per-process batch size (DeepSpeed's train_micro_batch_size_per_gpu); informational: for the backend "
             "to check against the data loader's batch size")
    train_batch_size: int | None = spec(
        None, int, lo=1, optional=True,
        help="samples per optimizer step over all processes = micro_batch_size x gradient_accumulation_steps x "
             "data-parallel size (DeepSpeed's train_batch_size); informational: checked by the backend")
    gradient_clipping: float | None = spec(
        None, float, lo=0, optional=True,
        help="the total norm DeepSpeed clips gradients to at every optimizer step, automatically (DeepSpeed's "
             "gradient_clipping), carried for the Accelerator to apply; null or 0: no automatic clipping")
    # Accelerate's fields (accelerate.parallelism_config.ParallelismConfig); null: left out
    dp_replicate_size: int | None = spec(
        None, int, lo=1, optional=True,
        help="data-parallel replicas (Accelerate's name): alone, DDP; with dp_shard_size > 1, HSDP (default 1)")
    dp_shard_size: int | None = spec(
        None, int, lo=1, optional=True,
        help="ranks each replica's parameters are sharded over (FSDP2; Accelerate's name); null: 1, or with "
             "zero_stage 2/3 or TP the data-parallel ranks dp_replicate_size leaves")
    cp_size: int = spec(
        1, int, lo=1,
        help="context-parallel degree: sequences cut into 2 x cp_size chunks, rank i holds chunks i and "
             "2*cp_size-1-i; attention all-gathers K/V (1: none)",
        ask="Context-parallel size (each process holds 2 of 2N chunks of every sequence)?")
    cp_backend: str | None = spec(None, str, choices=("torch",), optional=True,
                                  help="Accelerate's context-parallel backend name; accel's own runs either way")
    cp_comm_strategy: str = spec(
        "allgather", str, choices=CP_COMM_STRATEGIES,
        help="how context parallelism's attention gets the other ranks' keys and values: allgather (each rank "
             "all-gathers K and V over the cp ranks; gloo and NCCL, any mask) or ring (torch's ring attention on "
             "CUDA where it applies: SDPA with a causal mask or none; elsewhere allgather)")
    sp_size: int = spec(
        1, int, lo=1,
        help="sequence-parallel degree (Ulysses): each rank holds a contiguous slice of every sequence; attention "
             "all-to-alls to head-sharded full sequences (1: none)",
        ask="Sequence-parallel size (each process holds 1/N of every sequence)?")
    ep_size: int = spec(
        1, int, lo=1,
        help="expert-parallel degree: each MoE layer's experts are divided among ep_size data-parallel ranks, tokens "
             "reach them by all-to-all (taken from the data-parallel ranks: it divides dp; 1: none)",
        ask="Expert-parallel size for mixture-of-experts models (each MoE layer's experts divided among N "
            "data-parallel processes; 1: none)?")
    sp_backend: str | None = spec(None, str, choices=("deepspeed",), optional=True,
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
        for name, value in env_values({name: getattr(self, name) for name in ENV_FIELDS}).items():
            setattr(self, name, value)
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
        validate_fields(self, "ParallelismConfig")
        if derive_stage:
            self.zero_stage = derived_zero_stage(self.dp_shard_size)
        # Accelerate's attributes, kept from the InitVars (which mypy takes for no attribute)
        self.tp_handler, self.cp_handler, self.sp_handler = tp_handler, cp_handler, sp_handler  # type: ignore[attr-defined]
        self._resolved: tuple[int, int] | None = None  # (dp_replicate, dp_shard) of the run: record_run_sizes
        if self.dp_shard_size is not None:  # what needs no world size is checked now; the rest at start-up
            check_data_parallel_layout(self, self.dp_replicate_size or 1, self.dp_shard_size)

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
    def record_run_sizes(self, dp_replicate: int, dp_shard: int) -> None:
        """The run's resolved data-parallel sizes (MeshLayout.for_config): Accelerate's members describe them."""
        self._resolved = (dp_replicate, dp_shard)

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
        dimension is above 1. With accel's pipeline stages (pp_size > 1) it has the shape of accel's own mesh
        (accel.config.mesh_layout). The Accelerator's own mesh is `accelerator.torch_device_mesh`: this builds another
        (new process groups)."""
        flattened: dict[str, Any]
        if self.pp_size > 1:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            layout = MeshLayout.for_config(world, self, accelerate_names=True)
            names, shape = zip(*layout.mesh_dims(), strict=True)
            flattened = layout.flattened_dims()
        else:
            mesh = self._get_mesh()
            if not mesh:
                return None
            names, shape = mesh
            flattened = {"dp": self.dp_dim_names, "dp_shard_cp": self.dp_shard_cp_dim_names,
                         "dp_cp": self.dp_cp_dim_names}
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat, dims in flattened.items():
            if dims:
                device_mesh[dims]._flatten(flat)  # a list (Accelerate's) or a tuple of names
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
