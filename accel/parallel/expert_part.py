"""Expert parallelism (ep_size > 1) as a part: each MoE layer's experts are divided among the ep ranks at prepare
(expert.py), kept out of DDP or sharded first over their replicas under FSDP2, their gradients reduced over those
replicas after a synced backward, their norm summed over the ep group, and checkpoints given each ep rank's rows
of a stacked expert as DTensors (written once each) or its ModuleList experts (merged across ranks)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from accel.parallel.expert import (
    ExpertLayout,
    expert_names,
    expert_norm_power,
    gather_full,
    merge_layouts,
    reduce_expert_gradients,
    set_aside,
    shard_experts,
    shard_over_replicas,
)
from accel.parallel.part import Part

LAYOUT = "_accel_experts"  # a prepared model's own ExpertLayout (a plain attribute)


def layout_of(model: torch.nn.Module) -> ExpertLayout | None:
    return getattr(model, LAYOUT, None)


def _local(value):
    """DTensors (also inside an optimizer state's entries) as their local tensors."""
    if hasattr(value, "to_local"):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    return value


def expert_mesh(layout, device_type: str):
    """The mesh of expert parallelism for a MeshLayout: the data-parallel ranks cut into (edp, ep), ep inner
    (neighbours exchange tokens), then `tp` (with tensor parallelism), the pipeline stages in a leading `ep_rest`
    (each stage's MoE layers exchange tokens within the stage), the sequence ranks folded into `edp`. An `ep` group
    holds each expert once (its ranks exchange tokens by all-to-all); an `edp` group holds replicas of the same
    experts (the data-parallel ranks with the same ep coordinate, and their sequence ranks: expert gradients are
    summed there and divided by `expert_divisor`)."""
    from torch.distributed.device_mesh import DeviceMesh

    edp = layout.dp_size // layout.ep_size
    ranks = torch.arange(layout.world_size).reshape(layout.pp_size, edp, layout.ep_size, layout.seq_size,
                                                    layout.tp_size)
    # (pp, edp x seq, ep, tp): a sequence rank is one more replica of its dp rank's experts
    ranks = ranks.permute(0, 1, 3, 2, 4).reshape(layout.pp_size, edp * layout.seq_size, layout.ep_size, layout.tp_size)
    if layout.tp_size > 1:  # its own dimension: experts split within by TP are DTensors over (ep, tp)
        names: tuple[str, ...] = ("ep_rest", "edp", "ep", "tp")
    else:
        ranks, names = ranks[..., 0], ("ep_rest", "edp", "ep")
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
    mesh[("edp", "ep")]._flatten("edp_ep")  # DTensor reduces 2-D expert shards in one collective
    return mesh


class ExpertPart(Part):
    name = "expert"
    title = "expert parallelism"
    save_pretrained_note = "its experts divided among processes"
    replica_dim = "edp"  # the ranks holding the same experts: ZeRO-1 shards its optimizer state over them

    def __init__(self, topology, state, parallelism, data_parallel) -> None:
        self.topology, self.state, self.data_parallel = topology, state, data_parallel
        self.layouts: list[ExpertLayout] = []  # one per prepared model
        topology.add_mesh(("ep", "edp"), expert_mesh)

    def _mesh(self):
        return self.topology.part_mesh("ep", self.state.device.type)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "layouts": []}

    def _group(self, name: str):
        return self.topology.group(name, self.state.device.type)

    # -- prepare ----------------------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, recipe) -> None:
        """Divide the MoE layers' experts among the ep ranks. DDP leaves them alone (their gradients are reduced over
        the expert's replicas in `around_backward`); a ModuleList's experts stay whole on every rank of the other
        dimensions (`recipe.kept_whole`)."""
        rank = self.topology.coordinates(self.state.process_index)["ep"]
        layout = shard_experts(model, self.topology.ep_size, rank, self._group("ep"))
        self._group("edp")  # every rank builds the expert mesh's groups now, together
        layout.held = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
            {n for n, _ in model.named_buffers()}
        self.layouts.append(layout)
        setattr(model, LAYOUT, layout)
        recipe.kept_whole.update(layout.lists)
        if self.data_parallel.ddp:
            DDP._set_params_and_buffers_to_ignore_for_model(model, sorted(expert_names(layout)))

    def shard_first(self, model: torch.nn.Module, options: dict) -> None:
        """FSDP2: the experts (stacked, or each of a ModuleList) sharded over their replicas first."""
        layout = layout_of(model)
        if layout:
            shard_over_replicas(layout, self._mesh(),
                                self.topology.expert_divisor, options, device=self.state.device)

    def adopt(self, whole: torch.nn.Module, models: list[torch.nn.Module]) -> None:
        """A pipeline's stages on this process: their experts as one layout (checkpoints read it)."""
        layouts = [layout for layout in map(layout_of, models) if layout is not None]
        if layouts:
            setattr(whole, LAYOUT, merge_layouts(layouts))

    # -- the step ---------------------------------------------------------------------------------------------
    def around_backward(self, sync: bool):
        return self._reducing(sync) if self.layouts else contextlib.nullcontext()

    @contextlib.contextmanager
    def _reducing(self, sync: bool):
        """The expert gradients are reduced after the backward (when `sync`), over the edp group with the divisor of
        every other gradient; those a previous synced backward of this step reduced are set aside meanwhile (two
        backward calls per step, as DDP allows), those accumulated under no_sync are reduced with the new."""
        aside = [set_aside(layout) for layout in self.layouts if layout.reduced] if sync else []
        yield
        for layout in self.layouts:
            layout.reduced = sync
        if sync:
            edp = self._group("edp")
            for layout in self.layouts:
                reduce_expert_gradients(layout, edp, self.topology.expert_divisor)
            for restore in aside:
                restore()

    def norm_claims(self) -> set[int]:
        return {id(p) for layout in self.layouts for p in (*layout.params.values(), *layout.listed.values())}

    def norm_share(self, parameters: list[torch.Tensor], norm_type: float) -> torch.Tensor | None:
        """Each expert is held by one ep rank: sum |g|^p of the held ones over the ep group."""
        claimed = self.norm_claims()
        if not claimed:
            return None
        held: dict[str, Any] = {str(i): p for i, p in enumerate(p for p in parameters if id(p) in claimed)}
        mine = ExpertLayout(params=held)
        return expert_norm_power(mine, norm_type, self._group("ep"), self.state.device)

    # -- checkpoints ------------------------------------------------------------------------------------------
    @property
    def splits_state(self) -> bool:
        return bool(self.layouts)

    def held_names(self) -> set[str] | None:
        """A ModuleList's experts exist only on the ep rank holding them: checkpoints merge the ranks' tensors, as
        for pipeline stages (stacked experts are DTensors: every rank has every name)."""
        if not any(layout.listed for layout in self.layouts):
            return None
        return {name for layout in self.layouts for name in layout.held}

    def checkpoint_state(self, model: torch.nn.Module, state: dict) -> dict:
        """Each ep rank holds other rows of a stacked expert under the same name: given as DTensors sharded over ep
        (replicated over edp), DCP writes each row once in its place in the whole tensor."""
        layout = layout_of(model)
        if not layout or not layout.params:
            return state
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = self._mesh()[("edp", "ep")]

        def wrap(value):
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                return DTensor.from_local(value, mesh, [Replicate(), Shard(0)], run_check=False)
            return value

        for key in layout.params:
            if key in state.get("state", state):
                holder = state["state"] if "state" in state else state
                entry = holder[key]
                holder[key] = {k: wrap(v) for k, v in entry.items()} if isinstance(entry, dict) else wrap(entry)
        return state

    def load_model_state(self, model: torch.nn.Module, state: dict) -> dict:
        """This rank's rows of stacked experts; only the ModuleList experts it holds."""
        layout = layout_of(model)
        if not layout:
            return state
        return {k: _local(v) if k in layout.params else v for k, v in state.items()
                if not layout.listed or k in layout.held}

    def load_optimizer_state(self, model: torch.nn.Module, state: dict) -> dict:
        layout = layout_of(model)
        if not layout or not isinstance(state.get("state"), dict):
            return state
        mine = layout.held if layout.listed else None
        state = {**state, "state": {k: _local(v) if k in layout.params else v
                                    for k, v in state["state"].items() if mine is None or k in mine}}
        if mine is not None and isinstance(state.get("param_groups"), list):
            state["param_groups"] = [{**g, "params": [p for p in g["params"] if p in mine]}
                                     for g in state["param_groups"]]
        return state

    def load_consolidated_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                          state: dict) -> dict:
        """ZeRO-1's state, written by the first replica of each expert: this ep rank's rows of each stacked expert
        (from a DTensor, or whole [E, ...] as the other replicas read it), and only the ModuleList experts it holds,
        each parameter group listing this rank's parameters (the saved groups may be another ep rank's)."""
        layout = layout_of(model)
        if not layout or not isinstance(state.get("state"), dict):
            return state
        ep, rank = self.topology.ep_size, self.topology.coordinates(self.state.process_index)["ep"]

        def rows(key: str, value):
            if hasattr(value, "to_local"):
                return value.to_local()
            local = layout.params[key].shape[0]
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == local * ep:
                return value[rank * local:(rank + 1) * local]
            return value

        state = {**state, "state": {k: {n: rows(k, v) for n, v in entry.items()} if k in layout.params else entry
                                    for k, entry in state["state"].items()}}
        if not layout.listed or not isinstance(state.get("param_groups"), list):
            return state
        names = {id(p): n for n, p in model.named_parameters()}
        live = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        return {**state, "state": {k: v for k, v in state["state"].items() if k in layout.held},
                "param_groups": [{**g, "params": mine} for g, mine in zip(state["param_groups"], live, strict=True)]}

    def full_state(self, model: torch.nn.Module, state: dict) -> dict:
        """The experts whole, in the model's own names and layout (every rank gathers)."""
        layout = layout_of(model)
        if layout:
            state = gather_full(layout, state, self._group("ep"), self.topology.ep_size)
        return state

    def forget(self) -> None:
        self.layouts.clear()
