"""What collectives cost in a step: the ring's latency/bandwidth formula (or `--calibrate`'s timed sweep), what a
blocking one adds inside a step, what overlapping compute hides, and the sequence- and expert-parallel ones."""

from __future__ import annotations

import itertools
import math

from accel.planning.hardware import Hardware
from accel.planning.shape import Shape


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
