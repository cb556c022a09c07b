"""Parallel degrees -> named mesh dimensions: their sizes, each rank's coordinates, the mesh's shape and the
dimensions flattened from it. Pure arithmetic, no process group: the run's mesh and groups are built from this by
accel/runtime/topology.py, and `ParallelismConfig.build_device_mesh` (Accelerate's API) builds a mesh of this shape.

Rank layout is row-major over (pp, dp, seq, tp), as `init_device_mesh` lays it out: tp ranks are neighbours
(they talk most), then the sequence ranks (sp for Ulysses, cp for context parallelism: they share one batch, each
holding a slice of every sequence), pp is outermost, as torchtitan orders its mesh. The data-parallel degree dp may
be split as Accelerate names it, into dp_replicate (outer) x dp_shard (inner): HSDP shards within a dp_shard group
and all-reduces across replicas.

Dimension names: with accel's own fields the data-parallel dimension is one `dp`, as it always was. When the
config uses Accelerate's fields (dp_replicate_size / dp_shard_size), the mesh has Accelerate's dimensions
(dp_replicate, dp_shard: those above 1) and, flattened from them as Accelerate's `build_device_mesh` does,
`dp` (the whole data-parallel group: data loading, DDP, metrics), `dp_shard_cp` and `dp_cp`. Size-1 dimensions
are left out. With a sequence degree, `dp_cp` (the data-parallel ranks and the sequence ranks together) is where
gradients are reduced and FSDP2 shards, as torchtitan does: each sequence rank computes part of every gradient (under
HSDP, FSDP2 shards over `dp_shard_cp` and replicates over `dp_replicate`).

Expert parallelism (ep_size) takes its ranks from the data-parallel ones, as torchtitan does: data-parallel rank d
has ep coordinate d % ep (the ep ranks are neighbours) and edp coordinate d // ep (which copy of the experts it
holds; with a sequence degree, (d // ep) x seq + the sequence coordinate: the sequence ranks hold the same experts
and compute parts of their gradients, so they are replicas too). Each pipeline stage has its own ep and edp
groups (pp is outside them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

from accel.config.degrees import (
    check_expert_degree,
    data_parallel_sizes,
    divides_world,
    model_parallel_size,
    sequence_parallel_size,
)
from accel.config.errors import ConfigError

if TYPE_CHECKING:
    from accel.config.parallelism import ParallelismConfig

DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")
LayoutT = TypeVar("LayoutT", bound="MeshLayout")


@dataclass
class MeshLayout:
    """The named dimensions of `world_size` ranks laid out by the parallel degrees (checked on construction)."""

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    dp_replicate_size: int | None = None  # None (both): every data-parallel rank replicates
    dp_shard_size: int | None = None
    accelerate_names: bool = False  # name the data-parallel dims as Accelerate does (always when both are > 1)
    seq_size: int = 1  # the sequence degree (sp_size or cp_size)
    seq_name: str = "sp"  # its dimension's name: "sp" (Ulysses) or "cp" (context parallelism)
    ep_size: int = 1  # the expert-parallel degree, taken from the data-parallel ranks (ep divides dp)

    def __post_init__(self) -> None:
        model_parallel = model_parallel_size(self.tp_size, self.pp_size, self.seq_size)
        if not divides_world(self.world_size, self.tp_size, self.pp_size, self.seq_size):
            seq = f" x {self.seq_name}_size={self.seq_size}" if self.seq_size > 1 else ""
            raise ConfigError(
                f"parallelism: tp_size={self.tp_size} x pp_size={self.pp_size}{seq} = {model_parallel} does not "
                f"divide the world size {self.world_size}; allowed: degrees whose product divides the number of "
                "processes"
            )
        dp = self.dp_size
        replicate, shard = self.dp_replicate_size, self.dp_shard_size
        if replicate is None:
            replicate = dp if shard is None else max(dp // shard, 1)
        if shard is None:
            shard = 1 if self.dp_replicate_size is None else max(dp // replicate, 1)
        self.dp_replicate_size, self.dp_shard_size = replicate, shard
        if replicate * shard != dp:
            raise ConfigError(
                f"parallelism: dp_replicate_size={replicate} x dp_shard_size={shard} x "
                f"tp_size={self.tp_size} x pp_size={self.pp_size} does not make the world size {self.world_size}; "
                f"allowed: dp_replicate_size x dp_shard_size = {dp}")
        self.accelerate_names = self.accelerate_names or (replicate > 1 and shard > 1)
        check_expert_degree(self.ep_size, dp)

    @property
    def _dp_sizes(self) -> tuple[int, int]:
        """(dp_replicate, dp_shard): both set by __post_init__ (the fields are None only as arguments)."""
        return cast(int, self.dp_replicate_size), cast(int, self.dp_shard_size)

    @classmethod
    def for_config(cls: type[LayoutT], world_size: int, parallelism: ParallelismConfig,
                   accelerate_names: bool | None = None) -> LayoutT:
        """The layout a ParallelismConfig asks for on `world_size` processes (sizes left out are derived:
        `accel.config.degrees.data_parallel_sizes`); the resolved sizes are recorded on the config, whose
        Accelerate members (data_parallel_size, dp_shard_enabled, ...) then describe this run."""
        tp, pp, seq = parallelism.tp_size, parallelism.pp_size, sequence_parallel_size(parallelism)
        replicate = shard = None
        if divides_world(world_size, tp, pp, seq):  # else the constructor names tp x pp
            replicate, shard = data_parallel_sizes(parallelism, world_size)
        if accelerate_names is None:
            accelerate_names = parallelism.dp_replicate_size is not None or parallelism.dp_shard_size is not None
        seq_name = "cp" if getattr(parallelism, "cp_size", 1) > 1 else "sp"
        layout = cls(world_size, tp, pp, replicate, shard, accelerate_names, seq_size=seq, seq_name=seq_name,
                     ep_size=getattr(parallelism, "ep_size", 1))
        parallelism.record_run_sizes(*layout._dp_sizes)
        return layout

    @property
    def dp_size(self) -> int:
        """Data-parallel degree (dp_replicate x dp_shard): what is left of the world after the model-parallel
        degrees. Data loading, the scheduler and gradient averaging count these ranks."""
        return self.world_size // model_parallel_size(self.tp_size, self.pp_size, self.seq_size)

    @property
    def degrees(self) -> dict[str, int]:
        degrees = {"pp": self.pp_size, "dp": self.dp_size, "tp": self.tp_size}
        return {**degrees, self.seq_name: self.seq_size} if self.seq_size > 1 else degrees

    @property
    def sizes(self) -> dict[str, int]:
        """Every named dimension's size (dp is dp_replicate x dp_shard; dp_cp is dp x the sequence degree)."""
        replicate, shard = self._dp_sizes
        sizes = {**self.degrees, "dp_replicate": replicate, "dp_shard": shard}
        if self.ep_size > 1:  # edp: the expert's replicas, the sequence ranks included (they reduce its gradients)
            sizes.update(ep=self.ep_size, edp=self.dp_size // self.ep_size * self.seq_size)
        return {**sizes, "dp_cp": self.dp_size * self.seq_size} if self.seq_size > 1 else sizes

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position on each named dimension (pure arithmetic: no process group needed). Its `dp`
        coordinate is dp_replicate x dp_shard + dp_shard: its rank in the flattened data-parallel group."""
        tp = rank % self.tp_size
        seq = (rank // self.tp_size) % self.seq_size
        dp = (rank // (self.tp_size * self.seq_size)) % self.dp_size
        pp = rank // (self.tp_size * self.seq_size * self.dp_size)
        shard = self._dp_sizes[1]
        coords = {"pp": pp, "dp": dp, "tp": tp, "dp_replicate": dp // shard, "dp_shard": dp % shard}
        if self.ep_size > 1:
            coords.update(ep=dp % self.ep_size, edp=dp // self.ep_size * self.seq_size + seq)
        return {**coords, self.seq_name: seq, "dp_cp": dp * self.seq_size + seq} if self.seq_size > 1 else coords

    @property
    def gradient_dim(self) -> str:
        """The dimension whose ranks reduce gradients (DDP) and share optimizer state (ZeRO-1): dp, or with a
        sequence degree dp_cp (each sequence rank computes part of every gradient)."""
        return "dp_cp" if self.seq_size > 1 else "dp"

    def seq_rank(self, rank: int) -> int:
        """Which slice of every sequence this rank holds (0 without a sequence degree)."""
        return self.coordinates(rank).get(self.seq_name, 0)

    def dp_rank(self, rank: int) -> int:
        return self.coordinates(rank)["dp"]

    def mesh_dims(self) -> list[tuple[str, int]]:
        """The mesh's (name, size) dimensions, outermost first; those of size 1 are left out."""
        if self.accelerate_names:
            data = [(name, self.sizes[name]) for name in DATA_PARALLEL_DIMS]
        else:
            data = [("dp", self.dp_size)]
        dims = [(name, size) for name, size in [("pp", self.pp_size), *data, (self.seq_name, self.seq_size),
                                                ("tp", self.tp_size)] if size > 1]
        return dims or [("dp", 1)]

    def flattened_dims(self) -> dict[str, tuple[str, ...]]:
        """The dimensions flattened from the mesh's, in the order they are made: with Accelerate's names `dp` (the
        data-parallel dims), `dp_shard_cp` and `dp_cp`, as Accelerate's `build_device_mesh` makes them; with accel's,
        `dp_cp` (dp and the sequence ranks) when both are there."""
        names = tuple(name for name, _ in self.mesh_dims())
        data = tuple(name for name in DATA_PARALLEL_DIMS if name in names)
        seq = (self.seq_name,) if self.seq_name in names else ()
        if self.accelerate_names and data:
            flat = {"dp": data}
            if "dp_shard" in names:
                flat["dp_shard_cp"] = ("dp_shard",) + seq
            return {**flat, "dp_cp": data + seq}
        if seq and "dp" in names:
            return {"dp_cp": ("dp",) + seq}
        return {}

    def aliases(self) -> dict[str, str]:
        """Dimensions known under a second name: with the sequence ranks alone reducing gradients (no data-parallel
        dimension), `dp_cp` is the sequence dimension."""
        names = tuple(name for name, _ in self.mesh_dims())
        if self.seq_name in names and "dp_cp" not in self.flattened_dims():
            return {"dp_cp": self.seq_name}
        return {}

    def fsdp_dims(self) -> tuple[str, ...]:
        """The dimensions FSDP2 shards over: 2-D (dp_replicate, dp_shard) for HSDP, else the 1-D data-parallel
        dimension. The sequence ranks compute parts of the same gradients, so they shard with the data-parallel
        ones, as torchtitan does: dp_cp, or for HSDP (dp_replicate, dp_shard_cp)."""
        if self.seq_size > 1 and self.sizes["dp_replicate"] > 1 and self.sizes["dp_shard"] > 1:
            return ("dp_replicate", "dp_shard_cp")
        if self.seq_size > 1:
            return ("dp_cp",)
        if self.accelerate_names:
            return tuple(n for n in DATA_PARALLEL_DIMS if self.sizes[n] > 1) or ("dp",)
        return ("dp",)

    @property
    def expert_divisor(self) -> int:
        """What expert gradients summed over edp are divided by: the data-parallel x sequence degree, as the
        other gradients are over `gradient_dim` (each sequence rank's loss counts its slice seq times:
        sequence.reduce_loss), which gives the single-process gradient of the mean loss."""
        return self.dp_size * self.seq_size
