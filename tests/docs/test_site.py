"""The documentation site: `mkdocs build --strict` succeeds (a broken link, anchor or API reference fails
it), every section that left the README is reachable from the home page in two clicks, and a few pages open in
headless Chromium with no console error or failed load (screenshots under $ACCEL_DOCS_SCREENSHOTS when set).

Needs the docs extra (`pip install -e ".[docs]"`): .ci/docs installs it and runs this file."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest
from chromium import Browser, find

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                reason="the docs extra is not installed (pip install -e '.[docs]'); .ci/docs runs this")

# The README's sections before the site -> the heading they have on the site now (None: the same words). SLURM and
# Kubernetes are docs/clusters.md's; several machines and the hostfile stay in docs/launching.md.
MOVED = {
    "Set-up": "Install",
    "The three lines": None,
    "Configuration": None,
    "`accel launch`": "Launching: accel launch",
    "Several machines": None,
    "A cluster from a hostfile": None,
    "Under SLURM": "SLURM",
    "In Kubernetes: Kubeflow Trainer, PyTorchJob": "Kubernetes: Kubeflow Trainer and PyTorchJob",
    "The Accelerator": "The Accelerator: the API in your loop",
    "Data": None,
    "Mixed precision": "Mixed precision and fp8",
    "What is built on Accelerate: transformers' Trainer, PEFT, `from_pretrained`":
        "Trainer, PEFT, TRL and other libraries through the shim",
    "How much memory will training take? `accel estimate-memory`":
        "Memory and layout: accel estimate-memory and accel plan",
    "Which layout? `accel plan`": None,
    "ZeRO: sharded data parallelism": None,
    "Tensor parallelism": None,
    "Long sequences": "Long sequences: sequence and context parallelism",
    "Mixture of experts (expert parallelism)": None,
    "The recipe: what is done to the model, in which order": None,
    "torch.compile": None,
    "Activation checkpointing": None,
    "Pipeline parallelism": None,
    "Big models: device_map and offload": "Big models: device_map, CPU and disk offload",
    "Experiment tracking, logging, progress and plots": None,
    "Throughput and MFU while training": None,
    "Plotting training curves": None,
    "Checkpoints": "Checkpoints and resume",
    "Weights: `save_model` and `load_checkpoint_in_model`": None,
    "Training state: `save_state` and `load_state`": None,
    "Asynchronous saves: the loop waits only where the next step would overwrite the copy": None,
    "A save when the job is preempted": None,
    "One model file from a sharded checkpoint: `accel merge-weights`": None,
    "When things go wrong": "Troubleshooting",
    "A bad flag, config file or script": None,
    "A hang": None,
    "A worker dies: restart the group and continue": None,
    "Preemption (SLURM, Kubernetes)": None,
    "A host fails, or a rank you filtered out": None,
    "A save or a load fails": None,
    "Exit codes": None,
    "Architecture": "The folders",
    "Tests and benchmarks": None,
    "GPU jobs and the collective-device check": None,
}
LOOKED_AT = ["", "getting_started/", "concepts/", "config_reference/", "reference_accelerator/", "troubleshooting/"]
# the search box, typed into as a reader would: the number of results, after Material's search worker answers
SEARCH = """new Promise(resolve => {
  const input = document.querySelector('input.md-search__input');
  input.focus(); input.value = 'preemption_requested';
  input.dispatchEvent(new Event('input', {bubbles: true}));
  input.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true}));
  let waited = 0;
  const poll = setInterval(() => {
    const found = document.querySelectorAll('.md-search-result__item').length;
    if (found || ++waited > 100) { clearInterval(poll); resolve(found); }
  }, 100);
})"""


def _words(text: str) -> str:
    return " ".join(text.replace("`", "").replace("¶", "").split())


class _Page(HTMLParser):
    """The headings of a built page, and the links of its content (the article: not the navigation)."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.links: list[str] = []
        self._heading: list[str] | None = None
        self._article = 0

    def handle_starttag(self, tag, attrs):
        if tag == "article":
            self._article += 1
        if re.fullmatch(r"h[1-6]", tag):
            self._heading = []
        if tag == "a" and self._article and (href := dict(attrs).get("href")):
            self.links.append(href)

    def handle_endtag(self, tag):
        if tag == "article":
            self._article -= 1
        if re.fullmatch(r"h[1-6]", tag) and self._heading is not None:
            self.headings.append(_words("".join(self._heading)))
            self._heading = None

    def handle_data(self, data):
        if self._heading is not None:
            self._heading.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _file(site: Path, url: str) -> Path | None:
    path = site / urlparse(url).path.lstrip("/")
    if path.is_dir() or not path.suffix:
        path = path / "index.html"
    return path if path.is_file() else None


def test_every_moved_readme_section_is_two_clicks_from_home(site):
    reached: dict[str, list[str]] = {}  # page url -> its headings
    frontier = [""]
    for _click in range(3):  # the home page, then two clicks
        following = []
        for url in frontier:
            if url in reached or (path := _file(site, url)) is None:
                continue
            page = _parse(path)
            reached[url] = page.headings
            base = urljoin("http://site/" + url, ".")
            for href in page.links:
                target = urlparse(urljoin(base, href))
                if target.netloc == "site":
                    following.append(target.path.lstrip("/"))
        frontier = following
    headings = {h for page in reached.values() for h in page}
    missing = [old for old, new in MOVED.items() if _words(new or old) not in headings]
    assert not missing, f"not within two clicks of the home page: {missing}"


def test_the_api_reference_and_the_search_index_are_built(site):
    api = (site / "reference_accelerator" / "index.html").read_text()
    for name in ("prepare", "backward", "save_state", "load_state", "gather_for_metrics"):
        assert f'id="accel.accelerator.Accelerator.{name}"' in api, name
    index = json.loads((site / "search" / "search_index.json").read_text())
    text = " ".join(doc["text"] for doc in index["docs"])
    assert "preemption_requested" in text and "zero_stage" in text


def test_the_api_page_is_in_accelerates_order_with_a_wrapped_signature_and_no_internal_base(site):
    import html

    api = (site / "reference_accelerator" / "index.html").read_text()
    ids = re.findall(r'id="accel\.accelerator\.Accelerator(?:\.(\w+))?"', api)
    assert ids[0] == "" and ids.index("prepare") < ids.index("backward") < ids.index("step") < ids.index("save_state")
    assert "Bases:" not in api and "AccelerateMembers" not in api
    signature = re.search(r'<div class="doc-signature highlight"><pre><span></span><code>(.*?)</code>', api, re.S)
    lines = html.unescape(re.sub(r"<[^>]+>", "", signature.group(1))).splitlines()
    assert lines[0] == "Accelerator(" and len(lines) > 10 and max(map(len, lines)) <= 100, lines


@pytest.mark.skipif(find() is None, reason="no Chromium here (apt-get install chromium; .ci/run installs it)")
def test_pages_open_without_console_errors(site, tmp_path):
    shots = Path(os.environ.get("ACCEL_DOCS_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # no line per request in the test's output
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    problems = {}
    try:
        with Browser(find()) as browser:  # type: ignore[arg-type]
            for url in LOOKED_AT:
                page = browser.open(f"http://127.0.0.1:{server.server_address[1]}/{url}")
                title = page.evaluate("document.querySelector('article h1') && "
                                      "document.querySelector('article h1').textContent")
                assert title, url
                if not url:
                    assert page.evaluate(SEARCH) >= 2  # the API reference and the preemption page at least
                page.screenshot(shots / f"site_{url.strip('/') or 'index'}.png", full_page=False)
                problems[url] = page.problems()
    finally:
        server.shutdown()
    assert problems == {url: [] for url in LOOKED_AT}
