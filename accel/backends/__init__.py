"""The step owners: the objects that own what lasts across training steps (the prepared models, the backward,
no_sync, clipping, checkpoints' state) for one way of running data parallelism: `spmd` (each process runs the
whole model: DDP, FSDP2/HSDP or alone), `zero` (adds ZeRO-1's optimizer), `pipeline` (the schedule over stages,
each prepared by an inner step owner) and, in accel/fault_tolerance/, `fault_tolerant` (torchft's replica groups).
None of them names a parallel dimension: each holds the run's list of parts (accel/parallel/) and calls the part
protocol in order. `base.py` has the interface, `recipe.py` the ordered model transformations, `ddp.py` DDP's
wrapping, `launchable.py` the one check a config passes before a launch.

This module knows, without importing torch, which step owner a parallelism config asks for and whether this
version of accel has it (so `accel launch` can refuse a config before starting any process)."""

from __future__ import annotations

from accel.config import ConfigError, ParallelismConfig
from accel.config.degrees import model_parallel_size
from accel.parallel.data_parallel import DataParallelPlan

# backend name -> module that implements (and registers) it: one name per step owner
BACKEND_MODULES = {"spmd": "accel.backends.spmd", "zero": "accel.backends.zero",
                   "pipeline": "accel.backends.pipeline",
                   # data parallelism over torchft's replica groups (the config's fault_tolerance section)
                   "fault_tolerant": "accel.fault_tolerance.backend"}


class BackendNotAvailable(ConfigError):
    """The config asks for a parallelism this version of accel does not implement yet."""


def backend_name_for(parallelism: ParallelismConfig) -> str:
    """Which step owner a parallelism config asks for: the pipeline's with stages, ZeRO's when ZeRO is asked for,
    else the one of every layout in which each process runs the whole model (parallel dimensions are its parts)."""
    if parallelism.pp_size > 1:
        return "pipeline"
    return "zero" if DataParallelPlan.decide(parallelism).zero else "spmd"


SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")  # pipeline schedules that run one stage per process
# zero-bubble schedules with V placement: exactly 2 stages per process, rank r holding stages r and 2p-1-r
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# schedules that split the backward into input- and weight-gradient parts: torch computes the weight part with
# autograd.grad, past the hooks through which DDP (and FSDP2, here) reduce gradients over data-parallel replicas
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", *V_SCHEDULES)


def check_available(parallelism: ParallelismConfig, num_processes: int | None = None) -> str:
    """The backend's name, or a clear error when it is not available (never a silent fallback to DDP).

    Every rule about which parallelisms compose lives here; `accel launch`, `accel env` and `Accelerator()` run
    it before any process starts (`accel config` re-asks the question that completed a refused combination)."""
    name = backend_name_for(parallelism)
    data_parallel = DataParallelPlan.decide(parallelism)
    offload = data_parallel.offload_asked
    if name == "pipeline" and offload:
        raise BackendNotAvailable(
            f"parallelism: pipeline parallelism (pp_size={parallelism.pp_size}) with CPU offload is not available yet "
            "in accel; allowed: offload_optimizer and offload_params false")
    if parallelism.tp_size > 1 and (data_parallel.stage == 1 or offload):
        raise BackendNotAvailable(
            f"parallelism: tensor parallelism (tp_size={parallelism.tp_size}) with ZeRO stage 1 or CPU offload is not "
            "available yet in accel; allowed: zero_stage 0, 2 or 3 without offload")
    if offload and not data_parallel.shards_gradients:
        raise ConfigError(f"parallelism: offload_optimizer/offload_params need zero_stage 2 or 3 (FSDP2's CPU "
                          f"offload), got zero_stage={data_parallel.stage}; allowed: zero_stage 2 or 3 with offload")
    _check_sequence(parallelism)
    _check_expert(parallelism)
    schedule, per_rank = parallelism.pp_schedule, parallelism.pp_stages_per_rank
    if name == "pipeline" and schedule in SINGLE_STAGE_SCHEDULES and per_rank not in (None, 0, 1):
        raise ConfigError(f"parallelism: pp_schedule {schedule} runs one stage per process, got "
                          f"pp_stages_per_rank={per_rank}; allowed: 1, or a schedule such as Interleaved1F1B")
    if name == "pipeline" and schedule in V_SCHEDULES:
        _check_v_schedule(parallelism)
    if name == "pipeline" and num_processes:
        check_split_backward(parallelism, num_processes // model_parallel_size(parallelism.tp_size,
                                                                               parallelism.pp_size))
    if name not in BACKEND_MODULES:
        wanted = " and ".join(parallelism.requested_features())
        raise BackendNotAvailable(
            f"parallelism: {wanted} is not available yet in accel; this version runs data parallelism (DDP), "
            "ZeRO stages 1-3 and tensor parallelism (alone, with DDP or ZeRO 2/3) only: set pp_size 1"
        )
    return name


def check_split_backward(parallelism: ParallelismConfig, dp_size: int) -> None:
    """The zero-bubble schedules with data parallelism: torch computes their weight gradients past the hooks through
    which DDP and FSDP2 reduce them. accel averages them itself for DDP stages (zero_stage 0 or 1,
    accel/backends/ddp.py); FSDP2's (ZeRO 2/3, and TP with data parallelism) were measured wrong: refused."""
    if parallelism.pp_schedule not in SPLIT_BACKWARD_SCHEDULES or dp_size <= 1:
        return
    stage = DataParallelPlan.decide(parallelism).stage
    if stage >= 2 or parallelism.tp_size > 1:
        what = f"zero_stage={stage}" if stage >= 2 else f"tp_size={parallelism.tp_size}"
        raise BackendNotAvailable(
            f"parallelism: pp_schedule {parallelism.pp_schedule} with data parallelism ({dp_size} replicas of each "
            f"stage) and {what} is not available yet in accel: its split backward skips FSDP2's gradient "
            "reduction; allowed: zero_stage 0 or 1 without tp_size (DDP stages), or pp_schedule 1F1B, GPipe, "
            "Interleaved1F1B or LoopedBFS")


def _check_v_schedule(parallelism: ParallelismConfig) -> None:
    """torch's V schedules build only with exactly 2 stages per process, and DualPipeV with at least as many
    micro-batches as stages (2 x pp_size; unset, accel uses that many); ZBVZeroBubble takes any count."""
    schedule, per_rank, micro = parallelism.pp_schedule, parallelism.pp_stages_per_rank, parallelism.pp_microbatches
    if per_rank not in (None, 0, 2):
        raise ConfigError(f"parallelism: pp_schedule {schedule} places exactly 2 stages per process (V shape), got "
                          f"pp_stages_per_rank={per_rank}; allowed: 2 or unset")
    stages = 2 * parallelism.pp_size
    if schedule == "DualPipeV" and micro and micro < stages:
        raise ConfigError(f"parallelism: pp_schedule DualPipeV needs at least as many micro-batches as stages "
                          f"(2 x pp_size = {stages}), got pp_microbatches={micro}; allowed: pp_microbatches >= "
                          f"{stages} or unset")


def _check_sequence(parallelism: ParallelismConfig) -> None:
    """Sequence (sp_size, Ulysses) and context (cp_size) parallelism: one of them at a time, not with pipeline
    stages; with DDP, ZeRO 1-3, HSDP, offload and TP they compose (the backend is the one the other fields name:
    the sequence ranks reduce gradients and shard with the data-parallel ones; under HSDP FSDP2 shards over
    dp_shard x the sequence ranks and replicates over dp_replicate)."""
    cp, sp = getattr(parallelism, "cp_size", 1), getattr(parallelism, "sp_size", 1)
    if cp <= 1 and sp <= 1:
        return
    if cp > 1 and sp > 1:
        raise ConfigError(f"parallelism: cp_size={cp} and sp_size={sp}: context and sequence parallelism both split "
                          "the sequence, use one of them; allowed: cp_size 1 or sp_size 1")


def _check_expert(parallelism: ParallelismConfig) -> None:
    """Expert parallelism (ep_size) runs with DDP, ZeRO 1-3, HSDP, sequence/context parallelism, tensor
    parallelism and pipeline stages (each stage's experts over its own ep group) over the data-parallel ranks it is
    taken from (accel/parallel/expert.py); what it has not been made to work with is refused here, by name."""
    ep = getattr(parallelism, "ep_size", 1)
    if ep <= 1:
        return
    if parallelism.pp_size > 1 and parallelism.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise BackendNotAvailable(
            f"parallelism: expert parallelism (ep_size={ep}) with pp_schedule {parallelism.pp_schedule} is not "
            "available yet in accel: its split backward computes weight gradients past the expert gradients' "
            "reduction; allowed: pp_schedule 1F1B, GPipe, Interleaved1F1B or LoopedBFS with ep_size > 1")
