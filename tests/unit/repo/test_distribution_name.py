"""The package index's `accel` is another project (ACCeL, computational chemistry): accel installs as `accel-train`
(the import name and the `accel` command stay). Every install line for an extra, in messages, docs and scripts, must
name that distribution, or users would install the wrong software."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EXTRA = re.compile(r"""(?<![\w.-])([A-Za-z][\w.-]*)\[([a-z0-9_,-]+)\]""")  # name[extra] as pip takes it
SCANNED = ("accel", "docs", "examples", "benchmarks", ".ci", "README.md", "CHANGELOG.md")
OTHERS = {"ray", "torch", "transformers", "accelerate", "jax", "sentence-transformers", "diffusers", "peft"}


def distribution() -> tuple[str, set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["name"], set(project["optional-dependencies"])


def test_the_distribution_is_accel_train_and_keeps_the_accel_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "accel-train"
    assert project["scripts"]["accel"] == "accel.cli.main:main"


def test_every_extra_named_anywhere_is_ours_under_our_distribution_name():
    name, extras = distribution()
    wrong = []
    for top in SCANNED:
        paths = [ROOT / top] if (ROOT / top).is_file() else (ROOT / top).rglob("*")
        for path in paths:
            if not path.is_file() or path.suffix not in ("", ".py", ".md", ".yml", ".yaml", ".toml", ".txt", ".sh"):
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if "install" not in line and "extra" not in line and "`" not in line:
                    continue
                for dist, extra in EXTRA.findall(line):
                    if dist in OTHERS or not {e.strip() for e in extra.split(",")} & extras:
                        continue  # another package's extra, or an index/slice like x[0]
                    if dist != name:
                        wrong.append(f"{path.relative_to(ROOT)}:{number}: {dist}[{extra}]")
    assert not wrong, "\n".join(wrong)


def test_a_missing_extra_names_the_distribution(monkeypatch):
    from accel.fault_tolerance import MISSING_TORCHFT
    from accel.runtime.float8 import INSTALL

    assert "pip install 'accel-train[ft]'" in MISSING_TORCHFT
    assert INSTALL.startswith("pip install 'accel-train[fp8]'")
