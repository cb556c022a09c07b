"""Accelerate's module name for the data-loading API (`from accelerate.data_loader import ...`): accel.data's."""

from accel.data import (  # noqa: F401
    BatchSamplerShard,
    DataLoaderConfiguration,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    SkipDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
