"""DataModule: datasets in, batches out; seeded, shardable and resumable at any batch of an epoch.

Two ways to make batches, same order:
- the in-memory fast path, for datasets made of tensors (a `TensorDataset`, or anything exposing `.tensors`)
  when no worker processes are asked for: each epoch permutes the tensors once, then yields contiguous
  slices, so a batch costs a view instead of `batch_size` lookups and a collate;
- a `torch.utils.data.DataLoader` with our `EpochSampler`, for everything else, and for any dataset given a
  `collate_fn` (built by `_target_`, as Lightning's loaders take one: text of varying lengths, dicts, ...).
Either way the order depends only on (seed, epoch, rank, world size), never on the global RNG, so a run
resumed at batch k of an epoch sees exactly the batches an uninterrupted run would.

A split that is a `torch.utils.data.IterableDataset` (WebDataset shards, a token stream, any generator) is a
`framework.data.streaming.Stream`: the same `batches(split, epoch, start_batch)`, every sample once per epoch.

`folds=K, fold=i` (k-fold cross-validation, framework/data/folds.py): fold i of the train split is the val split, the
other folds the train split.

Several validation or test sets (Lightning's list of val/test loaders): `val` stays the default set; `val_sets` (and
`test_sets`) map a name to a dataset each, evaluated after it in config order (dataloader_idx 1, 2, ...). Each is a
split of its own here, keyed by its config path (`val_sets.noisy`), so it is batched, sharded and identified as `val`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Optional, Sequence, Sized, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset

import framework.data.folds as kfold
from framework.config.instantiate import FULL_ERROR_HINT, error_line
from framework.core.errors import ConfigError, UserError
from framework.core.reproducibility import generator, worker_seed
from framework.data.streaming import Stream

log = logging.getLogger(__name__)


class EpochSampler(Sampler[int]):
    """Per-epoch seeded order, sharded over ranks (like DistributedSampler) and started at any position."""

    def __init__(
        self, size: int, *, shuffle: bool, seed: int = 0, rank: int = 0, world_size: int = 1, pad: bool = True
    ) -> None:
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.pad = rank, world_size, pad
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order and skip its first `start` samples of this rank (already consumed)."""
        self.epoch, self.start = epoch, start

    def order(self) -> torch.Tensor:
        """All indices of this rank for the current epoch, including the skipped ones."""
        if self.shuffle:
            order = torch.randperm(self.size, generator=generator(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        if self.world_size > 1:
            if self.pad:  # every rank gets the same number of samples, so collectives stay in step
                total = math.ceil(self.size / self.world_size) * self.world_size
                order = torch.cat([order, order[: total - self.size]])
            order = order[self.rank :: self.world_size]
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start :].tolist())

    def __len__(self) -> int:
        return len(self.order()) - self.start


class TensorBatches:
    """The in-memory fast path: one gather per tensor per epoch, then a view per batch."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], sampler: EpochSampler, batch_size: int, drop_last: bool
    ) -> None:
        self.tensors, self.sampler, self.batch_size, self.drop_last = tensors, sampler, batch_size, drop_last

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        order = self.sampler.order()
        n = len(order) - len(order) % self.batch_size if self.drop_last else len(order)
        order = order[self.sampler.start : n]
        # A copy even without shuffling, so that a step changing its batch in place cannot change the dataset;
        # index_select takes a third of the time of `t[order]` on CPU, for the same result.
        permuted = [t.index_select(0, order.to(t.device)) for t in self.tensors]
        for i in range(0, len(order), self.batch_size):
            yield tuple(t[i : i + self.batch_size] for t in permuted)

    def __len__(self) -> int:
        return _num_batches(len(self.sampler), self.batch_size, self.drop_last)


def _num_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def dataset_tensors(dataset: Dataset) -> Optional[Sequence[torch.Tensor]]:
    """The tensors a dataset is made of, when it is made of tensors (TensorDataset or `.tensors`)."""
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, (tuple, list)) and tensors and all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors
    return None


class DataModule:
    """Holds the train/val/test datasets and the loader options from `data.*` in the config.

    `num_classes`, `input_shape` and `root` describe the data for the rest of the config (the model reads
    `${data.num_classes}`, datasets read `${data.root}`); the DataModule itself only batches. `collate_fn` turns
    a list of samples into a batch (default: torch's default_collate), e.g.
    `collate_fn: {_target_: experiments.lm.next_token_batch, _partial_: true}`.
    """

    def __init__(
        self,
        train: Dataset,
        val: Optional[Dataset] = None,
        test: Optional[Dataset] = None,
        *,
        num_classes: Optional[int] = None,
        input_shape: Optional[Sequence[int]] = None,
        root: Optional[str] = None,
        batch_size: int = 64,
        eval_batch_size: Optional[int] = None,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: Optional[int] = None,
        collate_fn: Optional[Callable[[list], Any]] = None,
        shuffle_buffer: int = 1000,
        skip_corrupt: bool = False,
        train_shards: Optional[str] = None,
        val_shards: Optional[str] = None,
        test_shards: Optional[str] = None,
        folds: Optional[int] = None,
        fold: Optional[int] = None,
        val_sets: Optional[Mapping[str, Optional[Dataset]]] = None,
        test_sets: Optional[Mapping[str, Optional[Dataset]]] = None,
    ) -> None:
        self.datasets: dict[str, Optional[Dataset]] = {"train": train, "val": val, "test": test}
        for split, named in (("val", val_sets), ("test", test_sets)):
            self.datasets.update({f"{split}_sets.{name}": dataset for name, dataset in (named or {}).items()})
        kfold.check(folds, fold)
        self.folds, self.fold = folds, fold
        self.fold_split: Optional[kfold.FoldSplit] = None  # made by setup, from the run's seed
        self.num_classes, self.input_shape, self.root = num_classes, input_shape, root
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        if collate_fn is not None and not callable(collate_fn):
            raise ConfigError(
                f"data.collate_fn={collate_fn!r}: expected a callable turning a list of samples into a "
                "batch, e.g. {_target_: my_module.my_collate, _partial_: true}"
            )
        self.collate_fn = collate_fn
        self.loader_options: dict[str, Any] = {
            "num_workers": num_workers,
            "pin_memory": pin_memory and torch.cuda.is_available(),  # pinning without a GPU only warns
            "persistent_workers": persistent_workers and num_workers > 0,
            "prefetch_factor": prefetch_factor if num_workers > 0 else None,
        }
        self._loaders: dict[str, tuple[EpochSampler, Iterable]] = {}
        self.shuffle_buffer, self.skip_corrupt = shuffle_buffer, skip_corrupt
        self.streams: dict[str, Stream] = {}

    def has(self, split: str) -> bool:
        return self.datasets.get(split) is not None

    def sets(self, split: str) -> dict[str, str]:
        """The sets `split` is evaluated on, in order (their position is Lightning's dataloader_idx): each one's key
        in `datasets` (and under `data.`), to its name, "" for the split's own (`val`), the default set."""
        found = {split: ""} if self.has(split) else {}
        prefix = f"{split}_sets."
        found.update({key: key[len(prefix) :] for key in self.datasets if key.startswith(prefix) and self.has(key)})
        return found

    def setup(self, seed: int, rank: int = 0, world_size: int = 1) -> None:
        """Build one loader per split; they are reused every epoch (so persistent workers persist)."""
        if self.folds is not None and self.fold is not None and self.fold_split is None:
            self._cut_fold(seed)
        for split, dataset in self.datasets.items():
            if dataset is None:
                continue
            train = split == "train"
            _check_dataset(split, dataset)
            if isinstance(dataset, IterableDataset):
                self.streams[split] = self._stream(split, dataset, seed, rank, world_size)
                continue
            try:
                size = len(cast(Sized, dataset))  # a map-style dataset's size; a wrong one fails here
            except Exception as err:  # e.g. a negative size in the dataset's config
                raise ConfigError(
                    f"data.{split}: len() of {type(dataset).__name__} failed ({err}); "
                    f"expected a dataset with a size >= 0"
                ) from None
            sampler = EpochSampler(
                size, shuffle=train and self.shuffle, seed=seed, rank=rank, world_size=world_size, pad=train
            )
            batch_size = self.batch_size if train else self.eval_batch_size
            drop_last = self.drop_last and train
            tensors = dataset_tensors(dataset)
            if tensors is not None and self.loader_options["num_workers"] == 0 and self.collate_fn is None:
                loader: Iterable = TensorBatches(tensors, sampler, batch_size, drop_last)
            else:
                loader = self._data_loader(split, sampler)
            self._loaders[split] = (sampler, loader)

    def _cut_fold(self, seed: int) -> None:
        """data.folds/data.fold: the val split is fold `fold` of the train split, the train split the other folds
        (stratified by label when the data names its classes: num_classes)."""
        assert self.folds is not None and self.fold is not None
        train = self.datasets["train"]
        assert train is not None  # the constructor's first argument
        _check_dataset("train", train)
        made = kfold.make(train, self.folds, self.fold, seed, stratify=self.num_classes is not None)
        self.datasets["train"], self.datasets["val"] = kfold.subset(train, made.train), kfold.subset(train, made.val)
        self.fold_split = made

    def _stream(self, split: str, dataset: IterableDataset, seed: int, rank: int, world_size: int) -> Stream:
        train = split == "train"
        return Stream(
            dataset,
            split,
            batch_size=self.batch_size if train else self.eval_batch_size,
            drop_last=self.drop_last and train,
            shuffle=train and self.shuffle,
            shuffle_buffer=self.shuffle_buffer,
            seed=seed,
            rank=rank,
            world_size=world_size,
            collate_fn=self.collate_fn,
            loader_options=self.loader_options,
        )

    def skipped(self) -> tuple[int, dict[str, set[int]]]:
        """Bad samples skipped (data.skip_corrupt): how many indexing found (the same on every rank), and the
        storage positions of those found while reading on this rank, by split."""
        indexed = sum(getattr(s.dataset, "bad", 0) for s in self.streams.values())
        return indexed, {split: s.bad for split, s in self.streams.items()}

    def _data_loader(self, split: str, sampler: EpochSampler) -> DataLoader:
        train = split == "train"
        dataset = self.datasets[split]
        assert dataset is not None  # loaders are made only for the splits that have a dataset
        return DataLoader(
            dataset,
            batch_size=self.batch_size if train else self.eval_batch_size,
            sampler=sampler,
            drop_last=self.drop_last and train,
            generator=generator(sampler.seed),
            collate_fn=self.collate_fn,
            **self.loader_options,
        )

    def batches(self, split: str, epoch: int = 0, start_batch: int = 0) -> Iterable:
        """The batches of `split` for `epoch`, skipping the first `start_batch` ones without loading them."""
        if split in self.streams:
            return self.streams[split].batches(epoch, start_batch)
        sampler, loader = self._loaders[split]
        batch_size = self.batch_size if split == "train" else self.eval_batch_size
        sampler.set_epoch(epoch, start_batch * batch_size)
        if isinstance(loader, DataLoader):
            # worker seeds follow the epoch, not global RNG, and the rank: each rank augments its samples its own way
            loader.generator.manual_seed(worker_seed(sampler.seed, epoch, sampler.rank))
        return loader

    def first_batch(self, split: str) -> Any:
        """The first batch of `split` (None if it has none), for the trainer's check before training; a dataset
        or collate failing to make it is reported as `data.<split>`."""
        try:
            return next(iter(self.batches(split)), None)
        except UserError:
            raise
        except Exception as err:
            raise ConfigError(
                f"data.{split}: making its first batch raised {error_line(err)}; expected samples "
                "of tensors, numbers or numpy arrays (e.g. images through a ToTensor transform) "
                f"{FULL_ERROR_HINT}"
            ) from err

    def predict_batches(
        self,
        split_or_dataset: str | Dataset,
        rank: int = 0,
        world_size: int = 1,
        skip: Collection[int] = frozenset(),
        *,
        seed: int = 0,
    ) -> Iterator[tuple[torch.Tensor, Any]]:
        """`(indices, batch)` for a predict run: this rank's unpadded shard of a split (its name) or of a dataset
        (rank, rank + world_size, ...: framework.stages.predictions.predict_indices), in dataset order, less the indices
        in `skip` (written by an earlier attempt), in batches of `eval_batch_size`, none dropped; `indices` holds
        each sample's index in the dataset (int64). Batches are made as `batches` makes them: the in-memory fast
        path for tensors, else a DataLoader with this module's collate and worker options (workers seeded from
        `seed` and the rank)."""
        split = split_or_dataset if isinstance(split_or_dataset, str) else "predict"
        dataset = self.datasets.get(split) if isinstance(split_or_dataset, str) else split_or_dataset
        if dataset is None:
            raise ConfigError(f"data.{split}: no dataset; expected a dataset node with a _target_")
        _check_dataset(split, dataset)
        if isinstance(dataset, IterableDataset):
            raise ConfigError(
                f"data.{split}: {type(dataset).__name__} is a stream; predict writes rows by dataset index, so "
                "expected a map-style dataset (__len__ and __getitem__)"
            )
        shard = EpochSampler(len(cast(Sized, dataset)), shuffle=False, rank=rank, world_size=world_size, pad=False)
        order = shard.order().to(torch.int64)
        if skip:  # (a Python loop over every index costs ~0.3 us each: a tenth of a small model's time per sample)
            order = order[~torch.isin(order, torch.tensor(sorted(skip), dtype=torch.int64))]
        size = self.eval_batch_size
        tensors = dataset_tensors(dataset)
        if tensors is not None and self.loader_options["num_workers"] == 0 and self.collate_fn is None:
            for start in range(0, len(order), size):
                rows = order[start : start + size]
                first, last = int(rows[0]), int(rows[-1])
                if last - first + 1 == len(rows):  # consecutive (one rank, nothing skipped): views, as x[i:j]
                    yield rows, tuple(t[first : last + 1] for t in tensors)
                else:
                    yield rows, tuple(t.index_select(0, rows.to(t.device)) for t in tensors)
            return
        loader = DataLoader(
            Subset(dataset, order.tolist()),
            batch_size=size,
            shuffle=False,
            generator=generator(worker_seed(seed, 0, rank)),
            collate_fn=self.collate_fn,
            **self.loader_options,
        )
        for start, batch in zip(range(0, len(order), size), loader):
            yield order[start : start + size], batch

    def close(self) -> None:
        """Stop the persistent worker processes now, each asked to exit and joined (exit code 0), rather than when
        the process ends. A DataLoader's workers live as long as it does (torch's `persistent_workers`), so each
        is dropped for a new one, which starts its own workers if it is used again."""
        for stream in self.streams.values():
            stream.close()
        for split, (sampler, loader) in list(self._loaders.items()):
            if isinstance(loader, DataLoader) and loader.persistent_workers:
                self._loaders[split] = (sampler, self._data_loader(split, sampler))

    def identity(self) -> dict[str, dict[str, Any]]:
        """Each split's number of samples and, for a stream read from files (`paths`), each file (its path or URL) with
        its samples and bytes: what a resume compares with the run's (`check_data`). Nothing is read but the files'
        sizes."""
        found: dict[str, dict[str, Any]] = {}
        for split, stream in self.streams.items():
            found[split] = {"samples": stream.samples, **_shard_files(stream.dataset, stream.sizes)}
        for split, (sampler, _) in self._loaders.items():
            found[split] = {"samples": sampler.size}
        return found

    def num_batches(self, split: str) -> int:
        """Batches in one full epoch of `split` on this rank."""
        if split in self.streams:
            return self.streams[split].batches_n
        sampler, loader = self._loaders[split]
        batch_size = self.batch_size if split == "train" else self.eval_batch_size
        return _num_batches(len(sampler.order()), batch_size, self.drop_last and split == "train")


def _check_dataset(split: str, dataset: Any) -> None:
    """A config value that is not a dataset (a dotted path without `_target_`, a node without one), or one
    that is neither indexed (the sampler draws indices, so the order is seeded and resumable) nor a stream."""
    if isinstance(dataset, (str, bytes, int, float, Mapping)):
        raise ConfigError(
            f"data.{split}={dataset!r}: expected a dataset node with a _target_, e.g. "
            f"data.{split}._target_=torchvision.datasets.FakeData, or null"
        )
    if not isinstance(dataset, IterableDataset) and not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            f"data.{split}: {type(dataset).__name__} cannot be indexed; expected a map-style "
            "dataset (__len__ and __getitem__), which the seeded, resumable order needs, or a "
            "torch.utils.data.IterableDataset"
        )


def _shard_files(dataset: Any, sizes: list[int]) -> dict[str, Any]:
    """`{"shards": [[file, samples, bytes], ...]}` for a stream read from files (`paths`, one per shard: local paths,
    or URLs, whose bytes its `shard_bytes()` gives), else {}."""
    paths = getattr(dataset, "paths", None)
    if not isinstance(paths, (list, tuple)) or len(paths) != len(sizes):
        return {}
    known = getattr(dataset, "shard_bytes", None)
    nbytes = known() if callable(known) else [os.stat(path).st_size for path in paths]
    return {"shards": [[str(path), size, n] for path, size, n in zip(paths, sizes, nbytes)]}


# ---------------------------------------------------------------------------------------------- the data's identity
# A run's data is identified, cheaply, by each split's number of samples, its shard files (their samples and bytes)
# and the config it is made from (the split's node and every key its `${...}` reach: `sources` in
# framework/config/schema.py). It is recorded when the run starts, kept in every checkpoint's meta.json
# (`data_identity`), and a resume on other data is refused in one line: the epoch's order, and the position in it, were
# planned on the old data. With resume_on_new_data=true the new data is taken: training goes on from the next epoch's
# batch 0.
NEW_DATA_KEY = "resume_on_new_data"
_UNSET = "(unset)"


@dataclass
class DataCheck:
    """A resumed run's data against its checkpoint's record."""

    record: dict[str, Any]  # what this run's checkpoints record: the run's, with what resume_on_new_data took
    changed: dict[str, str]  # split -> what differs from the record, taken by resume_on_new_data

    def announcement(self, epoch: int, step: int) -> str:
        """The one line a resume on new data says (`epoch`: where training goes on, after `start_next_epoch`)."""
        what = "; ".join(self.changed.values())
        then = f"epoch {epoch} starts from batch 0 on it, at step {step}, with the run's weights and optimizer"
        if "train" not in self.changed:
            then = "the training position stays; the new splits are used from their next round on"
        return f"Resuming on new data ({NEW_DATA_KEY}=true): {what}; {then}"


def check_data(current: dict[str, Any], saved: Any, *, accept: bool, where: str) -> DataCheck:
    """`current` (each split's identity now) against `saved` (the checkpoint's record, None in one saved before it
    existed): a split that differs is refused in one line naming the key and both values, unless `accept`."""
    if not isinstance(saved, dict):
        log.debug(
            "resume: %s records no data identity (saved before it was recorded): nothing to compare this run's "
            "data with; it is recorded from now on",
            where,
        )
        return DataCheck(current, {})
    changed: dict[str, str] = {}
    for split, now in current.items():
        was = saved.get(split)
        difference = _difference(split, was, now) if isinstance(was, dict) else None
        if difference is None:
            continue
        if not accept:
            raise ConfigError(
                f"{difference.refusal}, and a resume goes on with the order planned on that data; expected "
                f"{difference.expected}, or {NEW_DATA_KEY}=true to start the next epoch (from batch 0) on the new data"
            )
        changed[split] = difference.described
    return DataCheck({**current, **saved} if not changed else {**saved, **current}, changed)


@dataclass
class _Difference:
    described: str  # for the line a resume on new data says
    refusal: str  # the refusal's first part: the key, both values
    expected: str


def _counts(was: dict[str, Any], now: dict[str, Any]) -> str:
    def count(identity: dict[str, Any]) -> str:
        shards = identity.get("shards")
        return f"{identity.get('samples')} samples" + (f" in {len(shards)} shards" if isinstance(shards, list) else "")

    return f"then {count(was)}, now {count(now)}"


def _difference(split: str, was: dict[str, Any], now: dict[str, Any]) -> Optional[_Difference]:
    """How a split's identity differs from its record, or None. The key named is one the command line sets: a key the
    split's node interpolates before the node's own."""
    old_config: dict[str, Any] = was["config"] if isinstance(was.get("config"), dict) else {}
    new_config: dict[str, Any] = now["config"]
    keys = set(old_config) | set(new_config) if old_config else set()  # a record without its config: counts alone
    differ = sorted(k for k in keys if old_config.get(k, _UNSET) != new_config.get(k, _UNSET))
    counts = _counts(was, now)
    if differ:
        key = min(differ, key=lambda k: (k.startswith(f"data.{split}."), k))
        old, new = old_config.get(key, _UNSET), new_config.get(key, _UNSET)
        return _Difference(
            f"{key}: {old!r} -> {new!r} (data.{split}: {counts})",
            f"{key}={new!r}: the run's data.{split} was made with {key}={old!r} ({counts})",
            f"{key}={old!r}",
        )
    if was.get("samples") == now["samples"] and was.get("shards") == now.get("shards"):
        return None
    files = next(
        (
            f"{b[0]}: {b[1]} samples, {b[2]} bytes now; {a[1]}, {a[2]} then"
            for a, b in zip(was.get("shards") or [], now.get("shards") or [])
            if a != b
        ),
        "",
    )
    same = f"data.{split}: {counts}, from the same config{f' (first difference: {files})' if files else ''}"
    return _Difference(same, same, "the data the run was saved with")
