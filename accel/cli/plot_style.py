"""What both renderers of `accel plot` draw alike (the PNG/SVG/PDF one and the HTML one): colours, the raw
line's alpha, TensorBoard's smoothing."""

from __future__ import annotations

import math
import re

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
RAW_ALPHA = 0.25
MAX_DRAWN = 1e300  # larger magnitudes are drawn as gaps, like nan and infinities: no axis scales to the float's end


def drawable(values: list) -> list:
    """The values as both renderers draw them: a magnitude beyond MAX_DRAWN becomes nan (a gap)."""
    return [v if -MAX_DRAWN <= v <= MAX_DRAWN else math.nan for v in values]


_COUNTERS = {"epoch", "step", "global_step", "globalstep"}  # a panel of the step or epoch itself
_SCHEDULE_WORDS = ("lr", "learningrate", "learning rate", "momentum", "weight decay")


def _is_schedule(metric: str) -> bool:
    last = metric.lower().rsplit("/", 1)[-1]
    words = " ".join(re.split(r"[/_.\-\s]+", re.sub(r"([a-z])([A-Z])", r"\1 \2", metric).lower()))
    padded = " " + re.sub(r"(?<=lr)\d+", "", words) + " "  # lr0, lr1: per-group learning rates
    return last in _COUNTERS or any(f" {word} " in padded for word in _SCHEDULE_WORDS)


# The throughput monitor's keys (accel/planning/throughput.py) -> the unit its panel's title names
UNITS = {"throughput/step_time_s": "s", "throughput/samples_per_sec": "samples/s",
         "throughput/tokens_per_sec": "tokens/s", "throughput/tokens_per_sec_per_device": "tokens/s per device",
         "throughput/tflops_per_device": "TFLOP/s per device", "throughput/mfu_percent": "%",
         "throughput/peak_memory_gb": "GB"}
_RUNNING_MAXIMA = {"throughput/peak_memory_gb"}  # a peak so far: it only rises, an average would lag it


def smoothing_for(metric: str, smoothing: float) -> float:
    """The smoothing a metric's panel gets: `smoothing`, or 0 for a schedule (learning rate `lr`, `train/lr`,
    `lr_group_0`, `learning_rate`, `epoch`, `momentum`, `weight_decay`...): set by the run, not measured, so an
    average only makes it lag; and 0 for the throughput monitor's peak memory (a running maximum). Its rates, step
    time and MFU are window averages, still noisy between windows: smoothed."""
    return 0.0 if _is_schedule(metric) or metric in _RUNNING_MAXIMA else smoothing


def title_for(metric: str) -> str:
    """A panel's title: the metric's name, with its unit for the throughput monitor's keys
    (`throughput/mfu_percent (%)`)."""
    return f"{metric} ({UNITS[metric]})" if metric in UNITS else metric


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
