"""The fenced code blocks of README.md and docs/**/*.md, and the convention that says which of them run.

Every python/bash/sh/shell/console block runs (tests/docs/test_doc_blocks.py), unless the line right before its
opening fence is `<!-- not-run: <reason> -->`. A block of any language after `<!-- file: NAME -->` is written to NAME
in the page's folder (before the blocks after it run) instead of being run itself, so a later shell block can launch
it. Every yaml block is read as an accel config file (Accelerate's and accel's keys), unless marked not-run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell", "console": "console"}
CONFIG = {"yaml", "yml"}
MARKER = re.compile(r"^\s*<!--\s*(not-run|file):\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "not-run" or "file"
    value: str  # the reason or the file name

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = len(match["indent"]), match["fence"], match["info"].lower()
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][indent:] if not indent or lines[j][:indent].isspace() else lines[j].lstrip())
            j += 1
        marker = MARKER.match(lines[i - 1]) if i else None
        found.append(Block(path, i + 1, lang, "\n".join(body) + "\n", marker[1] if marker else None,
                           marker[2] if marker else ""))
        i = j + 1
    return found
