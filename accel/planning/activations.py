"""Activation memory of one micro-batch as the planner counts it (Korthikanti et al.'s per-layer formula, scaled
to accel.planning.estimate's fake-tensor measurement when asked), and the bytes the memory-bound work touches."""

from __future__ import annotations

from accel.planning.estimate import sequence_length
from accel.planning.recipe_terms import ACCEL, Recipe
from accel.planning.shape import Shape

AUTOCAST_CACHE = {"bf16": 2, "fp16": 2}  # bytes per float32 weight: autocast keeps its cast copy for the forward
ACT_BYTES = {"no": 2, "fp16": 1, "bf16": 1, "fp8": 1}  # x the fp16 activation formula
# bytes per logit at the loss: the float32 logits and log-softmax's output (kept for its backward), and under
# bf16/fp16 the head's own 2-byte output beside them while the float32 copy is made
LOGIT_BYTES = {"no": 8, "fp16": 10, "bf16": 10, "fp8": 10}


def activation_bytes(shape: Shape, micro_batch: int, seq_len: int, tp: int = 1, layers: int | None = None,
                     checkpointing: str = "no", mixed_precision: str = "bf16", calibration: dict | None = None,
                     sp: int = 1, cp: int = 1, fused_attention: bool = False, recipe: Recipe = ACCEL) -> int:
    """Activations kept for backward by `layers` blocks on one micro-batch: Korthikanti et al.'s per-layer
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes in fp16 (x2 in fp32); full checkpointing keeps each block's input
    (2*s*b*h) plus one block's full set while it recomputes; plus the logits at the loss (LOGIT_BYTES). Times
    `calibration[checkpointing]["scale"]`: accel.planning.estimate's fake-tensor measurement of the whole model over
    this formula (`activation_calibration`), so the measurement sets the size and the formula how it scales with
    the micro-batch, TP and the blocks of a pipeline stage. Sequence (sp) or context (cp) parallelism: one rank's
    share, the whole (padded) sequence's / the degree (Ulysses' attention holds 1/sp of the heads of the whole
    sequence, the same bytes), plus for cp each kept layer's K and V gathered from the other (n-1)/n ranks.
    `fused_attention` (flash or memory-efficient SDPA kernels): no s x s scores kept (the 5as/h term goes).
    Selective checkpointing keeps `recipe.selective_kept` of a block's set, plus one block's whole set while it
    recomputes. `recipe.sequence_parallel_tp`: the parts TP replicates (10 and the blocks' inputs) are split too."""
    layers = shape.layers if layers is None else layers
    n = sp * cp
    s, b, h = sequence_length(seq_len, sp, cp), micro_batch, shape.hidden
    scale = ACT_BYTES.get(mixed_precision, 1)
    per_layer = layer_bytes(shape, s * b, s, tp, fused_attention, recipe) * scale
    inputs = 2 * s * b * h * scale / (tp if recipe.sequence_parallel_tp else 1)  # a block's input, kept by full
    if checkpointing == "full":
        kept = layers * inputs + per_layer
    elif checkpointing == "selective":
        kept = layers * per_layer * recipe.selective_kept + per_layer
    else:
        kept = layers * per_layer
    kept_layers = min(layers, 1) if checkpointing == "full" else layers  # whose attention inputs are kept
    gathered = 2 * 2 * s * b * shape.kv_width / tp * scale * (n - 1) / n if cp > 1 else 0.0  # K and V, fp16 bytes
    factor = (calibration or {}).get(checkpointing, {}).get("scale", 1.0)
    logits = LOGIT_BYTES.get(mixed_precision, 8) * s * b * shape.vocab / tp
    return int(((kept + logits) / n + kept_layers * gathered) * factor)


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
                      mixed_precision: str, sp: int = 1, cp: int = 1, fused_attention: bool = False,
                      recipe: Recipe = ACCEL) -> float:
    """Bytes of one micro-batch's activations the memory-bound work (norms, activations, softmax, residuals, the
    loss) writes once: the activation formula's per-layer bytes (the parts TP replicates are not split) plus the
    float32 logits, whole on every TP rank (accel's head gathers them: the loss is replicated); a sequence rank's
    share of them (/ sp x cp)."""
    s, b = sequence_length(seq_len, sp, cp), micro_batch
    per_layer = layer_bytes(shape, s * b, s, tp, fused_attention, recipe) * ACT_BYTES.get(mixed_precision, 1)
    logits = 4 * s * b * shape.vocab / (tp if recipe.sequence_parallel_tp else 1)  # loss parallel: sharded
    return (layers * per_layer + logits) / (sp * cp)


def layer_bytes(shape: Shape, tokens: float, seq_len: float, tp: int, fused_attention: bool = False,
                recipe: Recipe = ACCEL) -> float:
    """One block's activations for `tokens` tokens in sequences of `seq_len`, in fp16 bytes: Korthikanti et
    al.'s tokens*h*(10 + 24/t + 5*a*s/(h*t)); the 10 (norms, residual, dropout) split by t too under
    sequence-parallel TP; without the s x s scores (5as/h) under fused attention kernels."""
    h, a = shape.hidden, shape.heads
    replicated = 10 / tp if recipe.sequence_parallel_tp else 10
    scores = 0.0 if fused_attention else 5 * a * seq_len / (h * tp)
    return tokens * h * (replicated + 24 / tp + scores)
