"""An optimizer that cannot train the prepared model, named in one line.

Sharding (ZeRO 2/3, HSDP: FSDP2), tensor parallelism and expert parallelism give a model NEW parameter objects at
`prepare` (DTensor shards, a rank's rows of the stacked experts). An optimizer passed to `prepare` is re-pointed at
them, whichever of the two was prepared first (the backends' `ParameterReplacements`). One that was never passed
keeps the old objects: no forward uses them, no backward gives them a gradient, so its `step` changes nothing the
model reads: exit code 0, and the model does not learn. This module notes which trainable parameters `prepare`
replaced (by name; the old objects weakly, so the whole unsharded model is never kept alive) and refuses such a
run in one line (`UnpreparedOptimizerError`, a ConfigError, so a ValueError as Accelerate's own FSDP2
refusal):

* at the first `accelerator.backward` after a model whose parameters were replaced was prepared, when no optimizer
  was prepared at all (Accelerate refuses that already at `prepare`; accel lets a model be prepared alone, e.g. for
  evaluation, and speaks only once the loop trains);
* when an optimizer is prepared, and at the first `step` of every optimizer (a torch hook on every optimizer's step,
  installed only while some prepared model's parameters were replaced), when it still holds a replaced parameter.

It never asks which backend replaced them: it compares the model's parameters, by name, before and after
`backend.prepare_model` (wrapper prefixes: `Accelerator.unwrap_model` on both sides, then `bare_name`). A parameter
the prepared model no longer has (another pipeline stage's, an expert another rank holds) is not replaced: this
process's optimizer is not meant to hold it. Plain DDP and ZeRO-1 keep the parameters: nothing is said there.

After an optimizer's first step the hook costs a set lookup per step (about 2 us on a CPU, and only in a run whose
parameters were replaced); after the first backward, the backward check is one attribute read.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from accel.config.errors import ConfigError

_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})  # torch.compile's, checkpoint_wrapper's
_ADVICE = ("pass the optimizer to prepare with the model: `model, optimizer = accelerator.prepare(model, optimizer, "
           "...)` (built on model.parameters(), before or after prepare)")


class UnpreparedOptimizerError(ConfigError):
    """An optimizer that cannot train the prepared model: one line naming the layout and what to pass to `prepare`
    (a ConfigError, so a ValueError as Accelerate's refusal, printed as accel's other one-line errors are)."""


def bare_name(name: str) -> str:
    """A parameter's name without the segments wrappers put in it (torch.compile's `_orig_mod`, torch's
    `checkpoint_wrapper`'s `_checkpoint_wrapped_module`)."""
    parts = name.split(".")
    return name if _WRAPPER_SEGMENTS.isdisjoint(parts) else ".".join(p for p in parts if p not in _WRAPPER_SEGMENTS)


def layout_name(parallelism: Any, sizes: dict[str, int]) -> str:
    """The layout in words, for the message: e.g. 'ZeRO-3', 'HSDP (dp_replicate_size=2 x dp_shard_size=2, ZeRO-3)',
    'tensor parallelism (tp_size=2)', joined with ' + '. `parallelism`: the config's ParallelismConfig; `sizes`: the
    topology's dimension sizes (dp_replicate, dp_shard)."""
    parts = []
    if parallelism.pp_size > 1:
        parts.append(f"pipeline parallelism (pp_size={parallelism.pp_size})")
    replicate, shard, stage = sizes.get("dp_replicate", 1), sizes.get("dp_shard", 1), parallelism.zero_stage
    if replicate > 1 and shard > 1:
        parts.append(f"HSDP (dp_replicate_size={replicate} x dp_shard_size={shard}, ZeRO-{stage})")
    elif stage:
        parts.append(f"ZeRO-{stage}")
    elif shard > 1:
        parts.append(f"FSDP (dp_shard_size={shard})")
    for dim, what in (("tp", "tensor"), ("cp", "context"), ("sp", "sequence"), ("ep", "expert")):
        size = getattr(parallelism, f"{dim}_size", 1) or 1
        if size > 1:
            parts.append(f"{what} parallelism ({dim}_size={size})")
    return " + ".join(parts) or ("data parallelism (DDP)" if sizes.get("dp", 1) > 1 else "one process")


class ReplacedParameters:
    """The trainable parameters `prepare` replaced (one per Accelerator), and the checks on the optimizers."""

    def __init__(self, layout: str) -> None:
        self.layout = layout  # layout_name's words for this Accelerator's layout
        self._reset()

    def _reset(self) -> None:
        self._originals: dict[int, tuple[weakref.ref, str]] = {}  # id(old parameter) -> (weakref to it, its name)
        self.replaced: list[str] = []  # the names replaced (their old objects may be gone)
        self.unchecked = False  # a model with replaced parameters was prepared since the last backward check
        self._prepared: Any = weakref.WeakSet()  # the optimizers prepare returned (the backend's, unwrapped)
        self._stepped: Any = weakref.WeakSet()  # optimizers whose first step passed the check

    def __getstate__(self) -> dict:
        return {"layout": self.layout}  # identities (what weakrefs record) do not survive pickling

    def __setstate__(self, state: dict) -> None:
        self.layout = state["layout"]
        self._reset()

    # -- prepare_model -----------------------------------------------------------------------------------------
    @staticmethod
    def snapshot(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """The model's trainable parameters by (bare) name, before `prepare` (the unwrapped model)."""
        return {bare_name(n): p for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}

    def record(self, before: dict[str, torch.nn.Parameter], prepared: torch.nn.Module) -> None:
        """Note which of `before` (a snapshot) the prepared, unwrapped model has under the same name as another
        object. One that it no longer has at all (another stage's, another rank's expert) is not replaced."""
        after = {bare_name(n): p for n, p in prepared.named_parameters(remove_duplicate=False)}
        replaced = [name for name, old in before.items() if after.get(name, old) is not old]
        if not replaced:
            return
        for name in replaced:
            old = before[name]
            self._originals[id(old)] = (weakref.ref(old), name)
        self.replaced += replaced
        self.unchecked = True
        self._stepped = weakref.WeakSet()  # an optimizer that stepped before this prepare is looked at again
        _watch(self)

    # -- the checks --------------------------------------------------------------------------------------------
    def held(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The names of the replaced parameters `optimizer` still holds (old objects)."""
        names = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                entry = self._originals.get(id(param))
                if entry is not None and entry[0]() is param:
                    names.append(entry[1])
        return names

    def check_prepared(self, optimizer: torch.optim.Optimizer) -> None:
        """At `prepare`: the optimizer the backend returned (re-pointed) holds none of the replaced parameters."""
        self._check(optimizer, "accelerator.prepare", prepared=True)
        self._prepared.add(optimizer)

    def check_backward(self) -> None:
        """At the first backward after a model whose parameters were replaced was prepared: some optimizer was
        prepared (one that was not holds the old parameters, or the new ones without accel's step)."""
        self.unchecked = False
        if self.replaced and not len(self._prepared):
            count, example = len(self.replaced), self.replaced[0]
            raise UnpreparedOptimizerError(
                f"accelerator.backward: under {self.layout}, prepare gave the model new parameters ({count}, e.g. "
                f"{example!r}) but no optimizer was prepared, so an optimizer built on the old ones never updates the "
                f"model; {_ADVICE}")

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        """At an optimizer's first step (any optimizer's: the hook `_watch` installs)."""
        try:
            if optimizer in self._stepped:
                return
        except TypeError:  # an optimizer without weak references: looked at every step
            self._check(optimizer, f"{type(optimizer).__name__}.step", prepared=False)
            return
        self._check(optimizer, f"{type(optimizer).__name__}.step", prepared=optimizer in self._prepared)
        self._stepped.add(optimizer)

    def _check(self, optimizer: torch.optim.Optimizer, where: str, prepared: bool) -> None:
        names = self.held(optimizer)
        if not names:
            return
        advice = ("prepare the optimizer in the same call as its model, or after it: `model, optimizer = "
                  "accelerator.prepare(model, optimizer, ...)`" if prepared else _ADVICE)
        raise UnpreparedOptimizerError(
            f"{where}: under {self.layout}, prepare gave the model new parameters, and this optimizer "
            f"({type(optimizer).__name__}) holds {len(names)} of the old ones (e.g. {names[0]!r}), which the model no "
            f"longer uses, so its steps never update the model; {advice}")

    # -- lifetime ----------------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget everything (Accelerator.free_memory); the step hook goes when no Accelerator needs it."""
        self._reset()
        _unwatch(self)


# One torch hook before every optimizer's step, in the whole process, while some Accelerator has replaced parameters
# (torch.optim.optimizer.register_optimizer_step_pre_hook); never removed while torch runs the hooks (only by
# `clear`), and the registries are held weakly (an Accelerator dropped without free_memory leaves the hook idle).
_WATCHED: Any = weakref.WeakSet()
_HOOK: list = []  # its handle while installed


def _before_any_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for registry in list(_WATCHED):
        registry.check_step(optimizer)


def _watch(registry: ReplacedParameters) -> None:
    _WATCHED.add(registry)
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_before_any_step))


def _unwatch(registry: ReplacedParameters) -> None:
    _WATCHED.discard(registry)
    if _HOOK and not len(_WATCHED):
        _HOOK.pop().remove()
