"""Tensor parallelism (Megatron-LM style) on DTensor: `parallelize_module` over the `tp` sub-mesh, then, on a
2-D mesh, FSDP2 over the `dp` sub-mesh (data parallelism; ZeRO 2/3 semantics with zero_stage 2/3).

A pair of linear layers is split so that only one all-reduce per block is needed: the first by columns
(its output stays sharded), the second by rows (it takes the sharded input and all-reduces its output).

Which module is split how (the plan: given, the model's own, or automatic; tied weights kept one parameter) is
decided in tensor_plan.py before anything is split; the styles torch does not ship (transformers' Conv1D, fused
q/k/v) are in tensor_parallel_styles.py.
"""

from __future__ import annotations

import torch

from accel.backends import fused
from accel.backends.base import Backend, ParameterReplacements, refuse_stepped_optimizer, register_backend
from accel.backends.recipe import apply_activation_checkpointing, apply_fsdp, fsdp_no_sync
from accel.backends.tensor_parallel_styles import ColumnSplit, TransposedRowwise
from accel.backends.tensor_plan import (  # noqa: F401  (the plan functions are also importable from here)
    automatic_plan,
    check_divisible,
    expand_plan,
    fused_parent,
    is_conv1d,
    keep_ties,
    kept_whole,
    model_plan,
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
    if is_conv1d(module) and name in ("colwise", "colwise_rep"):
        return ColumnSplit(out_dim=1, **({"output_layouts": Replicate()} if name == "colwise_rep" else {}))
    if is_conv1d(module) and name in ("rowwise", "rowwise_rep"):
        return TransposedRowwise(**({"input_layouts": Replicate()} if name == "rowwise_rep" else {}))
    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(),
        "replicate": lambda: PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
    }[name]()


@register_backend("tensor")
class TensorParallelBackend(Backend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.applied_plans: list[dict[str, str]] = []
        self.fixed_plan: dict[str, str] | None = None  # plan_whole_model's, for a pipeline's stages
        self.replacements = ParameterReplacements()

    @property
    def partial_gradients(self) -> bool:
        """With data parallelism, FSDP2 over `dp` shards the gradients."""
        return self.topology.dp_size > 1

    def plan_for(self, model: torch.nn.Module) -> dict[str, str]:
        """The plan for `model` (checked, with tied weights kept one parameter), printed on the main process
        with what stays whole and why."""
        given = getattr(self.parallelism, "tp_plan", None)
        source, plan = "ParallelismConfig(tp_plan=...)", given
        if not plan:
            source, plan = "the model's own tp plan", model_plan(model)
        if not plan:
            source, plan = "accel's automatic plan", automatic_plan(model)
        if not plan:
            raise ConfigError(f"tensor parallelism: no plan applies to {type(model).__name__}: it publishes no tp "
                              "plan and has no layer accel recognises (q/k/v/o or gate/up/down projections, GPT-2's "
                              "Conv1D c_attn/c_proj/c_fc, Linear pairs in an nn.Sequential, vocabulary embeddings "
                              "or lm_head); give ParallelismConfig(tp_plan={'layer.name': 'colwise', ...})")
        plan, tied = keep_ties(model, expand_plan(model, plan))
        check_divisible(model, plan, self.topology.tp_size)
        if self.state.is_main_process:
            lines = ", ".join(f"{k}: {v}" + (f" (tied to {tied[k]})" if k in tied else "") for k, v in plan.items())
            print(f"accel: tensor parallel plan ({source}, tp_size={self.topology.tp_size}): {lines}", flush=True)
            whole = kept_whole(model, plan)
            if whole:
                print("accel: tensor parallel: kept whole (every tp rank holds all of it): "
                      + ", ".join(f"{k} ({v})" for k, v in whole.items()), flush=True)
        return plan

    def plan_whole_model(self, model: torch.nn.Module) -> None:
        """The plan is checked (ties, divisibility) and printed on the whole model, then applied stage by stage."""
        self.fixed_plan = self.plan_for(model)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        from accel.checkpoint.ties import tied_names

        if device_placement:
            model = model.to(self.state.device)
        if self.fixed_plan is None:
            plan = self.plan_for(model)
        else:  # a pipeline stage: the entries for modules this stage holds (stand-ins hold no parameters)
            held = {name for name, m in model.named_modules() if next(m.parameters(), None) is not None}
            plan = {name: style for name, style in self.fixed_plan.items() if name in held}
        self.applied_plans.append(plan)
        mesh = self.topology.mesh(self.state.device.type)
        originals = self.replacements.snapshot(model)
        ties = tied_names(model)
        tp_size = self.topology.tp_size
        modules = dict(model.named_modules())
        for name, style in plan.items():
            parent = fused_parent(model, name, modules[name]) if style == "fused_qkv" else None
            if parent is not None:
                parent.split_size //= tp_size  # its forward splits the (now local) q/k/v output by this width
        parallelize_module(model, mesh["tp"], {name: _style(style, modules[name], tp_size)
                                               for name, style in plan.items()})
        _retie(model, ties)
        apply_activation_checkpointing(model, self.parallelism)  # the recipe's order: TP, then AC, then FSDP
        if self.topology.dp_size > 1:
            self._shard_over_dp(model, mesh["dp"])
        self.replacements.record(originals, model)  # the split layers have new (DTensor) parameters
        return model

    def _shard_over_dp(self, model: torch.nn.Module, dp_mesh) -> None:
        """The data-parallel dimension of the 2-D mesh: FSDP2 over `dp` (TP first, then this). Gradients are
        averaged over the dp ranks as DDP would (reduce-scatter); zero_stage 3 also reshards parameters after
        forward. DDP itself does not take DTensor parameters."""
        apply_fsdp(model, dp_mesh, self.parallelism, self.precision)

    def no_sync(self, model: torch.nn.Module):
        if hasattr(model, "set_requires_gradient_sync"):
            return fsdp_no_sync(model)
        return super().no_sync(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> torch.optim.Optimizer:
        refuse_stepped_optimizer(optimizer, "tensor parallelism")
        self.replacements.track(optimizer)
        return optimizer

    def forget(self) -> None:
        self.replacements.clear()

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return fused.to_model_order(state, model)


def _retie(model: torch.nn.Module, ties: list[tuple[str, ...]]) -> None:
    """Splitting gives each module a new parameter; a tied weight's uses get the one split parameter back (the
    plan split them alike: keep_ties), so they train as one and stay identical."""
    for names in ties:
        params = [model.get_parameter(n) for n in names]
        kept = next((p for p in params if hasattr(p, "device_mesh")), params[0])
        for name, param in zip(names, params):
            if param is not kept:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner) if owner else model, leaf, kept)
