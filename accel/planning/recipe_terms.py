"""What the training recipe changes in a step's time and memory, beside the layout: the selective activation
checkpointing policy, torch.compile, float8 matmuls, asynchronous TP and the shape of the TP plan. Each term is a
named constant, the same for every model and layout; docs/plan.md says where each number comes from.

`Recipe()` is what accel runs (its `selective` policy keeps every matmul and attention output, its TP replicates the
residual stream and gathers the logits); `TORCHTITAN` is torchtitan's recipe as its published runs used it (the
"op" selective policy, sequence-parallel TP with loss parallelism), so its benchmark tables can be predicted by
the same model (accel.planning.published).
"""

from __future__ import annotations

from dataclasses import dataclass

# Selective activation checkpointing: (share of the blocks' forward matmul FLOPs recomputed in backward, kept bytes
# over the activation formula's 34 bytes per token and hidden unit (Korthikanti et al.'s fp16 count without
# checkpointing)). Counted on a Llama block in bf16, per token, in units of the hidden size h: q h, k and v h/4 each
# (8 key/value heads of 32), attention output h, o h, gate and up 3.5h each, down h, the block's input h.
SELECTIVE_POLICIES = {
    # accel.transforms.activation_checkpointing: every mm/bmm and attention output saved, the pointwise ops
    # recomputed: q, k, v, attention, o, gate, up, down outputs and the block input, 12.5h = 25 bytes of 34
    "accel": (0.0, 0.74),
    # torchtitan's selective "op" policy: every other mm saved (q, v, gate, down), attention's output and the block
    # input saved: 7.75h = 15.5 bytes of 34; half the forward matmuls run again in backward
    "torchtitan_op": (0.5, 0.46),
}
# torch.compile: share of the eager memory-bound bytes left once inductor fuses each chain of pointwise ops (RMSNorm's
# upcast, mean of squares, rsqrt and scale; RoPE's complex multiply; SwiGLU; residual adds) into one kernel that reads
# its inputs and writes its output once: the eager chains move about 3x the bytes of their fused kernels.
COMPILE_MEMORY_BOUND = 1 / 3
# float8 (torchao, dynamic tensorwise scaling): the share of the fp8 peak's advantage over bf16 a linear keeps after
# computing each input's amax and scale and casting it (its own memory-bound passes, fused by compile).
FLOAT8_GAIN = 0.8
# Asynchronous TP (micro-pipelined all-gather/reduce-scatter matmuls): the share of TP's collectives hidden behind
# the matmuls they feed; the rest waits (the first chunk of each, and the chunked matmuls' lower rate).
ASYNC_TP_HIDDEN = 0.4


@dataclass(frozen=True)
class Recipe:
    """Recipe terms of a plan (accel's defaults). `compile`: the blocks run under torch.compile; `float8`: the
    blocks' linears run in float8 (the output head stays bf16, as torchao's and torchtitan's filters leave it);
    `async_tp`: TP's collectives micro-pipelined with their matmuls; `sequence_parallel_tp`: TP keeps the residual
    stream and norms sharded over the TP ranks (all-gather before and reduce-scatter after attention and the MLP,
    the logits left sharded for the loss) instead of all-reducing a replicated one; `selective`: which policy
    `activation_checkpointing: selective` runs (SELECTIVE_POLICIES)."""

    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    sequence_parallel_tp: bool = False
    selective: str = "accel"

    @property
    def selective_recompute(self) -> float:
        return SELECTIVE_POLICIES[self.selective][0]

    @property
    def selective_kept(self) -> float:
        return SELECTIVE_POLICIES[self.selective][1]

    def matmul_recompute(self, ac: str) -> float:
        """Forward + backward + recomputed matmul FLOPs of the blocks / forward + backward's."""
        return {"no": 1.0, "full": 4 / 3}.get(ac, 1 + self.selective_recompute / 3)

    def attention_recompute(self, ac: str) -> float:
        """The same for attention's QK^T and AV (selective policies keep attention's output)."""
        return 4 / 3 if ac == "full" else 1.0


ACCEL = Recipe()
TORCHTITAN = Recipe(sequence_parallel_tp=True, selective="torchtitan_op")
