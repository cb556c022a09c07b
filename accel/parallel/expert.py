"""Expert parallelism (ep_size > 1) for mixture-of-experts models, as torchtitan does it: the ep ranks are taken
from the data-parallel ranks; each MoE layer's E experts are divided among them (E / ep each, contiguous: ep rank
r holds experts r*E/ep ... (r+1)*E/ep - 1); every rank routes its own tokens with the model's own router (so the
router and its auxiliary loss are exactly the model's), sends each (token, chosen expert) pair to the rank holding
that expert with an all-to-all of variable splits, runs its local experts, sends the results back with the reverse
all-to-all and combines them with the router weights. Dropless: no capacity factor, every token reaches its top-k.

What is recognised:
- transformers' fused experts containers (Mixtral, Qwen2-MoE: `experts.gate_up_proj` [E, 2I, H] and
  `experts.down_proj` [E, H, I], called as `experts(tokens, top_k_index, top_k_weights)`): the container keeps
  its names and holds the slice [E/ep, ...] of both parameters; Qwen2-MoE's shared expert stays replicated.
- a MoE block of the user's own whose class (or instance) has `accel_expert_plan = ExpertPlan(...)`.

Expert gradients: the all-to-all's backward returns to each expert the gradient of every ep rank's tokens; summed
over the expert's replicas (the `edp` group: with sequence/context parallelism its sequence ranks too, which hold
other tokens of the same samples and route them themselves) and divided by the data-parallel x sequence degree
(`Topology.expert_divisor`, as the other gradients are over dp x sp/cp), they equal the single-process gradient of
the mean loss. With HSDP the edp group spans dp_replicate x dp_shard; with ZeRO-1 the optimizer shards its state
over edp (accel/backends/zero.py). With DDP (which ignores the experts) the backend does this by hand
(`reduce_expert_gradients`). With ZeRO 2/3 stacked experts become DTensors sharded over ep and FSDP2 shards them
again over edp, reduce-scattering there with that divisor (`shard_over_replicas`, torchtitan's layout): each
rank keeps E/dp of them. A ModuleList's experts are each their own FSDP2 unit over edp (each rank keeps 1/edp of
every expert its ep rank holds, the same E/dp in all), reduce-scattered there with the same divisor.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from accel.parallel.gradients import sum_gradients, total_norm
from accel.config.errors import ConfigError

FUSED_CONTAINERS = ("MixtralExperts", "Qwen2MoeExperts")  # transformers' fused layout, checked on the installed version
FUSED_PARAMS = ("gate_up_proj", "down_proj")


@dataclasses.dataclass
class ExpertPlan:
    """How to run a MoE block of your own under expert parallelism (set `accel_expert_plan` on its class).

    router: attribute holding the router, called with the block's tokens flattened to [T, H]; it returns a tuple
        whose last two items are (top_k_weights [T, k], top_k_index [T, k]) as transformers' routers do (anything
        before them, e.g. logits for an auxiliary loss, is the router's own business).
    experts: attribute holding the experts: an nn.ModuleList (expert j called as experts[j](x [n, H]) -> [n, H]),
        or a module with parameters stacked on dim 0 (give `params` and `call`).
    params: for stacked experts, the names of the parameters of `experts` whose dim 0 is the expert index.
    call: for stacked experts, `call(experts_module, j, x) -> y` runs local expert j (0 .. E/ep - 1) of that module.
    shared: attribute of a module run on every token and added to the output (a shared expert), or None.

    accel replaces the block's forward with: tokens -> router -> all-to-all to the experts -> back -> sum of
    weight x expert output over the top-k (+ shared(tokens)), in the input's shape.
    """

    router: str
    experts: str
    params: tuple[str, ...] = ()
    call: Callable[[torch.nn.Module, int, torch.Tensor], torch.Tensor] | None = None
    shared: str | None = None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its backward is the reverse all-to-all (also on gloo)."""

    @staticmethod
    def forward(ctx, x, send: list[int], receive: list[int], group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


@dataclasses.dataclass
class ExpertShard:
    """One MoE layer's experts on this rank: global experts [first, first + local)."""

    name: str
    num_experts: int
    ep: int
    rank: int
    group: Any
    run: Callable[[Any, int, torch.Tensor], torch.Tensor]  # run(experts, j, x): local expert j on tokens [n, H]
    module: torch.nn.Module | None = None  # the stacked experts' module (None: a ModuleList's)

    @property
    def local(self) -> int:
        return self.num_experts // self.ep

    @property
    def first(self) -> int:
        return self.rank * self.local

    def dispatch(self, tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{index[t, k]}(tokens[t]), the experts run where they are held."""
        k, local, ep = index.shape[-1], self.local, self.ep
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) pairs by expert: by destination rank, then expert
        source_token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # [ep sources x local experts]
        send = counts.view(ep, local).sum(1).tolist()
        receive = received_counts.view(ep, local).sum(1).tolist()
        received = _AllToAll.apply(tokens[source_token], send, receive, self.group)
        expert_of = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(received_counts)
        by_expert = torch.argsort(expert_of, stable=True)
        sizes = torch.bincount(expert_of, minlength=local).tolist()
        experts = local_view(self.module) if self.module is not None else None
        outputs = []
        for j, rows in enumerate(torch.split(by_expert, sizes)):  # every local expert, none skipped: its gradient
            outputs.append(self.run(experts, j, received[rows]).to(received.dtype))  # is defined on every rank, so
            # replicas reduce alike; cast back: experts FSDP2 leaves alone keep float32 under mixed precision
        computed = torch.cat(outputs) if outputs else received
        results = torch.empty_like(computed).index_copy(0, by_expert, computed)  # back to the received order
        returned = _AllToAll.apply(results, receive, send, self.group)
        combined = returned * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(tokens)
        return out.index_add(0, source_token, combined.to(tokens.dtype))


class _LocalView:
    """A stacked-experts module as its expert code reads it: under ZeRO 2/3 FSDP2 gives it DTensor parameters
    sharded over ep (whole tensors [E, ...]); this view returns their local rows [E/ep, ...] instead (autograd
    flows back through `to_local`), and everything else from the module."""

    def __init__(self, module: torch.nn.Module, local: dict[str, torch.Tensor]) -> None:
        self._module, self._local = module, local

    def __getattr__(self, name: str) -> Any:
        local = self.__dict__["_local"]
        return local[name] if name in local else getattr(self.__dict__["_module"], name)


def local_view(module: torch.nn.Module) -> Any:
    """`module`, or a view of it with its DTensor parameters' local rows (see _LocalView)."""
    from torch.distributed.tensor import DTensor

    local = {n: p.to_local() for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    return _LocalView(module, local) if local else module


def _fused_expert(container: Any, j: int, x: torch.Tensor) -> torch.Tensor:
    """transformers' fused expert j: down(act(gate(x)) * up(x))."""
    gate_up, down = getattr(container, "gate_up_proj"), getattr(container, "down_proj")  # noqa: B009 (Any, for mypy)
    gate, up = F.linear(x.to(gate_up.dtype), gate_up[j]).chunk(2, dim=-1)  # the tokens to the experts' dtype
    act: Any = getattr(container, "act_fn")  # noqa: B009
    return F.linear(act(gate) * up, down[j])


def _slice_params(module: torch.nn.Module, names, shard: ExpertShard, where: str) -> list[torch.nn.Parameter]:
    """Keep this rank's rows [first, first + local) of each stacked parameter, as new Parameters."""
    kept = []
    for pname in names:
        whole = getattr(module, pname)
        if whole.shape[0] != shard.num_experts:
            raise ConfigError(f"parallelism.ep_size: {where}.{pname} has {whole.shape[0]} rows on dim 0, not one per "
                              f"expert ({shard.num_experts}); allowed: parameters stacked over the experts")
        part = torch.nn.Parameter(whole.detach()[shard.first:shard.first + shard.local].clone(),
                                  requires_grad=whole.requires_grad)
        setattr(module, pname, part)
        kept.append(part)
    return kept


def _check_divides(where: str, num_experts: int, ep: int) -> None:
    if num_experts % ep:
        raise ConfigError(f"parallelism.ep_size={ep}: {where} has {num_experts} experts, not divisible by {ep}; "
                          f"allowed: an ep_size that divides {num_experts}")


def _plan_of(module: torch.nn.Module) -> ExpertPlan | None:
    plan = getattr(module, "accel_expert_plan", None)
    if isinstance(plan, dict):
        try:
            plan = ExpertPlan(**plan)
        except TypeError as error:
            allowed = ", ".join(f.name for f in dataclasses.fields(ExpertPlan))
            raise ConfigError(f"{type(module).__name__}.accel_expert_plan: {error}; allowed keys: {allowed}") from None
    if plan is not None and not isinstance(plan, ExpertPlan):
        raise ConfigError(f"{type(module).__name__}.accel_expert_plan: bad value {plan!r}; allowed: an ExpertPlan "
                          "(accel.parallel.expert) or a dict of its fields")
    return plan


def _part(block: torch.nn.Module, plan: ExpertPlan, role: str) -> torch.nn.Module:
    """The submodule a plan names for `role` (router, experts, shared); a one-line error when there is none."""
    attr = getattr(plan, role)
    found = None
    if isinstance(attr, str):
        try:
            found = block.get_submodule(attr)
        except AttributeError:
            pass
    if found is None:
        children = ", ".join(name for name, _ in block.named_children()) or "none"
        raise ConfigError(f"{type(block).__name__}.accel_expert_plan: {role}={attr!r} is not a submodule of "
                          f"{type(block).__name__}; allowed: the name of one of its submodules ({children})")
    return found


def _stacked(experts: torch.nn.Module, plan: ExpertPlan, block: torch.nn.Module) -> list[torch.Tensor]:
    """The stacked parameters a plan names (`params`), each a parameter of `experts` with dim 0 the experts."""
    own = dict(experts.named_parameters(recurse=False))
    missing = [p for p in plan.params if p not in own]
    if missing:
        raise ConfigError(f"{type(block).__name__}.accel_expert_plan: params {missing} are not parameters of "
                          f"{plan.experts!r}; allowed: its own parameters ({', '.join(own) or 'none'})")
    return [own[p] for p in plan.params]


@dataclasses.dataclass
class ExpertLayout:
    """Every sharded MoE layer of one model: the expert parameters (by name) and how they are split."""

    shards: list[ExpertShard] = dataclasses.field(default_factory=list)
    params: dict[str, torch.nn.Parameter] = dataclasses.field(default_factory=dict)  # stacked: dim 0 is split
    listed: dict[str, torch.nn.Parameter] = dataclasses.field(default_factory=dict)  # a ModuleList's own experts
    stacked: list = dataclasses.field(default_factory=list)  # (module, parameter names) of the stacked experts
    lists: list[str] = dataclasses.field(default_factory=list)  # the names of the ModuleList experts
    modules: list = dataclasses.field(default_factory=list)  # (name, module) of each ModuleList expert held here
    listed_sharded: bool = False  # the ModuleList experts are FSDP2 units (ZeRO 2/3): FSDP2 reduces them
    held: set[str] = dataclasses.field(default_factory=set)  # the model's tensor names on this rank (checkpoints)
    reduced: bool = False  # the experts' gradients (if any) are reduced already (the last backward was synced)

    def __bool__(self) -> bool:
        return bool(self.shards)


def merge_layouts(layouts: list[ExpertLayout]) -> ExpertLayout:
    """Several models' layouts as one (a pipeline's stages on one process: their names are the whole model's)."""
    merged = ExpertLayout()
    for layout in layouts:
        merged.shards += layout.shards
        merged.params.update(layout.params)
        merged.listed.update(layout.listed)
        merged.stacked += layout.stacked
        merged.lists += layout.lists
        merged.modules += layout.modules
        merged.held |= layout.held
        merged.listed_sharded = merged.listed_sharded or layout.listed_sharded
    return merged


def shard_experts(model: torch.nn.Module, ep: int, rank: int, group) -> ExpertLayout:
    """Divide every recognised MoE layer's experts among the ep ranks (this rank keeps its E/ep) and route their
    tokens by all-to-all; returns what was sharded. A model without a recognised MoE layer is refused."""
    layout = ExpertLayout()
    for name, module in list(model.named_modules()):
        plan = _plan_of(module)
        if plan is not None:
            _shard_planned(layout, name, module, plan, ep, rank, group)
        elif type(module).__name__ in FUSED_CONTAINERS and all(hasattr(module, p) for p in FUSED_PARAMS):
            _shard_fused(layout, name, module, ep, rank, group)
    if not layout:
        raise ConfigError(f"parallelism.ep_size={ep}: the model has no MoE layer accel recognises (transformers' "
                          f"{', '.join(FUSED_CONTAINERS)}, or a module with `accel_expert_plan`); allowed: ep_size 1, "
                          "or give your MoE block an ExpertPlan (docs/expert_parallel.md)")
    return layout


def expert_param_names(model: torch.nn.Module) -> set[str]:
    """The names of the parameters `shard_experts` would divide among the ep ranks (nothing is changed)."""
    names: set[str] = set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        plan = _plan_of(module)
        if plan is not None:
            experts = _part(module, plan, "experts")
            chosen = [n for n, _ in experts.named_parameters()] if isinstance(experts, torch.nn.ModuleList) \
                else list(plan.params)
            names.update(f"{prefix}{plan.experts}.{n}" for n in chosen)
        elif type(module).__name__ in FUSED_CONTAINERS and all(hasattr(module, p) for p in FUSED_PARAMS):
            names.update(f"{prefix}{p}" for p in FUSED_PARAMS)
    return names


def _shard_fused(layout: ExpertLayout, name: str, container: torch.nn.Module, ep: int, rank: int, group) -> None:
    """transformers' fused experts: keep the slices, replace the container's forward (names and call unchanged)."""
    num = int(getattr(container, "gate_up_proj").shape[0])  # noqa: B009 (Any, for mypy)
    _check_divides(name, num, ep)
    shard = ExpertShard(name, num, ep, rank, group, run=_fused_expert, module=container)
    for pname, param in zip(FUSED_PARAMS, _slice_params(container, FUSED_PARAMS, shard, name), strict=True):
        layout.params[f"{name}.{pname}"] = param
    layout.stacked.append((container, FUSED_PARAMS))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return shard.dispatch(hidden_states, top_k_index, top_k_weights)

    container.forward = types.MethodType(forward, container)
    layout.shards.append(shard)


def _shard_planned(layout: ExpertLayout, name: str, block: torch.nn.Module, plan: ExpertPlan, ep: int, rank: int,
                   group) -> None:
    """A block of the user's own: its experts are sliced (stacked) or thinned out (ModuleList: the other ranks'
    entries become empty modules, so names stay global), its forward becomes router -> all-to-all -> combine."""
    experts = _part(block, plan, "experts")
    router = _part(block, plan, "router")
    shared = _part(block, plan, "shared") if plan.shared else None
    prefix = f"{name}.{plan.experts}" if name else plan.experts
    if isinstance(experts, torch.nn.ModuleList):
        num = len(experts)
        _check_divides(name or type(block).__name__, num, ep)
        def run(_, j: int, x: torch.Tensor) -> torch.Tensor:
            expert = experts[shard.first + j]
            weight = next(expert.parameters(), None)
            return expert(x if weight is None else x.to(weight.dtype))

        shard = ExpertShard(name, num, ep, rank, group, run=run)
        layout.lists.append(prefix)
        for j in range(num):
            if shard.first <= j < shard.first + shard.local:
                for pname, param in experts[j].named_parameters():
                    layout.listed[f"{prefix}.{j}.{pname}"] = param
                layout.modules.append((f"{prefix}.{j}", experts[j]))
            else:
                experts[j] = torch.nn.Module()  # held by another ep rank
    else:
        if not plan.params or plan.call is None:
            raise ConfigError(f"{type(block).__name__}.accel_expert_plan: experts {plan.experts!r} is not an "
                              "nn.ModuleList; allowed: give `params` (stacked on dim 0) and `call(experts, j, x)`")
        num = _stacked(experts, plan, block)[0].shape[0]
        _check_divides(name or type(block).__name__, num, ep)
        shard = ExpertShard(name, num, ep, rank, group, run=plan.call, module=experts)
        for pname, param in zip(plan.params, _slice_params(experts, plan.params, shard, prefix), strict=True):
            layout.params[f"{prefix}.{pname}"] = param
        layout.stacked.append((experts, tuple(plan.params)))

        def route(self, tokens, index, weights):
            return shard.dispatch(tokens, index, weights)

        experts.forward = types.MethodType(route, experts)  # called as a module, so FSDP2 can shard it (ZeRO 2/3)

    def forward(self, hidden_states, *args, **kwargs):
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        *_, weights, index = router(tokens)
        out = shard.dispatch(tokens, index, weights) if shard.module is None else experts(tokens, index, weights)
        if shared is not None:
            out = out + shared(tokens)
        return out.reshape(hidden_states.shape)

    block.forward = types.MethodType(forward, block)
    layout.shards.append(shard)


def shard_over_replicas(layout: ExpertLayout, expert_mesh, divisor: int, options: dict,
                        device: torch.device | None = None) -> None:
    """ZeRO 2/3 (FSDP2): shard the stacked experts again over their replicas, as torchtitan does, so each rank
    keeps E/dp of them (not E/ep). Each stacked parameter becomes a DTensor sharded over `ep` (its whole shape
    [E, ...]: checkpoints and full state dicts need nothing else), then `fully_shard` over `edp` makes it 2-D
    and reduce-scatters its gradient there, divided by `divisor` (dp x the sequence degree): each rank's share
    already sums its ep group's tokens (the all-to-all's backward), so the sum over edp / divisor is the mean
    loss's gradient. Each ModuleList expert this ep rank holds becomes an FSDP2 unit over edp likewise (its
    parameters sharded on dim 0 over the replicas, its gradients reduce-scattered there with the same divisor).
    Afterwards the layout's hand-reduced `params` no longer hold them; `listed` holds the ModuleList experts' new
    (DTensor) parameters, which FSDP2 reduces (`listed_sharded`). `device`: the job's; a stacked expert left on
    the CPU (CPU offload does not place the model) goes there before it becomes a DTensor of the device's mesh, as
    FSDP2 requires (it moves plain tensors itself, never DTensors; its offload policy then moves the shards to the
    CPU)."""
    from torch.distributed.tensor import DTensor, Shard

    def placed(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if device is None or tensor.device == device else tensor.to(device)

    ep_mesh, edp_mesh = expert_mesh["ep"], expert_mesh["edp"]
    for module, names in layout.stacked:
        for pname in names:
            local = getattr(module, pname)
            if isinstance(local, DTensor):  # split within each expert by tensor parallelism: over (ep, tp)
                shape = torch.Size((local.shape[0] * ep_mesh.size(), *local.shape[1:]))
                whole = DTensor.from_local(placed(local.to_local().detach()), expert_mesh[("ep", "tp")],
                                           [Shard(0), *local.placements], run_check=False, shape=shape,
                                           stride=torch.empty(shape, device="meta").stride())
            else:
                whole = DTensor.from_local(placed(local.detach()), ep_mesh, [Shard(0)], run_check=False)
            setattr(module, pname, torch.nn.Parameter(whole, requires_grad=local.requires_grad))
        _shard_unit(module, edp_mesh, divisor, options)
    layout.params.clear()
    for name, module in layout.modules:
        _shard_unit(module, edp_mesh, divisor, options)
        for pname, param in module.named_parameters():
            layout.listed[f"{name}.{pname}"] = param
    layout.listed_sharded = bool(layout.modules)


def _shard_unit(module: torch.nn.Module, edp_mesh, divisor: int, options: dict) -> None:
    """One FSDP2 unit over the expert's replicas, its gradients summed there and divided by `divisor`."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=edp_mesh, **options)
    module.set_gradient_divide_factor(float(divisor))  # type: ignore[operator]  # FSDP2's method
    if edp_mesh.device_type == "cpu" and edp_mesh.size() > 1:  # gloo has no PREMUL_SUM: sum, then divide
        module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # (not on one replica: torch 2.13
        # then divides twice)


def expert_names(layout: ExpertLayout) -> set[str]:
    return set(layout.params) | set(layout.listed)


def hand_reduced(layout: ExpertLayout) -> list[torch.nn.Parameter]:
    """The expert parameters accel reduces itself (those FSDP2 leaves alone: all with DDP; none with ZeRO 2/3)."""
    return [*layout.params.values(), *(() if layout.listed_sharded else layout.listed.values())]


def set_aside(layout: ExpertLayout) -> Callable[[], None]:
    """Take the (reduced) expert gradients off the parameters; the returned function adds them back to what the
    next backward leaves there."""
    kept = [(p, p.grad) for p in hand_reduced(layout) if p.grad is not None]
    for p, _ in kept:
        p.grad = None

    def restore() -> None:
        for p, grad in kept:
            p.grad = grad if p.grad is None else grad.add_(p.grad)

    return restore


def reduce_expert_gradients(layout: ExpertLayout, edp_group, divisor: int) -> None:
    """Each expert gradient holds the sum over its ep group's tokens (the all-to-all's backward); sum it over the
    replicas of the expert (edp, sequence ranks included) and divide by `divisor` (dp x the sequence degree): the
    gradient of the mean loss."""
    grads = [p.grad for p in hand_reduced(layout) if p.grad is not None]
    sum_gradients(grads, edp_group, divide_by=divisor)


def expert_norm_power(layout: ExpertLayout, norm_type: float, ep_group, device: torch.device) -> torch.Tensor:
    """sum |g|^p over all experts of the model (inf: max |g|), over the ep group (each expert counted once). A
    ModuleList expert FSDP2 shards over its replicas (a DTensor gradient) counts its whole norm over them.
    `device`: the job's (the group's) device, where the sum is reduced, also on a rank with no expert gradient (a
    CPU tensor there would be refused by NCCL)."""
    from torch.distributed.tensor import DTensor

    every = [p.grad for p in (*layout.params.values(), *layout.listed.values()) if p.grad is not None]
    grads = [g for g in every if not isinstance(g, DTensor)]
    sharded: list[torch.Tensor] = [g for g in every if isinstance(g, DTensor)]
    if sharded:  # the norm of this ep rank's sharded experts, reduced over their replicas' mesh
        grads.append(total_norm(sharded, norm_type, device).reshape(1))
    # each gradient's share computed where it lies (offloaded ones on the CPU), the scalar moved to the device
    if norm_type == float("inf"):
        value = max((g.abs().max().float().to(device) for g in grads), default=torch.zeros((), device=device))
        value = torch.as_tensor(value, device=device).clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=ep_group)
        return value
    value = sum(((g.float().norm(norm_type) ** norm_type).to(device) for g in grads), torch.zeros((), device=device))
    dist.all_reduce(value, group=ep_group)
    return value


def gather_full(layout: ExpertLayout, state: dict, ep_group, ep: int) -> dict:
    """The whole experts in the model's own names and layout, in `state` (a full state dict on the CPU): stacked
    parameters are concatenated over the ep group on dim 0; a ModuleList's entries come from the ranks holding
    them. Every rank of the ep group takes part."""
    for key in sorted(layout.params):  # the same collectives on every rank, whatever its state holds
        local = layout.params[key].detach()
        parts = [torch.empty_like(local) for _ in range(ep)]
        dist.all_gather(parts, local.contiguous(), group=ep_group)
        if key in state:
            state[key] = torch.cat(parts).cpu()
    if layout.listed:
        mine = {}
        for key in sorted(layout.listed):  # FSDP2's shards over the replicas: gathered (every edp rank, alike)
            value = layout.listed[key].detach()
            mine[key] = (value.full_tensor() if hasattr(value, "full_tensor") else value).cpu()
        everyone: list = [None] * ep
        dist.all_gather_object(everyone, mine, group=ep_group)
        if state:  # a rank whose full state dict is empty (FSDP2 gathers to rank 0) stays so
            for part in everyone:
                state.update(part)
    return state
