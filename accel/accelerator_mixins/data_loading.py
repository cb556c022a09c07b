"""The Accelerator's data loaders: each process's share of a DataLoader, the shuffling seed every rank shares, how a
resumed loader continues, skipping batches, uneven inputs, and Accelerate's views of the dataloader config."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from accel.accelerator_mixins.process import ProcessControl
from accel.runtime import ops


class DataLoading(ProcessControl):
    """Prepares data loaders for the data-parallel ranks (accel.data.loading) and answers the dataloader config."""

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        """As in Accelerate: written to the dataloader config, so data loaders prepared after it follow it (those
        prepared before keep theirs; `join_uneven_inputs(even_batches=...)` changes them for a while)."""
        self.dataloader_config.even_batches = value

    def prepare_data_loader(self, data_loader, device_placement: bool | None = None, slice_fn_for_dispatch=None):
        from accel.data.loading import prepare_data_loader

        placement = self.device_placement if device_placement is None else device_placement
        prepared = prepare_data_loader(
            data_loader,
            device=self.device,
            num_processes=self.backend.data_parallel_size,
            process_index=self.backend.data_parallel_rank,
            split_batches=self.split_batches,
            put_on_device=placement,
            even_batches=self.even_batches,
            data_seed=self._shared_data_seed() if self._seedable_shuffle() else None,
            gradient_state=self.gradient_state,
            non_blocking=self.dataloader_config.non_blocking,
            use_seedable_sampler=self.dataloader_config.use_seedable_sampler,
            dispatch_batches=self.dataloader_config.dispatch_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_stateful_dataloader=self.dataloader_config.use_stateful_dataloader,
        )
        prepared.batch_transform = self.backend.batch_transform
        if self.throughput is not None:  # count each batch's samples and tokens (shapes only)
            prepared.batch_transform = self.throughput.counting(self.backend.batch_transform)
        prepared.exact_resume = self._exact_resume()
        self._dataloaders.append(prepared)
        expected = self.config.parallelism.micro_batch_size  # from a DeepSpeed JSON's train_micro_batch_size_per_gpu
        if expected and prepared.batch_size not in (None, expected):
            warnings.warn(f"config: micro_batch_size (train_micro_batch_size_per_gpu) is {expected} but this data "
                          f"loader gives each process batches of {prepared.batch_size}; the loader's size is used",
                          stacklevel=2)
        return prepared

    def _exact_resume(self) -> bool:
        """DataLoaderConfiguration.exact_resume; unset: Accelerate's resume where the script imported Accelerate (the
        shim: the drop-in gives Accelerate's numbers), accel's exact resume otherwise."""
        chosen = getattr(self.dataloader_config, "exact_resume", None)
        if chosen is None:
            given = os.environ.get("ACCEL_EXACT_RESUME", "").strip().lower()
            if given:  # for an unchanged Accelerate script that wants accel's exact resume
                if given not in ("1", "true", "0", "false"):
                    raise ValueError(f"ACCEL_EXACT_RESUME={given!r}; allowed: 1/true (accel's exact resume), 0/false "
                                     "(Accelerate's), or unset (Accelerate's under the shim, exact otherwise)")
                return given in ("1", "true")
            from accel.core.shim_version import shim_active

            return not shim_active()
        return bool(chosen)

    def _seedable_shuffle(self) -> bool:
        """Whether shuffles are a function of (seed, epoch): asked for, or a `data_seed` given (else Accelerate's
        draws from the global RNG, see accel.data.loading)."""
        return self.dataloader_config.use_seedable_sampler or self.dataloader_config.data_seed is not None

    def _shared_data_seed(self) -> int:
        """One shuffling seed for every rank: `data_seed`, else rank 0's torch seed (set by `set_seed`)."""
        if self._data_seed is None:
            seed = self.dataloader_config.data_seed
            if seed is None:
                seed = torch.initial_seed() % (2**63)  # reading it consumes no random numbers
                seed = int(ops.broadcast(torch.tensor([seed], dtype=torch.int64, device=self.device))[0])
            self._data_seed = int(seed)
        return self._data_seed

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """A loader over the rest of the current epoch, without loading the skipped batches."""
        from accel.data.loading import skip_first_batches

        return skip_first_batches(dataloader, num_batches)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None):
        """Train on data loaders whose processes get different numbers of batches (`even_batches=False`): torch's
        `Join` lets the processes that ran out shadow the others' gradient all-reduces, for DDP models on GPUs and,
        unlike Accelerate, on CPU processes (gloo) too. `even_batches` overrides the prepared map-style loaders'
        setting inside the block."""
        from accel.data.loading import BatchSamplerShard

        restore = []
        if even_batches is not None:
            samplers = [getattr(d, "batch_sampler", None) for d in self._dataloaders]
            if any(not isinstance(s, BatchSamplerShard) for s in samplers):
                warnings.warn("join_uneven_inputs(even_batches=...): overriding even_batches is only supported for "
                              "map-style datasets; iterable data loaders keep their setting", stacklevel=3)
            for sampler in samplers:
                if isinstance(sampler, BatchSamplerShard):
                    restore.append((sampler, sampler.even_batches))
                    sampler.even_batches = even_batches
        try:
            with self.backend.join(joinables):
                yield
        finally:
            for sampler, value in restore:
                sampler.even_batches = value

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def dispatch_batches(self):
        return self.dataloader_config.dispatch_batches
