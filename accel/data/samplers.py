"""What each process reads of an epoch: seedable random samplers, the batch-sampler shard (round robin or split
batches, padded to even rounds), the iterable-dataset shard, and a sampler that skips the first batches.

The prepared loaders (`prepared_loaders`) iterate these; `loading.prepare_data_loader` picks them.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Optional

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, Sampler



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
