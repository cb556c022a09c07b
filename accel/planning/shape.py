"""A model's shape as the planner reads it off its parameters (and its transformers config): layers, hidden
size, heads, vocabulary, ZeRO units, experts; and its FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass

from accel.planning.estimate import ModelSpec

HEAD_DIM = 128             # heads = hidden / HEAD_DIM when the model does not say


@dataclass
class Shape:
    params: int
    layers: int       # repeated blocks
    hidden: int
    heads: int
    vocab: int
    largest_unit: int  # parameters of the largest ZeRO wrap unit (a block or the root's own)
    flop_params: int = 0  # parameters used in matmuls: an untied input embedding is a lookup
    tp_splits: int = 4  # TP-split weights per block: each is one all-reduce (row-wise: forward; column-wise: backward)
    tensors: int = 0  # parameter tensors: what the per-op framework time scales with
    lookups: frozenset = frozenset()  # names of the parameters only looked up (an untied input embedding)
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    experts: int = 0  # experts per MoE layer (E); 0: not a mixture of experts
    expert_params: int = 0  # parameters of the MoE layers' experts (all E of every layer)
    moe_layers: int = 0  # blocks holding experts
    top_k: int = 0  # experts each token is routed to
    units: tuple = ()  # ((dense, expert) parameters) of each ZeRO wrap unit (the blocks, the root's own)

    def largest_unit_for(self, ep: int) -> int:
        """The largest ZeRO-3 unit's gathered parameters: with expert parallelism a block's stacked experts are an
        FSDP2 unit of their own, gathered to this rank's E/ep (over their dp / ep copies), apart from the rest."""
        if ep <= 1 or not self.units:
            return self.largest_unit
        return max(max(dense, expert // ep) for dense, expert in self.units)

    @property
    def kv_width(self) -> int:
        """The width of K (and of V): key/value heads x head dimension."""
        return self.hidden * (self.kv_heads or self.heads) // self.heads


CONFIG_KEYS = {"hidden": ("hidden_size", "n_embd", "d_model"), "heads": ("num_attention_heads", "n_head"),
               "kv_heads": ("num_key_value_heads",),
               "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
               "top_k": ("num_experts_per_tok", "moe_topk")}
DEFAULT_TOP_K = 2          # experts per token when the model does not say (Mixtral's)


def config_dims(module) -> dict:
    """{"hidden", "heads", "kv_heads", "experts", "top_k"} as the model's transformers config states them (text
    config for multimodal models; experts: a MoE layer's, num_local_experts or num_experts); {} for a module without
    one."""
    config = getattr(module, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    dims = {}
    for name, keys in CONFIG_KEYS.items():
        value = next((getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)), None)
        if value:
            dims[name] = value
    return dims


def expert_count(spec: ModelSpec) -> int:
    """Experts per MoE layer read off the expert parameters (accel.planning.estimate flags them: what accel's
    expert parallelism divides): a stacked container's dim 0 (transformers' `experts.gate_up_proj` [E, 2I, H]),
    else the distinct indices after `.experts.` (an nn.ModuleList of experts); 0 without expert parameters."""
    stacked = [p.shape[0] for p in spec.params if getattr(p, "expert", False) and len(p.shape) == 3]
    if stacked:
        return max(stacked)
    listed: dict[str, set] = {}
    for p in spec.params:
        if getattr(p, "expert", False) and ".experts." in p.name:
            head, _, tail = p.name.rpartition(".experts.")
            index = tail.split(".", 1)[0]
            if index.isdigit():
                listed.setdefault(head, set()).add(index)
    return max((len(v) for v in listed.values()), default=0)


def model_shape(spec: ModelSpec, hidden: int | None = None, heads: int | None = None,
                kv_heads: int | None = None, experts: int | None = None, top_k: int | None = None) -> Shape:
    """Layers, hidden size and vocabulary read off the parameter shapes: hidden is the most common smaller
    dimension of the blocks' 2-D parameters, the vocabulary the largest dim-0 outside the blocks. `hidden` and
    `heads` from the model's config win (`config_dims`); without one, heads = hidden / HEAD_DIM. A mixture of
    experts: the expert parameters (flagged by accel.planning.estimate), E from the config (`experts`) or their
    shapes (`expert_count`), top_k from the config or DEFAULT_TOP_K; matmul parameters then count the experts'
    top_k / E (each token runs top_k of them)."""
    blocks: dict[str, int] = {}
    block_experts: dict[str, int] = {}
    dims: dict[int, int] = {}
    root, vocab = 0, 0
    for p in spec.params:
        if p.block:
            blocks[p.block] = blocks.get(p.block, 0) + p.numel
            if getattr(p, "expert", False):
                block_experts[p.block] = block_experts.get(p.block, 0) + p.numel
            if len(p.shape) == 2 and min(p.shape) > 0:  # an empty tensor says nothing of the width
                dims[min(p.shape)] = dims.get(min(p.shape), 0) + 1
        else:
            root += p.numel
            if len(p.shape) == 2:
                vocab = max(vocab, max(p.shape))
    if hidden is None:
        hidden = max(dims, key=lambda d: dims[d]) if dims else max(
            (min(p.shape) for p in spec.params if len(p.shape) == 2), default=1)
    hidden = max(1, hidden)
    heads = heads or max(1, hidden // HEAD_DIM)
    vocab_tables = [p for p in spec.params if not p.block and len(p.shape) == 2 and max(p.shape) == vocab]
    looked_up = vocab_tables[:1] if len(vocab_tables) > 1 else []  # untied: the embedding is looked up
    lookups = sum(p.numel for p in looked_up)
    first = next(iter(blocks), None)
    splits = sum(1 for p in spec.params
                 if p.block == first and len(p.shape) >= 2 and getattr(p, "tp_dim", 0) is not None)
    kv_heads = kv_heads if kv_heads and heads % kv_heads == 0 else heads
    expert_params = sum(block_experts.values())
    num_experts = (experts or expert_count(spec)) if expert_params else 0
    k = min(top_k or DEFAULT_TOP_K, num_experts) if num_experts else 0
    idle_experts = expert_params - expert_params * k // num_experts if num_experts else 0  # not run per token
    units = ((root, 0), *((n - block_experts.get(b, 0), block_experts.get(b, 0)) for b, n in blocks.items()))
    return Shape(spec.numel, max(1, len(blocks)), hidden, heads, vocab, max([root, *blocks.values()]),
                 spec.numel - lookups - idle_experts, splits or 4, len(spec.params),
                 frozenset(p.name for p in looked_up), kv_heads, num_experts, expert_params, len(block_experts), k,
                 units)


def attention_flops_per_token(shape: Shape, seq_len: float) -> float:
    """FLOPs per token of attention's QK^T and AV, forward + backward, in sequences of `seq_len` tokens: 12 x layers
    x hidden x seq_len (no causal halving, as torchtitan counts it)."""
    return 12 * shape.layers * shape.hidden * seq_len


def training_flops_per_token(shape: Shape, seq_len: float) -> float:
    """FLOPs per token of one training step (forward + backward), as the plan's compute time counts them: 6 x the
    matmul parameters (`flop_params`: an untied input embedding is a lookup, an expert runs for top_k / E of the
    tokens) + attention (`attention_flops_per_token`); without activation checkpointing's recompute (MFU's
    convention). accel.runtime.throughput's MFU uses it (the Accelerator passes it in)."""
    return 6 * shape.flop_params + attention_flops_per_token(shape, seq_len)


def module_shape(module) -> Shape | None:
    """The `Shape` of a live model with a transformers config (hidden size and heads from it, as `plan` reads them),
    None for a module without one."""
    from accel.planning.estimate import spec_from_module

    dims = config_dims(module)
    if not dims.get("hidden"):
        return None
    spec = spec_from_module(module)
    if not spec.numel:
        return None
    return model_shape(spec, dims.get("hidden"), dims.get("heads"), dims.get("kv_heads"), dims.get("experts"),
                       dims.get("top_k"))
