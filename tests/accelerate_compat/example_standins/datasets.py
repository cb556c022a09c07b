"""Test fixture, not part of accel: a stand-in for the `datasets` package with just what Accelerate's examples use
(`load_dataset("nyu-mll/glue", "mrpc")`, `DatasetDict`, `Dataset.map/rename_column/select`), reading the synthetic
GLUE-MRPC-shaped rows that tests/accelerate_compat/examples_harness.py writes into mrpc.json beside this file. It is
put on the examples' PYTHONPATH (never on accel's) so they run offline, the same way under accel and Accelerate."""

from __future__ import annotations

import json
from pathlib import Path

__version__ = "0.0.0+standin"


class Dataset:
    def __init__(self, columns: dict[str, list]):
        self._columns = {name: list(values) for name, values in columns.items()}

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    def __len__(self) -> int:
        return len(next(iter(self._columns.values()), []))

    def __getitem__(self, key):
        if isinstance(key, str):
            return list(self._columns[key])
        return {name: values[key] for name, values in self._columns.items()}

    def map(self, function, batched: bool = False, remove_columns=None, **_):
        if batched:
            new = dict(function({name: list(values) for name, values in self._columns.items()}))
        else:
            rows = [dict(function(self[i])) for i in range(len(self))]
            new = {name: [row[name] for row in rows] for name in (rows[0] if rows else {})}
        drop = set([remove_columns] if isinstance(remove_columns, str) else remove_columns or ())
        columns = {name: values for name, values in self._columns.items() if name not in drop}
        columns.update({name: list(values) for name, values in new.items()})
        return Dataset(columns)

    def rename_column(self, old: str, new: str) -> Dataset:
        return Dataset({new if name == old else name: values for name, values in self._columns.items()})

    def remove_columns(self, names) -> Dataset:
        drop = {names} if isinstance(names, str) else set(names)
        return Dataset({name: values for name, values in self._columns.items() if name not in drop})

    def select(self, indices) -> Dataset:
        indices = list(indices)
        return Dataset({name: [values[i] for i in indices] for name, values in self._columns.items()})


class DatasetDict(dict):
    def map(self, *args, **kwargs) -> DatasetDict:
        return DatasetDict({split: ds.map(*args, **kwargs) for split, ds in self.items()})

    def rename_column(self, old: str, new: str) -> DatasetDict:
        return DatasetDict({split: ds.rename_column(old, new) for split, ds in self.items()})

    def remove_columns(self, names) -> DatasetDict:
        return DatasetDict({split: ds.remove_columns(names) for split, ds in self.items()})


def load_dataset(path: str, name: str | None = None, **_) -> DatasetDict:
    if path not in ("glue", "nyu-mll/glue") or name != "mrpc":
        raise ValueError(f"the datasets stand-in has only GLUE MRPC, not {path!r} {name!r}")
    splits = json.loads((Path(__file__).resolve().parent / "mrpc.json").read_text())
    return DatasetDict({split: Dataset(columns) for split, columns in splits.items()})
