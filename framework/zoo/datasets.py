"""Datasets for the built-in presets. Nothing here downloads: files are read from a local `root`.

torchvision is imported inside the functions that need it: it costs about a second of start-up, and the
default (digits) runs never use it.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Callable, Optional, Sequence, Sized, cast

import numpy as np
import torch
from torch.utils.data import TensorDataset

from framework.core.errors import ConfigError
from framework.core.reproducibility import generator

SPLITS = ("train", "val", "test")
# torchvision's MNIST wants all four, whichever split it reads.
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    # The same file sklearn.datasets.load_digits reads, read directly: importing sklearn.datasets costs
    # about a second of start-up for nothing (tests/test_datasets.py checks both give the same arrays).
    spec = importlib.util.find_spec("sklearn")
    assert spec is not None and spec.origin is not None  # sklearn is a dependency, installed as a package
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    return table[:, :-1], table[:, -1].astype(np.int64)


def digits(
    split: str,
    val_fraction: float = 0.15,
    test_fraction: float = 0.15,
    split_seed: int = 0,
    pixel_range: Sequence[float] = (0.0, 1.0),
) -> TensorDataset:
    """The UCI handwritten digits (1,797 8x8 images, 10 classes) shipped with scikit-learn, as tensors.

    The split is a fixed permutation by `split_seed`, independent of the run's seed, so every run of every
    seed validates on the same images. Pixels are scaled from 0..16 to `pixel_range` (0..1; a GAN's generator
    draws in -1..1).
    """
    if split not in SPLITS:
        raise ConfigError(f"data.*.split={split!r}: expected one of {', '.join(SPLITS)}")
    for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(f"data.*.{name}={fraction!r}: expected a fraction in [0, 1)")
    if val_fraction + test_fraction >= 1.0:
        raise ConfigError(
            f"data.train.val_fraction + test_fraction = {val_fraction + test_fraction}: expected "
            "less than 1, so that the training split keeps some images"
        )
    low, high = _pixel_range(pixel_range)
    x, y = _digits_arrays()
    order = torch.randperm(len(x), generator=generator(split_seed))
    n_test, n_val = round(len(x) * test_fraction), round(len(x) * val_fraction)
    parts = {"test": order[:n_test], "val": order[n_test : n_test + n_val], "train": order[n_test + n_val :]}
    index = parts[split]
    images = torch.from_numpy(x)[index].reshape(-1, 1, 8, 8) / 16.0
    if (low, high) != (0.0, 1.0):
        images = images * (high - low) + low
    return TensorDataset(images, torch.from_numpy(y)[index])


def _pixel_range(value: Sequence[float]) -> tuple[float, float]:
    if len(value) != 2 or not all(isinstance(v, (int, float)) for v in value) or not value[0] < value[1]:
        raise ConfigError(f"data.*.pixel_range={list(value)!r}: expected [low, high] with low < high, e.g. [-1, 1]")
    return float(value[0]), float(value[1])


def holdout(
    dataset: torch.utils.data.Dataset, part: str, val_fraction: float = 0.1, split_seed: int = 0
) -> torch.utils.data.Subset:
    """The `train` or `val` part of a fixed, seeded split of `dataset` (for data sets that ship no val split)."""
    if part not in ("train", "val"):
        raise ConfigError(f"data.*.part={part!r}: expected 'train' or 'val'")
    sized = cast(Sized, dataset)  # a map-style dataset, with a size
    order = torch.randperm(len(sized), generator=generator(split_seed)).tolist()
    n_val = round(len(sized) * val_fraction)
    return torch.utils.data.Subset(dataset, order[:n_val] if part == "val" else order[n_val:])


def mnist(root: str, train: bool = True, transform: Optional[Callable] = None) -> torch.utils.data.Dataset:
    """torchvision's MNIST reader on local idx files; a missing file is reported by name.

    (torchvision alone says "Dataset not found. You can use download=True", which names no file and
    suggests a download that cannot happen here.)
    """
    import torchvision

    raw = Path(root) / "MNIST" / "raw"
    missing = [name for name in MNIST_FILES if not (raw / name).is_file()]
    if missing:
        raise ConfigError(
            f"data.root={root!r}: no {', '.join(missing)} in {raw}; expected the uncompressed "
            "MNIST idx files in <data.root>/MNIST/raw (gunzip the official *.gz files there)"
        )
    return torchvision.datasets.MNIST(root, train=train, transform=transform, download=False)


def image_folder(
    root: str, split: str, num_classes: int, transform: Optional[Callable] = None
) -> torch.utils.data.Dataset:
    """torchvision's ImageFolder on `root/split`, checked against `root/train` and `data.num_classes`.

    ImageFolder numbers each folder's classes on its own, so a val folder missing a class would silently
    shift every later label; and a `num_classes` other than the number of class folders either fails
    mid-run (too few model outputs) or trains without a word (too many). Both are refused up front.
    """
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import find_classes

    def classes(name: str) -> list[str]:
        folder = Path(root) / name
        if not folder.is_dir():
            raise ConfigError(
                f"data.root={root!r}: no folder {folder}; expected <data.root>/{name}/<class>/<image files>"
            )
        try:
            return find_classes(folder)[0]
        except FileNotFoundError:
            raise ConfigError(
                f"data.root={root!r}: no class folders in {folder}; expected <data.root>/{name}/<class>/<image files>"
            ) from None

    names = classes("train")
    if len(names) != num_classes:
        raise ConfigError(
            f"data.num_classes={num_classes}: {Path(root) / 'train'} has {len(names)} class "
            f"folders ({', '.join(names)}); set data.num_classes={len(names)}"
        )
    others = classes(split) if split != "train" else names
    if others != names:
        raise ConfigError(
            f"data.root={root!r}: the class folders of {split}/ ({', '.join(others)}) differ "
            f"from those of train/ ({', '.join(names)}); expected the same class folders"
        )
    return ImageFolder(str(Path(root) / split), transform=transform)


class ImageFiles(torch.utils.data.Dataset):
    """Unlabelled images for `python run.py predict`: every image file directly in `root` (png, jpg, jpeg, bmp,
    webp), in sorted order, so a prediction's `index` is its file's position in `files` (listed beside the
    predictions, one path a line, in `predictions.files.txt`). Each is read as RGB and passed through `transform`
    (e.g. the run's own)."""

    SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")

    def __init__(self, root: str, transform: Optional[Callable] = None) -> None:
        folder = Path(root)
        if not folder.is_dir():
            raise ConfigError(f"data.predict.root={root!r}: no such directory; expected a folder of image files")
        self.files = sorted(p for p in folder.iterdir() if p.suffix.lower() in self.SUFFIXES and p.is_file())
        if not self.files:
            raise ConfigError(
                f"data.predict.root={root!r}: no image files ({', '.join(self.SUFFIXES)}) in it; expected a folder "
                "of images"
            )
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(self.files[index]) as image:
                rgb = image.convert("RGB")
        except (OSError, UnidentifiedImageError) as err:
            raise ConfigError(f"data.predict: {self.files[index]} is not a readable image ({err})") from None
        if self.transform is not None:
            return cast(torch.Tensor, self.transform(rgb))
        from torchvision.transforms.functional import to_tensor

        return to_tensor(rgb)
