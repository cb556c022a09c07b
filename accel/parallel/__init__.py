"""The parallel dimensions beyond data parallelism, one part each (`part.py`'s protocol): tensor (`tensor_part`,
with its plan `tensor_plan`, styles `tensor_parallel_styles`, the fused projections' layout `fused`, and the split
itself `tensor`), sequence/context (`sequence_part`, `sequence`, `sequence_layout`) and expert (`expert_part`,
`expert`) parallelism. `parts.py` builds a run's list from the topology; the step owners (accel/backends/) call it
in order without naming a dimension. Beside them: the data-parallel plan (`data_parallel`, the one decision of
the data-parallel kind) and the gradient arithmetic every owner and part shares (`gradients`).

They sit below the step owners: a part knows the topology, the process state and the config, never a backend."""
