"""Which parts a run has: the one place that maps the topology's degrees to the parallel dimensions' parts, in the
order every step owner calls them.

The order: tensor parallelism first (its plan is chosen on the model before another part changes it), then the
sequence/context dimension, then experts (their prepare divides the MoE layers, and keeps a ModuleList's experts
out of the tensor-parallel plan: `recipe.kept_whole`). Plain data parallelism has no part: the list is empty.
"""

from __future__ import annotations

import importlib

from accel.parallel.part import Part

# (module, class, the topology's degree that turns it on), in calling order
PARTS = (
    ("accel.parallel.tensor_part", "TensorPart", "tp_size"),
    ("accel.parallel.sequence_part", "SequencePart", "seq_size"),
    ("accel.parallel.expert_part", "ExpertPart", "ep_size"),
)


def build_parts(topology, state, parallelism, data_parallel) -> list[Part]:
    """The run's parts, each built with the topology, the process state, the parallelism config and the data-parallel
    plan (accel.parallel.data_parallel), for every degree above 1."""
    parts = []
    for module, name, degree in PARTS:
        if getattr(topology, degree) > 1:
            parts.append(getattr(importlib.import_module(module), name)(topology, state, parallelism, data_parallel))
    return parts
