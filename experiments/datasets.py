"""Datasets for the built-in presets. Nothing here downloads: files are read from a local `root`."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from framework.errors import ConfigError
from framework.reproducibility import generator

SPLITS = ("train", "val", "test")


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    # The same file sklearn.datasets.load_digits reads, read directly: importing sklearn.datasets costs
    # about a second of start-up for nothing (tests/test_datasets.py checks both give the same arrays).
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    return table[:, :-1], table[:, -1].astype(np.int64)


def digits(split: str, val_fraction: float = 0.15, test_fraction: float = 0.15, split_seed: int = 0) -> TensorDataset:
    """The UCI handwritten digits (1,797 8x8 images, 10 classes) shipped with scikit-learn, as tensors.

    The split is a fixed permutation by `split_seed`, independent of the run's seed, so every run of every
    seed validates on the same images. Pixels are scaled from 0..16 to 0..1.
    """
    if split not in SPLITS:
        raise ConfigError(f"data.*.split={split!r}: expected one of {', '.join(SPLITS)}")
    x, y = _digits_arrays()
    order = torch.randperm(len(x), generator=generator(split_seed))
    n_test, n_val = round(len(x) * test_fraction), round(len(x) * val_fraction)
    parts = {"test": order[:n_test], "val": order[n_test:n_test + n_val], "train": order[n_test + n_val:]}
    index = parts[split]
    images = torch.from_numpy(x)[index].reshape(-1, 1, 8, 8) / 16.0
    return TensorDataset(images, torch.from_numpy(y)[index])


def holdout(dataset: torch.utils.data.Dataset, part: str, val_fraction: float = 0.1,
            split_seed: int = 0) -> torch.utils.data.Subset:
    """The `train` or `val` part of a fixed, seeded split of `dataset` (for data sets that ship no val split)."""
    if part not in ("train", "val"):
        raise ConfigError(f"data.*.part={part!r}: expected 'train' or 'val'")
    order = torch.randperm(len(dataset), generator=generator(split_seed)).tolist()
    n_val = round(len(dataset) * val_fraction)
    return torch.utils.data.Subset(dataset, order[:n_val] if part == "val" else order[n_val:])
