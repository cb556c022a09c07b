"""`accel plan`: the seed's decision tree made executable. Enumerate layouts (data parallel x ZeRO stage x TP x
PP x sequence/context parallelism x offload x activation checkpointing x pipeline micro-batches), drop those that
do not fit a device, estimate each one's step time with a compute + latency/bandwidth model, rank them and say why.

Plain functions over accel.planning.estimate's `ModelSpec` (meta device: a 70B model plans in seconds).

The model and its constants (documented so a plan can be checked by hand):
- batch_size is GLOBAL: samples per optimizer step over all processes; each data-parallel rank gets
  batch_size / dp (a layout whose dp does not divide it is dropped), split into `micro_batches` under PP.
- Ranks are laid out as accel's topology does (accel/config/mesh_layout.py): tp innermost, then the sequence ranks
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
- The recipe's terms (accel.planning.recipe_terms, docs/plan.md): selective checkpointing's kept share and
  recomputed matmuls, torch.compile's fused memory-bound work, float8 linears, asynchronous and sequence-parallel
  TP; device presets (accel.planning.devices) with MATMUL_EFFICIENCY and LINK_EFFICIENCY; checked against
  torchtitan's published runs by accel.planning.published.
- Pipeline schedule (`pp_schedule`, default 1F1B): the pipeline layouts' bubble (`pipeline_bubble`), 2 stages per
  process for the looped, interleaved and V schedules (pp x 2 at most the blocks), DualPipeV with 2 x pp
  micro-batches or more; the split-backward ones (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) with data
  parallelism only on DDP stages (ZeRO 0/1, no TP; accel refuses FSDP2 stages). Activations held at once
  (`pipeline_in_flight`): all m micro-batches for GPipe and LoopedBFS, p for 1F1B and the others.
"""

from __future__ import annotations

import dataclasses
import math

from accel.planning.activations import (ACT_BYTES, AUTOCAST_CACHE, activation_bytes, activation_calibration,
                                        elementwise_bytes)
from accel.planning.collectives import (RING_HOPS, _exposed, _in_step, _interpolate, _link, collective, expert_comm,
                                        sequence_comm)
from accel.planning.estimate import ModelSpec
from accel.planning.explain import TIE, branch, describe, explain, family, layout_name, write_config
from accel.planning.hardware import (DEFAULT_HOST_GB, DEFAULT_INTER_GBS, DEFAULT_INTRA_GBS, DEFAULT_MEMORY_GBS,
                                     DEFAULT_TFLOPS, EFFICIENCY, GB, HOST_BW, INTER_LATENCY, INTRA_LATENCY, PCIE_BW,
                                     TOKENS_HALF, WIDTH_HALF, Hardware, PlanError, apply_calibration, detect)
from accel.planning.layouts import (LONG_SEQUENCE, MAX_ACCUMULATION_LOG2, MIN_LOCAL_TOKENS, _divisors, _pointless,
                                    candidates, expert_options, pipeline_bubble, pipeline_in_flight, sequence_options,
                                    stages_per_rank)
from accel.planning.recipe_terms import ACCEL, TORCHTITAN, Recipe
from accel.planning.shape import (CONFIG_KEYS, DEFAULT_TOP_K, HEAD_DIM, Shape, attention_flops_per_token, config_dims,
                                  expert_count, model_shape, module_shape, training_flops_per_token)
from accel.planning.step import (ADAM_PASSES, DDP_BUCKET, ELEMENTWISE_PASSES, OPS_PER_TENSOR, STATE_NAME,
                                 USABLE_FRACTION, _matmul_numel, evaluate)

__all__ = [
    "ACT_BYTES", "ADAM_PASSES", "AUTOCAST_CACHE", "CONFIG_KEYS", "DDP_BUCKET", "DEFAULT_HOST_GB", "DEFAULT_INTER_GBS",
    "DEFAULT_INTRA_GBS", "DEFAULT_MEMORY_GBS", "DEFAULT_TFLOPS", "DEFAULT_TOP_K", "EFFICIENCY", "ELEMENTWISE_PASSES",
    "GB", "HEAD_DIM", "HOST_BW", "INTER_LATENCY", "INTRA_LATENCY", "LONG_SEQUENCE", "MAX_ACCUMULATION_LOG2",
    "MIN_LOCAL_TOKENS", "OPS_PER_TENSOR", "PCIE_BW", "RING_HOPS", "STATE_NAME", "TIE", "TOKENS_HALF",
    "USABLE_FRACTION", "WIDTH_HALF", "ACCEL", "TORCHTITAN", "Recipe",
    "Hardware", "PlanError", "Shape", "_divisors", "_exposed", "_in_step",
    "_interpolate", "_link", "_matmul_numel", "_pointless", "activation_bytes", "activation_calibration",
    "apply_calibration", "attention_flops_per_token", "branch", "candidates", "collective", "config_dims", "describe",
    "detect", "elementwise_bytes", "evaluate", "expert_comm", "expert_count", "expert_options", "explain", "family",
    "layout_name", "model_shape", "module_shape", "pipeline_bubble", "pipeline_in_flight", "plan", "sequence_comm",
    "sequence_options", "stages_per_rank", "training_flops_per_token", "write_config",
]


def _complexity(row: dict) -> tuple:
    """Fewer moving parts first: no offload, no pipeline, no TP (which splits the model), no sequence ranks, ..."""
    return (row["offload"], row["pp_size"] > 1, row["tp_size"] > 1, row.get("sp_size", 1) * row.get("cp_size", 1) > 1,
            row.get("ep_size", 1) > 1, row["zero_stage"], row["activation_checkpointing"] != "no", row["micro_batches"],
            row["step_time_s"])


def plan(spec: ModelSpec, hw: Hardware, batch_size: int, seq_len: int, mixed_precision: str = "bf16",
         hidden: int | None = None, heads: int | None = None, module=None,
         measure_activations: bool = False, sp_size: int | None = None, cp_size: int | None = None,
         ep_size: int | None = None, pp_schedule: str = "1F1B", recipe: Recipe = ACCEL) -> dict:
    """Every candidate layout, fitting ones first by step time; `recommended` indexes the simplest of the
    fastest that fit (None when none does) and `explanation` says why in the seed's terms. `module` (the model on the
    meta device, or None) gives the hidden size and heads of its config; with `measure_activations` the
    activation formula is also calibrated on a fake-tensor run of it. `sp_size`/`cp_size`: every layout with that
    sequence/context-parallel degree (None for both: planned for long sequences only, `sequence_options`).
    `ep_size`: every layout with that expert-parallel degree (None: each one a mixture of experts allows,
    `expert_options`). `pp_schedule`: the pipeline layouts' schedule (accel.config.schema.PP_SCHEDULES).
    `recipe`: compile, float8 and the other terms of accel.planning.recipe_terms."""
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
    rows = [evaluate(spec, shape, hw, batch_size, seq_len, c, mixed_precision, cache, calibration, pp_schedule,
                     recipe)
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
                         "op_overhead": hw.op_overhead, "collectives_measured": bool(hw.collectives),
                         "fp8_flops": hw.fp8_flops, "fused_attention": hw.fused_attention, "device": hw.device},
            "recipe": dataclasses.asdict(recipe),
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
