"""k-fold cross-validation of a map-style training set: `data.folds=K data.fold=i`.

The train split is cut into K folds, seeded by the run's seed (the same partition in every job of a sweep that
shares it, whatever its fold) and, when every sample has a class label, stratified: each class is shuffled and
dealt round-robin over the folds, so every fold holds each class in proportion and fold sizes differ by at most
one (sklearn's StratifiedKFold makes the same promise). Fold i is the validation split, the other K - 1 the
training split; the test split is left as it is. `folds.json` in the run directory records the fold's sample
indices (positions in data.train), so a fold can be checked and re-run exactly.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sized, cast

import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from framework.core.errors import ConfigError
from framework.core.reproducibility import generator

log = logging.getLogger(__name__)
RECORD = "folds.json"


@dataclass
class FoldSplit:
    """Fold `fold` of `folds`: the training and validation samples, as indices into the original train split."""

    folds: int
    fold: int
    seed: int
    stratified: bool
    train: torch.Tensor
    val: torch.Tensor

    def record(self) -> dict[str, Any]:
        return {
            "folds": self.folds,
            "fold": self.fold,
            "seed": self.seed,
            "stratified": self.stratified,
            "train": self.train.tolist(),
            "val": self.val.tolist(),
        }


def check(folds: Optional[int], fold: Optional[int]) -> None:
    """The two keys together: both null (off), or K >= 2 and 0 <= i < K."""
    if folds is None and fold is None:
        return
    if folds is None:
        raise ConfigError(f"data.fold={fold!r}: data.folds is null; expected data.folds=K (K >= 2) beside it")
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise ConfigError(f"data.folds={folds!r}: expected null (no cross-validation) or a whole number of folds >= 2")
    if isinstance(fold, bool) or not isinstance(fold, int) or not 0 <= fold < folds:
        shown = "null" if fold is None else repr(fold)
        raise ConfigError(
            f"data.fold={shown}: expected the validation fold, a whole number in 0..{folds - 1} (data.folds={folds}); "
            f"a sweep runs them all: -m data.folds={folds} 'data.fold=range({folds})'"
        )


def labels(dataset: Dataset, size: int) -> Optional[torch.Tensor]:
    """Every sample's class (int64), or None when a sample has none: a TensorDataset's second tensor, a
    torchvision data set's `targets`, a Subset's share of its data set's, else each sample's second item."""
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, (tuple, list)) and len(tensors) >= 2 and isinstance(tensors[1], torch.Tensor):
        found: Optional[torch.Tensor] = tensors[1]
    elif isinstance(dataset, Subset):
        inner = labels(dataset.dataset, len(cast(Sized, dataset.dataset)))
        found = None if inner is None else inner[torch.as_tensor(list(dataset.indices), dtype=torch.int64)]
    elif getattr(dataset, "targets", None) is not None:
        try:
            found = torch.as_tensor(dataset.targets)  # type: ignore[attr-defined]
        except (TypeError, ValueError, RuntimeError):
            found = None
    else:
        found = _read_labels(dataset, size)
    if found is None or found.shape != (size,) or found.dtype.is_floating_point or found.dtype == torch.bool:
        return None
    return found.to(torch.int64)


def _read_labels(dataset: Dataset, size: int) -> Optional[torch.Tensor]:
    """Each sample's second item, read once (a data set that keeps no `targets`)."""
    found = []
    for i in range(size):
        sample = dataset[i]
        if not isinstance(sample, (tuple, list)) or len(sample) < 2:
            return None
        label = sample[1]
        if isinstance(label, torch.Tensor) and label.numel() == 1:
            label = label.item()
        if isinstance(label, bool) or not isinstance(label, int):
            return None
        found.append(label)
    return torch.tensor(found, dtype=torch.int64)


def split(size: int, folds: int, fold: int, seed: int, classes: Optional[torch.Tensor]) -> FoldSplit:
    """The samples of fold `fold` (validation) and of the others (training), each sorted. With `classes`, each
    class is shuffled and dealt round-robin, classes one after another: fold j takes every K-th sample from
    position j of that deal."""
    if size < folds:
        raise ConfigError(f"data.folds={folds}: data.train has {size} samples; expected at most {size} folds")
    perm = torch.randperm(size, generator=generator(seed))
    if classes is None:
        order = perm
    else:
        values, counts = torch.unique(classes, return_counts=True)
        smallest = int(counts.argmin())
        if int(counts[smallest]) < folds:
            raise ConfigError(
                f"data.folds={folds}: class {int(values[smallest])} of data.train has {int(counts[smallest])} "
                f"sample(s), fewer than the {folds} folds, so some fold could not hold it (stratified by label); "
                f"expected data.folds <= {int(counts[smallest])}"
            )
        order = perm[torch.argsort(classes[perm], stable=True)]  # grouped by class, each in the seeded order
    in_fold = torch.arange(size) % folds == fold
    return FoldSplit(
        folds,
        fold,
        seed,
        classes is not None,
        order[~in_fold].sort().values,
        order[in_fold].sort().values,
    )


def subset(dataset: Dataset, indices: torch.Tensor) -> Dataset:
    """`dataset`'s samples at `indices`: tensors stay tensors (the DataModule's in-memory fast path), anything else
    is a Subset."""
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, (tuple, list)) and tensors and all(isinstance(t, torch.Tensor) for t in tensors):
        return TensorDataset(*(t.index_select(0, indices.to(t.device)) for t in tensors))
    return Subset(dataset, indices.tolist())


def make(dataset: Dataset, folds: int, fold: int, seed: int, stratify: bool) -> FoldSplit:
    """Fold `fold` of `folds` of the train split `dataset`, stratified when `stratify` and every sample has a
    class label."""
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"data.folds={folds}: data.train is {type(dataset).__name__}, a stream, which has no sample indices "
            "to cut into folds; expected a map-style dataset (__len__ and __getitem__), or data.folds=null"
        )
    size = len(cast(Sized, dataset))
    classes = labels(dataset, size) if stratify else None
    made = split(size, folds, fold, seed, classes)
    log.info(
        "Fold %d of %d (seed %d%s): %d training and %d validation samples of data.train",
        fold,
        folds,
        seed,
        ", stratified by label" if made.stratified else "",
        len(made.train),
        len(made.val),
    )
    return made


def write_record(made: FoldSplit, run_dir: Path) -> None:
    """folds.json in the run directory. A run continued there (resume, a requeued or re-run sweep job) must cut the
    same fold, or its epochs would not be one run's: another fold, seed or data set is refused."""
    from framework.core.files import write_json

    path, record = run_dir / RECORD, made.record()
    if path.is_file():
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError):
            before = None  # damaged: written again, from the seed that cut it (the record is derived, not source)
            log.warning("%s is damaged; it is written again from data.folds, data.fold and the seed", path)
        if before == record:
            return
        if isinstance(before, dict):
            was = ", ".join(f"{k}={before.get(k)}" for k in ("folds", "fold", "seed"))
            raise ConfigError(
                f"data.fold={made.fold}: {path} records the samples this run started with ({was}), and data.folds="
                f"{made.folds} data.fold={made.fold} seed={made.seed} on this data.train gives others; expected the "
                "fold, seed and data the run started with, or a new run directory"
            )
    write_json(path, record)
