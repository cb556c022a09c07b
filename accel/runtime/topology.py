"""The run's process groups: one `DeviceMesh` over all ranks laid out as `accel.config.mesh_layout.MeshLayout`
says, its flattened dimensions, the meshes of parts that cut a dimension (expert parallelism's), and each named
dimension's group. Built on first use, by every rank in the same order; the Accelerator owns one and the backends
and parts ask it by name (`group("tp", device_type)`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from accel.config.mesh_layout import DATA_PARALLEL_DIMS, MeshLayout


@dataclass
class Topology(MeshLayout):
    """A MeshLayout with its meshes and process groups, built on first use."""

    _mesh: object = field(default=None, repr=False, compare=False)
    _flat: dict = field(default_factory=dict, repr=False, compare=False)
    _extra: dict = field(default_factory=dict, repr=False, compare=False)  # dimension -> (its part's dims, builder)

    def mesh(self, device_type: str):
        """The one `DeviceMesh` over all ranks, built on first use (by every rank). Dimensions of size 1 are kept
        out; with Accelerate's names, the flattened dp, dp_shard_cp and dp_cp are registered on it too."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            dims = self.mesh_dims()
            names = tuple(n for n, _ in dims)
            mesh = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=names)
            self._flat = {name: mesh[flat]._flatten(name) for name, flat in self.flattened_dims().items()}
            self._flat.update({name: mesh[dim] for name, dim in self.aliases().items()})
            self._mesh = mesh
        return self._mesh

    def add_mesh(self, names: tuple[str, ...], build) -> None:
        """A part's own mesh (expert parallelism's, which cuts the dp dimension): `build(self, device_type)` returns
        a DeviceMesh holding the dimensions `names`. It is built once, on first use, after the main mesh (every
        part of the run asking for the same dimensions shares it); `submesh` and `group` answer those names."""
        for name in names:
            self._extra.setdefault(name, (names, build))

    def part_mesh(self, name: str, device_type: str):
        """The whole mesh of a part that holds dimension `name` (`add_mesh`)."""
        names, build = self._extra[name]
        if names not in self._flat:
            self.mesh(device_type)  # the main mesh's groups first, in the same order on every rank
            self._flat[names] = build(self, device_type)
        return self._flat[names]

    def submesh(self, name: str, device_type: str):
        """One named dimension's mesh (flattened ones kept here: slicing those from the root is deprecated). With
        accel's names, dp_replicate/dp_shard of size > 1 are the one `dp` dimension; a part's own dimensions are its
        mesh's (`add_mesh`)."""
        if name in self._extra:
            return self.part_mesh(name, device_type)[name]
        mesh = self.mesh(device_type)
        if name in self._flat:
            return self._flat[name]
        if not self.accelerate_names and name in DATA_PARALLEL_DIMS:
            name = "dp"
        return mesh[name]

    def fsdp_mesh(self, device_type: str):
        """The mesh FSDP2 shards over, from the layout's `fsdp_dims`: one dimension, or two (HSDP: shards within a
        row, all-reduces across rows), sliced from the main mesh or, when one of them is flattened, concatenated
        once (every prepared model's FSDP2 shares its groups)."""
        dims = self.fsdp_dims()
        if len(dims) == 1:
            return self.submesh(dims[0], device_type)
        mesh = self.mesh(device_type)
        if not any(name in self._flat for name in dims):
            return mesh[dims]
        key = "(" + ", ".join(dims) + ")"
        if key not in self._flat:
            from torch.distributed.device_mesh import DeviceMesh

            self._flat[key] = DeviceMesh._concatenate([self.submesh(name, device_type) for name in dims])
        return self._flat[key]

    def group(self, name: str, device_type: str):
        """The process group of one named dimension, or None when that dimension has size 1."""
        if self.sizes[name] == 1:
            return None
        return self.submesh(name, device_type).get_group()
