"""The DataLoader classes `prepare` returns: `DataLoaderShard` (each process reads its shard, batches moved to its
device, the epoch and position kept for a resume), `DataLoaderDispatcher` (the main process reads and sends each
process its part), `SkipDataLoader`, and their torchdata StatefulDataLoader variants, built on first use.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sized
from typing import Any, Callable, Iterator, Optional, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from accel.runtime.ops import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    get_data_structure,
    initialize_tensors,
    send_to_device,
    slice_tensors,
)
from accel.data.samplers import (
    BatchSamplerShard,
    GlobalSeedRandomSampler,
    IterableDatasetShard,
    SeedableRandomSampler,
    _PerSampleShard,
)


# DataLoader settings copied verbatim from the original loader onto the prepared one.
_LOADER_ATTRS = (
    "collate_fn",
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
    "generator",  # the workers' base seed is drawn from it (the global RNG when None), as in torch and Accelerate
)


def _loader_kwargs(loader: DataLoader) -> dict:
    """The settings of `loader` that a rebuilt loader must keep (only those this torch version has)."""
    return {name: getattr(loader, name) for name in _LOADER_ATTRS if hasattr(loader, name)}


def _set_locked(loader: DataLoader, name: str, value) -> None:
    """DataLoader forbids setting batch_size/drop_last after __init__; torch only reads them to build
    fetchers and lengths (both already decided by our sampler), so we restore the user-facing values."""
    object.__setattr__(loader, name, value)


class _ItselfAsBase:
    """`loader.base_dataloader`: the loader itself. An instance attribute, as Accelerate's (set in its adapters'
    `__init__`): the class has none, so `DataLoaderShard.base_dataloader` is an AttributeError there too."""

    def __get__(self, loader, owner=None):
        if loader is None:
            raise AttributeError(f"type object '{owner.__name__}' has no attribute 'base_dataloader'")
        return loader


class DataLoaderShard(DataLoader):
    """A DataLoader over this rank's share that tracks epochs and tells the gradient state where it is.

    While the last batch is being processed `end_of_dataloader` is True and `remainder` is the number of
    real samples in the final global round (when padding was added, else -1). Each pass uses
    epoch = `iteration` (seeding the shuffle and the workers' base seed) and bumps it when it completes.
    """

    _fast_forward = 0  # batches still to skip (`fast_forward`): a fault-tolerant group that healed
    _handed_out = 0  # batches handed out (or skipped by `fast_forward`) over every epoch
    _on_stateful_loader = False  # True on the StatefulDataLoader variants (accel.data.stateful's mix-in)
    # the backend's last step on each batch, after device placement (sequence parallelism: this rank's slice)
    batch_transform: Optional[Callable] = None

    def __new__(cls, *args, use_stateful_dataloader: bool = False, **kwargs):
        """Accelerate's `DataLoaderShard(..., use_stateful_dataloader=True)` (and the dispatcher's): the same loader
        on torchdata's StatefulDataLoader (accel.data.stateful's subclass)."""
        if use_stateful_dataloader:
            shard, dispatcher, _ = stateful_classes()
            stateful = dispatcher if issubclass(cls, DataLoaderDispatcher) else shard
            if not issubclass(cls, stateful):
                cls = stateful
        return super().__new__(cls)

    def __init__(
        self,
        dataset,
        device=None,
        seed: int = 0,
        gradient_state=None,
        non_blocking: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,  # chose the class (__new__)
        **kwargs,
    ):
        super().__init__(dataset, **kwargs)
        self.use_stateful_dataloader = self._on_stateful_loader  # Accelerate's attribute
        self.device = device
        self.seed = int(seed)
        if gradient_state is None:  # a loader built without an Accelerator: the process's current state (Accelerate's)
            from accel.runtime.accumulation import GradientState

            gradient_state = GradientState()
        self.gradient_state = gradient_state
        self.non_blocking = non_blocking
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = -1
        self._parent: Optional[DataLoaderShard] = None  # set by skip_first_batches
        self._shard = self._find_shard()
        self.skip_batches = skip_batches
        if isinstance(self.batch_sampler, BatchSamplerShard) and self._shard.batch_size is not None:
            b = self._shard.batch_size
            _set_locked(self, "batch_size", b // self._shard.num_processes if self._shard.split_batches else b)
            _set_locked(self, "drop_last", self._shard.drop_last)

    def _find_shard(self):
        if isinstance(self.dataset, IterableDatasetShard):
            return self.dataset
        if isinstance(self.batch_sampler, BatchSamplerShard):
            return self.batch_sampler
        if isinstance(self.sampler, _PerSampleShard):
            return self.sampler.shard
        if isinstance(self.sampler, BatchSamplerShard):  # a batch sampler the user gave as `sampler=`
            return self.sampler
        return None

    # Accelerate's adapters wrap a torch loader (a StatefulDataLoader with `use_stateful_dataloader`); accel's loader
    # is that loader itself
    base_dataloader = _ItselfAsBase()

    @property
    def skip_batches(self) -> int:
        return self._skip_batches

    @skip_batches.setter
    def skip_batches(self, value: int) -> None:
        self._skip_batches = int(value)
        if self._skips_indices():
            self._shard.skip_batches = self._skip_batches

    def _skips_indices(self) -> bool:
        """Map-style loaders sharded by accel skip batches by index, loading nothing; others read and drop them."""
        return isinstance(self._shard, BatchSamplerShard)

    # -- sizes ---------------------------------------------------------------------------------------
    def __len__(self) -> int:
        if self._skips_indices():
            return super().__len__()  # our samplers already account for skip_batches
        if not isinstance(self.dataset, IterableDatasetShard):
            return max(super().__len__() - self.skip_batches, 0)  # a loader built directly on a user's sampler
        items = len(self.dataset)
        batches = items if self.batch_size is None else math.ceil(items / self.batch_size)
        return max(batches - self.skip_batches, 0)

    @property
    def total_batch_size(self) -> Optional[int]:
        """Samples consumed per step by all ranks together."""
        shard = self._shard
        b = getattr(shard, "batch_size", None)
        if b is None:
            return self.batch_size
        return b if shard.split_batches else b * shard.num_processes

    @property
    def total_dataset_length(self) -> int:
        dataset = self.dataset.dataset if isinstance(self.dataset, IterableDatasetShard) else self.dataset
        return len(cast(Sized, dataset))

    # -- epochs and resuming --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.iteration = int(epoch)
        sampler = getattr(self.batch_sampler, "sampler", None)
        if self._shard is not None:
            self._shard.set_epoch(epoch)
        elif sampler is not None and hasattr(sampler, "set_epoch"):  # a loader built directly on a user's sampler
            sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict:
        """The loader's place: its epoch (`iteration`), and mid-epoch what its shuffle was drawn from. Once the
        epoch's last batch is handed out (a checkpoint taken on it, where diffusers' scripts and
        run_glue_no_trainer save) the epoch counts as done, as in the run that goes on: the next pass starts the
        next epoch and draws its order afresh."""
        # (a stateful loader's own position already says where the epoch ends: torchdata resumes from it)
        done = (self.__dict__.get("_in_epoch") and self.__dict__.get("_last_batch_out")
                and not self._on_stateful_loader)
        state: dict[str, Any] = {"iteration": self.iteration + 1 if done else self.iteration, "seed": self.seed}
        generator = followed_generator(self)
        if generator is not None:  # mid-epoch: the state the epoch's shuffle was drawn from
            started = None if done else self.__dict__.get("_epoch_start_state")
            state["generator_state"] = (generator.get_state() if started is None else started).clone()
        sampler = self._order_sampler()
        if isinstance(sampler, GlobalSeedRandomSampler) and self.__dict__.get("_in_epoch") and not done:
            state["sampler_seed"] = sampler.epoch_seed  # mid-epoch: the global draw this epoch shuffled from
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.iteration = int(state_dict["iteration"])
        self.seed = int(state_dict.get("seed", self.seed))
        generator = followed_generator(self)
        if generator is not None and "generator_state" in state_dict:
            generator.set_state(torch.as_tensor(state_dict["generator_state"], dtype=torch.uint8).cpu())
        sampler = self._order_sampler()
        if isinstance(sampler, SeedableRandomSampler):
            sampler.seed = self.seed
        if isinstance(sampler, GlobalSeedRandomSampler):
            seed = state_dict.get("sampler_seed")
            sampler.resume_seed = None if seed is None else int(seed)

    # -- iteration -----------------------------------------------------------------------------------
    def __iter__(self):
        epoch = self.iteration
        self.set_epoch(epoch)
        followed = followed_generator(self)
        if followed is not None:  # every rank shuffles from the main process's generator state, as Accelerate does
            from accel.core.seeding import synchronize_rng_state

            synchronize_rng_state("generator", generator=followed)
            self._epoch_start_state = followed.get_state()
        self._resuming = self._resumes_mid_epoch()
        for loader in (self, self._parent) if self._parent is not None else (self,):  # the parent is what is saved
            loader._in_epoch = True
            loader._last_batch_out = False
        if self.gradient_state is not None:
            self.gradient_state._add_dataloader(self)
        try:
            yield from self._with_lookahead(self._raw_batches())
            self._finish_epoch(epoch)
        finally:
            self.end_of_dataloader = False
            self.remainder = -1
            if self.gradient_state is not None:
                self.gradient_state._remove_dataloader(self)

    def _resumes_mid_epoch(self) -> bool:
        """Whether this pass continues an epoch a checkpoint cut (whose draws the restored RNG already holds); under
        Accelerate's resume (exact_resume False) a resumed pass draws as a fresh one, as Accelerate's does."""
        owner = self._parent if self._parent is not None else self
        return self.skip_batches > 0 and owner.__dict__.get("exact_resume", True)

    def _base_iterator(self) -> Iterator:
        """torch's iterator over the base loader. It draws the workers' base seed from `self.generator` (the global
        RNG when None), as Accelerate's loader does; a pass resuming mid-epoch leaves the global RNG as restored, and
        so does a pass begun while fast-forwarding (a healed replica: the RNG states it received already hold the
        draws of the epochs it skips into)."""
        skipping = self._fast_forward_owner()._fast_forward > 0
        if not (self.__dict__.get("_resuming") or skipping) or self.generator is not None:
            return super(DataLoaderShard, self).__iter__()
        state = torch.get_rng_state()
        try:
            return super(DataLoaderShard, self).__iter__()
        finally:
            torch.set_rng_state(state)

    def _raw_batches(self) -> Iterator:
        batches = self._base_iterator()
        if self.skip_batches and not self._skips_indices():
            # iterables must be read to skip; so must a loader built directly on a user's sampler, as Accelerate's
            # DataLoaderShard reads and drops them
            return itertools.islice(batches, self.skip_batches, None)
        return batches

    def _with_lookahead(self, batches: Iterator) -> Iterator:
        """Fetch one batch ahead so the flags are already set while the last batch is processed."""
        done = object()
        owner = self._fast_forward_owner()
        current = next(batches, done)
        while current is not done:
            if owner._fast_forward:
                current = self._skip_ahead(owner, current, batches, done)
                if current is done:  # the epoch ended while skipping: the rest is skipped in the next ones
                    break
            self._snapshot()
            following = next(batches, done)
            if following is done:
                self.end_of_dataloader = True
                self.remainder = self._last_remainder()
                for loader in (self, self._parent) if self._parent is not None else (self,):
                    loader._last_batch_out = True
            owner._handed_out += 1
            yield self._to_device(current)
            current = following

    def _last_remainder(self) -> int:
        """The real samples of the last step's batches: the shard's count where it padded the last round, else
        Accelerate's `length % total_batch_size` (one process included, so `gather_for_metrics` trims a fixed-size
        value of the last batch as it does); -1 without a length or with drop_last."""
        padded = getattr(self._shard, "remainder", -1)
        if padded != -1 or getattr(self._shard, "drop_last", False) or self.drop_last:
            return padded
        try:
            length, total = self.total_dataset_length, self.total_batch_size
        except (TypeError, AttributeError, NotImplementedError):
            return -1
        return length % total if total else -1

    def _fast_forward_owner(self) -> "DataLoaderShard":
        return self._parent if self._parent is not None else self  # (a skip_first_batches view: its loader's budget)

    @property
    def batches_handed_out(self) -> int:
        """Batches handed out over every epoch of this loader (those `fast_forward` skipped included)."""
        return self._fast_forward_owner()._handed_out

    def fast_forward(self, batches: int) -> None:
        """Skip this process's next `batches` batches, across epochs (an epoch that ends while skipping ends early, so
        an epoch loop moves on). For a fault-tolerant replica group that healed: it received the other groups' step
        count with their weights, and its loader moves as far, so an unchanged loop ends with theirs. The batches are
        read and dropped."""
        owner = self._fast_forward_owner()
        owner._fast_forward += int(batches)

    @staticmethod
    def _skip_ahead(owner: "DataLoaderShard", current, batches: Iterator, done):
        while owner._fast_forward > 0 and current is not done:
            owner._fast_forward -= 1
            owner._handed_out += 1
            current = next(batches, done)
        return current

    def _snapshot(self) -> None:
        """Called as each batch is handed out; stateful loaders (accel.data.stateful) record their position."""

    def _order_sampler(self):
        """The sampler whose order the epoch follows (None for iterable datasets and custom batch samplers)."""
        return getattr(getattr(self._shard, "batch_sampler", None), "sampler", None)

    def _to_device(self, batch):
        if self.device is not None:
            batch = send_to_device(batch, self.device, non_blocking=self.non_blocking)
        return batch if self.batch_transform is None else self.batch_transform(batch)

    def _finish_epoch(self, epoch: int) -> None:
        self.iteration = epoch + 1
        self._epoch_start_state = None
        self._in_epoch = False
        self._last_batch_out = False
        if self._parent is not None:  # a skip_first_batches view: the real loader moves to the next epoch
            self._parent.iteration += 1
            self._parent._in_epoch = False
            self._parent._last_batch_out = False

    def _clone(self, **overrides) -> "DataLoaderShard":
        """A loader with the same sharding and settings but its own sampler state."""
        kwargs = _loader_kwargs(self)
        dataset: Any
        if isinstance(self.dataset, IterableDatasetShard):
            dataset = copy.copy(self.dataset)
            kwargs.update(batch_size=self.batch_size, drop_last=self.drop_last)
        elif isinstance(self.sampler, _PerSampleShard):
            dataset = self.dataset
            kwargs.update(sampler=_PerSampleShard(copy.copy(self.sampler.shard)), batch_size=None)
        elif isinstance(self.sampler, BatchSamplerShard):
            dataset = self.dataset
            kwargs.update(sampler=copy.copy(self.sampler), batch_size=None)
        else:
            dataset = self.dataset
            kwargs.update(batch_sampler=copy.copy(self.batch_sampler))
        settings = dict(
            device=self.device,
            seed=self.seed,
            gradient_state=self.gradient_state,
            non_blocking=self.non_blocking,
            skip_batches=self.skip_batches,
        )
        settings.update(overrides)
        clone = type(self)(dataset, **settings, **kwargs)
        clone.batch_transform = self.batch_transform
        return clone


class DataLoaderDispatcher(DataLoaderShard):
    """Only the main process reads the data; every batch is broadcast and each rank keeps its slice.

    Accelerate's `dispatch_batches=True`: the way to share an iterable dataset that cannot be read identically on
    every rank (a stream, a random generator), at the cost of one broadcast per batch. Without `split_batches` the
    main process reads `num_processes` batches and joins them, and rank r keeps the r-th slice; with it, one batch is
    cut in `num_processes` slices. A last round that does not divide evenly is padded with the epoch's first samples
    (unless `drop_last`); `remainder` is then the number of real samples in that round.
    """

    def __init__(self, dataset, num_processes: int = 1, process_index: int = 0, split_batches: bool = False,
                 slice_fn=None, global_drop_last: bool = False, global_batch_size: Optional[int] = None, **kwargs):
        self.num_processes, self.process_index, self.split_batches = num_processes, process_index, split_batches
        self.slice_fn = slice_tensors if slice_fn is None else slice_fn
        self._global_drop_last, self._global_batch_size = global_drop_last, global_batch_size
        self._base_kwargs = dict(kwargs)  # rebuilds the same loader (skip_first_batches)
        self._dispatched_remainder, self._round_position = -1, None
        kwargs.pop("use_stateful_dataloader", None)  # chose the class (DataLoaderShard.__new__)
        settings = {k: kwargs.pop(k) for k in ("device", "seed", "gradient_state", "non_blocking", "skip_batches")
                    if k in kwargs}
        super().__init__(dataset, **settings, **kwargs)
        if global_batch_size is not None:  # what each process receives, as for the other loaders
            _set_locked(self, "batch_size", global_batch_size // num_processes if split_batches else global_batch_size)

    def __len__(self) -> int:
        whole = DataLoader.__len__(self)  # global batches (a TypeError for an iterable dataset without __len__)
        if not self.split_batches:
            whole = whole // self.num_processes if self._global_drop_last else math.ceil(whole / self.num_processes)
        return max(whole - self.skip_batches, 0)

    @property
    def total_batch_size(self) -> Optional[int]:
        b = self._global_batch_size
        return b if b is None or self.split_batches else b * self.num_processes

    @property
    def total_dataset_length(self) -> int:
        return len(cast(Sized, self.dataset))  # a map-style dataset here

    def set_epoch(self, epoch: int) -> None:
        self.iteration = int(epoch)
        sampler = getattr(self.batch_sampler, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _order_sampler(self):
        return getattr(self.batch_sampler, "sampler", None) if type(self.batch_sampler) is BatchSampler else None

    def _last_remainder(self) -> int:
        return self._dispatched_remainder

    def _raw_batches(self) -> Iterator:
        import torch.distributed as dist

        main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        batches = self._global_batches(self._base_iterator() if main else None)  # the base loader's
        n, r, done = self.num_processes, self.process_index, object()
        self._dispatched_remainder, first = -1, None
        current = next(batches, done)
        index = 0
        while current is not done:
            following = next(batches, done)
            observed = find_batch_size(current)
            size = observed // n
            if first is None and not self._global_drop_last:  # kept to pad an uneven last round
                first = self.slice_fn(current, slice(0, n), process_index=r, num_processes=n)
            if following is done:
                self._dispatched_remainder = observed
                if observed % n and not self._global_drop_last:
                    current, size = concatenate([current, first]), size + 1
            if index >= self.skip_batches:
                if following is done:  # the flags are set before the last batch is handed out
                    self.end_of_dataloader, self.remainder = True, self._last_remainder()
                yield self.slice_fn(current, slice(r * size, (r + 1) * size), process_index=r, num_processes=n)
            index += 1
            current = following

    def _with_lookahead(self, batches: Iterator) -> Iterator:
        """`_raw_batches` already reads one round ahead (and sets the end flags): reading another would end the
        sampler's epoch a batch early, and hold one more batch."""
        for batch in batches:
            self._snapshot()
            yield self._to_device(batch)

    def _base_position(self):
        """The main process's position in the epoch, for stateful loaders (accel.data.stateful); None here."""
        return None

    def _global_batches(self, iterator) -> Iterator:
        """The main process's batches (joined per round), broadcast to every rank; `iterator` is None elsewhere."""
        per_round = 1 if self.split_batches else self.num_processes
        device = self.device if self.device is not None else torch.device("cpu")
        while True:
            batch: Any = None
            info: list[Any] = [None]
            if iterator is not None:
                self._round_position = self._base_position()
                got = list(itertools.islice(iterator, per_round))
                if got and (len(got) == per_round or not self._global_drop_last):
                    batch = got[0] if len(got) == 1 else _join(got)
                    info = [get_data_structure(batch)]
            broadcast_object_list(info)  # the structure (or the end) first, so the others can allocate
            if info[0] is None:
                return
            batch = initialize_tensors(info[0]) if batch is None else batch
            yield broadcast(send_to_device(batch, device, non_blocking=self.non_blocking))

    def _clone(self, **overrides) -> "DataLoaderDispatcher":
        kwargs = dict(self._base_kwargs, device=self.device, seed=self.seed, gradient_state=self.gradient_state,
                      non_blocking=self.non_blocking, skip_batches=self.skip_batches)
        if "batch_sampler" in kwargs:
            kwargs["batch_sampler"] = copy.copy(kwargs["batch_sampler"])
        kwargs.update(overrides)
        clone = type(self)(self.dataset, self.num_processes, self.process_index, self.split_batches,
                           self.slice_fn, self._global_drop_last, self._global_batch_size, **kwargs)
        clone.batch_transform = self.batch_transform
        return clone


def _join(batches: list):
    try:
        return concatenate(batches)
    except RuntimeError as error:
        raise RuntimeError("dispatch_batches=True: the main process cannot join batches of different shapes "
                           f"({error}); pad them in collate_fn, use split_batches=True, or dispatch_batches=False"
                           ) from None


class SkipDataLoader(DataLoader):
    """A plain DataLoader that reads and discards its first `skip_batches` batches (iterable datasets).
    `use_stateful_dataloader=True` (Accelerate's flag) builds it on torchdata's StatefulDataLoader."""

    def __new__(cls, *args, use_stateful_dataloader: bool = False, **kwargs):
        if use_stateful_dataloader and cls is SkipDataLoader:
            cls = stateful_classes()[2]
        return super().__new__(cls)

    def __init__(self, dataset, skip_batches: int = 0, use_stateful_dataloader: bool = False, **kwargs):
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches
        self.use_stateful_dataloader = use_stateful_dataloader

    base_dataloader = _ItselfAsBase()  # Accelerate's adapters wrap a torch loader; accel's loader is that loader

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)

    def __iter__(self):
        yield from itertools.islice(super().__iter__(), self.skip_batches, None)


def followed_generator(loader: DataLoader):
    """The user's `torch.Generator` that a prepared loader's shuffle follows (a kept RandomSampler's), or None."""
    sampler = loader._order_sampler() if isinstance(loader, DataLoaderShard) else None
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, (SeedableRandomSampler,
                                                                      GlobalSeedRandomSampler)):
        return sampler.generator
    return None


_STATEFUL_BUILT: dict[str, type] = {}  # name -> class, made on first use by stateful_classes


def stateful_classes() -> tuple[type, type, type]:
    """`StatefulDataLoaderShard`, `StatefulDataLoaderDispatcher` and `StatefulSkipDataLoader`: this module's loaders
    on torchdata's StatefulDataLoader (an optional extra: a one-line ImportError naming it when missing, asked each
    call) with accel.data.stateful's mix-ins, built once and kept as this module's attributes (so they pickle)."""
    try:
        from accel.data.stateful import DispatcherPosition, Position, SkipLoaderInit, StatefulDataLoader
    except ImportError as error:
        raise ImportError("use_stateful_dataloader=True needs torchdata (its StatefulDataLoader); install it with "
                          "`pip install 'accel-train[torchdata]'` or `pip install torchdata`") from error
    if not _STATEFUL_BUILT:
        for name, bases, doc in (
                ("StatefulDataLoaderShard", (Position, DataLoaderShard, StatefulDataLoader),
                 "A `DataLoaderShard` whose base loader is a `StatefulDataLoader`."),
                ("StatefulDataLoaderDispatcher", (DispatcherPosition, DataLoaderDispatcher, StatefulDataLoader),
                 "A `DataLoaderDispatcher` whose main process reads through a `StatefulDataLoader`."),
                ("StatefulSkipDataLoader", (SkipLoaderInit, SkipDataLoader, StatefulDataLoader),
                 "A `SkipDataLoader` on torchdata's `StatefulDataLoader`.")):
            _STATEFUL_BUILT[name] = globals()[name] = type(
                name, bases, {"__doc__": doc, "__module__": __name__, "__qualname__": name})
    built = _STATEFUL_BUILT
    return built["StatefulDataLoaderShard"], built["StatefulDataLoaderDispatcher"], built["StatefulSkipDataLoader"]


def __getattr__(name: str):
    """The stateful loader classes by name (torchdata imported only then)."""
    if name in ("StatefulDataLoaderShard", "StatefulDataLoaderDispatcher", "StatefulSkipDataLoader"):
        stateful_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
