"""The run's process groups: one `DeviceMesh` over all ranks laid out as `accel.config.mesh_layout.MeshLayout`
says, its flattened dimensions, the expert-parallel mesh, and each named dimension's group. Built on first use, by
every rank in the same order; the Accelerator owns one and the backends ask it by name (`group("tp", device_type)`).

The expert mesh holds expert parallelism's groups (ep, edp) on a second mesh, since they cut the dp dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accel.config.mesh_layout import DATA_PARALLEL_DIMS, MeshLayout

HSDP_SEQUENCE_MESH = "(dp_replicate, dp_shard_cp)"  # HSDP's 2-D mesh with the sequence ranks (kept with the flattened)


@dataclass
class Topology(MeshLayout):
    """A MeshLayout with its meshes and process groups, built on first use."""

    _mesh: object = field(default=None, repr=False, compare=False)
    _flat: dict = field(default_factory=dict, repr=False, compare=False)
    _expert_mesh: object = field(default=None, repr=False, compare=False)

    def mesh(self, device_type: str):
        """The one `DeviceMesh` over all ranks, built on first use (by every rank). Dimensions of size 1 are kept
        out; with Accelerate's names, the flattened dp, dp_shard_cp and dp_cp are registered on it too."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            dims = self.mesh_dims()
            names = tuple(n for n, _ in dims)
            mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=names)
            self._flat = {name: mesh[flat]._flatten(name) for name, flat in self.flattened_dims().items()}
            if "dp_cp" not in self._flat and self.seq_name in names:  # the sequence ranks alone reduce gradients
                self._flat["dp_cp"] = mesh[self.seq_name]
            self._mesh = mesh
        return self._mesh

    def expert_mesh(self, device_type: str):
        """The mesh of expert parallelism, built on first use (by every rank): the data-parallel ranks cut into
        (edp, ep), ep inner (neighbours exchange tokens), then `tp` (with tensor parallelism), the pipeline stages
        in a leading `ep_rest` (each stage's MoE layers exchange tokens within the stage), the sequence ranks
        folded into `edp`. An `ep` group holds each expert once (its ranks
        exchange tokens by all-to-all); an `edp` group holds replicas of the same experts (the data-parallel
        ranks with the same ep coordinate, and their sequence ranks: expert gradients are summed there and divided
        by `expert_divisor`)."""
        if self._expert_mesh is None:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            self.mesh(device_type)  # the main mesh's groups first, in the same order on every rank
            edp = self.dp_size // self.ep_size
            ranks = torch.arange(self.world_size).reshape(self.pp_size, edp, self.ep_size, self.seq_size, self.tp_size)
            # (pp, edp x seq, ep, tp): a sequence rank is one more replica of its dp rank's experts
            ranks = ranks.permute(0, 1, 3, 2, 4).reshape(self.pp_size, edp * self.seq_size, self.ep_size, self.tp_size)
            if self.tp_size > 1:  # its own dimension: experts split within by TP are DTensors over (ep, tp)
                names: tuple[str, ...] = ("ep_rest", "edp", "ep", "tp")
            else:
                ranks, names = ranks[..., 0], ("ep_rest", "edp", "ep")
            self._expert_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
            self._expert_mesh[("edp", "ep")]._flatten("edp_ep")  # DTensor reduces 2-D expert shards in one collective
        return self._expert_mesh

    def submesh(self, name: str, device_type: str):
        """One named dimension's mesh (flattened ones kept here: slicing those from the root is deprecated). With
        accel's names, dp_replicate/dp_shard of size > 1 are the one `dp` dimension; ep and edp are the expert
        mesh's (`expert_mesh`)."""
        if name in ("ep", "edp"):
            return self.expert_mesh(device_type)[name]
        mesh = self.mesh(device_type)
        if name in self._flat:
            return self._flat[name]
        if not self.accelerate_names and name in DATA_PARALLEL_DIMS:
            name = "dp"
        return mesh[name]

    def fsdp_mesh(self, device_type: str):
        """The mesh FSDP2 shards over: 2-D (dp_replicate, dp_shard) for HSDP (shards within a row, all-reduces
        across rows), else the 1-D data-parallel dimension. The sequence ranks compute parts of the same gradients,
        so they shard with the data-parallel ones, as torchtitan does: dp_cp, or for HSDP (dp_replicate,
        dp_shard_cp)."""
        mesh = self.mesh(device_type)
        if self.seq_size > 1 and self.sizes["dp_replicate"] > 1 and self.sizes["dp_shard"] > 1:
            from torch.distributed.device_mesh import DeviceMesh

            if HSDP_SEQUENCE_MESH not in self._flat:  # made once: FSDP2 of every prepared model shares its groups
                self._flat[HSDP_SEQUENCE_MESH] = DeviceMesh._concatenate([mesh["dp_replicate"],
                                                                          self._flat["dp_shard_cp"]])
            return self._flat[HSDP_SEQUENCE_MESH]
        if self.seq_size > 1:
            return self.submesh("dp_cp", device_type)
        if self.accelerate_names:
            data = tuple(n for n in DATA_PARALLEL_DIMS if self.sizes[n] > 1)
            return mesh[data] if data else self.submesh("dp", device_type)
        return mesh["dp"]

    def group(self, name: str, device_type: str):
        """The process group of one named dimension, or None when that dimension has size 1."""
        if self.sizes[name] == 1:
            return None
        return self.submesh(name, device_type).get_group()
