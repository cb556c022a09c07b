"""What both renderers of `accel plot` draw alike (the PNG/SVG/PDF one and the HTML one): colours, the raw
line's alpha, TensorBoard's smoothing."""

from __future__ import annotations

import math

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
RAW_ALPHA = 0.25
MAX_DRAWN = 1e300  # larger magnitudes are drawn as gaps, like nan and infinities: no axis scales to the float's end


def drawable(values: list) -> list:
    """The values as both renderers draw them: a magnitude beyond MAX_DRAWN becomes nan (a gap)."""
    return [v if -MAX_DRAWN <= v <= MAX_DRAWN else math.nan for v in values]


def smooth(values: list, weight: float) -> list:
    """TensorBoard's smoothing: a debiased exponential moving average; constant series and non-finite
    points are left as they are (the same as TensorBoard's scalar dashboard draws)."""
    if weight <= 0 or not values:
        return list(values)
    if all(v == values[0] for v in values):
        return list(values)
    out, last, count = [], 0.0, 0
    for value in values:
        if not math.isfinite(value):
            out.append(value)
            continue
        last = last * weight + (1 - weight) * value
        count += 1
        out.append(last / (1 - weight ** count))
    return out
