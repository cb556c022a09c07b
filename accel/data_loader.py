"""Accelerate's module name for the data-loading API (`from accelerate.data_loader import ...`):
accel.data.loading's."""

import abc

from accel.data.loading import (  # noqa: F401
    BatchSamplerShard,
    DataLoaderConfiguration,
    DataLoaderDispatcher,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)


class DataLoaderStateMixin(abc.ABC):  # noqa: B024 (no abstract method: a marker with Accelerate's members)
    """Accelerate's base of its prepared loaders: `end_of_dataloader` (True while the last batch is processed) and
    `remainder` (real samples in the last, padded round; -1: none). accel's DataLoaderShard and DataLoaderDispatcher
    keep both themselves; they are registered as its subclasses so Accelerate's isinstance checks hold."""

    end_of_dataloader = False
    remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1


DataLoaderStateMixin.register(DataLoaderShard)  # DataLoaderDispatcher is a DataLoaderShard
