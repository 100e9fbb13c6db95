"""The checkpoint format: its file names and versions, its errors, how a state of nested dicts becomes tensors
plus JSON (`flatten`) and back (`unflatten`), the checksums, and the one-line renderings of values read from a
file that every error message uses.

A checkpoint is a directory:
- `model.safetensors`: the unwrapped model's state dict;
- `state.safetensors`: every tensor of the training state (optimizer, scheduler, GradScaler, RNG, ...);
- `meta.json`: counters, metrics, the composed config, the structure that rebuilds the state around its
  tensors, XXH3-64 checksums of both files and the format version.

A sharded checkpoint (format version 3, parallel=fsdp) has one model and one state file per rank instead,
`model-rank{r}-of{n}.safetensors` and `state-rank{r}-of{n}.safetensors`, holding that rank's tensors: its own
shard of every sharded tensor (a DTensor's local part), and its own copy of every other one. meta.json adds
`shards`: the number of ranks, and for each sharded tensor its global shape, the dimension it is split along
and each rank's offset and length there (`chunk`), so that any number of ranks can read it back.
"""

from __future__ import annotations

import mmap
import os
import stat
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, TypeGuard

import torch
import xxhash

from framework.core.errors import UserError

FORMAT_VERSION = 2  # written; 1 (same layout, CRC-32 checksums) is still read
SHARDED_VERSION = 3  # written by sharded saves (a file per rank)
READABLE_VERSIONS = (1, 2, 3)
MODEL_FILE, STATE_FILE, META_FILE = "model.safetensors", "state.safetensors", "meta.json"


# torch.compile's wrapper (OptimizedModule) holds the module it compiles as `_orig_mod`, a name in every key of its
# state dict; a checkpoint holds the plain names, so a compiled run's weights load into an uncompiled model and back.
COMPILED_PREFIX = "_orig_mod."


def plain_key(key: str) -> str:
    """`key` without torch.compile's `_orig_mod.` segments (`net._orig_mod.0.weight` -> `net.0.weight`)."""
    return ".".join(part for part in key.split(".") if part != "_orig_mod") if COMPILED_PREFIX in key else key


def plain_keys(state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict under plain names (see COMPILED_PREFIX); the same dict when it has none to drop."""
    if not any(COMPILED_PREFIX in key for key in state):
        return state
    return {plain_key(key): value for key, value in state.items()}


def shard_file(kind: str, rank: int, world_size: int) -> str:
    """The file of rank `rank` of a sharded checkpoint written by `world_size` ranks; `kind`: model or state."""
    return f"{kind}-rank{rank}-of{world_size}.safetensors"


def shard_files(world_size: int) -> list[str]:
    """Every data file of a sharded checkpoint of `world_size` ranks."""
    return [shard_file(kind, rank, world_size) for rank in range(world_size) for kind in ("model", "state")]


def chunk(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """(offset, length) of rank `rank`'s part of a dimension of `size` split over `world_size` ranks as
    torch.chunk splits it, which DTensor's Shard placement and FSDP use: ceil(size / world_size) each, the
    last ranks' parts shorter or empty (a bias of size 1 over 2 ranks: (0, 1) and (1, 0))."""
    step = -(-size // world_size)
    start = min(size, rank * step)
    return start, min(size, start + step) - start


class DamagedCheckpoint(UserError):
    """A checkpoint that cannot be used as it is: missing, truncated or mismatched files, a meta.json of the
    wrong shape, not a regular file, or a state that does not fit this run."""


class UnreadableCheckpoint(UserError):
    """Intact, maybe, but of a format this version cannot read: never skipped (resume=auto would start over
    and its first saves would prune the checkpoints it could not read)."""


class CheckpointSaveError(UserError, OSError):
    """A checkpoint could not be written (disk full, file too large, no permission). Nothing of it is left
    behind and the checkpoints already on disk are kept. Also an OSError: it is one, for callers that handle
    I/O failures."""


def flatten(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """A JSON-able copy of `obj` with every tensor moved into `tensors` (replaced by a reference to it)."""
    if isinstance(obj, torch.Tensor):
        key = path or "root"
        tensors[key] = obj.detach()  # still the live tensor: the writer copies it (to CPU, contiguous)
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: flatten(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {"__items__": [[k, flatten(v, tensors, f"{path}/{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"checkpoint state at {path!r} holds a {type(obj).__name__}; expected tensors, "
        "containers and plain values (what state_dict() methods return)"
    )


def unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(unflatten(v, tensors) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {k: unflatten(v, tensors) for k, v in obj["__items__"]}
        return {k: unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten(v, tensors) for v in obj]
    return obj


def digest(path: Path, crc32: bool = False) -> Any:
    """XXH3-64 of a file's bytes, read through a memory map: at memory speed (~20 GB/s), where CRC-32 ran at
    2 GB/s and reading the file into a bytes object first cost more than the hash. `crc32`: the integer
    CRC-32 that format version 1 recorded."""
    with open(path, "rb") as f:
        return _digest_fd(f.fileno(), crc32)


def _digest_fd(fd: int, crc32: bool = False) -> Any:
    if os.fstat(fd).st_size == 0:
        data: Any = b""
        return zlib.crc32(data) if crc32 else "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
        return zlib.crc32(data) if crc32 else "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


_helpers: Optional[ThreadPoolExecutor] = None


def _in_helper(fn: Any, *args: Any) -> Future:
    """Run `fn` on a helper thread. For fsync and XXH3, which release the GIL: the disk flushes one file while
    the next is serialized (a save blocks ~25% less), and a load hashes its two files on two cores."""
    global _helpers
    if _helpers is None:
        _helpers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-io")
    return _helpers.submit(fn, *args)


def _join(futures: list[Future]) -> None:
    """Wait for every one of `futures` (even after one failed), then raise the first failure."""
    errors = [future.exception() for future in futures]
    for error in errors:
        if error is not None:
            raise error


_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a file of an unknown kind")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _name(path: Any) -> str:
    """A path for a message: as is, or quoted when it holds a newline or a control character (a hostile
    name must not forge a line of the log)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def _where(path: Path) -> str:
    return f"checkpoint {_name(path)}"


def _shown(value: Any, limit: int = 60) -> str:
    """A value read from a file, for a message: one short line, whatever the file holds."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return f"a dict of {len(value)} entries"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _key(key: Any) -> str:
    text = str(key)
    return text if text.isprintable() and len(text) <= 60 else _shown(key)


def _keys(keys: list[Any], shown: int = 3) -> str:
    return ", ".join(_key(k) for k in keys[:shown]) + (" ..." if len(keys) > shown else "")
