"""WebDataset-format tar shards, read with the standard library's `tarfile`.

A sample is the group of consecutive files in a shard that share a key (the file name up to its first dot):
an image (`KEY.png` or `KEY.jpg`) or an array (`KEY.npy`, any shape, as it was saved) and its label (`KEY.cls`,
a decimal class number). Shards are named by a
brace pattern, `DIR/train-{000000..000009}.tar`.

Why our own reader rather than the `webdataset` package: the planned order of `framework.data.streaming` needs random
access by sample position (to read one worker's batches, to resume at any batch, to redistribute an epoch over
another number of workers), which webdataset's pipeline of iterators does not offer; and indexing a shard is one
pass over its tar headers with `tarfile`, no data read. The index (every sample's member offsets and sizes) is
built when the dataset is made, so a missing shard, a truncated or corrupt tar and a sample without a label are
found before training, each named by its shard and sample key.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset

from framework.core.errors import ConfigError
from framework.data.streaming import Bad, expand_braces

log = logging.getLogger(__name__)

INPUT_EXTS = ("png", "jpg", "jpeg", "npy")


@dataclass
class Sample:
    shard: int
    key: str
    image: tuple[int, int]  # (offset, size) of the input's bytes in the shard
    label: tuple[int, int]
    array: bool  # the input is a .npy array, not an image


def shard_paths(pattern: Union[str, Sequence[str]], key: str) -> list[Path]:
    """The files of a brace pattern (or a list of them); every one must exist."""
    names = [n for p in ([pattern] if isinstance(pattern, str) else pattern) for n in expand_braces(str(p))]
    paths = [Path(n) for n in names]
    missing = [p for p in paths if not p.is_file()]
    if paths and len(missing) == len(paths):
        raise ConfigError(
            f"{key}={pattern!r}: matches no file ({len(paths)} names, e.g. {paths[0]}); expected WebDataset tar "
            "shards, e.g. 'DIR/train-{000000..000009}.tar' (quoted on the command line)"
        )
    if not paths:
        raise ConfigError(f"{key}={pattern!r}: names no shard; expected a brace pattern of tar files")
    if missing:
        raise ConfigError(
            f"{key}: shard {missing[0]} does not exist ({len(missing)} of the {len(paths)} shards of {pattern!r} "
            "are missing); expected every shard the pattern names"
        )
    return paths


class TarShards(IterableDataset):
    """Classification samples `(input, label)` from WebDataset tar shards: an image is a float tensor in [0, 1],
    C x H x W (then `transform`, if given), an .npy array a tensor as saved; `label` is an int. `key` names the
    config key in errors; `skip_corrupt` skips a bad sample (no label, no input, an undecodable one)."""

    def __init__(
        self,
        shards: Union[str, Sequence[str]],
        *,
        key: str = "shards",
        skip_corrupt: bool = False,
        transform: Optional[Callable[[torch.Tensor], Any]] = None,
    ) -> None:
        self.key, self.skip_corrupt, self.transform = key, skip_corrupt, transform
        self.paths = shard_paths(shards, key)
        self.samples: list[Sample] = []
        self.sizes: list[int] = []
        self.bad = 0  # samples skipped while indexing (skip_corrupt)
        for number, path in enumerate(self.paths):
            found = self._index(number, path)
            self.samples.extend(found)
            self.sizes.append(len(found))
        self._files: dict[int, BinaryIO] = {}
        self._pid = -1

    def _index(self, number: int, path: Path) -> list[Sample]:
        groups: dict[str, dict[str, tuple[int, int]]] = {}
        for base, ext, offset, size in _members(path, self.key):
            groups.setdefault(base, {})[ext] = (offset, size)
        found = []
        for base, files in groups.items():
            kind = next((e for e in INPUT_EXTS if e in files), None)
            image = files[kind] if kind is not None else None
            label = files.get("cls")
            if image is None or label is None:
                lacks = ".cls label" if label is None else ".png/.jpg image or .npy array"
                log.warning(
                    "%s: skipped (data.skip_corrupt=true)",
                    self._bad(f"{self.key}: sample key {base!r} in shard {path} has no {lacks}").message,
                )
                self.bad += 1
                continue
            found.append(Sample(number, base, image, label, kind == "npy"))
        return found

    def _bad(self, problem: str) -> Bad:
        """Raise, or (skip_corrupt) go on; a bad sample found when indexing is warned of and counted here, one found
        when reading by the stream (framework.data.streaming), since a worker process may read it."""
        if not self.skip_corrupt:
            raise ConfigError(f"{problem}; expected an image and a label per key, or data.skip_corrupt=true")
        return Bad(problem)

    def shard_sizes(self) -> list[int]:
        return list(self.sizes)

    def __len__(self) -> int:
        return len(self.samples)

    def _bytes(self, shard: int, where: tuple[int, int]) -> bytes:
        if self._pid != os.getpid():  # a worker process: its own file handles, never its parent's
            self._files, self._pid = {}, os.getpid()
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open(self.paths[shard], "rb")  # noqa: SIM115 (kept open while reading)
        f.seek(where[0])
        return f.read(where[1])

    def decode(self, position: int) -> Any:
        """The sample at a storage position, or a `Bad` if it cannot be decoded and skip_corrupt is on."""
        from PIL import Image

        s = self.samples[position]
        try:
            label = int(self._bytes(s.shard, s.label).decode().strip())
            if s.array:
                return torch.from_numpy(np.load(io.BytesIO(self._bytes(s.shard, s.image)))), label
            with Image.open(io.BytesIO(self._bytes(s.shard, s.image))) as img:
                array = np.asarray(img)
        except (ValueError, OSError) as err:
            return self._bad(
                f"{self.key}: sample key {s.key!r} in shard {self.paths[s.shard]} cannot be decoded ({err})"
            )
        image = torch.from_numpy(array.copy()).float().div_(255.0)
        image = image.unsqueeze(0) if image.ndim == 2 else image.permute(2, 0, 1)
        return (self.transform(image) if self.transform is not None else image), label

    def read(self, positions: Sequence[int]) -> Iterator[Any]:
        """The samples at `positions` (storage order: shard after shard), in the order given."""
        for position in positions:
            yield self.decode(position)

    def __iter__(self) -> Iterator[Any]:
        """Every sample in storage order (the framework reads by `read`; this is for use on its own)."""
        for position in range(len(self.samples)):
            sample = self.decode(position)
            if not isinstance(sample, Bad):
                yield sample

    def __getstate__(self) -> dict[str, Any]:  # open files stay in the process that opened them
        return {**self.__dict__, "_files": {}, "_pid": -1}


class TokenShards(IterableDataset):
    """A token stream from WebDataset tar shards: each `KEY.bin` member is a run of bytes (byte-level tokens), cut
    into windows of `block_size + 1` bytes, `block_size` apart (inputs and their next-byte targets: a collate such
    as experiments.lm.next_token_batch makes the pair). Windows never straddle two members."""

    def __init__(self, shards: Union[str, Sequence[str]], *, block_size: int, key: str = "shards") -> None:
        self.block_size, self.key = block_size, key
        self.paths = shard_paths(shards, key)
        self.windows: list[tuple[int, int]] = []  # (shard, byte offset) of each window
        self.sizes: list[int] = []
        for number, path in enumerate(self.paths):
            runs = [(o, n) for _, ext, o, n in _members(path, key) if ext == "bin"]
            found = [(number, o + w * block_size) for o, n in runs for w in range(max(0, (n - 1) // block_size))]
            self.windows.extend(found)
            self.sizes.append(len(found))
        self._files: dict[int, BinaryIO] = {}
        self._pid = -1

    def shard_sizes(self) -> list[int]:
        return list(self.sizes)

    def __len__(self) -> int:
        return len(self.windows)

    def read(self, positions: Sequence[int]) -> Iterator[torch.Tensor]:
        if self._pid != os.getpid():  # a worker process: its own file handles, never its parent's
            self._files, self._pid = {}, os.getpid()
        for position in positions:
            shard, offset = self.windows[position]
            f = self._files.get(shard)
            if f is None:
                f = self._files[shard] = open(self.paths[shard], "rb")  # noqa: SIM115 (kept open while reading)
            f.seek(offset)
            yield torch.frombuffer(bytearray(f.read(self.block_size + 1)), dtype=torch.uint8)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.read(range(len(self.windows)))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}, "_pid": -1}


def _members(path: Path, key: str) -> list[tuple[str, str, int, int]]:
    """(sample key, extension, data offset, size) of each file in a shard, in order, checked whole (a cut or
    garbled tar is an error naming the last sample key read)."""
    size, found, last = path.stat().st_size, [], "(none)"
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                if member.offset_data + member.size > size:
                    raise tarfile.ReadError(f"{member.name} ends past the end of the file")
                base, _, ext = member.name.partition(".")
                found.append((base, ext.lower(), member.offset_data, member.size))
                last = base
            end = tar.offset  # tarfile stops quietly at a cut or garbled header: the end must be zero blocks
        with open(path, "rb") as f:
            f.seek(end)
            if f.read(512) != bytes(512):
                raise tarfile.ReadError(f"no end-of-archive block at byte {end}")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise ConfigError(
            f"{key}: shard {path} is truncated or not a tar file ({err}; last sample key read: {last}); "
            "expected a complete WebDataset tar"
        ) from None
    return found


def tar_shards(shards: Union[None, str, Sequence[str]], **options: Any) -> Optional[TarShards]:
    """`TarShards(shards, ...)`, or None (the split is off) when `shards` is null: the `data=webdataset` preset's
    val and test splits exist once `data.val_shards` / `data.test_shards` are given."""
    return None if shards is None else TarShards(shards, **options)
