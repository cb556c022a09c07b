"""Reading a YAML config file strictly: every way a file can be unreadable is one ConfigError naming it.

PyYAML's `safe_load` takes a duplicated key silently (the last one wins) and an empty file as `None`; both hide a
mistake, so a config file must be UTF-8 text (a BOM is fine) holding a mapping with each key once. Nesting deeper than
MAX_NESTING levels, a number or date no Python type can hold, and bytes that are not UTF-8 are refused in one line too
(not a RecursionError or ValueError traceback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from accel.config.errors import MAX_NESTING, ConfigError, shown
from accel.config.text_file import read_text


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (at any depth) and nesting deeper than
    MAX_NESTING levels."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                mark = self.peek_event().start_mark
                raise ConfigError(f"{self.name}: nested more than {MAX_NESTING} levels deep (line {mark.line + 1}); "
                                  f"allowed: at most {MAX_NESTING} levels of lists and mappings")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except ConfigError:
            raise
        except (ValueError, OverflowError) as exc:  # a date like 2001-13-45, an integer of 5000 digits
            problem = " ".join(str(exc).split(";")[0].split())[:160]
            raise ConfigError(f"{self.name}: not valid YAML at line {node.start_mark.line + 1}: {shown(node.value)} "
                              f"is no number or date Python can hold ({problem}); allowed: a YAML config file of keys "
                              "and values") from None

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


def load_yaml_file(path: Path) -> Any:
    """The parsed contents of `path` (a mapping, or whatever the file holds for the caller to refuse); ConfigError
    for a missing, unreadable, non-UTF-8, invalid, too deeply nested, empty or duplicate-key file."""
    text = read_text(path, "config file", "a YAML config file")
    try:
        loader = UniqueKeyLoader(text)
        loader.name = str(path)
        try:
            raw = loader.get_single_data()
        finally:
            loader.dispose()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; allowed: at most {MAX_NESTING} levels of lists and "
                          "mappings") from None
    except (ValueError, OverflowError) as exc:  # construct_object names the line; this is a last resort
        problem = " ".join(str(exc).split(";")[0].split())[:160]
        raise ConfigError(f"{path}: not valid YAML: {problem}; allowed: a YAML config file of keys and "
                          "values") from None
    if raw is None:
        raise ConfigError(f"{path}: the config file is empty (no keys); allowed: a YAML mapping such as "
                          "'num_processes: 2', or delete the file")
    return raw
