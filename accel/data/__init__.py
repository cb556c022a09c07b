"""Data loading: each process's share of a DataLoader (`loading`: shards, the dispatcher, samplers, skipping) and
torchdata's StatefulDataLoader variants (`stateful`: its mix-ins; the loaders are built on first use)."""

from accel.data.loading import (
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

__all__ = ["BatchSamplerShard", "DataLoaderConfiguration", "DataLoaderDispatcher", "DataLoaderShard",
           "IterableDatasetShard", "SeedableRandomSampler", "SkipBatchSampler", "SkipDataLoader", "prepare_data_loader",
           "skip_first_batches"]
