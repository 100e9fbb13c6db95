"""WebDataset-format tar shards, read with the standard library's `tarfile`.

A sample is the group of consecutive files in a shard that share a key (the file name up to its first dot):
an image (`KEY.png` or `KEY.jpg`) or an array (`KEY.npy`, any shape, as it was saved) and its label (`KEY.cls`,
a decimal class number). Shards are named by a
brace pattern, `DIR/train-{000000..000009}.tar`, or a URL of one, `s3://BUCKET/train-{000000..000009}.tar`, read
through fsspec (framework/data/shard_files.py).

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
import tarfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset

from framework.core.errors import ConfigError
from framework.core.stores import cause, is_store_error, is_url
from framework.data.shard_files import EXPECTED_READABLE, ShardFiles
from framework.data.streaming import Bad

log = logging.getLogger(__name__)

INPUT_EXTS = ("png", "jpg", "jpeg", "npy")


@dataclass
class Sample:
    shard: int
    key: str
    image: tuple[int, int]  # (offset, size) of the input's bytes in the shard
    label: tuple[int, int]
    array: bool  # the input is a .npy array, not an image


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
        self.files = ShardFiles(shards, key)
        self.paths = self.files.names
        self.samples: list[Sample] = []
        self.sizes: list[int] = []
        self.bad = 0  # samples skipped while indexing (skip_corrupt)
        for number, path in enumerate(self.paths):
            found = self._index(number, path)
            self.samples.extend(found)
            self.sizes.append(len(found))

    def _index(self, number: int, path: str) -> list[Sample]:
        groups: dict[str, dict[str, tuple[int, int]]] = {}
        for base, ext, offset, size in _members(self.files, number, self.key):
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

    def shard_bytes(self) -> list[int]:
        """Each shard file's size, as found when the dataset was made (the data's identity)."""
        return list(self.files.sizes)

    def __len__(self) -> int:
        return len(self.samples)

    def decode(self, position: int) -> Any:
        """The sample at a storage position, or a `Bad` if it cannot be decoded and skip_corrupt is on."""
        from PIL import Image

        s = self.samples[position]
        # the input first: a remote shard's read of it brings the label after it along (shard_files.READ_BLOCK)
        data = self.files.read(s.shard, *s.image)
        try:
            label = int(self.files.read(s.shard, *s.label).decode().strip())
            if s.array:
                return torch.from_numpy(np.load(io.BytesIO(data))), label
            with Image.open(io.BytesIO(data)) as img:
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


class TokenShards(IterableDataset):
    """A token stream from WebDataset tar shards: each `KEY.bin` member is a run of bytes (byte-level tokens), cut
    into windows of `block_size + 1` bytes, `block_size` apart (inputs and their next-byte targets: a collate such
    as experiments.lm.next_token_batch makes the pair). Windows never straddle two members."""

    def __init__(self, shards: Union[str, Sequence[str]], *, block_size: int, key: str = "shards") -> None:
        self.block_size, self.key = block_size, key
        self.files = ShardFiles(shards, key)
        self.paths = self.files.names
        self.windows: list[tuple[int, int]] = []  # (shard, byte offset) of each window
        self.sizes: list[int] = []
        for number in range(len(self.paths)):
            runs = [(o, n) for _, ext, o, n in _members(self.files, number, key) if ext == "bin"]
            found = [(number, o + w * block_size) for o, n in runs for w in range(max(0, (n - 1) // block_size))]
            self.windows.extend(found)
            self.sizes.append(len(found))

    def shard_sizes(self) -> list[int]:
        return list(self.sizes)

    def shard_bytes(self) -> list[int]:
        """Each shard file's size, as found when the dataset was made (the data's identity)."""
        return list(self.files.sizes)

    def __len__(self) -> int:
        return len(self.windows)

    def read(self, positions: Sequence[int]) -> Iterator[torch.Tensor]:
        for position in positions:
            shard, offset = self.windows[position]
            yield torch.frombuffer(bytearray(self.files.read(shard, offset, self.block_size + 1)), dtype=torch.uint8)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.read(range(len(self.windows)))


def _members(files: ShardFiles, number: int, key: str) -> list[tuple[str, str, int, int]]:
    """(sample key, extension, data offset, size) of each file in shard `number`, in order, checked whole (a cut or
    garbled tar is an error naming the last sample key read)."""
    path, size, found, last = files.names[number], files.sizes[number], [], "(none)"
    try:
        with files.open(number) as f:
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    if member.offset_data + member.size > size:
                        raise tarfile.ReadError(f"{member.name} ends past the end of the file")
                    base, _, ext = member.name.partition(".")
                    found.append((base, ext.lower(), member.offset_data, member.size))
                    last = base
                end = tar.offset  # tarfile stops quietly at a cut or garbled header: the end must be zero blocks
            f.seek(end)
            if f.read(512) != bytes(512):
                raise tarfile.ReadError(f"no end-of-archive block at byte {end}")
    except (tarfile.TarError, OSError, EOFError) as err:
        if is_url(path) and is_store_error(err) and not isinstance(err, tarfile.TarError):
            raise ConfigError(f"{key}: reading shard {path} failed: {cause(err)}; {EXPECTED_READABLE}") from None
        raise ConfigError(
            f"{key}: shard {path} is truncated or not a tar file ({err}; last sample key read: {last}); "
            "expected a complete WebDataset tar"
        ) from None
    return found


def tar_shards(shards: Union[None, str, Sequence[str]], **options: Any) -> Optional[TarShards]:
    """`TarShards(shards, ...)`, or None (the split is off) when `shards` is null: the `data=webdataset` preset's
    val and test splits exist once `data.val_shards` / `data.test_shards` are given."""
    return None if shards is None else TarShards(shards, **options)
