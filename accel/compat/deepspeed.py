"""Accelerate's `DummyOptim` / `DummyScheduler`: a DeepSpeed JSON's `optimizer` and `scheduler` sections, built.

With DeepSpeed, Accelerate hands these sections to DeepSpeed, which builds the optimizer and LR scheduler the JSON
names. accel has no DeepSpeed: `build_optimizer` / `build_scheduler` build the same math with torch (Adam, AdamW,
SGD; WarmupLR, WarmupDecayLR, WarmupCosineLR with DeepSpeed's formulas) and `replace_dummies` swaps them in for the
dummies at the start of `Accelerator.prepare`, so every backend prepares them like a script's own optimizer and
scheduler. "auto" values are filled from the dummies as Accelerate fills them; the usage rules (no `DummyOptim`
without an `optimizer` section, no torch optimizer with one, ...) are Accelerate's.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from accel.compat.hf_deepspeed_config import HfDeepSpeedConfig  # noqa: F401 (accelerate.utils.deepspeed's name)
from accel.config import ConfigError
from accel.scheduler import AcceleratedScheduler

_AUTO = "auto"
OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
WARMUP_TYPES = ("log", "linear")
# optimizer params DeepSpeed passes on (FusedAdam / DeepSpeedCPUAdam / torch.optim.SGD); the rest are refused
_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode", "torch_adam",
                "set_grad_none")
_SGD_PARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
_WARMUP_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
_SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP_PARAMS,
    "WarmupDecayLR": _WARMUP_PARAMS + ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
}
_NO_DEEPSPEED = ("a DeepSpeed JSON with 'optimizer'/'scheduler' sections, given as Accelerator(deepspeed_plugin="
                 "DeepSpeedPlugin(hf_ds_config=...)), a config file's deepspeed_config_file or `accel launch "
                 "--deepspeed_config_file`; or use a torch {what}")


class DummyOptim:
    """Stands for the optimizer the DeepSpeed JSON's `optimizer` section names (Accelerate's class, same
    attributes): `prepare()` builds that optimizer on `params`; `lr`, `weight_decay` and the other keyword
    arguments fill the section's "auto" values."""

    _built: Any  # the optimizer prepare() built, once it has (read by a later DummyScheduler)

    def __init__(self, params, lr=0.001, weight_decay=0, **kwargs):
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for the LR scheduler the DeepSpeed JSON's `scheduler` section names (Accelerate's class, same
    attributes). Without that section, `lr_scheduler_callable(optimizer)` builds it on the real optimizer."""

    def __init__(self, optimizer, total_num_steps=None, warmup_num_steps=0, lr_scheduler_callable=None, **kwargs):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


# -------------------------------------------------------------------------------------------------------------
# values
# -------------------------------------------------------------------------------------------------------------

def _number(value: Any, key: str, source: str, *, integer: bool = False, lo: float | None = None) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (not integer or float(value).is_integer())
    if not ok or (lo is not None and value < lo):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{source}: key '{key}': bad value {value!r}; allowed: {kind}"
                          + (f" >= {lo}" if lo is not None else ""))
    return int(value) if integer else value


def _lr_values(value: Any, key: str, source: str, groups: int) -> list:
    """A number, or one per parameter group (DeepSpeed's `_format_param`)."""
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(f"{source}: key '{key}': {len(value)} values for {groups} parameter groups; "
                              "allowed: one number, or one per parameter group")
        return [float(_number(v, key, source)) for v in value]
    return [float(_number(value, key, source))] * groups


def _mapping(value: Any, key: str, source: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: key '{key}': expected a JSON object, got {value!r}")
    return value


def _section_type(section: Any, name: str, allowed: tuple[str, ...], source: str) -> tuple[str, dict]:
    """(canonical type, params) of an `optimizer` / `scheduler` section; the type's case does not matter."""
    section = _mapping(section, name, source)
    for key in section:
        if key not in ("type", "params", "legacy_fusion"):
            raise ConfigError(f"{source}: unknown key '{name}.{key}'; known keys: params, type")
    given = section.get("type")
    found = {t.lower(): t for t in allowed}.get(given.lower()) if isinstance(given, str) else None
    if found is None:
        raise ConfigError(f"{source}: key '{name}.type': bad value {given!r}; allowed: {', '.join(allowed)}")
    params = section.get("params")
    return found, dict(_mapping(params, f"{name}.params", source)) if params is not None else {}


def _check_keys(params: dict, allowed: tuple[str, ...], where: str, kind: str, source: str) -> None:
    for key in params:
        if key not in allowed:
            raise ConfigError(f"{source}: key '{where}.{key}': not a parameter of {kind} in accel; allowed: "
                              f"{', '.join(allowed)}")


# -------------------------------------------------------------------------------------------------------------
# the optimizer
# -------------------------------------------------------------------------------------------------------------

def build_optimizer(section: dict, params: Any, dummy: DummyOptim | None = None,
                    source: str = "DeepSpeed config") -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed builds from an `optimizer` section, on `params`.

    Adam/AdamW: DeepSpeed's FusedAdam/DeepSpeedCPUAdam are AdamW (decoupled decay) unless the type is Adam with
    `adam_w_mode: false` (then Adam, L2 decay); their weight_decay defaults to 0 (torch's AdamW: 0.01, used with
    `torch_adam: true` as DeepSpeed does). SGD: torch.optim.SGD. "auto": lr and weight_decay from `dummy` (what
    Accelerate fills); any other "auto" param from the dummy's keyword argument of that name (betas, eps, ...)."""
    kind, given = _section_type(section, "optimizer", OPTIMIZER_TYPES, source)
    _check_keys(given, _SGD_PARAMS if kind == "SGD" else _ADAM_PARAMS, "optimizer.params", kind, source)
    values = {}
    for name, value in given.items():
        if value == _AUTO:
            value = _auto_optimizer_value(name, dummy, source)
        values[name] = value
    where = "optimizer.params."
    for name in ("lr", "eps", "weight_decay", "momentum", "dampening"):
        if name in values:
            values[name] = _number(values[name], where + name, source, lo=0)
    if "betas" in values:
        betas = values["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise ConfigError(f"{source}: key '{where}betas': bad value {betas!r}; allowed: two numbers [beta1, beta2]")
        values["betas"] = tuple(_number(b, where + "betas", source, lo=0) for b in betas)
    for name in ("amsgrad", "adam_w_mode", "torch_adam", "nesterov", "maximize", "bias_correction", "set_grad_none"):
        if name in values and not isinstance(values[name], bool):
            raise ConfigError(f"{source}: key '{where}{name}': bad value {values[name]!r}; allowed: true, false")
    if kind == "SGD":
        return torch.optim.SGD(params, **values)
    if values.pop("bias_correction", True) is not True:
        raise ConfigError(f"{source}: key '{where}bias_correction': false is not supported by accel; allowed: true")
    values.pop("set_grad_none", None)  # FusedAdam's zero_grad detail; torch sets grads to None already
    torch_adam = values.pop("torch_adam", False)
    decoupled = values.pop("adam_w_mode", True) or kind == "AdamW"  # type AdamW forces it, as in DeepSpeed
    if not torch_adam:
        values.setdefault("weight_decay", 0.0)  # FusedAdam's and DeepSpeedCPUAdam's default
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **values)


def _auto_optimizer_value(name: str, dummy: DummyOptim | None, source: str) -> Any:
    if dummy is not None:
        if name == "lr":
            return dummy.lr
        if name == "weight_decay":
            return dummy.weight_decay
        if name in dummy.kwargs:
            return dummy.kwargs[name]
    raise ConfigError(f"{source}: key 'optimizer.params.{name}': \"auto\" but DummyOptim gives no {name}; "
                      f"allowed: a value in the JSON, or DummyOptim(..., {name}=...)")


# -------------------------------------------------------------------------------------------------------------
# the schedulers
# -------------------------------------------------------------------------------------------------------------

class _DeepSpeedSchedule(LRScheduler):
    """A DeepSpeed LR schedule as a torch LRScheduler.

    DeepSpeed steps its scheduler once per optimizer step; `AcceleratedScheduler` steps a scheduler
    `steps_per_update` times per optimizer step (the data-parallel size, as for every scheduler), so the schedule
    reads DeepSpeed's iteration as `last_epoch // steps_per_update - 1` (-1 before the first step, as in DeepSpeed,
    whose constructor sets the first lr). Everything kept is plain data, so `state_dict()` pickles."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_num_steps: int, warmup_type: str,
                 steps_per_update: int = 1) -> None:
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"{type(self).__name__}: argument 'warmup_type': bad value {warmup_type!r}; allowed: "
                             f"{', '.join(WARMUP_TYPES)}")
        self.warmup_num_steps = max(2, int(warmup_num_steps))  # DeepSpeed's floor: log(1) would divide by 0
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.steps_per_update = max(1, int(steps_per_update))
        super().__init__(optimizer)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's step counter: optimizer steps taken minus one."""
        return self.last_epoch // self.steps_per_update - 1

    def _warmup(self, it: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps

    def get_lr(self) -> list[float]:  # type: ignore[override]  # floats, as DeepSpeed's schedulers give
        return self.lrs_at(self.last_batch_iteration)

    def lrs_at(self, it: int) -> list[float]:
        raise NotImplementedError


class WarmupLR(_DeepSpeedSchedule):
    """DeepSpeed's WarmupLR: from warmup_min_lr to warmup_max_lr over warmup_num_steps ("log" or "linear"), then
    warmup_max_lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", steps_per_update: int = 1) -> None:
        groups = len(optimizer.param_groups)
        self.min_lrs = _lr_values(warmup_min_lr, "warmup_min_lr", type(self).__name__, groups)
        self.max_lrs = _lr_values(warmup_max_lr, "warmup_max_lr", type(self).__name__, groups)
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs, strict=True)]
        super().__init__(optimizer, warmup_num_steps, warmup_type, steps_per_update)

    def _gamma(self, it: int) -> float:
        return self._warmup(it) if it < self.warmup_num_steps else 1.0

    def lrs_at(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 steps_per_update: int = 1) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, steps_per_update)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return self._warmup(it)
        decay_steps = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - it) / decay_steps)


class WarmupCosineLR(_DeepSpeedSchedule):
    """DeepSpeed's WarmupCosineLR: each group's lr times a ratio rising from warmup_min_ratio to 1 over
    warmup_num_steps, then falling along a cosine to cos_min_ratio at total_num_steps.

    Before the first step DeepSpeed sets the first group's lr to 0 and leaves the others; here every group gets 0."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 steps_per_update: int = 1) -> None:
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        super().__init__(optimizer, warmup_num_steps, warmup_type, steps_per_update)
        if self.total_num_steps <= self.warmup_num_steps:  # DeepSpeed divides by their difference after warmup
            raise ValueError(f"WarmupCosineLR: argument 'total_num_steps': {self.total_num_steps} is not above "
                             f"warmup_num_steps ({self.warmup_num_steps}); allowed: more steps than the warmup")

    def ratio_at(self, it: int) -> float:
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup(it) * (1.0 - self.warmup_min_ratio)
        real_last_step = it - self.warmup_num_steps + 1
        real_total_steps = self.total_num_steps - self.warmup_num_steps
        ratio = (1 + math.cos(math.pi * real_last_step / real_total_steps)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def lrs_at(self, it: int) -> list[float]:
        ratio = self.ratio_at(it)
        return [base * ratio for base in self.base_lrs]  # type: ignore[misc]  # base_lrs: each group's lr when built (DeepSpeed's org_lrs)


def build_scheduler(section: dict, optimizer: torch.optim.Optimizer, dummy: DummyScheduler | None = None,
                    source: str = "DeepSpeed config", *, num_processes: int = 1, split_batches: bool = False,
                    steps_per_update: int = 1) -> _DeepSpeedSchedule:
    """The scheduler DeepSpeed builds from a `scheduler` section, on `optimizer`.

    "auto" is filled from `dummy` as Accelerate fills it: warmup_min_lr 0, warmup_max_lr the lr of the dummy's
    optimizer (a DummyOptim's `lr`, else `defaults["lr"]`), warmup_num_steps max(1, dummy's), total_num_steps
    the dummy's divided by `num_processes` (rounded up; not divided with `split_batches`): DeepSpeed counts
    optimizer steps, the dummy's count is written for the whole dataset."""
    kind, given = _section_type(section, "scheduler", SCHEDULER_TYPES, source)
    where = "scheduler.params."
    _check_keys(given, _SCHEDULER_PARAMS[kind], "scheduler.params", kind, source)
    values = {name: (_auto_scheduler_value(name, dummy, source, num_processes, split_batches) if value == _AUTO
                     else value) for name, value in given.items()}
    if values.pop("last_batch_iteration", -1) != -1:
        raise ConfigError(f"{source}: key '{where}last_batch_iteration': bad value "
                          f"{given['last_batch_iteration']!r}; allowed: -1 (resume with Accelerator.load_state)")
    if "warmup_type" in values and values["warmup_type"] not in WARMUP_TYPES:
        raise ConfigError(f"{source}: key '{where}warmup_type': bad value {values['warmup_type']!r}; allowed: "
                          f"{', '.join(WARMUP_TYPES)}")
    for name in ("warmup_num_steps", "total_num_steps"):
        if name in values:
            values[name] = _number(values[name], where + name, source, integer=True, lo=0)
    for name in ("warmup_min_ratio", "cos_min_ratio"):
        if name in values:
            values[name] = _number(values[name], where + name, source, lo=0)
    groups = len(optimizer.param_groups)
    for name in ("warmup_min_lr", "warmup_max_lr"):
        if name in values:
            _lr_values(values[name], where + name, source, groups)
    if kind != "WarmupLR" and "total_num_steps" not in values:
        raise ConfigError(f"{source}: key '{where}total_num_steps' is missing; allowed: a number of optimizer steps "
                          "(or \"auto\" with DummyScheduler(..., total_num_steps=...))")
    warmup = max(2, values.get("warmup_num_steps", 1000))
    if kind == "WarmupCosineLR" and values["total_num_steps"] <= warmup:  # DeepSpeed divides by the difference
        raise ConfigError(f"{source}: key '{where}total_num_steps': {values['total_num_steps']} is not above the "
                          f"{warmup} warmup steps; allowed: more steps than the warmup")
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}[kind]
    return cls(optimizer, steps_per_update=steps_per_update, **values)


def _auto_scheduler_value(name: str, dummy: DummyScheduler | None, source: str, num_processes: int,
                          split_batches: bool) -> Any:
    value = None
    if dummy is not None:
        if name == "warmup_min_lr":
            value = 0
        elif name == "warmup_max_lr":
            opt = dummy.optimizer
            value = getattr(opt, "lr", None) if getattr(opt, "defaults", None) is None else opt.defaults["lr"]
        elif name == "warmup_num_steps":
            value = max(1, dummy.warmup_num_steps)
        elif name == "total_num_steps" and dummy.total_num_steps is not None:
            total = dummy.total_num_steps
            value = total if split_batches else math.ceil(total / num_processes)
    if value is None:
        fills = {"total_num_steps": ", or DummyScheduler(..., total_num_steps=...)",
                 "warmup_num_steps": ", or DummyScheduler(..., warmup_num_steps=...)"}.get(name, "")
        raise ConfigError(f"{source}: key 'scheduler.params.{name}': \"auto\" but nothing fills it; allowed: a value "
                          f"in the JSON{fills}")
    return value


# -------------------------------------------------------------------------------------------------------------
# for Accelerator.prepare
# -------------------------------------------------------------------------------------------------------------

def _source_of(plugin: Any) -> str:
    carried = getattr(plugin, "_source", None)  # the JSON a config file or `accel launch` named
    if carried:
        return carried
    path = getattr(plugin, "hf_ds_config", None)
    if isinstance(path, (str, os.PathLike)):
        return os.path.normpath(os.fspath(path))
    return "DeepSpeedPlugin(hf_ds_config=...)"


def replace_dummies(args: tuple | list, deepspeed_plugin: Any, num_processes: int, split_batches: bool,
                    step_with_optimizer: bool) -> list:
    """`prepare()`'s arguments with each DummyOptim / DummyScheduler replaced by the torch object it stands for,
    after Accelerate's checks of the objects against the DeepSpeed JSON's sections.

    `num_processes` is the data-parallel size: an `AcceleratedScheduler` steps that many times per optimizer step
    (once with `split_batches`, or when the script steps it itself), so the built schedule counts in those steps."""
    from accel.optimizer import AcceleratedOptimizer
    from accel.scheduler import AcceleratedScheduler

    config = getattr(deepspeed_plugin, "deepspeed_config", None) if deepspeed_plugin is not None else None
    source = _source_of(deepspeed_plugin)
    sections = {key: (config or {}).get(key) for key in ("optimizer", "scheduler")}
    result = list(args)
    dummy_optims = [obj for obj in args if isinstance(obj, DummyOptim)]
    for obj in args:
        real = isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer)
        if real and sections["optimizer"] is not None:
            raise ValueError("You cannot specify an optimizer in the config file and in the code at the same time: "
                             f"{source} has an 'optimizer' section; allowed: remove it, or pass "
                             "accel.utils.DummyOptim(params, lr=...) instead of the torch optimizer")
        is_scheduler = isinstance(obj, (LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))
        if is_scheduler and not isinstance(obj, AcceleratedScheduler) and sections["scheduler"] is not None:
            raise ValueError("You cannot specify a scheduler in the config file and in the code at the same time: "
                             f"{source} has a 'scheduler' section; allowed: remove it, or pass "
                             "accel.utils.DummyScheduler(optimizer, ...) instead of the torch scheduler")
        if is_scheduler and dummy_optims:
            raise ValueError("prepare(): a torch scheduler was passed with a DummyOptim; allowed: "
                             "accel.utils.DummyScheduler (its lr_scheduler_callable builds a custom scheduler)")
    if dummy_optims and config is None:
        raise ValueError(f"DummyOptim needs a DeepSpeed config with an 'optimizer' section; allowed: "
                         f"{_NO_DEEPSPEED.format(what='optimizer')}")
    for i, obj in enumerate(args):
        if isinstance(obj, DummyOptim):
            if sections["optimizer"] is None:
                raise ValueError("You cannot create a `DummyOptim` without specifying an optimizer in the config "
                                 f"file: {source} has no 'optimizer' section; allowed: add one, or use a torch "
                                 "optimizer")
            obj._built = build_optimizer(sections["optimizer"], obj.params, obj, source)  # for a later DummyScheduler
            result[i] = obj._built
    steps = 1 if split_batches or not step_with_optimizer else num_processes
    for i, obj in enumerate(args):
        if not isinstance(obj, DummyScheduler):
            continue
        optimizer = obj.optimizer
        if isinstance(optimizer, DummyOptim):
            optimizer = getattr(optimizer, "_built", None)
            if optimizer is None:
                raise ValueError("DummyScheduler: its DummyOptim was not prepared; allowed: pass the DummyOptim to "
                                 "the same prepare() call (or an earlier one)")
        if obj.lr_scheduler_callable is not None:  # DeepSpeed's client scheduler: it wins over the JSON's
            result[i] = obj.lr_scheduler_callable(optimizer)
        elif sections["scheduler"] is not None:
            result[i] = build_scheduler(sections["scheduler"], optimizer, obj, source, num_processes=num_processes,
                                        split_batches=split_batches, steps_per_update=steps)
        elif config is None:
            raise ValueError(f"DummyScheduler needs a DeepSpeed config with a 'scheduler' section or "
                             f"lr_scheduler_callable; allowed: {_NO_DEEPSPEED.format(what='scheduler')}")
        else:
            raise ValueError("Either specify a scheduler in the config file or pass in the `lr_scheduler_callable` "
                             f"parameter when using `DummyScheduler`: {source} has no 'scheduler' section")
    return result


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """Accelerate's wrapper of a DeepSpeed engine's scheduler, whose `step` does nothing (the engine steps it).
    accel runs no DeepSpeed engine; transformers' Trainer imports the name and tests schedulers against it."""

    def __init__(self, scheduler, optimizers) -> None:
        from accel.runtime.state import GradientState

        super().__init__(scheduler, optimizers if isinstance(optimizers, list) else [optimizers], GradientState(), 1)

    def step(self, *args, **kwargs) -> None:
        """Nothing: the engine would step it."""
