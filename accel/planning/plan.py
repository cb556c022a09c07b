"""`accel plan`: the seed's decision tree made executable. Enumerate layouts (data parallel x ZeRO stage x TP x
PP x sequence/context parallelism x offload x activation checkpointing x pipeline micro-batches), drop those that
do not fit a device, estimate each one's step time with a compute + latency/bandwidth model, rank them and say why.

Plain functions over accel.planning.estimate's `ModelSpec` (meta device: a 70B model plans in seconds).

The model and its constants (documented so a plan can be checked by hand):
- batch_size is GLOBAL: samples per optimizer step over all processes; each data-parallel rank gets
  batch_size / dp (a layout whose dp does not divide it is dropped), split into `micro_batches` under PP.
- Ranks are laid out as accel's topology does (accel/config/topology.py): tp innermost, then the sequence ranks
  (sp or cp), dp, pp outermost, so a group crosses machines when its span (tp; tp*seq; tp*seq*dp; ...) exceeds the
  processes per machine. TP is only planned within a machine.
- Sequence parallelism (sp, Ulysses) and context parallelism (cp) are planned when asked for (`sp_size`/`cp_size`:
  every layout gets that degree) or, left out, for long sequences (seq_len >= LONG_SEQUENCE: each degree that
  divides the world and leaves each rank at least MIN_LOCAL_TOKENS tokens, next to none). Their ranks share one
  batch: activations per rank are the formula's / the degree (the sequence padded to a multiple of sp, or of 2 x
  cp), plus, for cp, each layer's all-gathered K and V; gradients are reduced, and ZeRO shards, over dp x sp/cp.
  Ulysses needs the heads (and key/value heads) to divide by tp x sp.
- Memory per rank = model states (accel.planning.estimate.training: what accel's backends keep) + activations
  (`activation_bytes`; under bf16/fp16 without FSDP2 plus autocast's cached 2-byte copy of every weight, held
  through the forward) + what is gathered while computing: ZeRO-2 keeps the rank's whole (tp/pp slice of the)
  parameters gathered in the compute dtype through forward and backward, ZeRO-3 (and offload) the largest unit
  twice (current + prefetched) plus its unsharded float32 gradient; while accumulating gradients FSDP2 keeps them
  unsharded. Usable memory = device_memory * USABLE_FRACTION. Micro-batches: pipeline micro-batches under PP,
  else gradient accumulation steps (one micro-batch's activations at a time).
- Offload: the shards live on the host (host_memory per machine must hold them all).
- Compute = (6 * params (an untied input embedding is a lookup: not counted) * tokens + 12 * layers * hidden *
  seq_len * tokens for attention's QK^T and AV; under PP, pp x the slowest stage's matmul parameters: accel's
  split balances parameter counts, and an embedding on the first stage is only looked up) (x 4/3 with full
  activation checkpointing) / (world * flops * efficiency), times (m + p - 1) / m for the pipeline bubble (1F1B's;
  `pipeline_bubble` has the other schedules', the zero-bubble ones' included);
  efficiency = EFFICIENCY (1 for a `--calibrate`d rate) * r/(r + tokens_half) * w/(w + width_half), r the tokens of one
  micro-batch, w = hidden / tp (small matmuls run below peak: what makes many tiny micro-batches or a wide TP
  degree cost something on a GPU; `--calibrate` measures both halves, near 0 on a CPU). Memory-bound work (norms,
  activations, softmax, residuals, the loss) = ELEMENTWISE_PASSES over a micro-batch's activation bytes (the parts
  TP replicates counted whole, the float32 logits whole on every TP rank) / memory_bw, a mix of those ops'
  measured rate; AdamW touches ADAM_PASSES x 4 bytes per element the rank steps at the same rate. Framework time:
  op_overhead x OPS_PER_TENSOR x the stage's parameter tensors per micro-batch pass (0 by default: a GPU's
  launches hide behind its kernels; `--calibrate` on a CPU measures it, tens of microseconds).
- Collectives (ring): all-reduce 2(n-1)/n * bytes / bw + 2(n-1) * latency; all-gather and reduce-scatter half
  of that at their own bandwidth (gather_factor, scatter_factor of the all-reduce's: 1 by default, measured by
  `--calibrate`; within a machine `--calibrate`'s timed sweep is interpolated instead). Gradient sync (float32):
  DDP all-reduce in DDP_BUCKET-byte buckets; ZeRO-1 all-reduce + all-gather of the parameters; ZeRO-2 one
  all-gather per pass + one reduce-scatter per step, per unit; ZeRO-3 two all-gathers per pass. TP: an all-reduce
  of a micro-batch's activations per split weight of a block (a Llama block 7: o/down in forward, q/k/v/gate/up in
  backward; GPT-2 4), +2 (embedding, head), x1.5 with recompute. PP: each micro-batch's activations sent forward
  and their gradient back at each of the p-1 boundaries. Offload adds the host<->device copies of parameters and
  gradients (PCIE_BW) and the CPU AdamW step (ADAM_PASSES x 4 bytes per element at HOST_BW, or the device's
  memory-bound rate where lower: a CPU device is the host).
- Inside a step a blocking collective costs more than alone: sync_fixed per call + sync_slowdown x its isolated
  time (0 and 1 by default, a GPU's figures; `--calibrate` measures them: on a 2-core CPU with gloo the ranks
  arrive apart and wait for each other, about 1 ms per call); FSDP2 and DTensor TP add their own cost per
  collective (copies, hooks, dispatch: `fsdp_call`, `tp_call`, 0 by default; `--calibrate` times torch's
  fully_shard and parallelize_module on a small block stack against the same stack alone). DDP's buckets but
  the last, FSDP2's backward gathers and reduce-scatters but the first unit's, and its forward gathers where the
  device runs ahead of the host (`run_ahead`: GPUs; not a CPU) run beside compute, of which `overlap` hides them
  (1 by default; `--calibrate` measures it). TP's all-reduces (and the head's all-gather of the logits, one per
  micro-batch: accel's TP head hands whole logits to the loss) and PP's sends are on the critical path.
- Sequence ranks (on the critical path, like TP's): Ulysses 4 all-to-alls per attention layer per forward (q, k,
  v, out), each moving (n-1)/n of the rank's local q/k/v/out bytes (bandwidth as an all-gather's), as many in
  backward, the forward's again with recompute; context parallelism (allgather) an all-gather of K and of V per
  layer per forward (again with recompute) and a reduce-scatter of their gradients in backward.
- Mixture of experts (`model_shape`: the expert parameters accel.planning.estimate flags, E experts per layer from
  the config's num_local_experts/num_experts or their stacked dim 0, top_k from num_experts_per_tok, else 2): a
  token runs top_k / E of the experts' matmul parameters. Expert parallelism (ep, `ep_size` or each divisor of dp
  that divides E) keeps 1/ep of the experts on each rank; ZeRO 2/3 shard those again over their dp / ep copies
  (a unit of their own per MoE layer, gathered to E/ep), TP splits each expert within; the rest shards as usual;
  with sp/cp the sequence ranks are more copies of each expert; ZeRO-1 shards the optimizer over the dp / ep
  copies; pipeline stages hold their layers' experts (each stage its own ep group); layouts accel refuses (ep
  with the split-backward schedules) are not planned. Time:
  per MoE layer two all-to-alls of the routed tokens (tokens x top_k x hidden) over the ep neighbours in forward
  and again in backward (on the critical path), the experts' gradients all-reduced among their dp / ep copies
  (ZeRO 2/3: reduce-scattered, and the experts all-gathered per pass);
  routing is assumed balanced and dropless, so each rank's expert compute is what it is without ep.
- Pipeline schedule (`pp_schedule`, default 1F1B): the pipeline layouts' bubble (`pipeline_bubble`), 2 stages per
  process for the looped, interleaved and V schedules (pp x 2 at most the blocks), DualPipeV with 2 x pp
  micro-batches or more; the split-backward ones (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) with data
  parallelism only on DDP stages (ZeRO 0/1, no TP; accel refuses FSDP2 stages). Activations held at once
  (`pipeline_in_flight`): all m micro-batches for GPipe and LoopedBFS, p for 1F1B and the others.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import Any

from accel.planning.estimate import EstimateError, ModelSpec, pipeline_stages, sequence_length, training

GB = 1e9
USABLE_FRACTION = 0.9      # of device memory: the rest for the CUDA context, allocator slack, buffers
EFFICIENCY = 0.5           # achieved / peak FLOP/s of a training step's large matmuls
TOKENS_HALF = 256          # matmul efficiency falls as rows/(rows + TOKENS_HALF) with a micro-batch's tokens
WIDTH_HALF = 128           # ... and as w/(w + WIDTH_HALF) with the hidden size per TP rank
DEFAULT_TFLOPS = 312.0     # peak dense bf16 of an A100; pass --flops for yours
DEFAULT_INTRA_GBS = 150.0  # per-device bandwidth within a machine (NVLink class), GB/s
DEFAULT_INTER_GBS = 25.0   # per-device bandwidth between machines (200 Gb/s InfiniBand class), GB/s
DEFAULT_MEMORY_GBS = 2000.0  # device memory bandwidth (A100 HBM class), GB/s: the memory-bound work's rate
ELEMENTWISE_PASSES = {"no": 4, "full": 5}  # passes over the kept activations: forward writes, backward reads,
#                                           its gradient written and read; recompute writes them again
INTRA_LATENCY = 5e-6       # seconds per collective hop within a machine
INTER_LATENCY = 20e-6      # between machines
PCIE_BW = 25 * GB          # host <-> device, bytes/s (offload)
HOST_BW = 20 * GB          # CPU AdamW step: bytes of state touched per second (offload)
DEFAULT_HOST_GB = 1024.0   # host memory per machine for offload
DDP_BUCKET = 25 * 2 ** 20  # DDP's gradient bucket
HEAD_DIM = 128             # heads = hidden / HEAD_DIM when the model does not say
OPS_PER_TENSOR = 10        # eager ops per parameter tensor per forward + backward (a Llama block: 9 tensors, ~100)
ADAM_PASSES = 12           # bytes of float32 state touched per element stepped by AdamW, / 4 (7 + temporaries)
AUTOCAST_CACHE = {"bf16": 2, "fp16": 2}  # bytes per float32 weight: autocast keeps its cast copy for the forward
ACT_BYTES = {"no": 2, "fp16": 1, "bf16": 1, "fp8": 1}  # x the fp16 activation formula
MAX_ACCUMULATION_LOG2 = 6  # gradient accumulation steps planned: 1, 2, 4, ... 64
TIE = 0.02                 # layouts within 2% of the fastest count as equal: the simplest is recommended
STATE_NAME = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
LONG_SEQUENCE = 16384      # tokens per sample from which sp/cp layouts are planned when not asked for
MIN_LOCAL_TOKENS = 1024    # ... with at least this many tokens of each sequence per rank


class PlanError(EstimateError):
    """A bad input for `accel plan`: one line for the user."""


@dataclass
class Hardware:
    num_machines: int = 1
    num_processes: int = 1  # per machine
    device_memory: float = 80 * GB
    intra_bw: float = DEFAULT_INTRA_GBS * GB
    inter_bw: float = DEFAULT_INTER_GBS * GB
    flops: float = DEFAULT_TFLOPS * 1e12
    host_memory: float = DEFAULT_HOST_GB * GB
    intra_latency: float = INTRA_LATENCY  # seconds per collective hop
    inter_latency: float = INTER_LATENCY
    tokens_half: float = TOKENS_HALF  # matmul rows at which the rate is half the peak (`--calibrate` measures it)
    width_half: float = WIDTH_HALF
    gather_factor: float = 1.0  # all-gather bus bandwidth / all-reduce's (gloo: ~0.5; `--calibrate` measures it)
    scatter_factor: float = 1.0  # reduce-scatter's (gloo: ~0.35)
    collectives: dict | None = None  # {kind: [[bytes, seconds], ...]} timed by `--calibrate` within a machine
    efficiency: float = EFFICIENCY  # of `flops` a training matmul reaches: a datasheet peak's; 1 for a measured rate
    memory_bw: float = DEFAULT_MEMORY_GBS * GB  # bytes/s of elementwise work (`--calibrate` measures it)
    overlap: float = 1.0  # share of DDP/FSDP2 collectives hidden behind compute (GPU: own stream; gloo ~0.3-0.6)
    sync_fixed: float = 0.0  # seconds a blocking collective adds inside a step beyond its transfer (`--calibrate`)
    sync_slowdown: float = 1.0  # x its isolated time there (caches cold, the other rank's threads busy)
    fsdp_call: float = 0.0  # seconds FSDP2 adds per all-gather/reduce-scatter beyond the transfer (`--calibrate`)
    tp_call: float = 0.0  # seconds DTensor TP adds per collective beyond the transfer (`--calibrate`)
    run_ahead: bool = True  # the host queues work ahead of the device (CUDA), so FSDP2's forward gathers overlap
    op_overhead: float = 0.0  # seconds of framework time per op (forward + backward) the device does not hide

    @property
    def world(self) -> int:
        return self.num_machines * self.num_processes


def detect() -> Hardware:
    """This machine: its CUDA GPUs (count, memory of the first), else its CPU cores (one process per 4 cores)
    and RAM shared between them, at an assumed 1 TFLOP/s per process."""
    import torch

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if torch.cuda.is_available():
        return Hardware(num_processes=torch.cuda.device_count(),
                        device_memory=torch.cuda.get_device_properties(0).total_memory, host_memory=ram)
    procs = max(1, (os.cpu_count() or 1) // 4)
    # gloo on a CPU as measured on a 2-core machine (`accel plan --calibrate` measures yours)
    return Hardware(num_processes=procs, device_memory=ram / procs, flops=1e12, intra_bw=10 * GB, host_memory=ram,
                    memory_bw=15 * GB, overlap=0.4, sync_fixed=1e-3, op_overhead=1e-5, run_ahead=False,
                    fsdp_call=3e-3, tp_call=5e-3)


def apply_calibration(hw: Hardware, cal: dict, compute: bool = True, links: bool = True) -> list[str]:
    """Set `hw` from a stored `accel plan --calibrate` record (accel.planning.measure.calibrate): the device's rates
    when `compute`, the links within a machine when `links`. What was used, in words."""
    used = []
    if compute and cal.get("flops"):
        hw.flops, hw.efficiency = cal["flops"], 1.0  # a measured matmul rate: already what a matmul reaches
        used.append(f"{cal['flops'] / 1e12:.2f} TFLOP/s")
        if cal.get("tokens_half") is not None:
            hw.tokens_half, hw.width_half = cal["tokens_half"], cal.get("width_half", hw.width_half)
            used.append(f"half rate at {hw.tokens_half:.0f} rows / width {hw.width_half:.0f}")
        if cal.get("memory_bandwidth"):
            hw.memory_bw = cal["memory_bandwidth"]
            used.append(f"memory-bound work {hw.memory_bw / 1e9:.1f} GB/s")
        if cal.get("op_overhead") is not None:
            hw.op_overhead = cal["op_overhead"]
            used.append(f"{hw.op_overhead * 1e6:.0f} us per op")
    if links and cal.get("intra_bandwidth"):
        hw.intra_bw = cal["intra_bandwidth"]
        used.append(f"{hw.intra_bw / 1e9:.2f} GB/s within a machine")
        if cal.get("intra_latency"):
            hw.intra_latency = cal["intra_latency"]
            used.append(f"{hw.intra_latency * 1e6:.0f} us per hop")
        if cal.get("gather_factor"):
            hw.gather_factor, hw.scatter_factor = cal["gather_factor"], cal["scatter_factor"]
            hw.collectives = cal.get("collectives")
            used.append(f"all-gather / reduce-scatter at {hw.gather_factor:.2f} / {hw.scatter_factor:.2f} of it")
        if cal.get("overlap") is not None:
            hw.overlap = cal["overlap"]
            used.append(f"{hw.overlap:.0%} of a collective hidden behind compute")
        if cal.get("sync_fixed") is not None:
            hw.sync_fixed, hw.sync_slowdown = cal["sync_fixed"], cal["sync_slowdown"]
            used.append(f"a blocking collective in a step: {hw.sync_fixed * 1e3:.2f} ms + {hw.sync_slowdown:.2f} x "
                        f"its time alone")
        if cal.get("fsdp_call") is not None:
            hw.fsdp_call, hw.tp_call = cal["fsdp_call"], cal["tp_call"]
            used.append(f"FSDP2 / TP add {hw.fsdp_call * 1e3:.2f} / {hw.tp_call * 1e3:.2f} ms per collective")
    if compute and cal.get("run_ahead") is not None:
        hw.run_ahead = cal["run_ahead"]
    return used


# -- the model's shape ----------------------------------------------------------------------------------------
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
    convention). accel.planning.throughput's MFU uses it."""
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


def activation_bytes(shape: Shape, micro_batch: int, seq_len: int, tp: int = 1, layers: int | None = None,
                     checkpointing: str = "no", mixed_precision: str = "bf16", calibration: dict | None = None,
                     sp: int = 1, cp: int = 1) -> int:
    """Activations kept for backward by `layers` blocks on one micro-batch: Korthikanti et al.'s per-layer
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes in fp16 (x2 in fp32); full checkpointing keeps each block's input
    (2*s*b*h) plus one block's full set while it recomputes; plus the float32 logits and their gradient. Times
    `calibration[checkpointing]["scale"]`: accel.planning.estimate's fake-tensor measurement of the whole model over
    this formula (`activation_calibration`), so the measurement sets the size and the formula how it scales with
    the micro-batch, TP and the blocks of a pipeline stage. Sequence (sp) or context (cp) parallelism: one rank's
    share, the whole (padded) sequence's / the degree (Ulysses' attention holds 1/sp of the heads of the whole
    sequence, the same bytes), plus for cp each kept layer's K and V gathered from the other (n-1)/n ranks."""
    layers = shape.layers if layers is None else layers
    n = sp * cp
    s, b, h, a = sequence_length(seq_len, sp, cp), micro_batch, shape.hidden, shape.heads
    scale = ACT_BYTES.get(mixed_precision, 1)
    per_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) * scale
    kept = layers * 2 * s * b * h * scale + per_layer if checkpointing == "full" else layers * per_layer
    kept_layers = min(layers, 1) if checkpointing == "full" else layers  # whose attention inputs are kept
    gathered = 2 * 2 * s * b * shape.kv_width / tp * scale * (n - 1) / n if cp > 1 else 0.0  # K and V, fp16 bytes
    factor = (calibration or {}).get(checkpointing, {}).get("scale", 1.0)
    return int(((kept + 2 * 4 * s * b * shape.vocab / tp) / n + kept_layers * gathered) * factor)


def activation_calibration(module, shape: Shape, seq_len: int, mixed_precision: str = "bf16") -> dict:
    """{checkpointing: {"scale", "fixed_bytes"}} from accel.planning.estimate.activation_bytes on fake tensors (no
    memory) for 1 and 2 samples of `seq_len` through the whole `module`: the difference is what one sample adds
    (`scale` = it over the formula's), the rest is fixed per step (`fixed_bytes`: mostly autocast's cached low-
    precision copy of every weight, held until the forward's autocast region ends), so it is not scaled with the
    micro-batch. {} (the formula alone) when that estimator is missing or cannot run the model."""
    from accel.planning import estimate

    measure = getattr(estimate, "activation_bytes", None)
    if measure is None or module is None:
        return {}
    factors = {}
    for ac in ("no", "full"):
        try:
            one, two = (measure(module, b, seq_len, mixed_precision, ac) for b in (1, 2))
        except Exception:  # noqa: BLE001 - any model the fake run cannot handle falls back to the formula
            return {}
        per_sample = max(two - one, 1)
        factors[ac] = {"scale": per_sample / activation_bytes(shape, 1, seq_len, 1, None, ac, mixed_precision),
                       "fixed_bytes": max(0, one - per_sample)}
    return factors


def elementwise_bytes(shape: Shape, micro_batch: int, seq_len: int, tp: int, layers: int,
                      mixed_precision: str, sp: int = 1, cp: int = 1) -> float:
    """Bytes of one micro-batch's activations the memory-bound work (norms, activations, softmax, residuals, the
    loss) writes once: the activation formula's per-layer bytes (the parts TP replicates are not split) plus the
    float32 logits, whole on every TP rank (accel's head gathers them: the loss is replicated); a sequence rank's
    share of them (/ sp x cp)."""
    s, b, h, a = sequence_length(seq_len, sp, cp), micro_batch, shape.hidden, shape.heads
    per_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) * ACT_BYTES.get(mixed_precision, 1)
    return (layers * per_layer + 4 * s * b * shape.vocab) / (sp * cp)


def _in_step(hw: Hardware, seconds: float, calls: int, backend_call: float = 0.0) -> float:
    """What `calls` blocking collectives taking `seconds` in isolation (`collective`) take inside a step; a
    backend's own measured cost per call (`fsdp_call`, `tp_call`: copies, hooks, dispatch, waits) in place of
    the bare collective's fixed cost where larger."""
    return calls * max(hw.sync_fixed, backend_call) + hw.sync_slowdown * seconds if seconds else 0.0


def _exposed(hw: Hardware, seconds: float, hideable: float, window: float) -> float:
    """What a collective adds to the step when the `hideable` share of it runs beside `window` seconds of
    compute, of which `hw.overlap` can hide it."""
    return seconds * (1 - hideable) + max(0.0, seconds * hideable - hw.overlap * window)


# -- collectives ----------------------------------------------------------------------------------------------
RING_HOPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


def collective(hw: Hardware, kind: str, nbytes: float, n: int, span: int, calls: int = 1) -> float:
    """Seconds for `calls` calls of `kind` moving `nbytes` in all among `n` ranks that span `span` consecutive
    ranks. Within a machine whose collectives `--calibrate` timed: those times (2 processes, interpolated at the
    size of one call, scaled by the ring's 2(n-1)/n for n); else the ring's latency/bandwidth formula. An
    all-to-all's `nbytes` is what each rank holds, of which it sends (n-1)/n, at an all-gather's bandwidth."""
    if n <= 1:
        return 0.0
    table = (hw.collectives or {}).get(kind) if span <= hw.num_processes else None
    if table:
        return calls * _interpolate(table, nbytes / calls) * 2 * (n - 1) / n
    bw, lat = _link(hw, span)
    bw *= {"all_gather": hw.gather_factor, "all_to_all": hw.gather_factor,
           "reduce_scatter": hw.scatter_factor}.get(kind, 1.0)
    hops = RING_HOPS[kind]
    return hops * (n - 1) / n * nbytes / bw + hops * (n - 1) * lat * calls


def _interpolate(points: list, size: float) -> float:
    """Seconds at `size` bytes from measured [bytes, seconds] points: log-log between them, the smallest one's
    time below them (latency), its last slope beyond them (bandwidth)."""
    points = sorted(points)
    if size <= points[0][0]:
        return points[0][1]
    for (s0, t0), (s1, t1) in itertools.pairwise(points):
        if size <= s1:
            w = math.log(size / s0) / math.log(s1 / s0)
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    (s0, t0), (s1, t1) = points[-2], points[-1]
    return t1 + (size - s1) * (t1 - t0) / (s1 - s0)


def _link(hw: Hardware, span: int) -> tuple[float, float]:
    """Bandwidth and latency of a group whose ranks span `span` consecutive ranks."""
    return (hw.intra_bw, hw.intra_latency) if span <= hw.num_processes else (hw.inter_bw, hw.inter_latency)


# -- layouts --------------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    """n's divisors, ascending (pairs up to its square root: a world of a million ranks costs a thousand steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _pointless(zero: int, offload: bool, dp: int, tp: int) -> bool:
    """Offload is planned with ZeRO-3 only (estimate's zero3_offload); ZeRO without data parallelism shards
    nothing (except to offload); next to TP accel runs data parallelism as FSDP2 without resharding after the
    forward whatever the stage below 3 (accel.backends.spmd.data_parallel_kind: DDP takes no DTensors), so
    ZeRO-0/1 there are ZeRO-2 under another name. `dp` counts the ranks that reduce gradients (dp x sp/cp)."""
    return (offload and zero != 3) or (dp == 1 and zero > 0 and not offload) or (tp > 1 and dp > 1 and zero < 2)


def sequence_options(hw: Hardware, shape: Shape, seq_len: int, sp_size: int | None = None,
                     cp_size: int | None = None) -> list[tuple[int, int]]:
    """The (sp, cp) degrees to plan: the ones given (`sp_size`/`cp_size`, checked: accel runs them on this world
    and model), else (1, 1), and for a long sequence (seq_len >= LONG_SEQUENCE) each sp and cp degree that divides
    the world and leaves every rank at least MIN_LOCAL_TOKENS tokens."""
    if sp_size is None and cp_size is None:
        if seq_len < LONG_SEQUENCE:
            return [(1, 1)]
        degrees = [d for d in _divisors(hw.world) if 1 < d and seq_len // d >= MIN_LOCAL_TOKENS]
        return [(1, 1), *((d, 1) for d in degrees), *((1, d) for d in degrees)]
    sp, cp = sp_size or 1, cp_size or 1
    for flag, value in (("--sp_size", sp), ("--cp_size", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{flag}: bad value {value!r}; allowed: a positive integer")
    if sp > 1 and cp > 1:
        raise PlanError(f"--sp_size {sp} and --cp_size {cp}: sequence and context parallelism both split the "
                        "sequence; allowed: one of them above 1")
    flag, n = ("--sp_size", sp) if sp > 1 else ("--cp_size", cp)
    if hw.world % n:
        raise PlanError(f"{flag} {n}: does not divide the {hw.world} processes; allowed: a divisor of {hw.world}")
    kv = shape.kv_heads or shape.heads
    if sp > 1 and (shape.heads % sp or kv % sp):
        raise PlanError(f"--sp_size {sp}: Ulysses splits the model's {shape.heads} attention heads ({kv} key/value "
                        f"heads) over the sp ranks; allowed: a divisor of {math.gcd(shape.heads, kv)}, or --cp_size")
    return [(sp, cp)]


def expert_options(hw: Hardware, shape: Shape, ep_size: int | None = None) -> list[int]:
    """The expert-parallel degrees to plan: the one given (`ep_size`, checked: the model has experts, it divides
    their number E and the processes), else 1 and, for a mixture of experts, each divisor of the world above 1
    that divides E (`candidates` keeps those dividing a layout's dp)."""
    if ep_size is None:
        if not shape.experts:
            return [1]
        return [d for d in _divisors(hw.world) if d == 1 or shape.experts % d == 0]
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise PlanError(f"--ep_size: bad value {ep_size!r}; allowed: a positive integer")
    if ep_size > 1 and not shape.experts:
        raise PlanError(f"--ep_size {ep_size}: the model has no mixture-of-experts layers (no expert parameters); "
                        "allowed: 1")
    if ep_size > 1 and shape.experts % ep_size:
        raise PlanError(f"--ep_size {ep_size}: does not divide the model's {shape.experts} experts per layer; "
                        f"allowed: a divisor of {shape.experts} that divides the {hw.world} processes")
    if hw.world % ep_size:
        raise PlanError(f"--ep_size {ep_size}: does not divide the {hw.world} processes; allowed: a divisor of "
                        f"{hw.world} (and of the model's {shape.experts} experts)")
    return [ep_size]


def stages_per_rank(schedule: str) -> int:
    """Model stages each pipeline process holds under `schedule`, as accel runs it (pp_stages_per_rank unset): 1
    for GPipe and 1F1B, 2 for the looped, interleaved and V schedules."""
    from accel.backends import SINGLE_STAGE_SCHEDULES

    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def candidates(hw: Hardware, shape: Shape, batch_size: int, sequences: list[tuple[int, int]] | None = None,
               experts: list[int] | None = None, schedule: str = "1F1B"):
    """(zero, tp, pp, dp, offload, ac, m, per_rank, sp, cp, ep) combinations accel can run: TP within a machine,
    PP at most the blocks (pp x stages per rank under `schedule`), the (sp, cp) degrees of `sequences` (default:
    none) where the heads divide for Ulysses, the ep degrees of `experts` (default: none) that divide dp, accel's
    combination rules (accel.backends.check_available: expert parallelism with anything but the split-backward
    schedules, the split-backward schedules with data parallelism only on DDP stages, DualPipeV with 2 x pp
    micro-batches or more)."""
    from accel.backends import check_available
    from accel.config import ConfigError, ParallelismConfig

    per_stage = stages_per_rank(schedule)
    for (sp, cp), ep in itertools.product(sequences or [(1, 1)], experts or [1]):
        seq = sp * cp
        for tp in _divisors(hw.num_processes):
            if shape.hidden % tp or shape.heads % tp or hw.world % (tp * seq):
                continue
            if sp > 1 and (shape.heads % (tp * sp) or (shape.kv_heads or shape.heads) % (tp * sp)):
                continue  # Ulysses: each rank's heads (after TP's split) must divide by sp
            for pp in _divisors(hw.world // (tp * seq)):
                if pp * (per_stage if pp > 1 else 1) > shape.layers:
                    continue
                dp = hw.world // (tp * pp * seq)
                if dp % ep:
                    continue  # the ep ranks are taken from the data-parallel ones
                per_rank = batch_size // dp if batch_size % dp == 0 else 0
                for zero in range(4):
                    for offload in (False, True):
                        if _pointless(zero, offload, dp * seq, tp):
                            continue
                        par: dict[str, Any] = dict(zero_stage=zero, tp_size=tp, pp_size=pp, sp_size=sp, cp_size=cp,
                                                   offload_optimizer=offload, offload_params=offload, ep_size=ep,
                                                   pp_schedule=schedule)
                        try:
                            check_available(ParallelismConfig(**par), hw.world)
                        except ConfigError:
                            continue
                        if pp == 1:  # gradient accumulation: per_rank / m samples per forward, m per step
                            micro = [2 ** k for k in range(MAX_ACCUMULATION_LOG2 + 1)
                                     if per_rank and per_rank % 2 ** k == 0] or [1]
                        else:
                            least = 2 * pp if schedule == "DualPipeV" else pp  # DualPipeV: m >= its 2p stages
                            micro = [m for m in (pp, 2 * pp, 4 * pp, 8 * pp)
                                     if m >= least and per_rank and per_rank % m == 0] or [least]
                        for ac in ("no", "full"):
                            for m in micro:
                                yield zero, tp, pp, dp, offload, ac, m, per_rank, sp, cp, ep


def pipeline_bubble(m: int, pp: int, schedule: str = "1F1B", per_rank: int = 2) -> float:
    """Step time / busy time of a pipeline with equal stages and free communication (1 without one). In units of
    one stage's forward F (full backward B = 2F, its weight part W = F): 1F1B and GPipe idle (p-1)(F+B) per rank,
    so (m + p - 1) / m; the looped ones (Interleaved1F1B, LoopedBFS) 1/v of that, v stages per rank (Megatron's
    (p-1)/(v m)); zero bubble, arXiv 2401.10241: ZB-H1's (p-1)(F+B-2W) is 1/3 of 1F1B's (InterleavedZeroBubble:
    also / v), ZB-V's is ~0 when F = B/2 = W (ZBVZeroBubble); DualPipeV, DeepSeek-V3 (arXiv 2412.19437, table 2)
    (PP/2-1)(F&B+B-3W) over 2p half-size stages, with no forward/backward overlap credited, is 1/3 of 1F1B's."""
    if pp <= 1:
        return 1.0
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else per_rank
    idle = {"ZBVZeroBubble": 0.0, "DualPipeV": 1 / 3, "InterleavedZeroBubble": 1 / (3 * stages_per_rank)}.get(
        schedule, 1 / stages_per_rank)
    return (m + (pp - 1) * idle) / m


def pipeline_in_flight(m: int, pp: int, schedule: str = "1F1B") -> float:
    """The micro-batches whose activations the busiest process holds at once, in units of one micro-batch through
    all of its layers (1 without a pipeline). GPipe and LoopedBFS run every forward before the first backward, so
    they hold all m. 1F1B's first stage holds p; the interleaved and zero-bubble schedules are counted as 1F1B."""
    if pp <= 1:
        return 1.0
    return float(m if schedule in ("GPipe", "LoopedBFS") else min(m, pp))


def evaluate(spec: ModelSpec, shape: Shape, hw: Hardware, batch_size: int, seq_len: int, cand,
             mixed_precision: str, states_cache: dict, calibration: dict | None = None,
             schedule: str = "1F1B") -> dict:
    zero, tp, pp, dp, offload, ac, m, per_rank, sp, cp, ep = (*cand, 1)[:11]  # (ep 1 when not given)
    seq = sp * cp  # the sequence ranks: they share the batch, and reduce gradients with the data-parallel ranks
    key = (tp, pp, sp, cp, ep)
    if key not in states_cache:  # (this world's states, one replica's: dp 1 holds the rank's tp/pp slice whole;
        #                           under ep an ep group's rank: the dense parameters whole, 1/ep of the experts)
        states_cache[key] = (training(spec, hw.world, tp, pp, sp, cp, ep),
                             training(spec, tp * pp * ep, tp, pp, ep=ep))
    states = states_cache[key][0]["layouts"]["zero3_offload" if offload else STATE_NAME[zero]]
    rank_numel = states_cache[key][1]["layouts"]["ddp"]["params_bytes"] / 4  # the rank's tp/pp slice, unsharded
    shard_numel = states["params_bytes"] / 4
    unit = shape.largest_unit_for(ep) / tp
    expert_numel = shape.expert_params / ep if ep > 1 else 0.0  # this rank's experts (gathered, under ZeRO 2/3)
    row = {"zero_stage": zero, "tp_size": tp, "pp_size": pp, "sp_size": sp, "cp_size": cp, "ep_size": ep,
           "dp_size": dp, "offload": offload,
           "activation_checkpointing": ac, "micro_batches": m, "gradient_accumulation_steps": m if pp == 1 else 1,
           "per_process_batch": per_rank, "micro_batch_size": per_rank // m if per_rank else 0,
           "model_state_bytes_per_rank": states["device_bytes"], "host_bytes_per_rank": states["host_bytes"]}
    if pp > 1:
        row["pp_schedule"] = schedule
    if not per_rank or per_rank % m:
        return {**row, "fits": False, "memory_per_rank_bytes": None, "step_time_s": None,
                "reason": f"batch_size {batch_size} does not split into dp {dp} x {m} micro-batches"}
    mb = per_rank // m
    accum = m if pp == 1 else 1  # forward/backward passes per optimizer step outside a pipeline
    layers = math.ceil(shape.layers / pp)
    acts = activation_bytes(shape, mb, seq_len, tp, layers, ac, mixed_precision, calibration, sp, cp) \
        * pipeline_in_flight(m, pp, schedule)
    fsdp = zero >= 2  # FSDP2 gathers the parameters in the compute dtype: autocast has nothing to cast
    if not fsdp and calibration:
        acts += calibration.get(ac, {}).get("fixed_bytes", 0) * rank_numel / shape.params
    elif not fsdp:
        acts += AUTOCAST_CACHE.get(mixed_precision, 0) * rank_numel
    gathered, pbytes = 0, 4 if mixed_precision == "no" else 2
    if zero == 2:
        gathered = (rank_numel - shard_numel) * pbytes
    elif zero == 3:
        gathered = 2 * unit * pbytes + unit * 4
    if zero >= 2 and accum > 1:  # FSDP2 without gradient sync accumulates unsharded gradients until the last pass
        gathered += (rank_numel - shard_numel) * 4
    memory = int(states["device_bytes"] + acts + gathered)
    usable = hw.device_memory * USABLE_FRACTION
    fits, reason = memory <= usable, ""
    if not fits:
        reason = "needs more than the device's usable memory"
    elif offload and states["host_bytes"] * hw.num_processes > hw.host_memory:
        fits, reason = False, "the offloaded shards do not fit the host memory"
    tokens = batch_size * seq_len
    local_len = sequence_length(seq_len, sp, cp) / seq  # tokens of each sequence on this rank
    rows_mb, width = mb * local_len, shape.hidden / tp
    eff = hw.efficiency * rows_mb / (rows_mb + hw.tokens_half) * width / (width + hw.width_half)
    bubble = pipeline_bubble(m, pp, schedule, stages_per_rank(schedule))
    attention = attention_flops_per_token(shape, seq_len) * tokens
    recompute = 4 / 3 if ac == "full" else 1
    if ("flops", pp) not in states_cache:  # a pipeline runs at its slowest stage's pace
        states_cache["flops", pp] = shape.flop_params if pp == 1 else pp * max(
            sum(_matmul_numel(shape, p) for p in stage) for stage in pipeline_stages(spec, pp))
    compute = (6 * states_cache["flops", pp] * tokens + attention) * recompute / (hw.world * hw.flops * eff) * bubble
    memory_bound = (ELEMENTWISE_PASSES[ac] * elementwise_bytes(shape, mb, seq_len, tp, layers, mixed_precision,
                                                               sp, cp)
                    * m / hw.memory_bw * bubble)
    stepped = states["optimizer_bytes"] / 8  # elements this rank's AdamW steps (two float32 moments each)
    memory_bound += 0.0 if offload else ADAM_PASSES * 4 * stepped / hw.memory_bw
    dispatch = hw.op_overhead * OPS_PER_TENSOR * shape.tensors / pp * m * recompute * bubble
    window = compute + memory_bound + dispatch  # what collectives issued beside compute can hide behind
    grads = (rank_numel - expert_numel) * 4  # the experts' (ep > 1): reduced among their copies, below
    ranks = dp * seq  # the ranks that reduce gradients (and ZeRO shards over): dp x sp/cp
    units, span = layers + 1, tp * seq * dp
    if zero <= 1:  # DDP's bucketed all-reduce in the last pass's backward (ZeroRedundancyOptimizer: + all-gather)
        buckets = math.ceil(grads / DDP_BUCKET)
        sync = _in_step(hw, collective(hw, "all_reduce", grads, ranks, span, buckets), buckets)
        dp_comm = _exposed(hw, sync, (buckets - 1) / buckets if buckets > 1 else 0.0, window * 2 / 3 / accum)
        dp_comm += _in_step(hw, collective(hw, "all_gather", grads, ranks, span), 1) if zero == 1 else 0.0
    else:  # per pass an all-gather (ZeRO-2) or two (ZeRO-3: forward, backward); one reduce-scatter per step
        params = (rank_numel - expert_numel) * pbytes  # FSDP2 gathers in the compute dtype, reduces float32 grads
        gather = _in_step(hw, accum * collective(hw, "all_gather", params, ranks, span, units), accum * units,
                          hw.fsdp_call)
        late = (gather if zero == 3 else 0.0) + _in_step(  # backward: FSDP2 prefetches the next unit's
            hw, collective(hw, "reduce_scatter", grads, ranks, span, units), units, hw.fsdp_call)
        early = gather if not hw.run_ahead else 0.0  # forward: hidden only where the host runs ahead
        late += gather if hw.run_ahead else 0.0
        dp_comm = early + _exposed(hw, late, (units - 1) / units, window)
    if expert_numel and dp * seq > ep:  # each expert's dp x seq / ep copies (ep ranks apart, the sequence ranks
        # too): DDP all-reduces its gradient; ZeRO 2/3 shard it again over them: an all-gather per pass (ZeRO-3:
        # two), a reduce-scatter per step
        copies = dp * seq // ep
        if zero <= 1:
            expert_sync = collective(hw, "all_reduce", expert_numel * 4, copies, span)
        else:
            passes = accum * (2 if zero == 3 else 1)
            expert_sync = (collective(hw, "reduce_scatter", expert_numel * 4, copies, span)
                           + passes * collective(hw, "all_gather", expert_numel * pbytes, copies, span))
        dp_comm += _exposed(hw, _in_step(hw, expert_sync, 1), 0.5, window)
    elem = 4 if mixed_precision == "no" else 2
    act_mb = mb * local_len * shape.hidden * elem  # a micro-batch's activations on this rank
    logits_mb = mb * local_len * shape.vocab * elem
    tp_calls = math.ceil((shape.tp_splits * layers + 2) * m * (2 if ac == "no" else 3) / 2)
    tp_comm = 0.0 if tp == 1 else (  # on the critical path: each output is needed by the next op
        _in_step(hw, tp_calls * collective(hw, "all_reduce", act_mb, tp, tp), tp_calls, hw.tp_call)
        + _in_step(hw, m * collective(hw, "all_gather", logits_mb, tp, tp), m, hw.tp_call))  # the head's logits
    seq_comm = sequence_comm(hw, shape, mb * local_len, tp, sp, cp, layers, ac, elem) * m
    ep_comm = expert_comm(hw, shape, mb * local_len, ep, ac, elem) * m
    pbw, plat = _link(hw, tp * dp * pp)
    sends = 2 * (m + pp - 2)  # each boundary: activations forward, their gradient back
    pp_comm = 0.0 if pp == 1 else _in_step(hw, sends * (plat + act_mb / tp / pbw), sends)
    host_rate = min(HOST_BW, hw.memory_bw)  # a CPU "device" is the host: its AdamW is no faster offloaded
    off = 0.0 if not offload else (accum + 1) * shard_numel * 4 / PCIE_BW + ADAM_PASSES * 4 * shard_numel / host_rate
    step = compute + memory_bound + dispatch + dp_comm + tp_comm + seq_comm + ep_comm + pp_comm + off
    return {**row, "memory_per_rank_bytes": memory, "activation_bytes_per_rank": int(acts),
            "gathered_bytes_per_rank": int(gathered), "fits": fits, "reason": reason,
            "step_time_s": step, "time_breakdown_s": {"compute": compute, "memory_bound": memory_bound,
                                                      "dispatch": dispatch, "data_parallel": dp_comm,
                                                      "tensor_parallel": tp_comm,
                                                      "sequence_parallel": seq_comm, "expert_parallel": ep_comm,
                                                      "pipeline": pp_comm,
                                                      "offload": off}}


def sequence_comm(hw: Hardware, shape: Shape, tokens: float, tp: int, sp: int, cp: int, layers: int, ac: str,
                  elem: int) -> float:
    """Seconds one micro-batch's sequence-parallel collectives take (on the critical path: attention waits for
    them), `tokens` its tokens on this rank: Ulysses 4 all-to-alls per layer per forward (q, k, v, out; each rank
    sends (n-1)/n of its slice), as many in backward; context parallelism (allgather) an all-gather of K and of V
    per layer per forward, a reduce-scatter of their gradients in backward. Full checkpointing repeats the
    forward's. The group spans tp x n consecutive ranks (topology order: tp innermost, then the sequence ranks)."""
    n = sp * cp
    if n == 1:
        return 0.0
    forwards = 1 if ac == "no" else 2
    q, kv = tokens * shape.hidden / tp * elem, tokens * shape.kv_width / tp * elem  # this rank's bytes of each
    if sp > 1:
        calls = 4 * layers * (forwards + 1)
        return _in_step(hw, collective(hw, "all_to_all", (2 * q + 2 * kv) * layers * (forwards + 1), n, tp * n,
                                       calls), calls)
    gathers, scatters = 2 * layers * forwards, 2 * layers
    return (_in_step(hw, collective(hw, "all_gather", n * kv * gathers, n, tp * n, gathers), gathers)
            + _in_step(hw, collective(hw, "reduce_scatter", n * kv * scatters, n, tp * n, scatters), scatters))


def expert_comm(hw: Hardware, shape: Shape, tokens: float, ep: int, ac: str, elem: int) -> float:
    """Seconds one micro-batch's expert-parallel all-to-alls take (on the critical path: the experts wait for
    their tokens), `tokens` its tokens on this rank: per MoE layer two all-to-alls of the routed tokens (tokens x
    top_k x hidden, to the experts and back) in forward, as many in backward, the forward's again with full
    checkpointing; each rank sends (n-1)/n of them. Routing is assumed balanced and dropless, so every rank runs
    as much expert compute as without ep. The ep ranks are neighbours among the data-parallel ones (span ep)."""
    if ep <= 1 or not shape.moe_layers:
        return 0.0
    passes = 2 if ac == "no" else 3  # forward, backward (and the recomputed forward)
    calls = 2 * shape.moe_layers * passes
    routed = tokens * shape.top_k * shape.hidden * elem  # bytes of one all-to-all on this rank
    return _in_step(hw, collective(hw, "all_to_all", routed * calls, ep, ep, calls), calls)


def _matmul_numel(shape: Shape, p) -> float:
    """A parameter's share of a token's matmuls: an untied embedding is looked up (none), an expert runs for
    top_k / E of the tokens."""
    if p.name in shape.lookups:
        return 0.0
    return p.numel * shape.top_k / shape.experts if getattr(p, "expert", False) and shape.experts else p.numel


def _complexity(row: dict) -> tuple:
    """Fewer moving parts first: no offload, no pipeline, no TP (which splits the model), no sequence ranks, ..."""
    return (row["offload"], row["pp_size"] > 1, row["tp_size"] > 1, row.get("sp_size", 1) * row.get("cp_size", 1) > 1,
            row.get("ep_size", 1) > 1, row["zero_stage"], row["activation_checkpointing"] != "no", row["micro_batches"],
            row["step_time_s"])


def plan(spec: ModelSpec, hw: Hardware, batch_size: int, seq_len: int, mixed_precision: str = "bf16",
         hidden: int | None = None, heads: int | None = None, module=None,
         measure_activations: bool = False, sp_size: int | None = None, cp_size: int | None = None,
         ep_size: int | None = None, pp_schedule: str = "1F1B") -> dict:
    """Every candidate layout, fitting ones first by step time; `recommended` indexes the simplest of the
    fastest that fit (None when none does) and `explanation` says why in the seed's terms. `module` (the model on the
    meta device, or None) gives the hidden size and heads of its config; with `measure_activations` the
    activation formula is also calibrated on a fake-tensor run of it. `sp_size`/`cp_size`: every layout with that
    sequence/context-parallel degree (None for both: planned for long sequences only, `sequence_options`).
    `ep_size`: every layout with that expert-parallel degree (None: each one a mixture of experts allows,
    `expert_options`). `pp_schedule`: the pipeline layouts' schedule (accel.config.schema.PP_SCHEDULES)."""
    from accel.config.schema import PP_SCHEDULES

    if pp_schedule not in PP_SCHEDULES:
        raise PlanError(f"--pp_schedule: bad value {pp_schedule!r}; allowed: {', '.join(PP_SCHEDULES)}")
    for name, value in (("--batch_size", batch_size), ("--seq_len", seq_len), ("--num_processes", hw.num_processes),
                        ("--num_machines", hw.num_machines)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}: bad value {value!r}; allowed: a positive integer")
    for name, rate in (("--device_memory", hw.device_memory), ("--flops", hw.flops),
                       ("--intra_bandwidth", hw.intra_bw), ("--inter_bandwidth", hw.inter_bw),
                       ("memory bandwidth", hw.memory_bw)):
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise PlanError(f"{name}: bad value {rate!r}; allowed: a finite number > 0")
    if not (isinstance(hw.host_memory, (int, float)) and math.isfinite(hw.host_memory) and hw.host_memory >= 0):
        raise PlanError(f"--host_memory: bad value {hw.host_memory!r}; allowed: a finite number >= 0")
    if not spec.numel:
        raise PlanError(f"{spec.source}: the model has no parameters (or only empty ones)")
    dims = config_dims(module)
    shape = model_shape(spec, hidden or dims.get("hidden"), heads or dims.get("heads"), dims.get("kv_heads"),
                        dims.get("experts"), dims.get("top_k"))
    sequences = sequence_options(hw, shape, seq_len, sp_size, cp_size)
    experts = expert_options(hw, shape, ep_size)
    cache: dict = {}
    calibration = activation_calibration(module, shape, seq_len, mixed_precision) if measure_activations else {}
    rows = [evaluate(spec, shape, hw, batch_size, seq_len, c, mixed_precision, cache, calibration, pp_schedule)
            for c in candidates(hw, shape, batch_size, sequences, experts, pp_schedule)]
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"] if r["step_time_s"] is not None else math.inf))
    recommended = None
    if rows and rows[0]["fits"]:  # the simplest layout within TIE of the fastest: fewer moving parts
        fast = rows[0]["step_time_s"] * (1 + TIE)
        recommended = min((i for i, r in enumerate(rows) if r["fits"] and r["step_time_s"] <= fast),
                          key=lambda i: _complexity(rows[i]))
    return {"model": spec.source, "params": shape.params,
            "shape": {"layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads,
                      "kv_heads": shape.kv_heads or shape.heads, "vocab": shape.vocab,
                      "largest_unit_params": shape.largest_unit, "experts": shape.experts,
                      "expert_params": shape.expert_params, "moe_layers": shape.moe_layers, "top_k": shape.top_k},
            "hardware": {"num_machines": hw.num_machines, "num_processes": hw.num_processes,
                         "device_memory": hw.device_memory, "intra_bandwidth": hw.intra_bw,
                         "inter_bandwidth": hw.inter_bw, "flops": hw.flops, "host_memory": hw.host_memory,
                         "intra_latency": hw.intra_latency, "inter_latency": hw.inter_latency,
                         "tokens_half": hw.tokens_half, "width_half": hw.width_half,
                         "gather_factor": hw.gather_factor, "scatter_factor": hw.scatter_factor,
                         "efficiency": hw.efficiency, "memory_bandwidth": hw.memory_bw, "overlap": hw.overlap,
                         "sync_fixed": hw.sync_fixed, "sync_slowdown": hw.sync_slowdown, "run_ahead": hw.run_ahead,
                         "fsdp_call": hw.fsdp_call, "tp_call": hw.tp_call,
                         "op_overhead": hw.op_overhead, "collectives_measured": bool(hw.collectives)},
            "batch_size": batch_size, "seq_len": seq_len, "mixed_precision": mixed_precision,
            "sequence_degrees": [{"sp_size": sp, "cp_size": cp} for sp, cp in sequences],
            "expert_degrees": experts, "pp_schedule": pp_schedule,
            "activation_method": ("formula (Korthikanti et al.) scaled to accel.planning.estimate's fake-tensor "
                                  "measurement: "
                                  + ", ".join(f"{k} x{v['scale']:.2f} + {v['fixed_bytes'] / 2 ** 30:.2f} GiB fixed"
                                              for k, v in calibration.items())) if calibration
            else "formula (Korthikanti et al.)",
            "layouts": rows, "recommended": recommended,
            "explanation": explain(rows, recommended, shape, hw, seq_len, any(sp * cp > 1 for sp, cp in sequences))}


# -- the seed's terms ------------------------------------------------------------------------------------------
def family(row: dict) -> str:
    """The seed's branches: pure data parallelism, ZeRO-3, offload, tensor or pipeline parallelism."""
    if row["offload"]:
        return "ZeRO-3 + offload"
    if row["pp_size"] > 1:
        return "pipeline parallelism"
    if row.get("ep_size", 1) > 1:
        return "expert parallelism"
    if row.get("sp_size", 1) > 1:
        return "sequence parallelism (Ulysses)"
    if row.get("cp_size", 1) > 1:
        return "context parallelism"
    if row["tp_size"] > 1:
        return "tensor parallelism"
    return {0: "DDP", 1: "ZeRO-1/2", 2: "ZeRO-1/2", 3: "ZeRO-3"}[row["zero_stage"]]


def layout_name(row: dict) -> str:
    parts = [f"PP {row['pp_size']}"] if row["pp_size"] > 1 else []
    parts += [row["pp_schedule"]] if row["pp_size"] > 1 and row.get("pp_schedule", "1F1B") != "1F1B" else []
    parts += [f"TP {row['tp_size']}"] if row["tp_size"] > 1 else []
    parts += [f"{name.upper()} {row[name + '_size']}" for name in ("sp", "cp", "ep") if row.get(name + "_size", 1) > 1]
    parts.append("DDP" if row["zero_stage"] == 0 else f"ZeRO-{row['zero_stage']}")
    return " + ".join(parts) + (" + offload" if row["offload"] else "")


def describe(row: dict) -> str:
    t = "" if row["step_time_s"] is None else f"{row['step_time_s']:.3g} s/step"
    batches = (f"{row['micro_batches']} micro-batches of {row['micro_batch_size']}" if row["pp_size"] > 1 else
               f"gradient accumulation {row['micro_batches']} x {row['micro_batch_size']}"
               if row["micro_batches"] > 1 else f"batch {row['micro_batch_size']}")
    seq = "".join(f", {name} {row[name + '_size']}" for name in ("sp", "cp", "ep") if row.get(name + "_size", 1) > 1)
    return (f"{layout_name(row)} (dp {row['dp_size']}, tp {row['tp_size']}, pp {row['pp_size']}{seq}, {batches} "
            f"per process, checkpointing {row['activation_checkpointing']}) {t}").strip()


def branch(shape: Shape, hw: Hardware) -> str:
    """Which branch of the seed's decision tree the model and hardware fall in."""
    usable = hw.device_memory * USABLE_FRACTION
    states = 16 * shape.params  # float32 params + grads + two moments
    if states <= usable:
        out = "the model's training state fits one device -> data parallelism (DDP) or ZeRO-1/2"
    elif 8 * shape.largest_unit > usable:  # its float32 weights and gradient, gathered whole
        out = ("even its largest layer does not fit one device when gathered -> tensor parallelism (within a "
               "machine), or ZeRO with care")
    else:
        out = "the model's training state does not fit one device -> ZeRO-3, pipeline or tensor parallelism"
    if hw.num_machines > 1:
        slow = hw.inter_bw * 4 < hw.intra_bw
        out += ("; slow links between machines -> pipeline parallelism across them, TP/ZeRO within" if slow else
                "; fast links between machines -> data parallelism/ZeRO may span them")
    return out


def explain(rows: list[dict], recommended: int | None, shape: Shape, hw: Hardware, seq_len: int = 0,
            sequence_planned: bool = False) -> list[str]:
    long = (f"; sequences of {seq_len} tokens -> sequence (Ulysses) or context parallelism spread each one's "
            "activations over several devices" if sequence_planned else "")
    lines = [f"Branch: {branch(shape, hw)}{long}."]
    if recommended is None:
        lines.append("No layout fits: more devices, more device memory, a smaller batch or a shorter sequence.")
        return lines
    best = rows[recommended]
    lines.append(f"Recommended: {describe(best)}" + ("" if recommended == 0 else
                 f", the simplest within {TIE:.0%} of the fastest ({layout_name(rows[0])})") + ".")
    if best["pp_size"] > 1:
        lines.append(f"Your script feeds {best['per_process_batch']} samples per process per step (the pipeline "
                     f"splits them into {best['micro_batches']}); pipeline parallelism needs the pipeline-ready loop "
                     "(loss_fn given to prepare, loss = model(x, target=y)).")
    else:
        lines.append(f"Your DataLoader's batch_size: {best['micro_batch_size']} per process" +
                     (f", with gradient_accumulation_steps {best['micro_batches']}" if best["micro_batches"] > 1
                      else "") + f" ({best['per_process_batch']} samples per process per optimizer step).")
    degree = best.get("sp_size", 1) * best.get("cp_size", 1)
    if degree > 1 and seq_len:
        lines.append(f"The {degree} processes of a sequence group get the same samples and keep "
                     f"{sequence_length(seq_len, best.get('sp_size', 1), best.get('cp_size', 1)) // degree} tokens of "
                     "each sequence (the prepared DataLoader cuts them; the loop is unchanged).")
    seen = {family(best)}
    for row in rows:
        name = family(row)
        if name in seen:
            continue
        seen.add(name)
        if row["fits"]:
            lines.append(f"Not {name}: its best, {layout_name(row)}, fits but is slower ({row['step_time_s']:.3g} "
                         f"vs {best['step_time_s']:.3g} s/step).")
        else:
            lines.append(f"Not {name}: none fits ({layout_name(row)} {row['reason']}).")
    return lines


def write_config(result: dict, path, main_process_ip: str | None = None):
    """Save the recommended layout as an accel config (AccelConfig.save) that check_launchable accepts; several
    machines need the address of machine 0 (each machine then sets its own machine_rank)."""
    from accel.config import config_from_dict
    from accel.backends.launchable import check_launchable

    if result["recommended"] is None:
        raise PlanError("--write: no layout fits, nothing to write")
    if result["hardware"]["num_machines"] > 1 and not main_process_ip:
        raise PlanError("--write with --num_machines > 1 needs --main_process_ip (the address of machine 0)")
    row = result["layouts"][result["recommended"]]
    hw = result["hardware"]
    par = {"zero_stage": row["zero_stage"], "tp_size": row["tp_size"], "pp_size": row["pp_size"],
           "offload_optimizer": row["offload"], "offload_params": row["offload"],
           "activation_checkpointing": row["activation_checkpointing"]}
    for name in ("sp_size", "cp_size", "ep_size"):
        if row.get(name, 1) > 1:
            par[name] = row[name]
    if row["pp_size"] > 1:
        par["pp_microbatches"] = row["micro_batches"]
        par["pp_schedule"] = row.get("pp_schedule", "1F1B")
    data = {"num_processes": hw["num_machines"] * hw["num_processes"], "num_machines": hw["num_machines"],
            "main_process_ip": main_process_ip, "mixed_precision": result["mixed_precision"], "parallelism": par}
    if row["gradient_accumulation_steps"] > 1:
        data["gradient_accumulation_steps"] = row["gradient_accumulation_steps"]
    cfg = check_launchable(config_from_dict(data, "accel plan"), "accel plan")
    return cfg.save(path)
