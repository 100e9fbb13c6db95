"""The files of a split's shards: local paths, or URLs of any file system fsspec knows (`s3://` through s3fs), named
by brace patterns that expand alike. Every shard is found, with its size, before training, and read by offset
through one open file per shard per process, never downloaded whole.

A URL is checked as `checkpoint.remote`'s is (framework/core/stores.py: no credentials in it, a scheme fsspec
knows, its library installed) and its store opened with the same bounded timeouts; a missing shard, no credentials,
an unreachable endpoint or a missing bucket is one ConfigError naming the key, the pattern and the cause.

fsspec's asynchronous file systems (s3fs) run on an event loop thread of the process that made them, which a
forked DataLoader worker does not have: each process opens its own (as its own files), and a forked worker leaves
its parent's alone (closing them would close the parent's sockets through the epoll instance they share).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, Sequence, Union

from framework.core.errors import ConfigError
from framework.core.stores import cause, check_url, is_store_error, is_url, storage_options
from framework.data.streaming import expand_braces

# The index pass reads a shard's tar headers in order: blocks of this size hold many small samples' headers, one
# ranged read each. A sample read is at a random offset: a small block, enough for its label after its input.
INDEX_BLOCK = 2 << 20
READ_BLOCK = 64 << 10
EXPECTED_READABLE = (
    "expected shards readable with the credentials in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; "
    "the endpoint from AWS_ENDPOINT_URL)"
)


class ShardFiles:
    """The shards a pattern (or a list of them) names: `names` (a local path as `str(Path)`, a URL as given) and
    their `sizes` in bytes, each one checked to exist when made. `key` names the config key in errors."""

    def __init__(self, pattern: Union[str, Sequence[str]], key: str) -> None:
        self.pattern, self.key = pattern, key
        patterns = [str(p) for p in ([pattern] if isinstance(pattern, str) else pattern)]
        for url in filter(is_url, patterns):
            check_url(key, url)  # the value named as given; before anything is contacted
        given = [n for p in patterns for n in expand_braces(p)]
        if not given:
            raise ConfigError(f"{key}={pattern!r}: names no shard; expected a brace pattern of tar files")
        self.names = [n if is_url(n) else str(Path(n)) for n in given]
        self._files: dict[int, Any] = {}  # this process's open file of each shard read so far
        self._stores: dict[str, Any] = {}  # this process's fsspec file system of each scheme
        self._inherited: list[Any] = []  # a forked worker's parent's files and file systems, left untouched
        self._pid = os.getpid()
        self.sizes = self._sizes()

    def __len__(self) -> int:
        return len(self.names)

    def _sizes(self) -> list[int]:
        sizes: list[int] = []
        missing: list[str] = []
        why = ""
        for name in self.names:
            try:
                sizes.append(self._size(name))
            except FileNotFoundError as err:
                missing.append(name)
                why = why or (f"; {cause(err)}" if is_url(name) else "")
        if len(missing) == len(self.names):
            raise ConfigError(
                f"{self.key}={self.pattern!r}: matches no file ({len(missing)} names, e.g. {missing[0]}{why}); "
                "expected WebDataset tar shards, e.g. 'DIR/train-{000000..000009}.tar' or "
                "'s3://BUCKET/train-{000000..000009}.tar' (quoted on the command line)"
            )
        if missing:
            raise ConfigError(
                f"{self.key}: shard {missing[0]} does not exist ({len(missing)} of the {len(self.names)} shards of "
                f"{self.pattern!r} are missing); expected every shard the pattern names"
            )
        return sizes

    def _size(self, name: str) -> int:
        """The file's size; FileNotFoundError where there is no such file (or no such bucket)."""
        if not is_url(name):
            if not Path(name).is_file():
                raise FileNotFoundError(name)
            return Path(name).stat().st_size
        try:
            info = self._store(name).info(name)
        except FileNotFoundError:
            raise
        except Exception as err:
            if not is_store_error(err):
                raise
            raise ConfigError(
                f"{self.key}={self.pattern!r}: cannot read {name}: {cause(err)}; {EXPECTED_READABLE}"
            ) from None
        if info.get("type") != "file":
            raise FileNotFoundError(name)
        return int(info["size"])

    def _store(self, url: str) -> Any:
        """This process's file system for the URL's scheme (checked when first met)."""
        import fsspec

        self._own()
        scheme = check_url(self.key, url)
        if scheme not in self._stores:
            self._stores[scheme] = fsspec.filesystem(scheme, **storage_options(scheme, None))
        return self._stores[scheme]

    def _own(self) -> None:
        """In a forked worker, drop (but keep alive) what the parent process opened: the worker opens its own."""
        if self._pid != os.getpid():
            if self._files or self._stores:
                self._inherited.append((self._files, self._stores))
            self._files, self._stores, self._pid = {}, {}, os.getpid()

    def open(self, number: int) -> BinaryIO:
        """Shard `number` opened anew, for one pass in storage order (the index); the caller closes it."""
        name = self.names[number]
        if not is_url(name):
            return open(name, "rb")  # noqa: SIM115 (the caller's `with`)
        return self._store(name).open(name, "rb", block_size=INDEX_BLOCK, cache_type="readahead")

    def read(self, number: int, offset: int, size: int) -> bytes:
        """`size` bytes of shard `number` from `offset`, through this process's open file of the shard."""
        self._own()
        f = self._files.get(number)
        name = self.names[number]
        try:
            if f is None:
                f = self._files[number] = (
                    open(name, "rb")  # noqa: SIM115 (kept open while reading)
                    if not is_url(name)
                    else self._store(name).open(name, "rb", block_size=READ_BLOCK, cache_type="readahead")
                )
            f.seek(offset)
            return f.read(size)
        except Exception as err:
            if not is_url(name) or not is_store_error(err):
                raise
            raise ConfigError(f"{self.key}: reading shard {name} failed: {cause(err)}; {EXPECTED_READABLE}") from None

    def __getstate__(self) -> dict[str, Any]:  # a spawned worker opens its own files and file systems
        return {**self.__dict__, "_files": {}, "_stores": {}, "_inherited": [], "_pid": -1}
