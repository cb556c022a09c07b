"""Values derived from the parallel degrees, each computed here only, so the config checks, the launcher, the
backends and the mesh layout agree. Plain arithmetic on a ParallelismConfig (duck-typed: this module is below the
parallelism section, whose mesh has the shape mesh_layout.py computes with these)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.config.errors import ConfigError

if TYPE_CHECKING:
    from accel.config.schema import ParallelismConfig


def model_parallel_size(tp_size: int, pp_size: int, seq_size: int = 1) -> int:
    """Processes that share one batch (tp x pp x the sequence degree); the data-parallel degree is the world size
    over this."""
    return tp_size * pp_size * seq_size


def divides_world(world_size: int, tp_size: int, pp_size: int, seq_size: int = 1) -> bool:
    """Whether tp x pp (x sp/cp) divides the world size: every data-parallel replica needs a whole group."""
    return world_size % model_parallel_size(tp_size, pp_size, seq_size) == 0


def sequence_parallel_size(parallelism: ParallelismConfig) -> int:
    """The sequence degree: ranks that hold one slice each of every sequence (sp_size for Ulysses, cp_size for
    context parallelism; at most one of them is above 1)."""
    return getattr(parallelism, "sp_size", 1) * getattr(parallelism, "cp_size", 1)


def shards_data_parallel(parallelism: ParallelismConfig) -> bool:
    """accel's rule for a data-parallel dimension left undescribed: FSDP2 (sharded) with ZeRO 2/3, or with TP
    (DDP does not take TP's DTensors); else DDP (replicated)."""
    return parallelism.zero_stage >= 2 or parallelism.tp_size > 1


def data_parallel_sizes(parallelism: ParallelismConfig, world_size: int,
                        source: str = "parallelism") -> tuple[int, int]:
    """(dp_replicate, dp_shard) for `world_size` processes: their product is the data-parallel degree, the
    world size over tp x pp (checked before: `divides_world`).

    Left out: with neither given, accel's fields decide (`shards_data_parallel`: all data-parallel ranks shard,
    else all replicate: Accelerate's DDP is dp_replicate = the process count). Otherwise dp_replicate_size is 1
    (Accelerate's default) and dp_shard_size is 1, or, with zero_stage 2/3 or TP, the ranks dp_replicate_size
    leaves. dp_replicate x dp_shard x tp x pp must be the world size."""
    par = parallelism
    seq = sequence_parallel_size(par)
    dp = world_size // model_parallel_size(par.tp_size, par.pp_size, seq)
    replicate, shard = par.dp_replicate_size, par.dp_shard_size
    if replicate is None and shard is None:
        return (1, dp) if shards_data_parallel(par) else (dp, 1)
    replicate = replicate or 1
    derived = shard is None
    if shard is None:
        shard = max(dp // replicate, 1) if shards_data_parallel(par) else 1
    if replicate * shard * par.tp_size * par.pp_size * seq != world_size:
        shown = f"{shard} (left out: {'derived' if shards_data_parallel(par) else '1'})" if derived else str(shard)
        seq_text = f" x sp_size/cp_size={seq}" if seq > 1 else ""
        raise ConfigError(
            f"{source}: dp_replicate_size={replicate} x dp_shard_size={shown} x tp_size={par.tp_size} x pp_size="
            f"{par.pp_size}{seq_text} = {replicate * shard * par.tp_size * par.pp_size * seq}, but {world_size} "
            f"processes run; allowed: sizes whose product is {world_size}")
    check_data_parallel_layout(par, replicate, shard, source)
    return replicate, shard


def data_parallel_kind(parallelism: ParallelismConfig, replicate: int, shard: int) -> str:
    """The data-parallel kind in words, as the backends run it: DDP, ZeRO-1, ZeRO-2/3 (FSDP2), FSDP2 (TP's data
    parallelism at zero_stage 0), HSDP (replicas of sharded groups), or none (one data-parallel rank, no ZeRO)."""
    stage = parallelism.zero_stage
    if replicate * shard == 1 and stage == 0:
        return "no data parallelism"
    if shard > 1 or stage >= 2:
        kind = f"ZeRO-{stage} (FSDP2)" if stage >= 2 else "FSDP2"
        return f"HSDP {kind}" if replicate > 1 and shard > 1 else kind
    return "ZeRO-1" if stage == 1 else "DDP"


def layout_words(parallelism: ParallelismConfig, replicate: int, shard: int, every: bool = False) -> str:
    """The layout in words: the data-parallel kind, then the degrees (`every`: each one, else those above 1) and CPU
    offload, e.g. "ZeRO-2 (FSDP2), dp_shard 2". One wording for `accel launch`'s start line and the state's
    summary."""
    degrees = {"dp_replicate": replicate, "dp_shard": shard, "tp": parallelism.tp_size, "pp": parallelism.pp_size,
               "cp": getattr(parallelism, "cp_size", 1), "sp": getattr(parallelism, "sp_size", 1),
               "ep": getattr(parallelism, "ep_size", 1)}
    words = [data_parallel_kind(parallelism, replicate, shard)]
    words += [f"{name} {size}" for name, size in degrees.items() if every or size > 1]
    if parallelism.offload_params or parallelism.offload_optimizer:
        words.append("CPU offload")
    return ", ".join(words)


def check_data_parallel_layout(parallelism: ParallelismConfig, replicate: int, shard: int,
                               source: str = "parallelism") -> None:
    """The data-parallel layout must agree with accel's own fields (one-line ConfigError otherwise): sharding
    needs ZeRO 2/3 (or TP's FSDP2, zero_stage 0), pure replication is DDP (zero_stage 0/1, no TP)."""
    stage, tp = parallelism.zero_stage, parallelism.tp_size
    if shard > 1 and (stage == 1 or (stage == 0 and tp == 1)):
        what = f"with dp_replicate_size={replicate}: HSDP" if replicate > 1 else "FSDP2"
        raise ConfigError(
            f"{source}: dp_shard_size={shard} ({what}) shards the model, which contradicts zero_stage={stage} "
            f"({'ZeRO-1: DDP' if stage == 1 else 'plain DDP'}); allowed: zero_stage 2 or 3, or leave zero_stage out "
            "(then 3)")
    if shard == 1 and replicate > 1 and stage >= 2:
        raise ConfigError(
            f"{source}: zero_stage={stage} shards over dp_shard_size, which is 1 (dp_replicate_size={replicate} only "
            "replicates); allowed: dp_shard_size > 1 (HSDP), or zero_stage 0/1 for DDP")
    if shard == 1 and replicate > 1 and tp > 1:
        raise ConfigError(
            f"{source}: tp_size={tp} with dp_replicate_size={replicate} and dp_shard_size 1 (DDP) is not supported: "
            "TP's data parallelism is FSDP2; allowed: dp_shard_size > 1 (HSDP x TP), or dp_replicate_size 1")


def check_expert_degree(ep_size: int, dp_size: int, source: str = "parallelism") -> None:
    """ep_size ranks are taken from the data-parallel ranks (as torchtitan does): it must divide their number."""
    if ep_size > 1 and dp_size % ep_size:
        allowed = ", ".join(str(d) for d in range(1, dp_size + 1) if dp_size % d == 0)
        raise ConfigError(f"{source}.ep_size={ep_size} does not divide the data-parallel degree {dp_size} (the ranks "
                          f"experts are divided among); allowed: {allowed}")


def check_world_layout(parallelism: ParallelismConfig, num_processes: int, source: str = "config") -> None:
    """tp x pp x sp/cp (x the data-parallel sizes, and ep within them) must fit `num_processes`, one process
    included: a config file alone (no launch) may leave num_processes at 1 for a world torchrun sets, but a launch
    starts exactly that many. Every degree's arithmetic is here, so a new degree is checked in this module only."""
    par = parallelism
    seq = sequence_parallel_size(par)
    if not divides_world(num_processes, par.tp_size, par.pp_size, seq):
        needed = model_parallel_size(par.tp_size, par.pp_size, seq)
        names = "tp_size x pp_size" + ("" if seq == 1 else " x cp_size" if par.cp_size > 1 else " x sp_size")
        raise ConfigError(f"{source}: key 'num_processes': {num_processes} is not divisible by {names} = "
                          f"{needed}; allowed: num_processes a multiple of {needed}, or a smaller "
                          f"{names.replace(' x ', '/')}")
    data_parallel_sizes(par, num_processes, f"{source}: parallelism")
    dp = num_processes // model_parallel_size(par.tp_size, par.pp_size, seq)
    check_expert_degree(getattr(par, "ep_size", 1), dp, f"{source}: parallelism")
