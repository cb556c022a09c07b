"""Tensor-parallel plans: which module is split how, found before anything is split (no processes needed).

Where a plan comes from, in order: `ParallelismConfig(tp_plan={...})` (names with `*` wildcards), the model's
own `_tp_plan`/`base_model_tp_plan` (transformers), else the automatic plan for recognised layers:
q/k/v/o and gate/up/down projections, GPT-2's `Conv1D` layers (weight stored [in, out]) and its fused q/k/v
projection `c_attn`, consecutive Linear pairs in an `nn.Sequential`, embeddings and the output head.

Tied weights stay one parameter: a plan that splits one use of a tied weight is completed so every use is
split the same way (an embedding tied to a vocabulary-split head is split by vocabulary too), and a plan that
cannot keep a tie is refused with both names.
"""

from __future__ import annotations

import fnmatch
import re

import torch
from torch import nn

from accel.config import ConfigError

STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate", "colwise_rep", "rowwise_rep", "fused_qkv")
_COLUMN_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "w1", "w3", "wq", "wk", "wv")
_EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
_HEAD_NAMES = ("lm_head", "output")
_ROW_NAMES = ("o_proj", "down_proj", "fc2", "c_proj", "w2", "wo", "out_proj")
_FUSED_NAMES = ("c_attn",)  # GPT-2: q, k and v in one Conv1D of 3 * hidden outputs


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2, GPT, ...): a linear layer whose weight is stored transposed, [in, out]."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or Conv1D."""
    return (module.nx, module.nf) if is_conv1d(module) else (module.in_features, module.out_features)


def fused_parent(model: nn.Module, name: str, module: nn.Module):
    """The attention module whose fused q/k/v projection `name` is (GPT-2 style: it splits the output by its
    `split_size` and has whole heads to give each rank), or None."""
    if not is_linear(module) or name.rsplit(".", 1)[-1] not in _FUSED_NAMES:
        return None
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    inputs, outputs = features(module)
    if outputs == 3 * inputs and getattr(parent, "split_size", None) == inputs and hasattr(parent, "num_heads"):
        return parent
    return None


def automatic_plan(model: nn.Module) -> dict[str, str]:
    """A plan for the patterns this module recognises (empty when none applies)."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and leaf in _EMBEDDING_NAMES:
            plan[name] = "rowwise_rep"  # vocabulary split; the looked-up vectors are all-reduced
        elif isinstance(module, nn.Linear) and leaf in _HEAD_NAMES:
            plan[name] = "colwise_rep"  # vocabulary split; the logits are gathered
        elif fused_parent(model, name, module) is not None:
            plan[name] = "fused_qkv"
        elif is_linear(module) and leaf in _COLUMN_NAMES:
            plan[name] = "colwise"
        elif is_linear(module) and leaf in _ROW_NAMES:
            plan[name] = "rowwise"
        elif isinstance(module, nn.Sequential):
            linears = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Linear)]
            children = list(module.named_children())
            for (first, _), (second, _) in zip(linears, linears[1:]):
                between = children[[n for n, _ in children].index(first) + 1:[n for n, _ in children].index(second)]
                if all(not list(m.parameters()) for _, m in between):  # only activations/dropout between them
                    prefix = f"{name}." if name else ""
                    if f"{prefix}{first}" not in plan and f"{prefix}{second}" not in plan:
                        plan[f"{prefix}{first}"] = "colwise"
                        plan[f"{prefix}{second}"] = "rowwise"
    return _drop_unfed_rowwise(model, plan)


def _drop_unfed_rowwise(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A row-wise layer takes its input split: keep it only where a split (column-wise or fused) sibling
    produces that input, so an unrecognised attention is kept whole rather than run on half its features."""
    kept = {}
    for name, style in plan.items():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        siblings = [n for n, s in plan.items() if s in ("colwise", "fused_qkv")
                    and (n.rsplit(".", 1)[0] if "." in n else "") == parent]
        if style != "rowwise" or siblings or isinstance(model.get_submodule(parent) if parent else model,
                                                         nn.Sequential):
            kept[name] = style
    return kept


# transformers' style names -> ours
_STYLE_ALIASES = {"colwise_gather_output": "colwise_rep", "embedding_rowwise": "rowwise_rep",
                  "gather_output": "colwise_rep", "rowwise_split_input": "rowwise"}


def model_plan(model: nn.Module) -> dict[str, str]:
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


def expand_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
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


def check_divisible(model: nn.Module, plan: dict[str, str], tp_size: int) -> None:
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules[name]
        if style == "fused_qkv":
            parent = fused_parent(model, name, module)
            if parent is None:
                raise ConfigError(f"tensor parallelism: layer '{name}' (fused_qkv) is not a fused q/k/v projection "
                                  "accel can split (a Conv1D/Linear of 3 x hidden outputs in an attention module "
                                  "with split_size and num_heads)")
            if parent.num_heads % tp_size:
                raise ConfigError(f"tensor parallelism: layer '{name}' (fused_qkv) has {parent.num_heads} heads, not "
                                  f"divisible by tp_size={tp_size} (each rank holds whole heads)")
        elif is_linear(module) and style in ("colwise", "rowwise", "colwise_rep", "rowwise_rep"):
            inputs, outputs = features(module)
            dim, size = ("out_features", outputs) if style.startswith("colwise") else ("in_features", inputs)
            if size % tp_size:
                raise ConfigError(f"tensor parallelism: layer '{name}' ({style}) has {dim}={size}, not divisible "
                                  f"by tp_size={tp_size}")
        if isinstance(module, nn.Embedding) and style.startswith("rowwise") and module.num_embeddings % tp_size:
            raise ConfigError(f"tensor parallelism: embedding '{name}' has num_embeddings={module.num_embeddings}, "
                              f"not divisible by tp_size={tp_size}")


def split_dim(module: nn.Module, leaf: str, style: str | None) -> int | None:
    """The dimension of parameter `leaf` of `module` that `style` splits (None: kept whole, -1: reordered)."""
    if style in (None, "sequence_parallel", "replicate"):
        return None
    if style == "fused_qkv":
        return -1  # a layout of its own: never the same placement as another parameter
    column = style.startswith("colwise")
    if isinstance(module, nn.Embedding):
        return 0 if not column else 1
    if is_conv1d(module):
        return (1 if column else 0) if leaf == "weight" else (0 if column else None)
    if isinstance(module, nn.Linear):
        return (0 if column else 1) if leaf == "weight" else (0 if column else None)
    return None


def keep_ties(model: nn.Module, plan: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The plan completed so that every use of a tied weight is split the same way, and the entries added
    (module name -> the tied parameter that caused it). Raises a one-line error naming both parameters where
    a tie cannot be kept. A tied parameter whose module does not compute with it (an MLM head's `bias`, which its
    decoder uses) simply follows the split one."""
    from accel.checkpoint.ties import tied_names

    modules = dict(model.named_modules())
    plan, added = dict(plan), {}
    groups = [[(n, *(n.rsplit(".", 1) if "." in n else ("", n))) for n in names] for names in tied_names(model)]

    def dim(owner: str, leaf: str) -> int | None:
        return split_dim(modules[owner], leaf, plan.get(owner))

    changed = True
    while changed:  # completing one tie can split a module that holds another
        changed = False
        for group in groups:
            split = [dim(o, leaf) for _, o, leaf in group if dim(o, leaf) is not None]
            if not split:
                continue
            for _, owner, leaf in group:
                module = modules[owner]
                if owner in plan or not isinstance(module, (nn.Embedding, nn.Linear)):
                    continue
                for style in ("rowwise_rep", "colwise_rep"):  # a vocabulary split of an embedding / output head
                    if split_dim(module, leaf, style) == split[0]:
                        plan[owner] = style
                        added[owner] = next(n for n, o, lf in group if o != owner and dim(o, lf) is not None)
                        changed = True
                        break

    def how(owner: str) -> str:
        return f"split by '{plan[owner]}'" if owner in plan else "kept whole"

    for group in groups:
        first = next(((n, o, lf) for n, o, lf in group if dim(o, lf) is not None), None)
        if first is None:
            continue
        for name, owner, leaf in group:
            computes = is_linear(modules[owner]) or isinstance(modules[owner], nn.Embedding)
            differs = dim(owner, leaf) != dim(first[1], first[2]) or dim(first[1], first[2]) == -1
            if name != first[0] and differs and (computes or dim(owner, leaf) is not None):
                raise ConfigError(f"tensor parallelism: tied weights '{first[0]}' ({how(first[1])}) and '{name}' "
                                  f"({how(owner)}) cannot stay one parameter; give both the same split in tp_plan, "
                                  "or untie them (e.g. tie_word_embeddings=False)")
    return plan, added


def kept_whole(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Modules with parameters of their own that the plan does not split -> why (indices folded into '*')."""
    modules = dict(model.named_modules())
    split = {id(p) for n in plan for p in modules[n].parameters(recurse=False)}  # tied: held by a split module
    kept: dict[str, str] = {}
    for name, module in modules.items():
        own = [p for p in module.parameters(recurse=False) if id(p) not in split]
        if name in plan or not own:
            continue
        kind = type(module).__name__
        if "norm" in kind.lower():
            why = f"{kind}: a norm, replicated"
        elif isinstance(module, nn.Embedding):
            why = "Embedding: not a vocabulary embedding, replicated"
        elif is_linear(module):
            why = f"{kind}: not a recognised projection (name it in tp_plan to split it)"
        else:
            why = f"{kind}: replicated"
        kept.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", name) or "(root)", why)
    return kept
