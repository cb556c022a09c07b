"""Parallel degrees -> one validated `DeviceMesh` with named dimensions (pp, dp, tp).

Rank layout is row-major over (pp, dp, tp), as `init_device_mesh` lays it out: tp ranks are neighbours
(they talk most), pp is outermost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accel.config import ConfigError, divides_world, model_parallel_size


@dataclass
class Topology:
    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    _mesh: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        model_parallel = model_parallel_size(self.tp_size, self.pp_size)
        if not divides_world(self.world_size, self.tp_size, self.pp_size):
            raise ConfigError(
                f"parallelism: tp_size={self.tp_size} x pp_size={self.pp_size} = {model_parallel} does not divide "
                f"the world size {self.world_size}; allowed: degrees whose product divides the number of processes"
            )

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: what is left of the world after the model-parallel degrees."""
        return self.world_size // model_parallel_size(self.tp_size, self.pp_size)

    @property
    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp_size, "dp": self.dp_size, "tp": self.tp_size}

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position on each named dimension (pure arithmetic: no process group needed)."""
        tp = rank % self.tp_size
        dp = (rank // self.tp_size) % self.dp_size
        pp = rank // (self.tp_size * self.dp_size)
        return {"pp": pp, "dp": dp, "tp": tp}

    def dp_rank(self, rank: int) -> int:
        return self.coordinates(rank)["dp"]

    def mesh(self, device_type: str):
        """The one `DeviceMesh` over all ranks, built on first use. Dimensions of size 1 are kept out."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            dims = [(name, size) for name, size in self.degrees.items() if size > 1] or [("dp", 1)]
            self._mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        return self._mesh

    def group(self, name: str, device_type: str):
        """The process group of one named dimension, or None when that dimension has size 1."""
        if self.degrees[name] == 1:
            return None
        return self.mesh(device_type)[name].get_group()
