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
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

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


# ----------------------------------------------------------------------------------------------------------
# Samplers
# ----------------------------------------------------------------------------------------------------------
class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order is a pure function of (seed, epoch), identical on every rank.

    It never reads the global RNG, so iterating it cannot perturb model initialisation or dropout.
    """

    def __init__(self, data_source, replacement: bool = False, num_samples: Optional[int] = None,
                 seed: Optional[int] = None, generator=None, data_seed: Optional[int] = None):
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        # Accelerate's order of precedence: data_seed, else the seed torch was given (set_seed)
        chosen = data_seed if data_seed is not None else seed
        self.seed = int(torch.random.initial_seed() if chosen is None else chosen)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        n = len(self.data_source)
        if not self.replacement and self.num_samples == n:
            yield from torch.randperm(n, generator=generator).tolist()
        else:  # replacement / custom num_samples: torch's algorithm, fed our generator
            yield from RandomSampler(self.data_source, self.replacement, self.num_samples, generator=generator)
        self.epoch += 1  # as Accelerate's: a plain DataLoader over it reshuffles each pass (prepared ones set it)


def _global_draw() -> int:
    """One int64 from the global RNG, as torch's DataLoader and RandomSampler draw their seeds."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class GlobalSeedRandomSampler(RandomSampler):
    """torch's `RandomSampler` without a generator (one global draw per epoch, the same order), which also remembers
    the epoch's seed, so a run resumed mid-epoch shuffles as the uninterrupted one did without drawing again."""

    def __init__(self, data_source, replacement: bool = False, num_samples: Optional[int] = None):
        super().__init__(data_source, replacement=replacement, num_samples=num_samples)
        self.epoch_seed: Optional[int] = None  # the seed of the epoch being read
        self.resume_seed: Optional[int] = None  # set by a loader's load_state_dict: the next pass uses it

    def __iter__(self) -> Iterator[int]:
        seed, self.resume_seed = (_global_draw() if self.resume_seed is None else self.resume_seed), None
        self.epoch_seed = seed
        yield from RandomSampler(self.data_source, self.replacement, self._num_samples,
                                 generator=torch.Generator().manual_seed(seed))


class _Head:
    """The first items of an epoch, kept so an incomplete last round can be padded by wrapping around."""

    def __init__(self, limit: int):
        self.limit = limit
        self.items: list = []

    def add(self, items) -> None:
        if len(self.items) < self.limit:
            self.items.extend(items[: self.limit - len(self.items)])

    def take(self, count: int) -> list:
        return [self.items[i % len(self.items)] for i in range(count)]


def _split_message(what: str, num_processes: int) -> str:
    """split_batches' refusal, in Accelerate's words ("a round multiple"), naming the value and the process count."""
    return f"split_batches=True needs {what} to be a round multiple of num_processes ({num_processes})."


class BatchSamplerShard(Sampler):
    """Yields this rank's batches of indices out of `batch_sampler`'s global batches.

    Default: round-robin, rank r gets global batches r, r+N, r+2N, ... With `split_batches`, every global
    batch is cut into N contiguous parts and rank r gets part r. With `even_batches` (and N > 1) the last
    round is padded with indices from the start of the epoch so all ranks get equally many full batches;
    `remainder` then records how many real samples that round had (-1 when nothing was padded).
    `skip_batches` drops this rank's first batches at the index level, so their data is never loaded.
    """

    def __init__(
        self,
        batch_sampler,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ):
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        # Only torch's own BatchSampler guarantees fixed-size batches; custom ones may vary (None).
        self.batch_size = batch_sampler.batch_size if type(batch_sampler) is BatchSampler else None
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches and getattr(batch_sampler, "batch_size", None) is None:  # refused as Accelerate does
            raise ValueError(f"split_batches=True needs a batch sampler with a batch_size; this "
                             f"{type(batch_sampler).__name__} has none (its batches may vary in size); allowed: a "
                             f"batch sampler whose batch_size is a round multiple of num_processes ({num_processes}), "
                             "or split_batches=False")
        if split_batches and self.batch_size is not None and self.batch_size % num_processes:
            raise ValueError(
                _split_message(f"batch_size ({self.batch_size})", num_processes)
            )
        self.skip_batches = 0
        self.remainder = -1

    @property
    def _pads(self) -> bool:
        return self.even_batches and self.num_processes > 1

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to whichever inner object reshuffles with it."""
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)
        elif hasattr(getattr(self.batch_sampler, "sampler", None), "set_epoch"):
            self.batch_sampler.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return max(self._epoch_length() - self.skip_batches, 0)

    def _epoch_length(self) -> int:
        n_global, n, r = len(self.batch_sampler), self.num_processes, self.process_index
        if self.split_batches:
            if self.batch_size is None or self._pads or self.drop_last or n == 1:
                return n_global
            last = len(self.batch_sampler.sampler) % self.batch_size  # short last batch, if any
            reaches_me = last > r * (self.batch_size // n)
            return n_global if last == 0 or reaches_me else n_global - 1
        if self.drop_last:
            return n_global // n
        if self._pads:
            return math.ceil(n_global / n)
        return n_global // n + (1 if r < n_global % n else 0)

    def __iter__(self) -> Iterator[list]:
        self.remainder = -1
        batches = self._split() if self.split_batches else self._round_robin()
        yield from itertools.islice(batches, self.skip_batches, None)

    # -- default: whole batches, round-robin ----------------------------------------------------------
    def _round_robin(self) -> Iterator[list]:
        n, b = self.num_processes, self.batch_size
        head = _Head(n * b if b is not None else n)  # indices (fixed b) or whole batches (custom sampler)
        round_: list = []
        for batch in self.batch_sampler:
            batch = list(batch)
            head.add(batch if b is not None else [batch])
            round_.append(batch)
            if len(round_) == n and (b is None or len(batch) == b or not self._pads):
                yield round_[self.process_index]
                round_ = []
        if round_:
            yield from self._last_round(round_, head)

    def _last_round(self, round_: list, head: _Head) -> Iterator[list]:
        n, b, r = self.num_processes, self.batch_size, self.process_index
        if self.drop_last and len(round_) < n:
            return
        if not self._pads:
            if r < len(round_):
                yield round_[r]
            return
        self.remainder = sum(len(batch) for batch in round_)
        if b is None:  # variable-size batches: pad with whole batches from the epoch's start
            yield (round_ + head.take(n - len(round_)))[r]
            return
        flat = [i for batch in round_ for i in batch]
        flat += head.take(n * b - len(flat))
        yield flat[r * b : (r + 1) * b]

    # -- split_batches: every global batch cut into N parts --------------------------------------------
    def _split(self) -> Iterator[list]:
        n, b, r = self.num_processes, self.batch_size, self.process_index
        head = _Head(b or 0)
        for batch in self.batch_sampler:
            batch = list(batch)
            if b is None:
                if len(batch) % n:
                    raise ValueError(
                        _split_message(f"every batch's size ({len(batch)})", n)
                    )
                part = len(batch) // n
                yield batch[r * part : (r + 1) * part]
                continue
            head.add(batch)
            part = b // n
            if len(batch) < b and self._pads:
                self.remainder = len(batch)
                batch = batch + head.take(b - len(batch))
            piece = batch[r * part : (r + 1) * part]
            if piece:
                yield piece


class _PerSampleShard(Sampler):
    """Adapts a BatchSamplerShard over batches of one index to a plain sampler (loaders with batch_size=None)."""

    def __init__(self, shard: BatchSamplerShard):
        self.shard = shard

    def __len__(self) -> int:
        return len(self.shard)

    def __iter__(self) -> Iterator[int]:
        for batch in self.shard:
            yield batch[0]


class SkipBatchSampler(Sampler):
    """Wraps a (batch) sampler and drops its first `skip_batches` items, so skipped data is never loaded."""

    def __init__(self, batch_sampler, skip_batches: int = 0):
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)

    def __iter__(self):
        yield from itertools.islice(iter(self.batch_sampler), self.skip_batches, None)


# ----------------------------------------------------------------------------------------------------------
# Iterable datasets
# ----------------------------------------------------------------------------------------------------------
class IterableDatasetShard(IterableDataset):
    """This rank's items of an iterable dataset that every rank reads in full.

    Items are buffered in chunks of N*b (b with `split_batches`); rank r keeps the r-th slice of each chunk,
    which the loader then batches by the slice size. A final partial chunk is dropped (`drop_last`), padded
    by cycling from the first items seen (`even_batches`, N > 1; `remainder` = its real item count), or
    shared out as it is. `remainder` is only visible to the main process, i.e. with num_workers=0.
    """

    def __init__(
        self,
        dataset,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ):
        if split_batches and batch_size % num_processes:
            raise ValueError(
                _split_message(f"batch_size ({batch_size})", num_processes)
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.chunk_size = batch_size if split_batches else batch_size * num_processes
        self.part = self.chunk_size // num_processes  # items this rank takes per chunk
        self.epoch = 0
        self.remainder = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        full, rest = divmod(len(self.dataset), self.chunk_size)
        if rest == 0 or self.drop_last:
            return full * self.part
        if self.even_batches and self.num_processes > 1:
            return (full + 1) * self.part
        return full * self.part + min(max(rest - self.process_index * self.part, 0), self.part)

    def __iter__(self):
        self.remainder = -1
        head, chunk = _Head(self.chunk_size), []
        for item in self.dataset:
            head.add([item])
            chunk.append(item)
            if len(chunk) == self.chunk_size:
                yield from self._mine(chunk)
                chunk = []
        if not chunk or self.drop_last:
            return
        if self.even_batches and self.num_processes > 1:
            self.remainder = len(chunk)
            chunk = chunk + head.take(self.chunk_size - len(chunk))
        yield from self._mine(chunk)

    def _mine(self, chunk: list) -> list:
        start = self.process_index * self.part
        return chunk[start : start + self.part]


# ----------------------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------
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


def followed_generator(loader: DataLoader):
    """The user's `torch.Generator` that a prepared loader's shuffle follows (a kept RandomSampler's), or None."""
    sampler = loader._order_sampler() if isinstance(loader, DataLoaderShard) else None
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, (SeedableRandomSampler,
                                                                      GlobalSeedRandomSampler)):
        return sampler.generator
    return None


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
