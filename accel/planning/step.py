"""One layout's memory per rank and step time (accel.planning.plan's docstring states the model)."""

from __future__ import annotations

import math

from accel.planning.activations import AUTOCAST_CACHE, activation_bytes, elementwise_bytes
from accel.planning.collectives import _exposed, _in_step, _link, collective, expert_comm, sequence_comm
from accel.planning.estimate import ModelSpec, pipeline_stages, sequence_length, training
from accel.planning.hardware import HOST_BW, PCIE_BW, Hardware
from accel.planning.layouts import pipeline_bubble, pipeline_in_flight, stages_per_rank
from accel.planning.recipe_terms import ACCEL, ASYNC_TP_HIDDEN, COMPILE_MEMORY_BOUND, FLOAT8_GAIN, Recipe
from accel.planning.shape import Shape, attention_flops_per_token

USABLE_FRACTION = 0.9      # of device memory: the rest for the CUDA context, allocator slack, buffers
ELEMENTWISE_PASSES = {"no": 4, "full": 5, "selective": 5}  # passes over the kept activations: forward writes,
#                               backward reads, its gradient written and read; recompute (full or selective) again
DDP_BUCKET = 25 * 2 ** 20  # DDP's gradient bucket
OPS_PER_TENSOR = 10        # eager ops per parameter tensor per forward + backward (a Llama block: 9 tensors, ~100)
ADAM_PASSES = 12           # bytes of float32 state touched per element stepped by AdamW, / 4 (7 + temporaries)
STATE_NAME = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def evaluate(spec: ModelSpec, shape: Shape, hw: Hardware, batch_size: int, seq_len: int, cand,
             mixed_precision: str, states_cache: dict, calibration: dict | None = None,
             schedule: str = "1F1B", recipe: Recipe = ACCEL) -> dict:
    """One candidate layout (`layouts.candidates`' tuple) as a plan's row: memory per rank, whether it fits, step
    time and its parts, under `recipe`'s terms (accel.planning.recipe_terms)."""
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
    acts = activation_bytes(shape, mb, seq_len, tp, layers, ac, mixed_precision, calibration, sp, cp,
                            hw.fused_attention, recipe) * pipeline_in_flight(m, pp, schedule)
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
    recompute = recipe.matmul_recompute(ac)
    if ("flops", pp) not in states_cache:  # a pipeline runs at its slowest stage's pace
        states_cache["flops", pp] = shape.flop_params if pp == 1 else pp * max(
            sum(_matmul_numel(shape, p) for p in stage) for stage in pipeline_stages(spec, pp))
    head = min(shape.vocab * shape.hidden / max(shape.flop_params, 1), 1.0)  # the output head's share: kept bf16,
    #                                                                            outside the checkpointed blocks
    matmuls = 6 * states_cache["flops", pp] * tokens * ((1 - head) * recompute / float8_speedup(hw, recipe,
                                                                                             mixed_precision) + head)
    compute = (matmuls + attention * recipe.attention_recompute(ac)) / (hw.world * hw.flops * eff) * bubble
    fused = COMPILE_MEMORY_BOUND if recipe.compile else 1.0
    memory_bound = (ELEMENTWISE_PASSES[ac] * fused * elementwise_bytes(shape, mb, seq_len, tp, layers,
                                                                       mixed_precision, sp, cp, hw.fused_attention,
                                                                       recipe)
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
    tp_comm = tensor_parallel_comm(hw, shape, recipe, tp, layers, m, ac, act_mb, logits_mb)
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


def _matmul_numel(shape: Shape, p) -> float:
    """A parameter's share of a token's matmuls: an untied embedding is looked up (none), an expert runs for
    top_k / E of the tokens."""
    if p.name in shape.lookups:
        return 0.0
    return p.numel * shape.top_k / shape.experts if getattr(p, "expert", False) and shape.experts else p.numel


def float8_speedup(hw: Hardware, recipe: Recipe, mixed_precision: str) -> float:
    """How much faster the blocks' linears run in float8 than in bf16: the fp8 peak over the bf16 one times
    FLOAT8_GAIN (1 without float8, or on a device without fp8 math)."""
    if not (recipe.float8 or mixed_precision == "fp8") or hw.fp8_flops <= hw.flops:
        return 1.0
    return max(1.0, hw.fp8_flops / hw.flops * FLOAT8_GAIN)


def tensor_parallel_comm(hw: Hardware, shape: Shape, recipe: Recipe, tp: int, layers: int, m: int, ac: str,
                         act_mb: float, logits_mb: float) -> float:
    """Seconds of TP collectives on the critical path (each output is needed by the next op). accel's TP: an
    all-reduce of a micro-batch's activations per split weight of a block (`Shape.tp_splits`), +2 (embedding,
    head), x1.5 with recompute, and the head's all-gather of the logits. Sequence-parallel TP (torchtitan's): an
    all-gather before and a reduce-scatter after attention and the MLP in forward, as many in backward, the
    forward's again under full checkpointing; the logits stay sharded. Async TP hides ASYNC_TP_HIDDEN of them."""
    if tp == 1:
        return 0.0
    if recipe.sequence_parallel_tp:
        calls = 2 * layers * m * (3 if ac == "full" else 2)  # of each kind
        seconds = (_in_step(hw, calls * collective(hw, "all_gather", act_mb, tp, tp), calls, hw.tp_call)
                   + _in_step(hw, calls * collective(hw, "reduce_scatter", act_mb, tp, tp), calls, hw.tp_call))
    else:
        calls = math.ceil((shape.tp_splits * layers + 2) * m * (2 if ac == "no" else 3) / 2)
        seconds = (_in_step(hw, calls * collective(hw, "all_reduce", act_mb, tp, tp), calls, hw.tp_call)
                   + _in_step(hw, m * collective(hw, "all_gather", logits_mb, tp, tp), m, hw.tp_call))
    return seconds * (1 - ASYNC_TP_HIDDEN) if recipe.async_tp else seconds
