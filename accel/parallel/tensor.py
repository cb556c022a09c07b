"""Tensor parallelism (Megatron-LM style) on DTensor, one step of the recipe: `parallelize_module` over the `tp`
sub-mesh (on a 2-D mesh the recipe then shards over `dp` with FSDP2: data parallelism, ZeRO 2/3 semantics).

A pair of linear layers is split so that only one all-reduce per block is needed: the first by columns
(its output stays sharded), the second by rows (it takes the sharded input and all-reduces its output).

Which module is split how (the plan: given, the model's own, or automatic; tied weights kept one parameter) is
decided in tensor_plan.py before anything is split; the styles torch does not ship (transformers' Conv1D, fused
q/k/v) are in tensor_parallel_styles.py.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.parallel.tensor_parallel_styles import ColumnSplit, EmbeddingRowwise, ExpertsSplit, TransposedRowwise
from accel.parallel.tensor_plan import (
    automatic_plan,
    builtin_source,
    check_divisible,
    check_peft_layers,
    expand_plan,
    fused_parent,
    is_conv1d,
    keep_ties,
    kept_whole,
    model_plan,
    torch_pieces,
)
from accel.config import ConfigError


def _style(name: str, module: torch.nn.Module, tp_size: int):
    """The torch ParallelStyle for one plan entry; transformers' Conv1D and fused q/k/v layers get accel's own."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if name == "fused_qkv":
        return ColumnSplit(out_dim=1 if is_conv1d(module) else 0, parts=3, tp_size=tp_size)
    if name == "experts":
        return ExpertsSplit(tp_size)
    replicated_output: dict[str, Any] = {"output_layouts": Replicate()} if name == "colwise_rep" else {}
    replicated_input: dict[str, Any] = {"input_layouts": Replicate()} if name == "rowwise_rep" else {}
    if is_conv1d(module) and name in ("colwise", "colwise_rep"):
        return ColumnSplit(out_dim=1, **replicated_output)
    if is_conv1d(module) and name in ("rowwise", "rowwise_rep"):
        return TransposedRowwise(**replicated_input)
    if isinstance(module, torch.nn.Embedding) and name in ("rowwise", "rowwise_rep"):
        return EmbeddingRowwise(**replicated_input)
    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(),
        "replicate": lambda: PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
    }[name]()


def plan_for(model: torch.nn.Module, parallelism, tp_size: int, announce: bool) -> dict[str, str]:
    """The plan for `model` (given, the model's own, or automatic; checked, with tied weights kept one
    parameter), printed with what stays whole and why when `announce` (the main process). Errors name where
    the bad entry came from (the config key, the model's plan, or accel's built-in one)."""
    given = getattr(parallelism, "tp_plan", None)
    source, plan = "ParallelismConfig(tp_plan=...)", given
    origin: str | dict[str, str] = "parallelism.tp_plan"  # a dict: where each entry was read
    if not plan:
        origins: dict[str, str] = {}
        source, plan, origin = "the model's own tp plan", model_plan(model, origins), origins
    if not plan:
        source, plan = "accel's automatic plan", automatic_plan(model)
        origin = builtin_source(model)
    if not plan:
        raise ConfigError(f"tensor parallelism: no plan applies to {type(model).__name__}: it publishes no tp "
                          "plan and has no layer accel recognises (q/k/v/o or gate/up/down projections, GPT-2's "
                          "Conv1D c_attn/c_proj/c_fc, Linear pairs in an nn.Sequential, vocabulary embeddings "
                          "or lm_head); give ParallelismConfig(tp_plan={'layer.name': 'colwise', ...})")
    plan = expand_plan(model, plan, origin)  # a dict `origin` gains the concrete names' origins
    plan, whole = check_peft_layers(model, plan, origin)
    plan, tied = keep_ties(model, plan)
    plan, _ = check_peft_layers(model, plan, origin, keep_whole=False)  # a tie completed onto a peft layer
    check_divisible(model, plan, tp_size, origin)
    if announce:
        lines = ", ".join(f"{k}: {v}" + (f" (tied to {tied[k]})" if k in tied else "") for k, v in plan.items())
        print(f"accel: tensor parallel plan ({source}, tp_size={tp_size}): {lines}", flush=True)
        whole = {**whole, **kept_whole(model, plan)}
        if whole:
            print("accel: tensor parallel: kept whole (every tp rank holds all of it): "
                  + ", ".join(f"{k} ({v})" for k, v in whole.items()), flush=True)
    return plan


def held_part(plan: dict[str, str], model: torch.nn.Module) -> dict[str, str]:
    """The entries of a whole model's plan for the modules a pipeline stage holds (stand-ins hold no parameters)."""
    held = {name for name, m in model.named_modules() if next(m.parameters(), None) is not None}
    return {name: style for name, style in plan.items() if name in held}


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh, plan: dict[str, str]) -> None:
    """Split the planned layers over `tp_mesh` (torch's `parallelize_module`; a peft LoRA layer as its base layer
    and adapter matrices: tensor_plan.torch_pieces), then give each tied weight's uses the one split parameter
    back."""
    from torch.distributed.tensor.parallel import parallelize_module

    from accel.checkpoint.ties import tied_names

    ties = tied_names(model)
    tp_size = tp_mesh.size()
    modules = dict(model.named_modules())
    for name, style in plan.items():
        parent = fused_parent(model, name, modules[name]) if style == "fused_qkv" else None
        if parent is not None:
            parent.split_size //= tp_size  # its forward splits the (now local) q/k/v output by this width
    pieces = [piece for name, style in plan.items() for piece in torch_pieces(name, modules[name], style)]
    parallelize_module(model, tp_mesh, {name: _style(style, modules[name], tp_size) for name, style in pieces})
    _retie(model, ties)


def _retie(model: torch.nn.Module, ties: list[tuple[str, ...]]) -> None:
    """Splitting gives each module a new parameter; a tied weight's uses get the one split parameter back (the
    plan split them alike: keep_ties), so they train as one and stay identical."""
    for names in ties:
        params = [model.get_parameter(n) for n in names]
        kept = next((p for p in params if hasattr(p, "device_mesh")), params[0])
        for name, param in zip(names, params, strict=True):
            if param is not kept:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner) if owner else model, leaf, kept)
