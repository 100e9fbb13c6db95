"""CIFAR-10 from local files, through torchvision's own reader."""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Callable, Optional

import torchvision
from torchvision.datasets.utils import check_integrity

from framework.errors import ConfigError


class CIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR-10 reader (python pickle batches under `root/cifar-10-batches-py`).

    `verify_checksums=false` accepts files that are not the official ones (a subset, or test fixtures);
    the official check compares MD5 sums of the whole files. A missing or altered file is a ConfigError that
    names it (torchvision alone says "not found or corrupted" and suggests a download that cannot happen).
    """

    def __init__(self, root: str, train: bool = True, transform: Optional[Callable] = None,
                 verify_checksums: bool = True) -> None:
        self.verify_checksums = verify_checksums
        super().__init__(root, train=train, transform=transform, download=False)

    def _checked(self, name: str, md5: str) -> Path:
        """The path of one of the data set's files, after checking it is there (and official, if asked)."""
        path = Path(self.root) / self.base_folder / name
        if not path.is_file():
            raise ConfigError(f"data.root={self.root!r}: no file {path}; expected the python version of "
                              "CIFAR-10 (cifar-10-python.tar.gz) extracted in <data.root>")
        if self.verify_checksums and not check_integrity(str(path), md5):
            raise ConfigError(f"{path} is not the official CIFAR-10 file (MD5 differs); to use other files "
                              "(a subset, test fixtures) set data.train.dataset.verify_checksums=false")
        return path

    def _check_integrity(self) -> bool:
        for name, md5 in self.train_list + self.test_list:
            self._checked(name, md5)
        return True

    def _load_meta(self) -> None:
        # torchvision checks this file's MD5 here unconditionally, so it is read here too.
        with open(self._checked(self.meta["filename"], self.meta["md5"]), "rb") as f:
            self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
