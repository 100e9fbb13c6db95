"""The data: a `DataModule` serves map-style datasets (a seeded, sharded, resumable sampler; `module`) and streaming
ones (`streaming`, WebDataset tar shards in `shards`, local or at a URL: `shard_files`) behind the same
`batches(split, epoch)`, and cuts k folds (`folds`)."""

from framework.data.module import DataModule

__all__ = ["DataModule"]
