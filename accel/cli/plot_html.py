"""`accel plot --format html`: one self-contained page of inline SVG panels, drawn without matplotlib.

No external resources (no scripts, fonts, stylesheets or links), so the page can be mailed or archived as is.
"""

from __future__ import annotations

import math
import sys
from html import escape

from accel.cli.plot_style import COLORS, RAW_ALPHA, drawable, smooth, smoothing_for, title_for

WIDTH, HEIGHT = 440, 290
LEFT, RIGHT, TOP, BOTTOM = 64, 14, 30, 40


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values (steps of 1, 2, 2.5 or 5 times a power of ten) covering [lo, hi]; any
    finite lo < hi, the whole float range included (differences are taken of halves: they never overflow)."""
    raw = (hi / 2 - lo / 2) / count * 2
    if not (math.isfinite(raw) and raw > 0):
        return [lo, hi]
    magnitude = 10.0 ** math.floor(math.log10(raw))
    if not magnitude:  # below the smallest float
        return [lo, hi]
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if raw <= m * magnitude)
    first = math.ceil(lo / step - 1e-9)
    ticks = [(first + i) * step for i in range(int(hi / step - lo / step + 1e-9) + 2)]
    return [t for t in ticks if math.isfinite(t) and t <= hi + step * 1e-9]


def _extent(values: list[float]) -> tuple[float, float]:
    """The axis range: the finite values with a margin (as matplotlib leaves one), within the float range."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    half = hi / 2 - lo / 2  # half the span: never overflows
    if half < 1e-300 or half <= max(abs(lo), abs(hi)) * 1e-13:  # one value, to a float's precision
        pad = max(abs(lo), abs(hi)) * 0.1
        pad = pad if pad >= 1e-300 else 1.0
    else:
        pad = half * 0.08
    return max(lo - pad, -sys.float_info.max), min(hi + pad, sys.float_info.max)


class _Frame:
    """Maps data coordinates onto the panel's plotting area."""

    def __init__(self, xs: list[float], ys: list[float]):
        self.x0, self.x1 = _extent(xs)
        self.y0, self.y1 = _extent(ys)

    def px(self, x: float) -> float:
        return LEFT + _share(x, self.x0, self.x1) * (WIDTH - LEFT - RIGHT)

    def py(self, y: float) -> float:
        return HEIGHT - BOTTOM - _share(y, self.y0, self.y1) * (HEIGHT - TOP - BOTTOM)


def _share(v: float, lo: float, hi: float) -> float:
    """Where v lies between lo and hi (0 to 1), in halves: no overflow across the whole float range."""
    return (v / 2 - lo / 2) / (hi / 2 - lo / 2)


def _path(frame: _Frame, xs: list[float], ys: list[float]) -> str:
    """SVG path data; a non-finite point breaks the line (as matplotlib does)."""
    parts, pen_down = [], False
    for x, y in zip(xs, ys, strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            pen_down = False
            continue
        parts.append(f"{'L' if pen_down else 'M'}{frame.px(x):.1f},{frame.py(y):.1f}")
        pen_down = True
    return "".join(parts)


def _axes(frame: _Frame, metric: str) -> list[str]:
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    out = [f'<text x="{WIDTH / 2:.0f}" y="18" class="title">{escape(title_for(metric))}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{right - LEFT}" height="{bottom - TOP}" class="frame"/>']
    for t in nice_ticks(frame.x0, frame.x1):
        x = frame.px(t)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{bottom}" class="grid"/>'
                   f'<text x="{x:.1f}" y="{bottom + 15}" class="xtick">{t:.4g}</text>')
    for t in nice_ticks(frame.y0, frame.y1):
        y = frame.py(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{LEFT - 5}" y="{y + 4:.1f}" class="ytick">{t:.4g}</text>')
    out.append(f'<text x="{(LEFT + right) / 2:.0f}" y="{HEIGHT - 6}" class="xlabel">step</text>')
    return out


def render_panel(runs: list, metric: str, smoothing: float) -> str:
    """One metric's inline SVG: per run a faint raw path and, when smoothing, a smoothed path over it."""
    present = [(i, run, run.metrics[metric].x, drawable(run.metrics[metric].y)) for i, run in enumerate(runs)
               if metric in run.metrics]
    frame = _Frame([x for _, _, xs, _ in present for x in xs], [y for _, _, _, ys in present for y in ys])
    body = _axes(frame, metric)
    smoothing = smoothing_for(metric, smoothing)
    for index, run, xs, ys in present:
        color, label = COLORS[index % len(COLORS)], escape(run.label)
        if smoothing > 0:
            body.append(f'<path d="{_path(frame, xs, ys)}" stroke="{color}" '
                        f'stroke-opacity="{RAW_ALPHA}" class="raw" data-run="{label}"><title>{label} (raw)</title>'
                        "</path>")
            body.append(f'<path d="{_path(frame, xs, smooth(ys, smoothing))}" stroke="{color}" class="smoothed" '
                        f'data-run="{label}"><title>{label} (smoothed {smoothing:g})</title></path>')
        else:
            body.append(f'<path d="{_path(frame, xs, ys)}" stroke="{color}" class="smoothed" '
                        f'data-run="{label}"><title>{label}</title></path>')
    return (f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
            f'aria-label="{escape(metric)}">' + "".join(body) + "</svg>")


STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 1.6em; height: 0.25em; vertical-align: middle; margin-right: 0.4em; }
.panels { display: flex; flex-wrap: wrap; gap: 0.5em; }
svg text { font-size: 11px; fill: #444; }
svg .title { font-size: 13px; text-anchor: middle; fill: #000; }
svg .xtick, svg .xlabel { text-anchor: middle; }
svg .ytick { text-anchor: end; }
svg .frame { fill: none; stroke: #999; }
svg .grid { stroke: #ddd; }
svg path { fill: none; stroke-width: 1.6; stroke-linejoin: round; }
svg path.raw { stroke-width: 1; }
"""


def render_html(runs: list, metrics: list[str], smoothing: float) -> str:
    legend = "".join(f'<span><i style="background:{COLORS[i % len(COLORS)]}"></i>{escape(run.label)}</span>'
                     for i, run in enumerate(runs))
    note = (f"smoothed (exponential moving average, weight {smoothing:g}) over the raw values (faint)"
            if smoothing > 0 else "raw values (no smoothing)")
    panels = "\n".join(render_panel(runs, metric, smoothing) for metric in metrics)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>accel plot</title>'
            f"<style>{STYLE}</style></head><body>\n<h1>Training curves</h1>\n"
            f'<p class="legend">{legend}</p>\n<p>{note}; x = step.</p>\n'
            f'<div class="panels">\n{panels}\n</div>\n</body></html>\n')
