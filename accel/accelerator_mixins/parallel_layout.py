"""Accelerate's read-only views of the parallel layout: the parallelism config, the DeviceMesh, this rank's
coordinate on each dimension, whether FSDP2 or fp8 runs."""

from __future__ import annotations

import contextlib

from accel.accelerator_mixins.process import ProcessControl
from accel.config import ParallelismConfig


class ParallelLayout(ProcessControl):
    """The layout as Accelerate's attributes name it, read from the topology and the backend."""

    @property
    def parallelism_config(self) -> ParallelismConfig:
        return self.config.parallelism

    @property
    def torch_device_mesh(self):
        """The DeviceMesh of the parallel dimensions (pp, dp, tp; dp_replicate and dp_shard when Accelerate's
        ParallelismConfig fields ask for them), or None on one process."""
        return self.state.device_mesh

    @property
    def is_fsdp2(self) -> bool:
        """Accelerate's test for its FSDP2 path: true when `state.fsdp_plugin` is set (a plugin was given, or the
        config's ZeRO 2/3 shards with FSDP2; `distributed_type` is then FSDP)."""
        return self.state.is_fsdp2

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def fp8_backend(self):
        """FP8BackendType.AO when training in fp8 (torchao), else NO."""
        from accel.compat.dataclasses import FP8BackendType

        return FP8BackendType.AO if self.config.mixed_precision == "fp8" else FP8BackendType.NO

    @property
    def should_save_model(self) -> bool:
        return True  # every rank takes part in saving (the checkpoint writer decides who writes), as in Accelerate

    @property
    def data_parallel_shard_rank(self) -> int:
        """This rank's position on the dp_shard dimension (0 when nothing is sharded)."""
        return self.topology.coordinates(self.process_index)["dp_shard"]

    @property
    def context_parallel_rank(self) -> int:
        """This rank's slice of every sequence on the cp (or sp) dimension (0 without one)."""
        return self.topology.seq_rank(self.process_index)

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """Accelerate's context manager that shards `buffers` along the sequence for context parallelism. accel's
        prepared DataLoader already hands each rank its slice (and the attention runs over the whole sequence while
        the model runs), so the block runs as it is."""
        yield

    @property
    def data_parallel_rank(self) -> int:
        return self.backend.data_parallel_rank

    @property
    def tensor_parallel_rank(self) -> int:
        return self.topology.coordinates(self.process_index)["tp"]

    @property
    def pipeline_parallel_rank(self) -> int:
        return self.topology.coordinates(self.process_index)["pp"]
