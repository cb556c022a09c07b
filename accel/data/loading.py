"""Data loaders that give each process its share of every epoch (Accelerate's `prepare_data_loader`).

The sharding keeps one property exact: at step k the N ranks together see the original global batches
kN..kN+N-1 (or, with `split_batches`, the N parts of global batch k), so N processes with batch size b
reproduce one process with batch size N*b.

Random numbers are drawn as Accelerate's loaders draw them, so a script gives Accelerate's numbers (its dropout
masks included): each pass takes the workers' base seed from the loader's `generator` (the global RNG when None),
and a `RandomSampler` without a generator shuffles from one global draw at `prepare` on several processes (the
generator then followed like a user's one), or from a global draw per epoch on one process (torch's own
`RandomSampler`). `use_seedable_sampler` (or a `data_seed`) makes the order a pure function of (seed, epoch). A pass
that resumes mid-epoch draws nothing: the checkpointed RNG state already holds that epoch's draws.

This module holds the entry points (`prepare_data_loader`, `skip_first_batches`, `DataLoaderConfiguration`) and the
choice of sampler and loader; what each process reads is in `samplers`, the loader classes in `prepared_loaders`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from accel.data.prepared_loaders import (  # noqa: F401
    DataLoaderDispatcher,
    DataLoaderShard,
    SkipDataLoader,
    _loader_kwargs,
    followed_generator,
    stateful_classes,
)
from accel.data.samplers import (
    BatchSamplerShard,
    GlobalSeedRandomSampler,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    _global_draw,
    _PerSampleShard,
    _split_message,
)

__all__ = [
    "BatchSamplerShard",
    "DataLoaderConfiguration",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "prepare_data_loader",
    "skip_first_batches",
]


@dataclass
class DataLoaderConfiguration:
    """How `Accelerator.prepare` builds data loaders (Accelerate's field names and defaults)."""

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False
    # accel's: whether load_state puts plain loaders back where the checkpoint was taken (their epoch and the order
    # they drew) and a resumed pass draws nothing more, so a resumed run repeats the uninterrupted one bit for bit.
    # False: Accelerate's resume (only stateful loaders are restored; a resumed pass draws as a fresh one). None:
    # Accelerate's where the script imported Accelerate (the shim), accel's exact resume otherwise.
    exact_resume: Optional[bool] = None

    def __post_init__(self):
        if self.exact_resume is not None and not isinstance(self.exact_resume, bool):
            raise ValueError(f"DataLoaderConfiguration: exact_resume={self.exact_resume!r}; allowed: True, False or "
                             "None (Accelerate's resume under the shim, accel's exact resume otherwise)")
        if self.use_stateful_dataloader:
            stateful_classes()  # fail here, where the user asked for it, when torchdata is missing


@dataclass(frozen=True)
class _Shuffle:
    """How a prepared loader shuffles a `RandomSampler` (Accelerate's rules; see the module's docstring)."""

    seed: Optional[int]  # a seed asked for (`data_seed`, accel's `seed=`): the order is a function of (seed, epoch)
    use_seedable_sampler: bool
    num_processes: int

    def sampler(self, sampler):
        """The sampler the prepared loader reads in place of `sampler` (anything but a RandomSampler is kept)."""
        if not isinstance(sampler, RandomSampler) or isinstance(sampler, (SeedableRandomSampler,
                                                                          GlobalSeedRandomSampler)):
            return sampler
        if sampler.generator is not None and not self.use_seedable_sampler:
            return sampler  # the user's generator: its order, synchronised from the main process each epoch
        if self.use_seedable_sampler or self.seed is not None:
            return SeedableRandomSampler(sampler.data_source, sampler.replacement, sampler._num_samples,
                                         seed=self.seed)
        if self.num_processes > 1:  # Accelerate: a generator seeded from one global draw, followed from then on
            return RandomSampler(sampler.data_source, sampler.replacement, sampler._num_samples,
                                 generator=torch.Generator().manual_seed(_global_draw()))
        return GlobalSeedRandomSampler(sampler.data_source, sampler.replacement, sampler._num_samples)


MEASURE_BATCH_ENV = "ACCEL_MEASURE_BATCH_SIZE"  # set by `accel plan --measure`: the layout's batch per process


def _measured_batch_size(dataloader: DataLoader, split_batches: bool) -> DataLoader:
    """Under `accel plan --measure` the loader of the measured layout: its per-process batch (a micro-batch under
    gradient accumulation) in place of the script's, so each layout runs the work the plan sized it for. Only a
    plain `batch_size` is rebuilt (not a custom batch sampler, not `split_batches`)."""
    import os

    wanted = os.environ.get(MEASURE_BATCH_ENV)
    plain = dataloader.batch_size is not None and type(dataloader.batch_sampler) is BatchSampler
    if not wanted or split_batches or not plain:
        return dataloader
    if int(wanted) == dataloader.batch_size:
        return dataloader
    iterable = isinstance(dataloader.dataset, IterableDataset)
    return DataLoader(dataloader.dataset, batch_size=int(wanted), drop_last=dataloader.drop_last,
                      sampler=None if iterable else dataloader.sampler, **_loader_kwargs(dataloader))


def _global_batch_sampler(dataloader: DataLoader, shuffle: _Shuffle):
    """The original loader's batch order, shuffled by `shuffle`'s rules; batches of one index when it does not
    batch."""
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        return BatchSampler(shuffle.sampler(dataloader.sampler), 1, False)
    return _global_batches_of(batch_sampler, shuffle)


def _global_batches_of(batch_sampler, shuffle: _Shuffle):
    """A torch BatchSampler with its sampler shuffled by `shuffle`'s rules; a custom batch sampler as it is
    (sharded batch by batch)."""
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(shuffle.sampler(batch_sampler.sampler), batch_sampler.batch_size, batch_sampler.drop_last)
    inner = getattr(batch_sampler, "sampler", None)
    if (isinstance(inner, RandomSampler) and (shuffle.use_seedable_sampler or shuffle.seed is not None)
            and not isinstance(inner, (SeedableRandomSampler, GlobalSeedRandomSampler))):
        # Accelerate's set_sampler: a custom batch sampler's RandomSampler becomes the seedable one, in place
        # (transformers' Trainer asks for use_seedable_sampler; sentence-transformers gives its own batch samplers)
        batch_sampler.sampler = shuffle.sampler(inner)
    return batch_sampler


def prepare_data_loader(
    dataloader: DataLoader,
    device=None,
    num_processes: Optional[int] = None,
    process_index: Optional[int] = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types=None,
    dispatch_batches: Optional[bool] = None,
    even_batches: bool = True,
    slice_fn_for_dispatch=None,
    use_seedable_sampler: bool = False,
    data_seed: Optional[int] = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh=None,
    *,
    seed: Optional[int] = None,
    gradient_state=None,
) -> DataLoaderShard:
    """Rebuild `dataloader` over the same dataset so that it yields this process's share of each epoch.

    Accelerate's arguments, order and defaults (`num_processes`/`process_index` default to the running job's):
    `dispatch_batches` (default: True for iterable datasets when `put_on_device`) has only the main process read the
    data and send each rank its slice (`DataLoaderDispatcher`); otherwise every rank reads its own share.
    `use_seedable_sampler` shuffles as a function of (seed, epoch) also where the user gave a generator (without it,
    a RandomSampler with a generator follows that generator, synchronised from the main process each epoch);
    `data_seed` is the seed (accel's keyword `seed` too). `rng_types` and `torch_device_mesh` are accepted: no RNG
    other than the loader's is synchronised, and the data-parallel rank is the one given."""
    shard_class, dispatcher_class = stateful_classes()[:2] if use_stateful_dataloader else (DataLoaderShard,
                                                                                          DataLoaderDispatcher)
    if dispatch_batches is None:
        dispatch_batches = put_on_device and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError("prepare_data_loader: dispatch_batches=True needs put_on_device=True (the batches are "
                         "broadcast on the device)")
    if num_processes is None or process_index is None or (device is None and put_on_device):
        from accel.runtime.state import PartialState  # what the job has, for what the caller left out

        state = PartialState()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
        device = state.device if device is None and put_on_device else device
    if data_seed is not None:
        seed = data_seed
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index ({process_index}) must be in [0, num_processes={num_processes}).")
    shuffle = _Shuffle(None if seed is None else int(seed), use_seedable_sampler, num_processes)
    seed = 0 if seed is None else int(seed)
    dataloader = _measured_batch_size(dataloader, split_batches)
    unbatched = dataloader.batch_size is None and dataloader.batch_sampler is None
    if split_batches and unbatched:
        raise ValueError("split_batches=True needs a data loader with a batch_size (got batch_size=None).")
    kwargs = _loader_kwargs(dataloader)
    settings = dict(
        device=device if put_on_device else None,
        seed=seed,
        gradient_state=gradient_state,
        non_blocking=non_blocking,
    )
    dataset = dataloader.dataset
    if dispatch_batches:
        return _dispatcher(dispatcher_class, dataloader, num_processes, process_index, split_batches,
                           slice_fn_for_dispatch, shuffle, settings, kwargs)
    shard_args: dict[str, Any] = dict(
        num_processes=num_processes,
        process_index=process_index,
        split_batches=split_batches,
        even_batches=even_batches,
    )
    if isinstance(dataset, IterableDataset):
        per_batch = 1 if unbatched else cast(int, dataloader.batch_size)  # an iterable dataset: batched has a size
        iterable = IterableDatasetShard(dataset, batch_size=per_batch, drop_last=dataloader.drop_last, **shard_args)
        batch_size = None if unbatched else iterable.part
        return shard_class(iterable, batch_size=batch_size, drop_last=dataloader.drop_last, **settings, **kwargs)
    if unbatched and isinstance(dataloader.sampler, BatchSampler):  # batches given as `sampler=`: shard them as
        given = BatchSamplerShard(_global_batches_of(dataloader.sampler, shuffle),
                                  **shard_args)  # Accelerate does (even_batches pads the last one too)
        return shard_class(dataset, sampler=given, batch_size=None, **settings, **kwargs)
    shard = BatchSamplerShard(_global_batch_sampler(dataloader, shuffle), **shard_args)
    if unbatched:
        return shard_class(dataset, sampler=_PerSampleShard(shard), batch_size=None, **settings, **kwargs)
    return shard_class(dataset, batch_sampler=shard, **settings, **kwargs)


def _dispatcher(dispatcher_class: type, dataloader: DataLoader, num_processes: int, process_index: int,
                split_batches: bool, slice_fn, shuffle: _Shuffle, settings: dict,
                kwargs: dict) -> DataLoaderDispatcher:
    """A `dispatcher_class` loader whose main process reads the original loader's batches (its sampler made
    shuffled by `shuffle`'s rules as one process's: only the main process draws, as in Accelerate)."""
    dataset, batch_size = dataloader.dataset, dataloader.batch_size
    shuffle = dataclasses.replace(shuffle, num_processes=1)
    kwargs.pop("generator", None)  # Accelerate's dispatcher draws the base seed from the global RNG
    if isinstance(dataset, IterableDataset):
        kwargs.update(batch_size=batch_size, drop_last=dataloader.drop_last)
    elif dataloader.batch_sampler is None:
        kwargs.update(sampler=shuffle.sampler(dataloader.sampler), batch_size=None)
    else:
        kwargs["batch_sampler"] = _global_batch_sampler(dataloader, shuffle)
        batch_size = getattr(kwargs["batch_sampler"], "batch_size", batch_size)
    if split_batches and batch_size is not None and batch_size % num_processes:
        raise ValueError(_split_message(f"batch_size ({batch_size})", num_processes))
    return dispatcher_class(dataset, num_processes, process_index, split_batches, slice_fn,
                            global_drop_last=dataloader.drop_last, global_batch_size=batch_size, **settings, **kwargs)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader that resumes mid-epoch: the same batches as `dataloader`'s current epoch minus the first ones.

    For a DataLoaderShard, finishing the returned loader's epoch advances `dataloader.iteration`, so the
    usual resume loop continues with the same epoch numbers and permutations as an uninterrupted run.
    """
    if isinstance(dataloader, DataLoaderShard):
        child = dataloader._clone(skip_batches=num_batches)
        child.iteration = dataloader.iteration
        child._parent = dataloader
        return child
    kwargs = _loader_kwargs(dataloader)
    kwargs["generator"] = dataloader.generator
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        return SkipDataLoader(
            dataset,
            skip_batches=num_batches,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **kwargs,
        )
    if dataloader.batch_sampler is None:  # no auto-collation: a "batch" is one sample
        return DataLoader(dataset, sampler=SkipBatchSampler(dataloader.sampler, num_batches), batch_size=None, **kwargs)
    return DataLoader(dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches), **kwargs)


def __getattr__(name: str):
    """The stateful loader classes by name (torchdata imported only then): accel.data.prepared_loaders' own."""
    if name in ("StatefulDataLoaderShard", "StatefulDataLoaderDispatcher", "StatefulSkipDataLoader"):
        from accel.data import prepared_loaders

        return getattr(prepared_loaders, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
