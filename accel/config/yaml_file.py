"""Reading a YAML config file strictly: every way a file can be unreadable is one ConfigError naming it.

PyYAML's `safe_load` takes a duplicated key silently (the last one wins) and an empty file as `None`; both hide a
mistake, so a config file must be UTF-8 text holding a mapping with each key once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from accel.config.schema import ConfigError


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (at any depth)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if first is not None:
                where = f"lines {first} and {line}" if first != line else f"line {line}"
                raise ConfigError(f"{self.name}: key {key!r} appears twice ({where}); allowed: each key once")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; allowed: a YAML config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          "allowed: a YAML config file saved as UTF-8") from None


def load_yaml_file(path: Path) -> Any:
    """The parsed contents of `path` (a mapping, or whatever the file holds for the caller to refuse); ConfigError
    for a missing, unreadable, non-UTF-8, invalid, empty or duplicate-key file."""
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    text = _text(path)
    try:
        loader = UniqueKeyLoader(text)
        loader.name = str(path)
        try:
            raw = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if raw is None:
        raise ConfigError(f"{path}: the config file is empty (no keys); allowed: a YAML mapping such as "
                          "'num_processes: 2', or delete the file")
    return raw
