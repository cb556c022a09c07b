"""Tensor-parallel plans: which module is split how, found before anything is split (no processes needed).

Where a plan comes from, in order: `ParallelismConfig(tp_plan={...})` (names with `*` wildcards), the model's
own `_tp_plan`/`base_model_tp_plan` (transformers), else the automatic plan for recognised layers:
q/k/v/o and gate/up/down projections, GPT-2's `Conv1D` layers (weight stored [in, out]) and its fused q/k/v
projection `c_attn`, consecutive Linear pairs in an `nn.Sequential`, embeddings and the output head, and a MoE
layer's stacked experts (transformers' Mixtral/Qwen2-MoE `experts`, split within each expert: `experts`).

Tied weights stay one parameter: a plan that splits one use of a tied weight is completed so every use is
split the same way (an embedding tied to a vocabulary-split head is split by vocabulary too), and a plan that
cannot keep a tie is refused with both names.

Wrapped models: a plan written for the bare model also matches it inside PEFT (`base_model.model.`),
torch.compile (`_orig_mod.`) and DDP (`module.`). A planned peft LoRA layer around a Linear/Conv1D is split as one
layer: its base layer by the entry's style, and the adapter matrices so the sum stays one process's (column-wise:
lora_B by its outputs, lora_A whole; row-wise: lora_A by its inputs, its rank-r output all-reduced, lora_B whole).
"""

from __future__ import annotations

import difflib
import fnmatch
import itertools
import re
import sys
from typing import Any, cast

import torch
from torch import nn

from accel.config import ConfigError

STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate", "colwise_rep", "rowwise_rep", "fused_qkv", "experts")
_COLUMN_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "w1", "w3", "wq", "wk", "wv")
_EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
_HEAD_NAMES = ("lm_head", "output")
_ROW_NAMES = ("o_proj", "down_proj", "fc2", "c_proj", "w2", "wo", "out_proj")
_FUSED_NAMES = ("c_attn",)  # GPT-2: q, k and v in one Conv1D of 3 * hidden outputs


def fold_indices(name: str) -> str:
    """A module name with its layer indices as `*` (`model.layers.0.mlp` -> `model.layers.*.mlp`)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def is_stacked_experts(module: nn.Module) -> bool:
    """transformers' fused MoE experts: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (the `experts` style)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2])


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2, GPT, ...): a linear layer whose weight is stored transposed, [in, out]."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or Conv1D."""
    layer: Any = computing(module)  # a Linear or transformers' Conv1D: their size attributes
    return (layer.nx, layer.nf) if is_conv1d(layer) else (layer.in_features, layer.out_features)


# -- wrappers: PEFT, torch.compile, DDP -----------------------------------------------------------------------

def _loaded_class(module_name: str, name: str):
    """A class of a wrapper's module, only when that module is imported (a model it wrapped imported it): the
    check imports nothing (neither peft nor torch._dynamo, seconds each)."""
    return getattr(sys.modules.get(module_name), name, None)


def _wrapped_child(module: nn.Module) -> str | None:
    """The child a wrapper holds the wrapped model in: PeftModel's `base_model`, a peft tuner's `model`,
    torch.compile's `_orig_mod`, DDP's/DataParallel's `module` (None: not a wrapper)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    kinds = [(DistributedDataParallel, "module"), (DataParallel, "module")]
    kinds += [(_loaded_class("peft", "PeftModel"), "base_model"), (_loaded_class("peft", "PeftMixedModel"),
                                                                    "base_model"),
              (_loaded_class("peft.tuners.tuners_utils", "BaseTuner"), "model"),
              (_loaded_class("torch._dynamo.eval_frame", "OptimizedModule"), "_orig_mod")]  # imported by compile
    for kind, child in kinds:
        if kind is not None and isinstance(module, kind) and isinstance(module._modules.get(child), nn.Module):
            return child
    return None


def wrapper_prefix(model: nn.Module) -> tuple[str, nn.Module]:
    """The names wrappers put before the wrapped model's own ('base_model.model.' for PEFT, '_orig_mod.',
    'module.', nested in any order) and the model inside, whose names a plan is written for."""
    prefix, inner = "", model
    while (child := _wrapped_child(inner)) is not None:
        prefix, inner = f"{prefix}{child}.", inner.get_submodule(child)
    return prefix, inner


def bare_name(name: str, prefix: str) -> str:
    """A module's name without the wrappers' prefix (the name it has in the bare model)."""
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def is_peft_layer(module: nn.Module) -> bool:
    """A layer peft put in place of the model's own: a tuner layer (LoRA, IA3, ...) or a modules_to_save copy."""
    kinds = [_loaded_class("peft.tuners.tuners_utils", "BaseTunerLayer"),
             _loaded_class("peft.utils.other", "AuxiliaryTrainingWrapper"),
             _loaded_class("peft.utils.other", "ModulesToSaveWrapper")]  # its own base class in older peft
    return any(kind is not None and isinstance(module, kind) for kind in kinds)


def is_lora_linear(module: nn.Module) -> bool:
    """peft's plain LoRA around a Linear/Conv1D (`base_layer` computes, each adapter adds lora_B(lora_A(x)));
    not DoRA or another variant, whose forward also reads the whole base weight."""
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    base = getattr(module, "base_layer", None)
    return (is_peft_layer(module) and isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict)
            and isinstance(base, nn.Module) and is_linear(base) and not getattr(module, "lora_variant", None)
            and not len(getattr(module, "lora_magnitude_vector", None) or ())
            and all(is_linear(m) for m in (*lora_a.values(), *lora_b.values())))


def is_saved_copy(module: nn.Module) -> bool:
    """peft's modules_to_save wrapper: the original layer and a trainable copy per adapter, split alike."""
    original, copies = getattr(module, "original_module", None), getattr(module, "modules_to_save", None)
    return (is_peft_layer(module) and isinstance(original, nn.Module) and isinstance(copies, nn.ModuleDict)
            and not is_peft_layer(original) and all(type(c) is type(original) for c in copies.values()))


def computing(module: nn.Module) -> nn.Module:
    """The layer whose weights a plan entry splits: a LoRA layer's base layer, a modules_to_save wrapper's
    original, else the module itself (a peft layer accel cannot split stays itself, so no style applies)."""
    if is_lora_linear(module):
        return cast(nn.Module, module.base_layer)
    if is_saved_copy(module):
        return cast(nn.Module, module.original_module)
    return module


def torch_pieces(name: str, module: nn.Module, style: str) -> list[tuple[str, str]]:
    """(submodule, style) pairs torch applies for one plan entry. A LoRA layer: its base layer by `style`;
    column-wise, lora_B by its outputs too (lora_A whole: every rank computes the rank-r product); row-wise,
    lora_A by its inputs too (its rank-r output is all-reduced, lora_B whole); layout-only styles on the layer
    itself. A modules_to_save wrapper: the original and each copy alike."""
    if is_lora_linear(module) and style not in ("sequence_parallel", "replicate"):
        matrices = "lora_A" if style.startswith("rowwise") else "lora_B"
        return [(f"{name}.base_layer", style)] + [(f"{name}.{matrices}.{key}", style)
                                                   for key in getattr(module, matrices)]
    if is_saved_copy(module):
        return [(f"{name}.original_module", style)] + [(f"{name}.modules_to_save.{key}", style)
                                                        for key in cast(nn.ModuleDict, module.modules_to_save)]
    return [(name, style)]


def fused_parent(model: nn.Module, name: str, module: nn.Module):
    """The attention module whose fused q/k/v projection `name` is (GPT-2 style: it splits the output by its
    `split_size` and has whole heads to give each rank), or None."""
    if not is_linear(computing(module)) or name.rsplit(".", 1)[-1] not in _FUSED_NAMES:
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
        leaf, layer = name.rsplit(".", 1)[-1], computing(module)  # a LoRA layer is planned as the layer it wraps
        if is_stacked_experts(module):
            plan[name] = "experts"  # each expert's intermediate features split; the outputs all-reduced
        elif isinstance(layer, nn.Embedding) and leaf in _EMBEDDING_NAMES:
            plan[name] = "rowwise_rep"  # vocabulary split; the looked-up vectors are all-reduced
        elif isinstance(layer, nn.Linear) and leaf in _HEAD_NAMES:
            plan[name] = "colwise_rep"  # vocabulary split; the logits are gathered
        elif fused_parent(model, name, module) is not None:
            plan[name] = "fused_qkv"
        elif is_linear(layer) and leaf in _COLUMN_NAMES:
            plan[name] = "colwise"
        elif is_linear(layer) and leaf in _ROW_NAMES:
            plan[name] = "rowwise"
        elif isinstance(module, nn.Sequential):
            linears = [(n, m) for n, m in module.named_children() if isinstance(computing(m), nn.Linear)]
            children = list(module.named_children())
            for (first, _), (second, _) in itertools.pairwise(linears):
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
                  "gather_output": "colwise_rep", "rowwise_split_input": "rowwise", "moe_tp_experts": "experts"}


def model_plan(model: nn.Module, origins: dict[str, str] | None = None) -> dict[str, str]:
    """The plan a transformers model publishes (`base_model_tp_plan` on its config, `_tp_plan` on the model),
    read from the model inside any wrapper (PEFT, torch.compile, DDP) and named as in that model; style names
    translated to ours, entries in styles accel does not know left out (and printed). An `experts` entry takes
    the entries for its parameters (`experts.gate_up_proj: packed_colwise`, ...) with it; entries that match no
    module of this model (a dense MLP's in a model whose layers are all MoE) are left out too. Stacked experts the
    plan does not name get an `experts` entry: splitting them is most of what TP saves in a MoE model. `origins`,
    when given, receives where each entry was read (for the errors)."""
    _, model = wrapper_prefix(model)
    plan: dict[str, str] = {}
    found: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_base = prefix and hasattr(model, prefix)
    for key, style in base.items():
        plan[f"{prefix}.{key}" if has_base else key] = style
        found[f"{prefix}.{key}" if has_base else key] = f"{type(config).__name__}.base_model_tp_plan['{key}']"
    for key, style in (getattr(model, "_tp_plan", None) or {}).items():  # transformers copies the config's here
        if plan.get(key) != style:
            plan[key], found[key] = style, f"{type(model).__name__}._tp_plan['{key}']"
    translated: dict[str, str] = {}
    skipped: list[str] = []
    styles = {key: _STYLE_ALIASES.get(str(style).replace("local_", ""), str(style).replace("local_", ""))
              for key, style in plan.items()}
    experts = [key for key, style in styles.items() if style == "experts"]
    modules = {n: m for n, m in model.named_modules() if n}
    unmatched = []
    for key, style in styles.items():
        if any(key.startswith(f"{owner}.") for owner in experts):
            continue  # a parameter of stacked experts: the `experts` entry splits them
        if not any(fnmatch.fnmatchcase(n, key) for n in modules):
            unmatched.append(key)
        elif style in STYLES:
            translated[key] = style
        else:
            skipped.append(f"{key}: {style}")
    if skipped:
        print(f"accel: tensor parallel plan: left out entries in styles accel does not know: {', '.join(skipped)}")
    if unmatched:
        print(f"accel: tensor parallel plan: left out entries that match no module of {type(model).__name__}: "
              f"{', '.join(unmatched)}")
    if origins is not None:
        origins.update({key: f"the model's own plan ({found[key]})" for key in translated})
    if translated:  # stacked experts the plan leaves whole (transformers 5.25's Mixtral): split within, as accel would
        added = {fold_indices(name): "experts" for name, module in modules.items()
                 if is_stacked_experts(module) and not any(fnmatch.fnmatchcase(name, key) for key in translated)}
        translated.update(added)
        if origins is not None:
            origins.update(dict.fromkeys(added, "accel's experts entry for the model's stacked experts"))
    return translated


def builtin_source(model: nn.Module) -> str:
    return f"accel's built-in plan for {type(wrapper_prefix(model)[1]).__name__}"


def _origin(source: str | dict | None, key: str) -> str:
    """Where plan entry `key` came from, for an error (default: the config key a user writes a plan under)."""
    if isinstance(source, dict):
        source = source.get(key)
    return source or "parallelism.tp_plan"


def check_style(pattern: Any, style: Any, where: str) -> None:
    """One plan entry's style is one accel has (its pattern may name nothing yet: only a model says)."""
    if not isinstance(style, str) or style not in STYLES:
        raise ConfigError(f"{where}: '{pattern}': bad style {style!r}; allowed: {', '.join(STYLES)}")


def check_plan_styles(plan: dict, where: str = "parallelism.tp_plan") -> None:
    """Every entry of a given plan (`parallelism.tp_plan`) names a style accel has: the check before any process
    starts (accel.backends.launchable), as the workers would refuse it once they have the model."""
    for pattern, style in plan.items():
        check_style(pattern, style, where)


def _closest(pattern: str, names: list[str]) -> str:
    """', closest: ...' for a pattern that matched nothing (names with layer indices folded into '*')."""
    folded = sorted({fold_indices(n) for n in names})
    close = difflib.get_close_matches(pattern, folded, n=3, cutoff=0.5)
    return f"; closest: {', '.join(repr(c) for c in close)}" if close else ""


def expand_plan(model: nn.Module, plan: dict[str, str], source: str | dict | None = None) -> dict[str, str]:
    """Wildcard names -> the concrete module names they match (a pattern that matches nothing is an error naming
    where it came from: `source`, one label or entry -> label, a dict gaining the concrete names' labels). A
    pattern matches a module's full name or its name in the bare model inside PEFT/torch.compile/DDP wrappers;
    a match inside a peft layer (its base layer, its adapter matrices) is the peft layer."""
    prefix, _ = wrapper_prefix(model)
    names = [n for n, _ in model.named_modules() if n]
    layers = peft_layers(model)
    concrete: dict[str, str] = {}
    for pattern, style in plan.items():
        check_style(pattern, style, _origin(source, pattern))
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(bare_name(n, prefix),
                                                                                            pattern)]
        if not hits:
            bare = [bare_name(n, prefix) for n in names if n.startswith(prefix)]
            wrapped = f" (or with the wrappers' prefix '{prefix}')" if prefix else ""
            raise ConfigError(f"{_origin(source, pattern)}: '{pattern}' matches no module of the model; allowed: "
                              f"the name of a module as the bare {type(wrapper_prefix(model)[1]).__name__} names "
                              f"it{wrapped}, '*' matching any part{_closest(pattern, bare)}")
        for hit in hits:
            owner = enclosing_layer(hit, layers)
            if owner != hit and owner in concrete and concrete[owner] != style:
                continue  # the peft layer's own entry (or an earlier one) decides
            concrete[owner] = style
            if isinstance(source, dict) and pattern in source:
                source.setdefault(owner, source[pattern])
    return concrete


def peft_layers(model: nn.Module) -> set[str]:
    """Names of the layers peft put in the model (LoRA layers, modules_to_save wrappers, ...)."""
    return {n for n, m in model.named_modules() if n and is_peft_layer(m)}


def enclosing_layer(name: str, layers: set[str]) -> str:
    """The outermost peft layer `name` is (or is inside of), else `name`."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        if ".".join(parts[:i]) in layers:
            return ".".join(parts[:i])
    return name


def check_peft_layers(model: nn.Module, plan: dict[str, str], source: str | dict | None = None,
                      keep_whole: bool = True) -> tuple[dict[str, str], dict[str, str]]:
    """The plan with its entries on peft layers accel cannot split (a LoRA embedding, DoRA, IA3, ...) taken out
    where that keeps the math (styles whose input and output are whole: colwise_rep, rowwise_rep) when
    `keep_whole`, and those entries (name -> why). Any other entry on such a layer, or inside one, is refused."""
    layers, modules = peft_layers(model), dict(model.named_modules())
    kept, whole = {}, {}
    for name, style in plan.items():
        owner = enclosing_layer(name, layers)
        if owner not in layers or (owner == name and (is_lora_linear(modules[name]) or is_saved_copy(modules[name])
                                                      or style in ("sequence_parallel", "replicate"))):
            kept[name] = style
            continue
        kind = f"peft {type(modules[owner]).__name__} ({type(modules[owner]).__module__})"
        if owner == name and keep_whole and style in ("colwise_rep", "rowwise_rep"):
            whole[name] = f"{kind}: accel splits LoRA only around a Linear/Conv1D, kept whole"
            continue
        where = f"is {kind}" if owner == name else f"is inside {kind} '{owner}'"
        raise ConfigError(f"tensor parallelism: layer '{name}' ({style}, from {_origin(source, name)}) {where}, "
                          "which accel cannot split; allowed: plain LoRA (no DoRA) around a "
                          "Linear/Conv1D, modules_to_save copies, or leave the layer out of the peft config's "
                          "target_modules")
    return kept, whole


def check_divisible(model: nn.Module, plan: dict[str, str], tp_size: int, source: str | dict | None = None) -> None:
    """Every planned split is even (a whole number of features, vocabulary rows or heads per rank); the error
    names the layer, the plan it came from (`source`) and the sizes allowed."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module, origin = modules[name], _origin(source, name)
        if style == "fused_qkv":
            parent = fused_parent(model, name, module)
            if parent is None:
                raise ConfigError(f"tensor parallelism: layer '{name}' (fused_qkv, from {origin}) is not a fused "
                                  "q/k/v projection accel can split (a Conv1D/Linear of 3 x hidden outputs in an "
                                  "attention module with split_size and num_heads)")
            if parent.num_heads % tp_size:
                raise ConfigError(f"tensor parallelism: layer '{name}' (fused_qkv) has {parent.num_heads} heads, not "
                                  f"divisible by tp_size={tp_size} (each rank holds whole heads; allowed: a tp_size "
                                  f"dividing {parent.num_heads}; the entry is from {origin})")
        elif style == "experts":
            if not is_stacked_experts(module):
                raise ConfigError(f"tensor parallelism: layer '{name}' (experts, from {origin}) is not a MoE layer's "
                                  "stacked experts accel can split (gate_up_proj [E, 2I, H] and down_proj [E, H, I])")
            inner = module.get_parameter("down_proj").shape[2]
            if inner % tp_size:
                raise ConfigError(f"tensor parallelism: experts '{name}' have intermediate size {inner}, not divisible "
                                  f"by tp_size={tp_size} (allowed: a tp_size dividing {inner}; the entry is from "
                                  f"{origin})")
        elif is_linear(computing(module)) and style in ("colwise", "rowwise", "colwise_rep", "rowwise_rep"):
            inputs, outputs = features(module)
            dim, size = ("out_features", outputs) if style.startswith("colwise") else ("in_features", inputs)
            if size % tp_size:
                raise ConfigError(f"tensor parallelism: layer '{name}' ({style}) has {dim}={size}, not divisible "
                                  f"by tp_size={tp_size} (allowed: a tp_size dividing {size}; the entry is from "
                                  f"{origin})")
        layer = computing(module)
        if isinstance(layer, nn.Embedding) and style.startswith("rowwise") and layer.num_embeddings % tp_size:
            raise ConfigError(f"tensor parallelism: embedding '{name}' has num_embeddings={layer.num_embeddings}, "
                              f"not divisible by tp_size={tp_size} (allowed: a tp_size dividing "
                              f"{layer.num_embeddings}; the entry is from {origin})")


def split_dim(module: nn.Module, leaf: str, style: str | None) -> int | None:
    """The dimension of parameter `leaf` of `module` that `style` splits (None: kept whole, -1: reordered)."""
    if style in (None, "sequence_parallel", "replicate"):
        return None
    if style == "fused_qkv" or (style == "experts" and leaf == "gate_up_proj"):
        return -1  # a layout of its own: never the same placement as another parameter
    if style == "experts":
        return 2 if leaf == "down_proj" else None
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
    layers = peft_layers(model)

    def key(owner: str) -> str:
        """The plan entry that splits `owner`: a LoRA base layer / modules_to_save original is its peft layer's."""
        layer = enclosing_layer(owner, layers)
        return layer if layer != owner and computing(modules[layer]) is modules[owner] else owner

    def dim(owner: str, leaf: str) -> int | None:
        return split_dim(modules[owner], leaf, plan.get(key(owner)))

    changed = True
    while changed:  # completing one tie can split a module that holds another
        changed = False
        for group in groups:
            split = [dim(o, leaf) for _, o, leaf in group if dim(o, leaf) is not None]
            if not split:
                continue
            for _, owner, leaf in group:
                module = modules[owner]
                if key(owner) in plan or not isinstance(module, (nn.Embedding, nn.Linear)):
                    continue
                for style in ("rowwise_rep", "colwise_rep"):  # a vocabulary split of an embedding / output head
                    if split_dim(module, leaf, style) == split[0]:
                        plan[key(owner)] = style
                        added[key(owner)] = next(n for n, o, lf in group if o != owner and dim(o, lf) is not None)
                        changed = True
                        break

    def how(owner: str) -> str:
        return f"split by '{plan[key(owner)]}'" if key(owner) in plan else "kept whole"

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
    layers = peft_layers(model)
    split = {id(p) for n in plan  # tied: held by a split module; a planned peft layer's adapters go with it
             for p in modules[n].parameters(recurse=n in layers)}
    kept: dict[str, str] = {}
    for name, module in modules.items():
        own = [p for p in module.parameters(recurse=False) if id(p) not in split]
        if name in plan or not own:
            continue
        kind, layer = type(module).__name__, enclosing_layer(name, layers)
        if layer != name:
            name, why = layer, f"peft {type(modules[layer]).__name__}: not split, replicated"
        elif "norm" in kind.lower():
            why = f"{kind}: a norm, replicated"
        elif isinstance(module, nn.Embedding):
            why = "Embedding: not a vocabulary embedding, replicated"
        elif is_linear(module):
            why = f"{kind}: not a recognised projection (name it in tp_plan to split it)"
        else:
            why = f"{kind}: replicated"
        kept.setdefault(fold_indices(name) or "(root)", why)
    return kept
