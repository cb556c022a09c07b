"""One source of truth (issue 45): the config-key and CLI reference pages are generated from the config schema and the
argparse parsers (docs/gen_reference.py), and this fails when a committed page differs from what the code gives now.
Regenerate with `python docs/gen_reference.py`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_pages_are_current(gen):
    assert gen.stale() == [], "stale generated pages: run `python docs/gen_reference.py` and commit them"


def test_every_config_key_and_every_visible_flag_is_on_its_page(gen):
    from accel.cli.main import _subparsers, build_parser
    from accel.config.schema import AccelConfig

    config = gen.config_reference()
    for f in dataclasses.fields(AccelConfig):
        if "kind" in f.metadata:
            assert f"| `{f.name}`" in config, f.name
        elif f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(section := f.default_factory()):
            for sub in dataclasses.fields(section):
                if "kind" in sub.metadata:
                    assert f"| `{f.name}.{sub.name}`" in config, f"{f.name}.{sub.name}"
    cli = gen.cli_reference()
    for name, parser in _subparsers(build_parser()).items():
        assert f"## `accel {name}`" in cli, name
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS and action.dest != "help":
                assert f"`{action.option_strings[0]}`" in cli, (name, action.option_strings)


def test_a_stale_page_is_named(gen, tmp_path, monkeypatch):
    monkeypatch.setattr(gen, "DOCS", tmp_path)
    assert gen.main([]) == 0 and gen.stale() == []
    page = tmp_path / "config_reference.md"
    page.write_text(page.read_text().replace("total processes over all machines", "processes"))
    assert gen.stale() == ["docs/config_reference.md"]
    assert gen.main(["--check"]) == 1
