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

How bf16/fp16 (and fp8's bf16 rest) runs under ZeRO 2/3 (`parallelism.zero_mixed_precision`) is decided here too:
`fsdp_policy` is FSDP2's `MixedPrecisionPolicy` (parameters gathered in the compute dtype, fp32 master shards in the
optimizer, gradients reduced in fp32), `autocast` keeps fp32 parameters under autocast; `auto` takes the policy
where Accelerate's FSDP2 does: whenever FSDP2 shards over several ranks, and on one process off the CPU (Accelerate
launches one GPU process with torchrun and wraps it in FSDP2 on a one-rank mesh); one CPU process keeps autocast.
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
    low_precision_params: bool = False  # FSDP2's MixedPrecisionPolicy: forward and backward on compute-dtype params

    @classmethod
    def decide(cls, parallelism, topology=None, fault_tolerance=None, precision=None) -> DataParallelPlan:
        """The plan for `parallelism` on `topology` (None: before any process starts, as if there were several
        data-parallel ranks); `fault_tolerance`: the config's section, when enabled; `precision`: the run's
        PrecisionPolicy (None: float32, as far as the plan goes)."""
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
        policy = _policy_asked(parallelism, precision)
        one_process = topology is not None and topology.world_size == 1 and kind == "none"
        if one_process and stage >= 2 and policy and (policy == "fsdp_policy" or precision.device_type != "cpu"):
            kind = "fsdp"  # FSDP2 on a one-rank mesh, for its mixed-precision policy
        return cls(kind=kind, stage=stage, offload_asked=asked, reshard_after_forward=stage == 3,
                   low_precision_params=bool(policy) and kind in ("fsdp", "hsdp"))

    def fsdp_mesh(self, topology, state):
        """The mesh FSDP2 shards over: the topology's; on one process, a mesh of its one rank (over a process group
        the state then owns)."""
        if topology.world_size > 1:
            return topology.fsdp_mesh(state.device.type)
        from accel.runtime.one_rank_group import one_rank_mesh

        return one_rank_mesh(state)

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


def _policy_asked(parallelism, precision) -> str | None:
    """`zero_mixed_precision` where it asks for FSDP2's mixed-precision policy (fsdp_policy, or auto) in a
    low-precision mode; None where parameters stay float32 (float32 mode, or autocast)."""
    if precision is None or precision.dtype is None:
        return None
    choice = parallelism.zero_mixed_precision
    return None if choice == "autocast" else choice
