"""The layouts a plan tries: degrees that divide the world, accel's rules of what composes with what, the
sequence and expert degrees, the pipeline schedule's bubble and activations in flight."""

from __future__ import annotations

import itertools
import math
from typing import Any

from accel.planning.hardware import Hardware, PlanError
from accel.planning.shape import Shape

CHECKPOINTING = ("no", "full")  # activation checkpointing planned (`selective` is modelled, not planned)
MAX_ACCUMULATION_LOG2 = 6  # gradient accumulation steps planned: 1, 2, 4, ... 64
LONG_SEQUENCE = 16384      # tokens per sample from which sp/cp layouts are planned when not asked for
MIN_LOCAL_TOKENS = 1024    # ... with at least this many tokens of each sequence per rank


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending (pairs up to its square root: a world of a million ranks costs a thousand steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _pointless(zero: int, offload: bool, dp: int, tp: int) -> bool:
    """Offload is planned with ZeRO-3 only (estimate's zero3_offload); ZeRO without data parallelism shards
    nothing (except to offload); next to TP accel runs data parallelism as FSDP2 without resharding after the
    forward whatever the stage below 3 (accel.parallel.data_parallel.DataParallelPlan: DDP takes no DTensors), so
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
                        for ac in CHECKPOINTING:
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
