"""`accel plot --format html` as a reader sees it: the page opened in headless Chromium shows one panel
per metric, each with a drawn line, and no console error, uncaught exception or failed load. A screenshot is kept
under $ACCEL_DOCS_SCREENSHOTS when that is set (else in the test's temporary folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chromium import Browser, find

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = find()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium here (apt-get install chromium; .ci/run installs it, so CI runs this)")

# each <svg> of the page's panels: its metric, its size on screen, and how many of its paths were drawn with a size
PANELS = """Array.from(document.querySelectorAll('.panels svg')).map(svg => ({
  metric: svg.getAttribute('aria-label'),
  width: svg.getBoundingClientRect().width,
  drawn: Array.from(svg.querySelectorAll('path')).filter(p => {
    const box = p.getBBox(); return p.getTotalLength() > 0 && (box.width > 0 || box.height > 0); }).length,
}))"""


def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("ACCEL_DOCS_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def looked_at(url: str, screenshot: Path) -> tuple[list[str], list[dict]]:
    """The page's problems and its panels, with a screenshot."""
    assert CHROMIUM is not None
    with Browser(CHROMIUM) as browser:
        page = browser.open(url)
        panels = page.evaluate(PANELS)
        page.screenshot(screenshot)
        return page.problems(), panels


def empty(panels: list[dict]) -> list[str]:
    return [p["metric"] for p in panels if not p["drawn"] or p["width"] < 50]


@needs_chromium
def test_the_plot_page_of_real_runs_has_no_console_error_and_no_empty_panel(isolated_env, tmp_path):
    runs = tmp_path / "runs"
    env = {**isolated_env, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--epochs", "2", "--project_dir",
                    str(runs)], env=env, check=True, capture_output=True, timeout=300)
    # a second run in the same project, with a gap (nan) and a metric only it has
    extra = runs / "quickstart" / "run-002"
    extra.mkdir()
    with open(extra / "metrics.jsonl", "w") as fh:
        for step in range(40):
            loss = float("nan") if step == 20 else 5.0 / (step + 1)
            fh.write(json.dumps({"step": step, "time": 0.0, "values": {"loss": loss, "accuracy": step / 40}}) + "\n")
    page = tmp_path / "curves.html"
    done = subprocess.run([sys.executable, "-m", "accel.cli.main", "plot", str(runs), "-o", str(page)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    problems, panels = looked_at(page.as_uri(), shots(tmp_path) / "accel_plot.png")
    assert problems == []
    assert sorted(p["metric"] for p in panels) == ["accuracy", "loss", "lr"]
    assert empty(panels) == []
    loss = next(p for p in panels if p["metric"] == "loss")
    assert loss["drawn"] >= 4  # two runs, each raw and smoothed


@needs_chromium
def test_the_check_sees_an_empty_panel_and_a_console_error(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><div class="panels">'
                    '<svg aria-label="loss" width="440" height="290"><path d="M10,10L200,100"/></svg>'
                    '<svg aria-label="lr" width="440" height="290"><path d=""/></svg></div>'
                    '<script>console.error("boom"); undefined_function();</script></body></html>')
    problems, panels = looked_at(page.as_uri(), tmp_path / "broken.png")
    assert empty(panels) == ["lr"]
    assert [p.split(":")[0] for p in problems] == ["console.error", "uncaught"]
