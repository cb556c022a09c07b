"""Tensor parallelism (Megatron-LM style) on DTensor: `parallelize_module` over the `tp` sub-mesh, then, on a
2-D mesh, FSDP2 over the `dp` sub-mesh (data parallelism; ZeRO 2/3 semantics with zero_stage 2/3).

A pair of linear layers is split so that only one all-reduce per block is needed: the first by columns
(its output stays sharded), the second by rows (it takes the sharded input and all-reduces its output).

Where the plan comes from, in order: `ParallelismConfig(tp_plan={...})` (names with `*` wildcards; styles
colwise, rowwise, sequence_parallel, replicate), the model's own `_tp_plan`/`base_model_tp_plan`
(transformers), else an automatic plan for recognised patterns (q/k/v/o and gate/up/down projections,
consecutive Linear pairs in an `nn.Sequential`, embeddings and the output head).
"""

from __future__ import annotations

import fnmatch

import torch

from accel.backends.base import Backend, ParameterReplacements, refuse_stepped_optimizer, register_backend
from accel.config import ConfigError

STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate", "colwise_rep", "rowwise_rep")
_COLUMN_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "w1", "w3", "wq", "wk", "wv")
_EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
_HEAD_NAMES = ("lm_head", "output")
_ROW_NAMES = ("o_proj", "down_proj", "fc2", "c_proj", "w2", "wo", "out_proj")


def automatic_plan(model: torch.nn.Module) -> dict[str, str]:
    """A plan for the patterns this module recognises (empty when none applies)."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and leaf in _EMBEDDING_NAMES:
            plan[name] = "rowwise_rep"  # vocabulary split; the looked-up vectors are all-reduced
        elif isinstance(module, torch.nn.Linear) and leaf in _HEAD_NAMES:
            plan[name] = "colwise_rep"  # vocabulary split; the logits are gathered
        elif isinstance(module, torch.nn.Linear) and leaf in _COLUMN_NAMES:
            plan[name] = "colwise"
        elif isinstance(module, torch.nn.Linear) and leaf in _ROW_NAMES:
            plan[name] = "rowwise"
        elif isinstance(module, torch.nn.Sequential):
            linears = [(n, m) for n, m in module.named_children() if isinstance(m, torch.nn.Linear)]
            children = list(module.named_children())
            for (first, _), (second, _) in zip(linears, linears[1:]):
                between = children[[n for n, _ in children].index(first) + 1:[n for n, _ in children].index(second)]
                if all(not list(m.parameters()) for _, m in between):  # only activations/dropout between them
                    prefix = f"{name}." if name else ""
                    if f"{prefix}{first}" not in plan and f"{prefix}{second}" not in plan:
                        plan[f"{prefix}{first}"] = "colwise"
                        plan[f"{prefix}{second}"] = "rowwise"
    return plan


# transformers' style names -> ours
_STYLE_ALIASES = {"colwise_gather_output": "colwise_rep", "embedding_rowwise": "rowwise_rep",
                  "gather_output": "colwise_rep", "rowwise_split_input": "rowwise"}


def model_plan(model: torch.nn.Module) -> dict[str, str]:
    """The plan a transformers model publishes (`base_model_tp_plan` on its config, `_tp_plan` on the model);
    style names translated to ours, entries in styles accel does not know left out (and printed)."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_base = prefix and hasattr(model, prefix)
    for key, style in base.items():
        plan[f"{prefix}.{key}" if has_base else key] = style
    plan.update(getattr(model, "_tp_plan", None) or {})
    translated, skipped = {}, []
    for key, style in plan.items():
        style = _STYLE_ALIASES.get(str(style).replace("local_", ""), str(style).replace("local_", ""))
        (translated.__setitem__(key, style) if style in STYLES else skipped.append(f"{key}: {style}"))
    if skipped:
        print(f"accel: tensor parallel plan: left out entries in styles accel does not know: {', '.join(skipped)}")
    return translated


def expand_plan(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Wildcard names -> the concrete module names they match (a pattern that matches nothing is an error)."""
    names = [n for n, _ in model.named_modules() if n]
    concrete: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"parallelism.tp_plan: '{pattern}': bad style {style!r}; allowed: {', '.join(STYLES)}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ConfigError(f"parallelism.tp_plan: '{pattern}' matches no module of the model")
        for hit in hits:
            concrete[hit] = style
    return concrete


def check_divisible(model: torch.nn.Module, plan: dict[str, str], tp_size: int) -> None:
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules[name]
        if isinstance(module, torch.nn.Linear) and style in ("colwise", "rowwise", "colwise_rep", "rowwise_rep"):
            dim, size = ("out_features", module.out_features) if style.startswith("colwise") else ("in_features", module.in_features)
            if size % tp_size:
                raise ConfigError(f"tensor parallelism: layer '{name}' ({style}) has {dim}={size}, not divisible "
                                  f"by tp_size={tp_size}")
        if isinstance(module, torch.nn.Embedding) and style.startswith("rowwise") and module.num_embeddings % tp_size:
            raise ConfigError(f"tensor parallelism: embedding '{name}' has num_embeddings={module.num_embeddings}, "
                              f"not divisible by tp_size={tp_size}")


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

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
        par = self.parallelism
        if par.zero_stage == 1 or par.offload_optimizer or par.offload_params:
            raise ConfigError("parallelism: tensor parallelism with ZeRO stage 1 or CPU offload is not available yet "
                              "in accel; allowed: zero_stage 0, 2 or 3 without offload")
        if self.precision.mode == "fp16" and self.topology.dp_size > 1:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.precision.use_scaler_class(ShardedGradScaler)
        self.applied_plans: list[dict[str, str]] = []
        self.fixed_plan: dict[str, str] | None = None  # a pipeline checks the plan on the whole model, then sets it
        self.replacements = ParameterReplacements()

    def plan_for(self, model: torch.nn.Module) -> dict[str, str]:
        given = getattr(self.parallelism, "tp_plan", None)
        source, plan = "ParallelismConfig(tp_plan=...)", given
        if not plan:
            source, plan = "the model's own tp plan", model_plan(model)
        if not plan:
            source, plan = "accel's automatic plan", automatic_plan(model)
        if not plan:
            raise ConfigError(f"tensor parallelism: no plan applies to {type(model).__name__}: no q/k/v/o or "
                              "gate/up/down projections and no Linear pairs in an nn.Sequential; give "
                              "ParallelismConfig(tp_plan={'layer.name': 'colwise', ...})")
        plan = expand_plan(model, plan)
        check_divisible(model, plan, self.topology.tp_size)
        if self.state.is_main_process:
            lines = ", ".join(f"{k}: {v}" for k, v in plan.items())
            print(f"accel: tensor parallel plan ({source}, tp_size={self.topology.tp_size}): {lines}", flush=True)
        return plan

    def prepare_model(self, model: torch.nn.Module, device_placement: bool = True) -> torch.nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        if device_placement:
            model = model.to(self.state.device)
        if self.fixed_plan is None:
            plan = self.plan_for(model)
        else:  # a pipeline stage: the entries for modules this stage holds
            held = {name for name, m in model.named_modules() if not hasattr(m, "_accel_where")}
            plan = {name: style for name, style in self.fixed_plan.items() if name in held}
        self.applied_plans.append(plan)
        mesh = self.topology.mesh(self.state.device.type)
        originals = self.replacements.snapshot(model)
        parallelize_module(model, mesh["tp"], {name: _style(style) for name, style in plan.items()})
        if self.topology.dp_size > 1:
            self._shard_over_dp(model, mesh["dp"])
        self.replacements.record(originals, model)  # the split layers have new (DTensor) parameters
        return model

    def _shard_over_dp(self, model: torch.nn.Module, dp_mesh) -> None:
        """The data-parallel dimension of the 2-D mesh: FSDP2 over `dp` (TP first, then this). Gradients are
        averaged over the dp ranks as DDP would (reduce-scatter); zero_stage 3 also reshards parameters after
        forward. DDP itself does not take DTensor parameters."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from accel.backends.zero import DEFAULT_MIN_PARAMS, wrap_targets

        options = {"mesh": dp_mesh, "reshard_after_forward": self.parallelism.zero_stage == 3}
        if self.precision.dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.precision.dtype, reduce_dtype=torch.float32)
        classes = [c.strip() for c in (self.parallelism.zero_wrap_classes or "").split(",") if c.strip()]
        for block in reversed(wrap_targets(model, classes, self.parallelism.zero_min_params or DEFAULT_MIN_PARAMS)):
            fully_shard(block, **options)
        fully_shard(model, **options)

    def no_sync(self, model: torch.nn.Module):
        if hasattr(model, "set_requires_gradient_sync"):
            from accel.backends.zero import _fsdp_no_sync

            return _fsdp_no_sync(model)
        return super().no_sync(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> torch.optim.Optimizer:
        refuse_stepped_optimizer(optimizer, "tensor parallelism")
        self.replacements.track(optimizer)
        return optimizer

    def forget(self) -> None:
        self.replacements.clear()

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
