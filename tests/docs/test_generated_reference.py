"""One source of truth: the config-key and CLI reference pages are generated from the config schema and the
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


def test_the_accelerator_page_lists_each_documented_member_once_in_accelerates_order(gen):
    """docs/reference_accelerator.md: the class (its constructor) first, then prepare, the loop, saving and loading,
    tracking and the utilities, each documented member of Accelerator exactly once."""
    import re

    from accel.accelerator import Accelerator

    page = (ROOT / "docs" / "reference_accelerator.md").read_text()
    sections = re.findall(r"^## (.+)$", page, flags=re.M)
    assert sections[:6] == ["Construction", "Preparing", "The training loop", "Saving and loading",
                            "Experiment tracking", "Utilities"]
    members = re.findall(r"^::: accel\.accelerator\.Accelerator\.(\w+)$", page, flags=re.M)
    assert sorted(members) == sorted(gen.documented_members(Accelerator)) and len(set(members)) == len(members)
    order = {name: i for i, name in enumerate(members)}
    assert order["prepare"] < order["backward"] < order["accumulate"] < order["clip_grad_norm_"] < order["step"]
    assert order["step"] < order["save_state"] < order["load_state"] < order["init_trackers"] < order["free_memory"]
    assert page.index("::: accel.accelerator.Accelerator\n") < page.index("## Preparing")


def test_a_new_documented_member_lands_under_utilities_and_a_stale_name_fails(gen, monkeypatch):
    from accel.accelerator import Accelerator

    def shiny(self):
        """A new documented method."""

    monkeypatch.setattr(Accelerator, "shiny", shiny, raising=False)
    page = gen.accelerator_reference()
    assert page.index("## Utilities") < page.index("::: accel.accelerator.Accelerator.shiny") < page.index(
        "## Configuration objects")
    monkeypatch.setitem(gen.ACCELERATOR_SECTIONS, "Preparing", ["prepare", "prepare_everything"])
    with pytest.raises(SystemExit, match="prepare_everything"):
        gen.accelerator_reference()


def test_the_site_formats_long_signatures_and_hides_the_internal_base():
    """mkdocstrings formats a signature longer than line_length one argument a line only with ruff or black: the docs
    extra installs ruff; the Accelerator's internal mix-in is not shown as its base."""
    import tomllib

    import yaml

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    assert any(req.split("=")[0] in ("ruff", "black") for req in extras), extras
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))
    options = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]["options"]
    assert options["show_bases"] is False and options["separate_signature"] is True and options["line_length"] <= 100
