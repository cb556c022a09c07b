"""`accel plot`: run folders in the shared format (written by hand here) drawn as matplotlib figures or HTML.

The figure is checked through its axes and Line2D data before saving, never through pixels."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from accel.cli import main as cli_main
from accel.cli import plot

LOSS_A = [4.0, 2.0, 3.0, 1.0]


def _jsonl_run(folder: Path) -> None:
    """alpha: jsonl with numbers, a string, a nested dict and one log() call without a step."""
    folder.mkdir(parents=True)
    records = [{"step": i * 10, "time": 100.0 + i, "values": {"loss": v, "lr": 0.1 / (i + 1), "phase": "train"}}
               for i, v in enumerate(LOSS_A)]
    records.append({"step": None, "time": 200.0, "values": {"eval": {"acc": 0.9}, "grad_norm": "nan"}})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "config.json").write_text('{"lr": 0.1}')


def _csv_run(folder: Path) -> None:
    """beta: long csv; the last call has an empty step, so x is that call's index (2)."""
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text(
        "step,time,name,value\n0,1.0,loss,5.0\n0,1.0,lr,0.2\n0,1.0,note,hello\n"
        "5,2.0,loss,4.0\n5,2.0,lr,0.1\n,3.0,loss,3.5\n")


def _tensorboard_run(folder: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder))
    for step, value in [(0, 6.0), (2, 5.0), (4, 4.5)]:
        writer.add_scalar("loss", value, step)
    writer.add_scalars("eval", {"acc": 0.5}, 4)  # a subfolder eval_acc with tag "eval"
    writer.add_hparams({"lr": 0.1}, metric_dict={})  # a subfolder without scalars
    writer.close()


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    _jsonl_run(root / "runs" / "alpha")
    _csv_run(root / "runs" / "beta")
    _tensorboard_run(root / "tb" / "gamma")
    return root


def _lines(ax) -> dict:
    return {line.get_gid(): line for line in ax.get_lines()}


def test_smooth_is_tensorboards_debiased_ema():
    # by hand, weight 0.5: last = 0.5, 0.25 + 1.5, 0.875 + 1.0; divided by 1 - 0.5**n
    assert plot.smooth([1.0, 3.0, 2.0], 0.5) == pytest.approx([1.0, 1.75 / 0.75, 1.875 / 0.875])
    assert plot.smooth([1.0, 3.0, 2.0], 0.0) == [1.0, 3.0, 2.0]
    assert plot.smooth([2.0, 2.0, 2.0], 0.9) == [2.0, 2.0, 2.0]  # constant: left as is, like TensorBoard
    nan_kept = plot.smooth([1.0, float("nan"), 3.0], 0.5)
    assert nan_kept[0] == 1.0 and nan_kept[1] != nan_kept[1] and nan_kept[2] == pytest.approx(1.75 / 0.75)


def test_reads_jsonl_csv_and_tensorboard(logs):
    runs = plot.load_runs([str(logs / "runs"), str(logs / "tb" / "gamma")])
    by_label = {run.label: run for run in runs}
    assert list(by_label) == ["alpha", "beta", "gamma"]
    alpha, beta, gamma = by_label["alpha"].metrics, by_label["beta"].metrics, by_label["gamma"].metrics
    assert sorted(alpha) == ["eval/acc", "grad_norm", "loss", "lr"]  # "phase" skipped, the dict flattened
    assert (alpha["loss"].x, alpha["loss"].y) == ([0.0, 10.0, 20.0, 30.0], LOSS_A)
    assert (alpha["eval/acc"].x, alpha["eval/acc"].y) == ([4.0], [0.9])  # step null: the call's index
    assert alpha["grad_norm"].y[0] != alpha["grad_norm"].y[0]  # "nan", as the jsonl tracker writes NaN
    assert sorted(beta) == ["loss", "lr"]
    assert (beta["loss"].x, beta["loss"].y) == ([0.0, 5.0, 2.0], [5.0, 4.0, 3.5])
    assert (gamma["loss"].x, gamma["loss"].y) == ([0.0, 2.0, 4.0], [6.0, 5.0, 4.5])
    assert (gamma["eval/acc"].x, gamma["eval/acc"].y) == ([4.0], [0.5])  # add_scalars' subfolder eval_acc
    assert sorted(gamma) == ["eval/acc", "loss"]


def test_figure_has_a_panel_per_metric_and_a_raw_and_smoothed_line_per_run(logs):
    runs = plot.load_runs([str(logs / "runs"), str(logs / "tb" / "gamma")])
    metrics = plot.choose_metrics(runs, None)
    fig = plot.build_figure(runs, metrics, 0.6)
    assert [ax.get_title() for ax in fig.axes] == ["eval/acc", "grad_norm", "loss", "lr"]
    loss = _lines(fig.axes[2])
    assert sorted(loss) == sorted(f"{kind}:{run}" for kind in ("raw", "smoothed") for run in ("alpha", "beta", "gamma"))
    assert list(loss["raw:alpha"].get_xdata()) == [0, 10, 20, 30]
    assert list(loss["raw:alpha"].get_ydata()) == LOSS_A
    expected, last = [], 0.0
    for n, value in enumerate(LOSS_A, start=1):  # hand-computed debiased EMA, weight 0.6
        last = 0.6 * last + 0.4 * value
        expected.append(last / (1 - 0.6 ** n))
    assert list(loss["smoothed:alpha"].get_ydata()) == pytest.approx(expected)
    assert list(loss["smoothed:gamma"].get_xdata()) == [0, 2, 4]
    assert loss["raw:beta"].get_alpha() == plot.RAW_ALPHA and loss["smoothed:beta"].get_alpha() is None
    assert loss["raw:beta"].get_color() == loss["smoothed:beta"].get_color() != loss["smoothed:alpha"].get_color()
    lr = _lines(fig.axes[3])  # a schedule: drawn as it is, never smoothed (a smoothed lr lags the real one)
    assert sorted(lr) == ["raw:alpha", "raw:beta"]
    assert list(lr["raw:alpha"].get_ydata()) == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025])
    assert lr["raw:alpha"].get_alpha() is None  # drawn full, not faint
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["alpha", "beta", "gamma"]


@pytest.mark.parametrize("metric", ["lr", "train/lr", "lr_group_0", "lr-AdamW", "lr0", "learning_rate",
                                    "LearningRate", "epoch", "train/epoch", "global_step", "momentum", "weight_decay"])
def test_schedules_are_not_smoothed(metric):
    assert plot.smoothing_for(metric, 0.6) == 0.0


@pytest.mark.parametrize("metric", ["loss", "train/loss", "eval/accuracy", "grad_norm", "clr_loss", "layer_norm",
                                    "steps_per_second", "tokens_per_step"])
def test_measurements_are_smoothed(metric):
    assert plot.smoothing_for(metric, 0.6) == 0.6


def test_html_draws_a_schedule_raw(logs):
    from accel.cli.plot_html import render_panel

    runs = plot.load_runs([str(logs / "runs")])
    assert 'class="raw"' not in render_panel(runs, "lr", 0.6) and 'class="raw"' in render_panel(runs, "loss", 0.6)


def test_metrics_flag_and_smoothing_zero_give_one_raw_line_per_run(logs):
    runs = plot.load_runs([str(logs / "runs")])
    fig = plot.build_figure(runs, plot.choose_metrics(runs, "lr, loss"), 0.0)
    assert [ax.get_title() for ax in fig.axes] == ["lr", "loss"]
    assert sorted(_lines(fig.axes[1])) == ["raw:alpha", "raw:beta"]
    assert list(_lines(fig.axes[1])["raw:beta"].get_ydata()) == [5.0, 4.0, 3.5]


def test_clashing_run_names_are_labelled_by_path(tmp_path):
    _jsonl_run(tmp_path / "a" / "run")
    _jsonl_run(tmp_path / "b" / "run")
    runs = plot.load_runs([str(tmp_path / "a"), str(tmp_path / "b" / "run"), str(tmp_path / "b" / "run")])
    assert [run.label for run in runs] == [str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]


def test_cli_writes_a_png(run_accel, logs, tmp_path):
    out = tmp_path / "curves.png"
    result = run_accel("plot", logs / "runs", logs / "tb" / "gamma", "-o", out)
    assert result.returncode == 0, result.stderr
    assert "4 metric(s), 3 run(s)" in result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_is_one_self_contained_page(logs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # html needs no matplotlib
    out = tmp_path / "curves.html"
    assert cli_main.main(["plot", str(logs / "runs"), str(logs / "tb" / "gamma"), "-o", str(out)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["curves.html"]
    page = out.read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page and "src=" not in page
    assert page.count("<svg") == 4
    for name in ("eval/acc", "grad_norm", "loss", "lr", "alpha", "beta", "gamma"):
        assert f">{name}<" in page or f'"{name}"' in page, name
    assert page.count('class="smoothed"') == 8  # a main line per run and panel: 2+1+3+2
    assert page.count('class="raw"') == 6  # and a faint raw one under it, but for the lr panel (a schedule)


@pytest.mark.parametrize("case, expected", [
    ("missing", "RUN_DIR {tmp}/nope: no such folder"),
    ("empty", "RUN_DIR {tmp}/empty: no metrics.jsonl, metrics.csv"),
    ("damaged", "{tmp}/bad/metrics.jsonl:2: not a JSON line"),
    ("unknown_metric", "--metrics: unknown metric 'acc'; logged numeric metrics: eval/acc, grad_norm, loss, lr"),
    ("unwritable", "-o {tmp}/no/dir/c.png: folder {tmp}/no/dir does not exist"),
    ("suffix", "-o {tmp}/c.txt: cannot tell the format"),
    ("smoothing", "--smoothing 1.0: must be >= 0 and < 1"),
])
def test_bad_input_is_one_line_exit_2(run_accel, logs, tmp_path, case, expected):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 0, "time": 1, "values": {"loss": 1}}\n{"step": 1, "ti\n')
    good, out = str(logs / "runs"), str(tmp_path / "c.png")
    args = {"missing": [tmp_path / "nope", "-o", out], "empty": [tmp_path / "empty", "-o", out],
            "damaged": [tmp_path / "bad", "-o", out], "unknown_metric": [good, "--metrics", "loss,acc", "-o", out],
            "unwritable": [good, "-o", tmp_path / "no" / "dir" / "c.png"], "suffix": [good, "-o", tmp_path / "c.txt"],
            "smoothing": [good, "--smoothing", "1", "-o", out]}[case]
    result = run_accel("plot", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("accel plot: error: " + expected.format(tmp=tmp_path)), result.stderr
    assert not (tmp_path / "c.png").exists()


@pytest.mark.parametrize("missing, extra, target", [("matplotlib", "accel-train[plot]", "runs"),
                                                     ("tensorboard", "accel-train[tensorboard]", "tb")])
def test_missing_optional_package_names_the_extra(logs, tmp_path, capsys, monkeypatch, missing, extra, target):
    monkeypatch.setitem(sys.modules, missing, None)
    for name in [m for m in sys.modules if m.startswith(missing + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert cli_main.main(["plot", str(logs / target), "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pip install '{extra}'" in err, err
