"""`accel plot`: draw every logged scalar of one or more runs against the step (one panel per metric, one line
per run).

Reads the run folders the trackers write (`<project>/run-<NNN>/metrics.jsonl` or `metrics.csv`, TensorBoard event
files) and writes a PNG/SVG/PDF with matplotlib (the `plot` extra) or one self-contained HTML page drawn without
it. Each run folder is its own line, labelled `<project>/run-<NNN>`; a project folder's own `metrics.jsonl` (the
single file older accels appended every run to) is one more line, labelled by the project; each event file of a
TensorBoard folder (Accelerate's tracker writes every run of a project into one folder) is one run, `<name>#<n>`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accel.cli._common import UsageError
from accel.cli.plot_style import COLORS, RAW_ALPHA, drawable, smooth, smoothing_for, title_for

FORMATS = ("png", "svg", "pdf", "html")
JSONL, CSV, EVENTS = "metrics.jsonl", "metrics.csv", "events.out.tfevents.*"
RUN_PREFIX = "run-"  # accel.tracking's run folders: <logging_dir>/<project_name>/run-<NNN>/
CSV_HEADER = ["step", "time", "name", "value"]
# matplotlib's tab10, shared by both renderers so a run has the same color in PNG and HTML
@dataclass
class Series:
    x: list = field(default_factory=list)
    y: list = field(default_factory=list)


@dataclass
class Run:
    path: Path
    source: str  # which file kind it was read from (JSONL, CSV or EVENTS)
    label: str = ""
    metrics: dict = field(default_factory=dict)  # name -> Series
    writer: int | None = None  # EVENTS with several event files in the folder: which one (one per SummaryWriter)


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plot",
        help="draw the logged metrics of one or more runs (PNG, SVG, PDF or one HTML page)",
        description="Draw every logged scalar against the step: one panel per metric, one line per run, "
        "smoothed (TensorBoard's exponential moving average) over the raw values drawn faint. A RUN_DIR holds "
        "metrics.jsonl, metrics.csv or TensorBoard event files, or is a folder of such run folders (a project "
        "folder of run-<NNN> folders, or a folder of projects). Runs are never joined: each run folder, and each "
        "event file of a TensorBoard folder, is its own line.",
        allow_abbrev=False,
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder, or a folder of run folders")
    parser.add_argument("-o", "--output", default="curves.png", metavar="PATH",
                        help="file to write (default: curves.png)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="png, svg, pdf (need matplotlib: pip install 'accel-train[plot]') or html "
                        "(one self-contained page); default: from the output's suffix")
    parser.add_argument("--smoothing", type=float, default=0.6, metavar="W",
                        help="EMA weight in [0, 1) as in TensorBoard (default: 0.6; 0 turns smoothing off)")
    parser.add_argument("--metrics", default=None, metavar="A,B",
                        help="comma-separated metric names to draw (default: every numeric metric)")
    parser.set_defaults(func=run_command)
    return parser


# ---------------------------------------------------------------- reading run folders

def _source_of(folder: Path) -> str | None:
    """The file kind a run folder is read from; one kind per folder, since trackers log the same values."""
    if (folder / JSONL).is_file():
        return JSONL
    if (folder / CSV).is_file():
        return CSV
    if any(p.is_file() for p in folder.glob(EVENTS)):
        return EVENTS
    return None


SEARCH_DEPTH = 3  # RUN_DIR, a project folder in it, a run-<NNN> folder in that


def _runs_in(folder: Path, depth: int = 0) -> list[tuple[Path, str]]:
    """The run folders under `folder`, each drawn on its own: the folder's own metrics.jsonl/csv (a log of older
    accels, where a project's runs shared one file) and every run folder below it (the trackers' `run-<NNN>/`). A
    TensorBoard folder (its runs: one per event file) counts unless jsonl/csv runs lie below it (accel's trackers
    write the same values there, one folder per run); its subfolders (add_scalars, add_hparams) belong to it."""
    source = _source_of(folder)
    subfolders = sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=_run_order)
    below = [] if depth >= SEARCH_DEPTH else [run for sub in subfolders for run in _runs_in(sub, depth + 1)]
    files = [run for run in below if run[1] != EVENTS]
    if source in (JSONL, CSV):
        return [(folder, source), *below]
    if source == EVENTS:
        return files or [(folder, source)]
    return below


def _run_number(name: str) -> int | None:
    digits = name[len(RUN_PREFIX):]
    return int(digits) if name.startswith(RUN_PREFIX) and digits.isdigit() else None


def _run_order(path: Path) -> tuple:
    """run-002 before run-010 (numbers compared as numbers), other names alphabetically."""
    number = _run_number(path.name)
    return (path.name, -1) if number is None else (RUN_PREFIX, number)


def _is_dir(path: Path) -> bool:
    """A folder; False for a name the OS refuses (a NUL byte, too long) too."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def find_runs(run_dirs: list[str]) -> list[Run]:
    """Each RUN_DIR is a run folder, a project folder of run folders, or a folder of those."""
    runs, seen = [], set()
    for arg in run_dirs:
        folder = Path(arg)
        if not arg or not _is_dir(folder):
            raise UsageError(f"RUN_DIR {arg}: no such folder")
        try:
            found = _runs_in(folder)
        except OSError as exc:  # a folder below it that cannot be listed
            raise UsageError(f"RUN_DIR {arg}: cannot read {exc.filename or 'it'} ({exc.strerror or exc})") from None
        if not found:
            raise UsageError(f"RUN_DIR {arg}: no {JSONL}, {CSV} or {EVENTS} in it nor in its subfolders")
        for path, kind in found:
            writers = len(_event_files(path)) if kind == EVENTS else 1
            for writer in range(writers) if writers > 1 else [None]:
                if (path.resolve(), writer) not in seen:
                    seen.add((path.resolve(), writer))
                    runs.append(Run(path=path, source=kind, writer=writer))
    _label(runs)
    return runs


def _name(path: Path) -> str:
    """A run's name: its folder's, with the project's before a trackers' run folder (`quickstart/run-002`)."""
    path = path.resolve()
    return path.name if _run_number(path.name) is None else f"{path.parent.name}/{path.name}"


def _label(runs: list[Run]) -> None:
    """A run is labelled by its name (`#<n>` after it for the n-th writer of a TensorBoard folder), or by its path
    where two runs share a name."""
    parts = ["" if run.writer is None else f"#{run.writer + 1}" for run in runs]  # runs of one TensorBoard folder
    names = [_name(run.path) + part for run, part in zip(runs, parts, strict=True)]
    for run, name, part in zip(runs, names, parts, strict=True):
        run.label = name if names.count(name) == 1 else str(run.path) + part


NON_FINITE = {"nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}
MAX_STEP = 2 ** 63 - 1  # TensorBoard's int64 step


def _number(value) -> float | None:
    """A loggable scalar as a float; None for strings, booleans and anything else not drawable. The jsonl
    tracker writes NaN and infinities as strings (JSON has no literal for them): those are numbers; so is an
    integer beyond a float's range (an infinity, drawn as a gap like them)."""
    if isinstance(value, str) and value.strip().lower() in NON_FINITE:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _step(text_or_int, where: str) -> float:
    """A logged step as the x value: an integer within TensorBoard's int64 steps."""
    if isinstance(text_or_int, str):
        try:
            text_or_int = int(text_or_int)
        except ValueError:
            raise UsageError(f"{where}: step {text_or_int[:40]!r} is not an integer (or empty)") from None
    if not -MAX_STEP - 1 <= text_or_int <= MAX_STEP:
        raise UsageError(f"{where}: step {str(text_or_int)[:40]}: out of range; allowed: an integer from "
                         f"{-MAX_STEP - 1} to {MAX_STEP} (or null)")
    return float(text_or_int)


def _flatten(values: dict, prefix: str = ""):
    """(name, value) of every leaf of a nested dict, `a/b` for {"a": {"b": ...}}; without recursion, so any
    depth json could read is fine."""
    stack = [(prefix, iter(values.items()))]
    while stack:
        base, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        name, value = item
        if isinstance(value, dict):
            stack.append((f"{base}{name}/", iter(value.items())))
        else:
            yield f"{base}{name}", value


def _decoded(raw: bytes, where: str, expected: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: not UTF-8 (byte {exc.start}); expected {expected} in UTF-8") from None


def _add(metrics: dict, name: str, x: float, value) -> None:
    number = _number(value)
    if number is not None:
        series = metrics.setdefault(name, Series())
        series.x.append(x)
        series.y.append(number)


def read_jsonl(path: Path) -> dict:
    """metrics.jsonl: one `{"step", "time", "values"}` object per log() call; x = step, else the call's index."""
    metrics: dict = {}
    expected = '{"step": int|null, "time": float, "values": {...}} per line'
    with open(path, "rb") as handle:
        for index, raw in enumerate(handle):
            where = f"{path}:{index + 1}"
            line = _decoded(raw, where, expected)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{where}: not a JSON line ({exc.msg}); expected {expected}") from None
            except RecursionError:
                raise UsageError(f"{where}: JSON nested too deeply; expected {expected}") from None
            step = record.get("step") if isinstance(record, dict) else None
            if (not isinstance(record, dict) or not isinstance(record.get("values"), dict)
                    or not (step is None or (isinstance(step, int) and not isinstance(step, bool)))):
                raise UsageError(f"{where}: expected an object with \"step\" (int or null) and \"values\" (object)")
            x = float(index) if step is None else _step(step, where)
            for name, value in _flatten(record["values"]):
                _add(metrics, name, x, value)
    return metrics


def read_csv(path: Path) -> dict:
    """metrics.csv, long format `step,time,name,value`; rows of one log() call share step and time."""
    metrics: dict = {}
    try:
        text = _decoded(path.read_bytes(), str(path), f"a csv file with the header {','.join(CSV_HEADER)}")
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header != CSV_HEADER:
            shown = ",".join(header or [])
            raise UsageError(f"{path}:1: header {shown[:80]!r}; expected {','.join(CSV_HEADER)!r}")
        call, last_key = -1, None
        for row in reader:
            if not row:
                continue
            where = f"{path}:{reader.line_num}"
            if len(row) != 4:
                raise UsageError(f"{where}: {len(row)} fields; expected 4 ({','.join(CSV_HEADER)})")
            step, time, name, value = row
            if (step, time) != last_key:
                call, last_key = call + 1, (step, time)
            x = _step(step, where) if step.strip() else float(call)
            try:
                number = float(value)
            except ValueError:
                continue  # a string value: not drawable
            _add(metrics, name, x, number)
    except csv.Error as exc:
        raise UsageError(f"{path}:{reader.line_num}: not csv ({exc}); expected the header "
                         f"{','.join(CSV_HEADER)} and rows of 4 fields") from None
    return metrics


def _scalars(folder: Path) -> dict:
    """tag -> Series of the event files directly in `folder` (or of that one event file), read with tensorboard's
    EventAccumulator."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError:
        raise UsageError(f"{folder}: reading TensorBoard event files needs tensorboard: "
                         "pip install 'accel-train[tensorboard]'") from None
    accumulator = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    try:
        accumulator.Reload()
    except Exception as exc:  # a damaged event file
        raise UsageError(f"{folder}: cannot read its TensorBoard event files ({exc})") from None
    metrics = {}
    for tag in accumulator.Tags().get(SCALARS, []):
        events = accumulator.Scalars(tag)
        metrics[tag] = Series([float(e.step) for e in events], [float(e.value) for e in events])
    return metrics


def _event_key(path: Path) -> tuple:
    """`events.out.tfevents.<time>.<host>.<pid>.<n>` (n counts a process's writers): (time, n, host.pid)."""
    parts = path.name.split(".")
    stamp, count = parts[3] if len(parts) > 4 else "", parts[-1]
    return (int(stamp) if stamp.isdigit() else 0, int(count) if count.isdigit() else 0, ".".join(parts[4:-1]))


def _event_files(folder: Path) -> list[Path]:
    """The event files directly in `folder`, oldest first: each is one SummaryWriter, so one run (Accelerate's
    TensorBoard tracker writes every run of a project into the same folder)."""
    return sorted((p for p in folder.glob(EVENTS) if p.is_file()), key=_event_key)


def _writer_of(event_file: Path, writers: list[Path]) -> int:
    """Which of a folder's writers made an add_scalars event file in its subfolder: the last one started before
    it, of the same process where there is one."""
    key = _event_key(event_file)
    same = [i for i, w in enumerate(writers) if _event_key(w)[2] == key[2]] or list(range(len(writers)))
    started = [i for i in same if _event_key(writers[i])[:2] <= key[:2]]
    return started[-1] if started else same[0]


def read_tensorboard(folder: Path, writer: int | None = None) -> dict:
    """The run folder's scalars, plus those SummaryWriter.add_scalars("a", {"b": ...}) puts in a subfolder
    `a_b` (tag "a"), named "a/b" as the jsonl tracker flattens the same dict. With `writer`, only that event
    file's run (a folder several runs wrote into: each drawn apart)."""
    writers = _event_files(folder) if writer is not None else []
    metrics = _scalars(folder) if writer is None else _scalars(writers[writer])
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and any(p.glob(EVENTS))):
        parts = [sub] if writer is None else [f for f in _event_files(sub) if _writer_of(f, writers) == writer]
        for part in parts:
            for tag, series in _scalars(part).items():
                prefix = f"{tag}_"
                name = f"{tag}/{sub.name[len(prefix):]}" if sub.name.startswith(prefix) else f"{sub.name}/{tag}"
                metrics.setdefault(name, series)
    return metrics


def load_runs(run_dirs: list[str]) -> list[Run]:
    runs = find_runs(run_dirs)
    for run in runs:
        if run.source == JSONL:
            run.metrics = read_jsonl(run.path / JSONL)
        elif run.source == CSV:
            run.metrics = read_csv(run.path / CSV)
        else:
            run.metrics = read_tensorboard(run.path, run.writer)
    return runs


def choose_metrics(runs: list[Run], wanted: str | None) -> list[str]:
    """The panels: every numeric metric (sorted), or those `--metrics` names, in its order."""
    available = sorted({name for run in runs for name in run.metrics})
    if not available:
        raise UsageError(f"no numeric metrics in {', '.join(str(run.path) for run in runs)}")
    if wanted is None:
        return available
    names = [name.strip() for name in wanted.split(",") if name.strip()]
    if not names:
        raise UsageError(f"--metrics {wanted!r}: no metric names; logged: {', '.join(available)}")
    for name in names:
        if name not in available:
            raise UsageError(f"--metrics: unknown metric {name!r}; logged numeric metrics: {', '.join(available)}")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------- smoothing

# ---------------------------------------------------------------- matplotlib figure

def _literal(text: str) -> str:
    """A metric or run name as matplotlib draws it literally: `$` would start its math mode (a name like
    `loss$x^` cannot be parsed)."""
    return text.replace("$", r"\$")


def _grid(count: int) -> tuple[int, int]:
    cols = min(3, count)
    return math.ceil(count / cols), cols


def build_figure(runs: list[Run], metrics: list[str], smoothing: float):
    """A matplotlib Figure (Agg canvas, never a GUI) with one panel per metric; each run is a faint raw line
    (gid `raw:<label>`) under its smoothed line (gid `smoothed:<label>`), or only the raw line at smoothing 0 and
    for a schedule such as the learning rate (`smoothing_for`)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("png, svg and pdf output need matplotlib: pip install 'accel-train[plot]' "
                         "(or write --format html, which does not)") from None
    rows, cols = _grid(len(metrics))
    fig = Figure(figsize=(4.6 * cols, 3.2 * rows + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    handles: dict[str, Any] = {}  # run label -> its first line (matplotlib's Line2D)
    for ax, metric in zip(axes, metrics, strict=False):  # the grid may have more axes than metrics
        ax.set_title(_literal(title_for(metric)))
        weight = smoothing_for(metric, smoothing)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        for index, run in enumerate(runs):
            series = run.metrics.get(metric)
            if series is None:
                continue
            color, ys = COLORS[index % len(COLORS)], drawable(series.y)
            if weight > 0:
                ax.plot(series.x, ys, color=color, alpha=RAW_ALPHA, linewidth=1,
                        label=f"_raw {run.label}", gid=f"raw:{run.label}")
                (line,) = ax.plot(series.x, smooth(ys, weight), color=color, linewidth=1.6,
                                  label=_literal(run.label), gid=f"smoothed:{run.label}")
            else:
                (line,) = ax.plot(series.x, ys, color=color, linewidth=1.4,
                                  label=_literal(run.label), gid=f"raw:{run.label}")
            handles.setdefault(run.label, line)
    for ax in axes[len(metrics):]:
        ax.remove()
    order = [run.label for run in runs if run.label in handles]
    fig.legend([handles[label] for label in order], [_literal(label) for label in order], loc="outside upper center",
               ncols=min(len(handles), 4), frameon=False)
    return fig


# ---------------------------------------------------------------- the command

def output_format(output: Path, chosen: str | None) -> str:
    if chosen:
        return chosen
    suffix = output.suffix.lower().lstrip(".")
    if suffix == "htm":
        return "html"
    if suffix not in FORMATS:
        raise UsageError(f"-o {output}: cannot tell the format from the suffix {output.suffix or '(none)'!r}; "
                         f"use .png, .svg, .pdf or .html, or pass --format {{{','.join(FORMATS)}}}")
    return suffix


def check_output(output: Path) -> None:
    parent = output.parent if str(output.parent) else Path(".")
    if "\x00" in str(output):
        raise UsageError(f"-o {str(output)!r}: a NUL character; expected a file path")
    try:
        if output.is_dir():
            raise UsageError(f"-o {output}: is a folder; expected a file path")
        if not parent.is_dir():
            raise UsageError(f"-o {output}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK) or (output.exists() and not os.access(output, os.W_OK)):
            raise UsageError(f"-o {output}: not writable")
    except OSError as exc:  # a name the OS refuses (too long, ...)
        raise UsageError(f"-o {str(output)[:80]}: not a usable file path ({exc.strerror or exc})") from None


def write_plot(runs: list[Run], metrics: list[str], smoothing: float, output: Path, fmt: str) -> None:
    try:
        if fmt == "html":
            from accel.cli.plot_html import render_html

            output.write_text(render_html(runs, metrics, smoothing), encoding="utf-8")
        else:
            build_figure(runs, metrics, smoothing).savefig(output, format=fmt, dpi=100)
    except OSError as exc:
        raise UsageError(f"-o {output}: cannot write it ({exc.strerror or exc})") from None


def run_command(args: argparse.Namespace) -> int:
    if not 0 <= args.smoothing < 1:
        raise UsageError(f"--smoothing {args.smoothing}: must be >= 0 and < 1 (0 turns smoothing off)")
    output = Path(args.output)
    fmt = output_format(output, args.format)
    check_output(output)
    runs = load_runs(args.run_dirs)
    metrics = choose_metrics(runs, args.metrics)
    write_plot(runs, metrics, args.smoothing, output, fmt)
    print(f"accel plot: wrote {output} ({len(metrics)} metric(s), {len(runs)} run(s): "
          f"{', '.join(run.label for run in runs)})")
    return 0
