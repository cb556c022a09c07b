"""The step owners, the recipe and the Accelerator name no parallel dimension: they hold the run's list of parts
(accel/parallel/part.py) and call its protocol in order. Read from the source: every identifier (names, attributes,
arguments, functions, imports) and every string that is not a docstring; comments and docstrings may explain."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CHECKED = ["accel/backends/spmd.py", "accel/backends/pipeline.py", "accel/backends/recipe.py", "accel/accelerator.py",
           *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "accel" / "accelerator_mixins").glob("*.py"))]

# a word of an identifier (split at "_" and at case changes) or of a string that names a dimension: the degrees' and
# mesh dimensions' short names and the dimensions' own words
DIMENSION_WORDS = {"expert", "experts", "moe", "ep", "edp", "sequence", "seq", "sp", "cp", "ulysses", "tp"}
# two-word names whose words alone are generic ("tensor", "context", "parallel" ...)
DIMENSION_PHRASES = ("tensor_parallel", "tensorparallel", "context_parallel", "contextparallel", "tp_plan")
# Accelerate's API, kept by the facade: these methods answer Accelerate's per-dimension questions (their bodies are
# not checked), and these names are its arguments and their translation into the config
ACCELERATE_METHODS = {"tensor_parallel_rank", "context_parallel_rank", "maybe_context_parallel",
                      "reduce_sequence_loss"}
ACCELERATE_NAMES = {"torch_tp_plugin", "tp_plugin_layer"}


def _words(text: str) -> set[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", text)
    return {w.lower() for w in re.split(r"[^A-Za-z0-9]+|_", spaced) if w}


def _is_dimension(text: str) -> bool:
    flat = text.lower().replace(" ", "_").replace("-", "_")
    return bool(_words(text) & DIMENSION_WORDS) or any(phrase in flat for phrase in DIMENSION_PHRASES)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _named(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, identifier or string) of everything the code names, outside Accelerate's per-dimension methods."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ACCELERATE_METHODS:
            skipped |= {id(inner) for inner in ast.walk(node)}
    docstrings = _docstrings(tree)
    named = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            named.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            named.append((line, node.attr))
        elif isinstance(node, ast.arg):
            named.append((line, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            named.append((line, node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            named.append((line, node.name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            named += [(line, alias.name) for alias in node.names]
            named += [(line, node.module)] if isinstance(node, ast.ImportFrom) and node.module else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            named.append((line, node.value))
    return named


@pytest.mark.parametrize("path", CHECKED)
def test_names_no_dimension(path):
    tree = ast.parse((ROOT / path).read_text())
    found = sorted({f"{path}:{line}: {text!r}" for line, text in _named(tree)
                    if text not in ACCELERATE_NAMES and _is_dimension(text)})
    assert not found, "a dimension is named (make it a part's hook, accel/parallel/part.py):\n" + "\n".join(found)


@pytest.mark.parametrize("text", ["self.experts", "_shard_experts", "sequence_parallel", "sp_size", "cp_size",
                                  "ep_size", "tp_plan", "tensor parallelism", "ExpertLayout", "seq_rank", "tp",
                                  "accel.parallel.expert", "context_parallel_rank", "edp"])
def test_the_words_catch_dimension_branching(text):
    assert _is_dimension(text)


@pytest.mark.parametrize("text", ["parts", "part.transform", "data_parallel", "tensor", "torch.Tensor", "step",
                                  "separate", "except", "keep", "sparse_grad", "pipeline", "DataParallelPlan",
                                  "replicas", "cpu_offload", "spmd", "TypeError"])
def test_the_words_leave_generic_names(text):
    assert not _is_dimension(text)
