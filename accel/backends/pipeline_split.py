"""Cutting a model into pipeline stages without tracing it.

A split point names the module where a stage begins. Every module that owns parameters belongs to the stage
whose split point precedes it in `named_modules()` order. Each stage gets a *stage model*: a shallow copy of
the user's model in which the modules of other stages are replaced by `Elsewhere` stubs (so their memory is
not held) and the stage's own modules are the user's objects (so parameter names and the optimizer's
references stay the original ones). The stage runs the model's real `forward`:

* a stub of an earlier stage returns the activation received from the previous stage (whatever the forward
  computes from it before this stage's first module is discarded: the entry module's input is replaced);
* the stub of the next stage's entry module ends the stage: its input is what is sent on.

So the model's own code (positional embeddings, masks, rotary tables, dropout, train/eval) runs unchanged,
with any input shape, and TP/DDP/FSDP wrap the stage models like any module.
"""

from __future__ import annotations

import copy
import difflib
import itertools

import torch
from torch import nn

from accel.config import ConfigError


class SplitError(ConfigError):
    """A pipeline split that cannot be made; the message names the module."""


# ----------------------------------------------------------------------------------------------------------
# where the stages begin
# ----------------------------------------------------------------------------------------------------------
def _owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own parameters directly, in `named_modules()` order."""
    return [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def _param_count(module: nn.Module, seen: set[int]) -> int:
    total = 0
    for p in module.parameters(recurse=False):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def blocks_container(model: nn.Module) -> tuple[str, nn.Module]:
    """What an automatic split cuts between: the children of an `nn.Sequential` model, else of the model's
    largest `nn.ModuleList` (a GPT-style stack of blocks)."""
    if isinstance(model, nn.Sequential):
        return "", model
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise SplitError(f"pipeline: cannot split {type(model).__name__} automatically: it is not an nn.Sequential "
                         "and has no nn.ModuleList of blocks; name where stages begin with "
                         "parallelism.pp_split_points: [module.name, ...]")
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))


def balanced_split_points(model: nn.Module, num_stages: int) -> list[str]:
    """Split points that balance the parameter count of the stages (modules before the blocks count with the
    first block, modules after them with the last)."""
    prefix, container = blocks_container(model)
    names = [f"{prefix}.{child}" if prefix else child for child, module in container.named_children()
             if any(True for _ in module.parameters())]  # parameter-free children go with the one before
    if len(names) < num_stages:
        where = f"'{prefix}'" if prefix else type(model).__name__
        raise SplitError(f"pipeline: {where} has {len(names)} blocks, too few for {num_stages} stages; allowed: "
                         f"pp_size x pp_stages_per_rank <= {len(names)}")
    costs = [0] * len(names)
    unit, seen = 0, set[int]()
    for name, module in model.named_modules():
        for i in range(unit + 1, len(names)):
            if name == names[i] or name.startswith(names[i] + "."):
                unit = i
        costs[unit] += _param_count(module, seen)
    groups = _partition(costs, num_stages)
    return [names[start] for start in groups[1:]]


def _partition(costs: list[int], parts: int) -> list[int]:
    """Start indices of `parts` contiguous groups minimising the largest group's cost (exact, small n)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for end in range(k, n + 1):
            for start in range(k - 1, end):
                value = max(best[k - 1][start], prefix[end] - prefix[start])
                if value < best[k][end]:
                    best[k][end], cut[k][end] = value, start
    starts, end = [], n
    for k in range(parts, 0, -1):
        starts.append(cut[k][end])
        end = cut[k][end]
    return starts[::-1]


def check_split_points(model: nn.Module, points: list[str], num_stages: int) -> list[str]:
    """The user's split points, validated: they exist, are not nested, follow the module order, and are
    `num_stages - 1` of them."""
    if len(points) != num_stages - 1:
        raise SplitError(f"parallelism.pp_split_points: {len(points)} names for {num_stages} stages; allowed: "
                         f"exactly {num_stages - 1} (pp_size x pp_stages_per_rank - 1)")
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    for name in points:
        if name not in order or name == "":
            close = difflib.get_close_matches(name, [n for n in order if n], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise SplitError(f"parallelism.pp_split_points: '{name}' is not a module of {type(model).__name__}{hint}")
    for first, second in itertools.pairwise(points):
        if order[second] <= order[first]:
            raise SplitError(f"parallelism.pp_split_points: '{second}' comes before '{first}' in the model; "
                             "allowed: names in the order the model defines them")
        if second.startswith(first + "."):
            raise SplitError(f"parallelism.pp_split_points: '{second}' is inside '{first}'; allowed: modules that "
                             "do not contain one another")
    return list(points)


# ----------------------------------------------------------------------------------------------------------
# which module belongs to which stage
# ----------------------------------------------------------------------------------------------------------
class StagePlan:
    """The stage of every parameter-owning module, and each stage's entry module (the outermost module that
    starts with the split point and belongs to that stage alone)."""

    def __init__(self, model: nn.Module, split_points: list[str]) -> None:
        self.split_points = split_points
        self.num_stages = len(split_points) + 1
        self.stage_of: dict[str, int] = {}
        stage = 0
        starts = {name: i + 1 for i, name in enumerate(split_points)}
        for name, module in model.named_modules():
            stage = starts.get(name, stage)
            if any(True for _ in module.parameters(recurse=False)):
                inside = [p for p in split_points if p.startswith(name + ".") or (name == "" and p)]
                if inside:
                    where = f"'{name}'" if name else f"the root module ({type(model).__name__})"
                    raise SplitError(f"pipeline: cannot split inside {where}: it owns parameters itself "
                                     f"({', '.join(n for n, _ in module.named_parameters(recurse=False))}) and "
                                     f"contains the split point '{inside[0]}'; split at a module boundary around it")
                self.stage_of[name] = stage
        self.subtree: dict[str, set[int]] = {}
        for name, _ in model.named_modules():
            self.subtree[name] = {s for owner, s in self.stage_of.items()
                                  if owner == name or owner.startswith(name + ".") or name == ""}
        for i, point in enumerate(split_points, start=1):
            if i not in self.subtree[point]:
                raise SplitError(f"pipeline: split point '{point}' owns no parameters, so stage {i} would be empty; "
                                 "name a module with parameters")
        self.entries = [None] + [self._entry(p, i) for i, p in enumerate(split_points, start=1)]
        empty = [s for s in range(self.num_stages) if s not in self.stage_of.values()]
        if empty:
            raise SplitError(f"pipeline: stage {empty[0]} has no parameters; choose other split points")

    def _entry(self, point: str, stage: int) -> str:
        entry, parts = point, point.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:depth])
            if self.subtree[parent] == {stage}:
                entry = parent
            else:
                break
        return entry

    def stages_of_param(self, model: nn.Module) -> dict[int, set[int]]:
        """id(parameter) -> the stages that use it (more than one: a weight tied across stages)."""
        modules = dict(model.named_modules())
        users: dict[int, set[int]] = {}
        for name, stage in self.stage_of.items():
            for p in modules[name].parameters(recurse=False):
                users.setdefault(id(p), set()).add(stage)
        return users


# ----------------------------------------------------------------------------------------------------------
# the stage model
# ----------------------------------------------------------------------------------------------------------
class StageDone(Exception):
    """Raised by the next stage's entry stub: carries the activation to send on."""

    def __init__(self, activation) -> None:
        super().__init__()
        self.activation = activation


class StageRun:
    """State of one forward of one stage model (set by `run_stage`, read by stubs and the entry hook)."""

    def __init__(self, plan: StagePlan, stages: set[int]) -> None:
        self.plan = plan
        self.stages = stages  # the stages this model holds (several only for a rank's local view)
        self.stage: int | None = None
        self.received = None
        self.entered = False

    def start(self, stage: int, received) -> None:
        self.stage, self.received, self.entered = stage, received, stage == 0


class Elsewhere(nn.Module):
    """Stands in for a module that lives on another stage."""

    def __init__(self, name: str, stage: int, run: StageRun) -> None:
        super().__init__()
        self._accel_where = (name, stage, run)

    def forward(self, *args, **kwargs):
        name, stage, run = self._accel_where
        if run.stage is None:
            raise RuntimeError(f"pipeline: module '{name}' lives on stage {stage}; call the prepared model, not the "
                               "model returned by unwrap_model")
        if stage < run.stage:
            if run.entered:
                raise SplitError(f"pipeline: module '{name}' (stage {stage}) runs after stage {run.stage} began at "
                                 f"'{run.plan.entries[run.stage]}'; split points must follow the order in which "
                                 "forward calls the modules")
            return run.received
        if stage == run.stage + 1 and name == run.plan.entries[stage]:
            first = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if not isinstance(first, torch.Tensor):
                raise SplitError(f"pipeline: stage {stage} begins at '{name}', whose first input is "
                                 f"{type(first).__name__}, not a tensor; split at a module that takes the activation")
            raise StageDone(first)
        raise SplitError(f"pipeline: module '{name}' (stage {stage}) runs before '{run.plan.entries[run.stage + 1]}',"
                         f" where stage {run.stage + 1} begins; split points must follow the order in which forward "
                         "calls the modules")

    def __getattr__(self, attr: str):
        try:
            return super().__getattr__(attr)
        except AttributeError:
            name, stage, _ = self.__dict__["_accel_where"]
            raise AttributeError(f"pipeline: stage code reads '{name}.{attr}', but module '{name}' lives on stage "
                                 f"{stage}; use the module's output instead, or choose split points that keep the "
                                 "two together") from None

    def extra_repr(self) -> str:
        return f"on stage {self._accel_where[1]}"


def stage_model(model: nn.Module, plan: StagePlan, stages: set[int], hooks: bool = True) -> tuple[nn.Module, StageRun]:
    """A shallow copy of `model` holding only `stages`' modules (the user's own objects) and stubs elsewhere;
    `hooks` adds the entry hooks that let it run as a stage."""
    run = StageRun(plan, stages)
    memo: dict[int, object] = {}
    for name, module in model.named_modules():
        used = plan.subtree[name]
        if not used or (len(used) == 1 and used <= stages):
            memo.setdefault(id(module), module)  # parameter-free or ours: shared, not copied
        elif len(used) == 1:
            memo.setdefault(id(module), Elsewhere(name, next(iter(used)), run))
        else:  # spans stages: copied as a container; its buffers stay shared
            for buffer in module.buffers(recurse=False):
                memo[id(buffer)] = buffer
    shell = copy.deepcopy(model, memo)
    for attr in ("forward", "_accel_original_forward"):  # a per-instance forward wrapper points at the original
        shell.__dict__.pop(attr, None)
    modules = dict(shell.named_modules())
    for stage in stages if hooks else ():
        if stage > 0:
            modules[plan.entries[stage]].register_forward_pre_hook(_entry_hook(run, stage), with_kwargs=True)
    return shell, run


def _entry_hook(run: StageRun, stage: int):
    def hook(module, args, kwargs):
        if run.stage != stage or run.entered:
            return None
        run.entered = True
        if args:
            return (run.received,) + tuple(args[1:]), kwargs
        key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
        if key is None:
            raise SplitError(f"pipeline: stage {stage} begins at '{run.plan.entries[stage]}', which is called with no "
                             "tensor input; split at a module that takes the activation")
        return args, {**kwargs, key: run.received}

    return hook


def run_stage(shell: nn.Module, run: StageRun, stage: int, received, args: tuple, kwargs: dict, call=None):
    """Run the model's forward as stage `stage`: returns what this stage sends on (the model's output on the
    last stage). `call`: the forward to run, when a part wrapped the model's (it calls the model's own in turn)."""
    run.start(stage, received)
    try:
        output = call(*args, **kwargs) if call is not None else type(shell).forward(shell, *args, **kwargs)
    except StageDone as done:
        output = done.activation
        last = False
    else:
        last = True
    finally:
        entered, run.stage = run.entered, None
    if not entered:
        raise SplitError(f"pipeline: stage {stage}'s forward never called '{run.plan.entries[stage]}', where the "
                         "stage begins; name modules that forward calls as split points")
    if last and stage != run.plan.num_stages - 1:
        raise SplitError(f"pipeline: stage {stage}'s forward returned without reaching "
                         f"'{run.plan.entries[stage + 1]}', where stage {stage + 1} begins")
    return output
