"""CIFAR-10 from local files, through torchvision's own reader."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torchvision
from torchvision.datasets.utils import check_integrity

from framework.core.errors import ConfigError


class CIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR-10 reader (python pickle batches under `root/cifar-10-batches-py`).

    `verify_checksums=false` accepts files that are not the official ones (a subset, or test fixtures);
    the official check compares MD5 sums of the whole files. A missing or altered file is a ConfigError that
    names it (torchvision alone says "not found or corrupted" and suggests a download that cannot happen).
    """

    def __init__(
        self, root: str, train: bool = True, transform: Optional[Callable] = None, verify_checksums: bool = True
    ) -> None:
        # torchvision's own __init__, but every file read by `_unpickle`: its pickle.load would run whatever
        # code a hostile file names (with verify_checksums=false nothing vouches for the files).
        torchvision.datasets.VisionDataset.__init__(self, root, transform=transform)
        self.verify_checksums, self.train = verify_checksums, train
        self._check_integrity()
        data, self.targets = [], []
        for name, md5 in self.train_list if train else self.test_list:
            entry = _unpickle(self._checked(name, md5))
            data.append(entry["data"])
            self.targets.extend(entry["labels"] if "labels" in entry else entry["fine_labels"])
        self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))
        self._load_meta()

    def _checked(self, name: str, md5: str) -> Path:
        """The path of one of the data set's files, after checking it is there (and official, if asked)."""
        path = Path(self.root) / self.base_folder / name
        if not path.is_file():
            raise ConfigError(
                f"data.root={self.root!r}: no file {path}; expected the python version of "
                "CIFAR-10 (cifar-10-python.tar.gz) extracted in <data.root>"
            )
        if self.verify_checksums and not check_integrity(str(path), md5):
            raise ConfigError(
                f"{path} is not the official CIFAR-10 file (MD5 differs); to use other files "
                "(a subset, test fixtures) set data.train.dataset.verify_checksums=false"
            )
        return path

    def _check_integrity(self) -> bool:
        for name, md5 in self.train_list + self.test_list:
            self._checked(name, md5)
        return True

    def _load_meta(self) -> None:
        # torchvision checks this file's MD5 here unconditionally, so it is read here too.
        self.classes = _unpickle(self._checked(self.meta["filename"], self.meta["md5"]))[self.meta["key"]]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


# What CIFAR-10's python batches hold besides dicts, lists, strings and numbers: numpy arrays.
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}  # encode: how protocol 2 stores bytes


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    """One CIFAR-10 file, allowing only the types its batches hold; anything else is a ConfigError naming it."""
    try:
        with open(path, "rb") as f:
            entry = _BatchUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"{path}: not a CIFAR-10 batch ({err}); expected the python version's pickled dicts "
            "of numpy arrays and lists"
        ) from None
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: holds a {type(entry).__name__}; expected a CIFAR-10 batch (a dict)")
    return entry
