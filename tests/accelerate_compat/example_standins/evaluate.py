"""Test fixture, not part of accel: a stand-in for the `evaluate` package with GLUE MRPC's metric (accuracy and F1,
as `evaluate.load("glue", "mrpc")` returns them), so Accelerate's examples run offline
(tests/accelerate_compat/examples_harness.py puts it on their PYTHONPATH)."""

from __future__ import annotations

__version__ = "0.0.0+standin"


def _values(x) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(v) for v in x]


class GlueMrpc:
    def __init__(self):
        self._predictions: list[int] = []
        self._references: list[int] = []

    def add_batch(self, predictions=None, references=None, **_):
        self._predictions += _values(predictions)
        self._references += _values(references)

    def compute(self, predictions=None, references=None, **_) -> dict:
        if predictions is not None:
            self.add_batch(predictions=predictions, references=references)
        p, r = self._predictions, self._references
        self._predictions, self._references = [], []
        pairs = list(zip(p, r, strict=True))
        tp = sum(a == 1 and b == 1 for a, b in pairs)
        fp = sum(a == 1 and b == 0 for a, b in pairs)
        fn = sum(a == 0 and b == 1 for a, b in pairs)
        accuracy = sum(a == b for a, b in pairs) / len(p) if p else 0.0
        f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
        return {"accuracy": float(accuracy), "f1": float(f1)}


def load(path: str, config_name: str | None = None, **_) -> GlueMrpc:
    if path != "glue" or config_name != "mrpc":
        raise ValueError(f"the evaluate stand-in has only GLUE MRPC's metric, not {path!r} {config_name!r}")
    return GlueMrpc()
