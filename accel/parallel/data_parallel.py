"""The data-parallel kind of a run, decided once from the config and the topology: every step owner, the recipe
and the config check read this plan (the only reader of `zero_stage` below the config).

- none:  one data-parallel rank (and no sequence ranks): nothing to reduce;
- ddp:   parameters stay whole on every rank (zero_stage 0), gradients all-reduced by DDP;
- zero1: DDP with ZeRO-1's optimizer, which shards its state over the gradient ranks;
- fsdp:  FSDP2 shards parameters and gradients (ZeRO 2/3, dp_shard_size > 1, or tensor parallelism's DTensors, which
         DDP does not take) over the data-parallel (and sequence) ranks;
- hsdp:  FSDP2 over the 2-D dp_replicate x dp_shard mesh (shards within a row, all-reduces across rows; with
         sequence ranks, dp_replicate x dp_shard_cp: they shard with dp_shard).

Under fault tolerance (torchft) the kind is DDP across replica groups, or FSDP2 inside each group with ZeRO 2/3.
"""

from __future__ import annotations

import dataclasses

KINDS = ("none", "ddp", "zero1", "fsdp", "hsdp")


@dataclasses.dataclass(frozen=True)
class DataParallelPlan:
    """How the data-parallel ranks run; `stage` is the ZeRO stage asked for (what is sharded when there is
    somewhere to shard it)."""

    kind: str = "none"
    stage: int = 0
    offload_asked: bool = False  # offload_params / offload_optimizer
    reshard_after_forward: bool = False  # ZeRO-3: parameters gathered again for backward

    @classmethod
    def decide(cls, parallelism, topology=None, fault_tolerance=None) -> DataParallelPlan:
        """The plan for `parallelism` on `topology` (None: before any process starts, as if there were several
        data-parallel ranks); `fault_tolerance`: the config's section, when enabled."""
        stage = parallelism.zero_stage
        asked = bool(parallelism.offload_params or parallelism.offload_optimizer)
        if fault_tolerance is not None and fault_tolerance.enabled:
            several = topology is None or topology.world_size > 1
            in_group = stage >= 2 and several and fault_tolerance.semi_sync_method is None
            kind = "fsdp" if in_group else "ddp"
        elif topology is not None and topology.dp_size * topology.seq_size <= 1:
            kind = "none"  # the sequence ranks reduce gradients like data-parallel ones
        else:
            replicate, shard = (topology.dp_replicate_size, topology.dp_shard_size) if topology else (1, 1)
            if shard > 1 or stage >= 2 or parallelism.tp_size > 1:
                kind = "hsdp" if replicate > 1 and shard > 1 else "fsdp"
            else:
                kind = "zero1" if stage == 1 else "ddp"
        return cls(kind=kind, stage=stage, offload_asked=asked, reshard_after_forward=stage == 3)

    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps the model (fsdp or hsdp)."""
        return self.kind in ("fsdp", "hsdp")

    @property
    def ddp(self) -> bool:
        """DDP wraps the model (ddp or zero1)."""
        return self.kind in ("ddp", "zero1")

    @property
    def offload(self) -> bool:
        """FSDP2's CPU offload: parameters and the optimizer step on the CPU."""
        return self.offload_asked and self.fsdp

    @property
    def zero(self) -> bool:
        """ZeRO is asked for (a stage, or offload): the ZeRO step owner runs."""
        return self.stage > 0 or self.offload_asked

    @property
    def shards_parameters(self) -> bool:
        """Whether prepare replaces the model's parameters (ZeRO shards them, or their optimizer state)."""
        return self.stage > 0

    @property
    def shards_gradients(self) -> bool:
        """ZeRO 2/3: FSDP2 shards gradients (and parameters) whatever the layout."""
        return self.stage >= 2

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole model and optimizer state (as far as data parallelism goes)."""
        return not self.fsdp and self.stage == 0
