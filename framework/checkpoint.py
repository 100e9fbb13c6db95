"""Checkpoints: a pickle-free format, atomic writes, save policies and resume discovery.

A checkpoint is a directory:
- `model.safetensors`: the unwrapped model's state dict;
- `state.safetensors`: every tensor of the training state (optimizer, scheduler, GradScaler, RNG, ...);
- `meta.json`: counters, metrics, the composed config, the structure that rebuilds the state around its
  tensors, XXH3-64 checksums of both files and the format version.
It is written as `NAME.tmp/`, flushed to disk, then renamed into place, so a crash mid-save never damages
an existing checkpoint. Loading reads only JSON and safetensors: a checkpoint cannot run code.
With `async_save`, the training loop waits only for a copy of the state into reused host buffers; writing,
hashing, flushing and renaming happen on a background thread (as torch.distributed.checkpoint.async_save).
This module knows nothing of what the state means: the trainer hands it plain nested dicts of tensors
and primitives (what `state_dict()` methods return) and gets the same back.

Whatever a checkpoint directory holds (a damaged file, a FIFO or a link to a device, a meta.json of the wrong
shape or of gigabytes, a structure that does not match its tensors), reading it ends in one
`DamagedCheckpoint` line naming the file: never a hang, a traceback or unbounded memory. Discovery skips such
a checkpoint with a warning; `validate_state` and `validate_rng_state` check a loaded state against the live
components before any of it is loaded, so a bad checkpoint cannot leave a run half-restored.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import stat
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from framework.errors import ConfigError, UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # written; 1 (same layout, CRC-32 checksums) is still read
READABLE_VERSIONS = (1, 2)
MODEL_FILE, STATE_FILE, META_FILE = "model.safetensors", "state.safetensors", "meta.json"
# A meta.json is a few KiB (a big model's structure: a few MiB). The caps bound what a hostile one costs: its
# parsed objects take at most ~20x its size in memory, and every recursive reader of it (ours, OmegaConf's
# for the config) stays far from Python's recursion limit.
MAX_META_BYTES = 16 * 2**20
MAX_META_DEPTH = 32
_MAX_COUNTER = 2**63 - 1  # counters end up in int64 tensors and TensorBoard steps
# Never follow a final symlink, never block (a FIFO swapped in after the check), never leak into children.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


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


def _save_error(path: Path, err: BaseException) -> CheckpointSaveError:
    if isinstance(err, OSError) and err.strerror:
        file = Path(err.filename) if isinstance(err.filename, (str, Path)) else None
        shown = file.relative_to(path.parent) if file is not None and file.is_relative_to(path.parent) else file
        reason = f"{shown}: {err.strerror}" if shown is not None else err.strerror
    else:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return CheckpointSaveError(f"could not save checkpoint {path} ({reason}); the previous checkpoints are kept. "
                               f"Expected free space and write permission in {path.parent}")


def _discard(tmp: Path) -> None:
    """Remove a half-written `NAME.tmp` (best effort: discovery ignores it and the next save replaces it)."""
    shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- format
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
    raise TypeError(f"checkpoint state at {path!r} holds a {type(obj).__name__}; expected tensors, "
                    "containers and plain values (what state_dict() methods return)")


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


def _write(path: Path, data: bytes, durable: bool = True) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())


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


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two sharing memory: safetensors refuses shared tensors (tied weights, e.g. an
    embedding reused as the output layer), so a tensor whose memory an earlier one uses is stored as a copy
    (load_state_dict ties them again, since it copies into the model's own parameters)."""
    out, seen = {}, set()
    for key, value in tensors.items():
        value = value.detach().cpu().contiguous()
        if value.numel() and value.untyped_storage().data_ptr() in seen:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        out[key] = value
    return out


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """safetensors' own writer straight to the file (no bytes object in between); returns its checksum.

    The file's size is checked against its own header: the checksum is taken from the file, so a write that
    failed silently (an error at close, which Rust's writer ignores) must be caught here, before the
    checkpoint replaces the previous one."""
    try:
        save_file(tensors, str(path))
    except SafetensorError as err:  # an I/O error, reported by safetensors' Rust writer as "... (os error N)"
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
        size = os.fstat(f.fileno()).st_size
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size != 8 + header_size + end:
        raise OSError(f"{path}: {size} bytes written, {8 + header_size + end} expected (a failed write)")
    return digest(path)


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


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(path: Path, model_state: dict[str, torch.Tensor], state: dict[str, Any],
                     meta: dict[str, Any], durable: bool = True) -> None:
    """Write atomically: everything goes to `path.tmp/`, then one rename makes it visible.

    `durable`: flush every file and the directory to disk before and after the rename (fsync), so that even a
    machine crash or power cut leaves an intact checkpoint. Without it the write is still atomic for the
    process (a kill, an OOM, a crash of Python), since the page cache outlives the process.
    A failure to write (a full disk, a file over the size limit, no permission) removes `path.tmp/` and raises
    `CheckpointSaveError`; the previous checkpoints are untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as err:
        raise _save_error(path, err) from None
    flushes: list[Future] = []
    try:
        tensors: dict[str, torch.Tensor] = {}
        structure = flatten(state, tensors)
        checksums = {}
        for name, content in ((MODEL_FILE, model_state), (STATE_FILE, tensors)):
            checksums[name] = _write_tensors(tmp / name, _unshared(content))
            if durable:
                flushes.append(_in_helper(_fsync, tmp / name))
        meta = {**meta, "format_version": FORMAT_VERSION, "structure": structure, "checksums": checksums}
        _write(tmp / META_FILE, json.dumps(meta, indent=1).encode(), durable)
        _join(flushes)  # every file is on disk before the rename makes the checkpoint visible (raises its error)
        _replace_dir(tmp, path, durable)
    except OSError as err:
        for flush in flushes:
            flush.exception()  # a flush still running must not race the removal
        _discard(tmp)
        raise _save_error(path, err) from None


class CheckpointWriter:
    """Writes checkpoints in order, inline or (`background`) on one background thread.

    In the background, `write` returns once the state is copied into host buffers that the next save reuses
    (no allocation after the first save; pinned memory for CUDA tensors): the loop then goes on while the
    files are written, hashed, flushed and renamed into place. Only one save is in flight: the next `write`
    first waits for the previous one. A failure skips what was queued after it (the links and the pruning
    that assumed the save) and is raised by the next `write` (after it has queued its own save) or `wait`:
    a CheckpointSaveError then, as the run's one error line; any other failure is also logged at once. A
    crash at any point leaves the previous checkpoint intact, as an inline save does."""

    def __init__(self, durable: bool = True, background: bool = False) -> None:
        self.durable, self.background = durable, background
        self._thread: Optional[ThreadPoolExecutor] = None
        self._pending: list[Future] = []
        self._staging: dict[str, torch.Tensor] = {}
        self._failure: Optional[BaseException] = None  # set by the writer thread, cleared by wait()

    def write(self, path: Path, model_state: dict[str, torch.Tensor], state: dict[str, Any],
              meta: dict[str, Any]) -> None:
        if not self.background:
            write_checkpoint(path, model_state, state, meta, self.durable)
            return
        try:
            self.wait()  # the staging buffers are about to be overwritten
            earlier = None
        except Exception as err:  # noqa: BLE001  (this save is still worth making: it may be a signal's `last`)
            earlier = err
        live: dict[str, torch.Tensor] = {}
        structure = flatten({"model": dict(model_state), "state": state}, live)
        staged = self._stage(live)
        copy = unflatten(structure, staged)
        self.call(write_checkpoint, path, copy["model"], copy["state"], meta, self.durable)
        if earlier is not None:
            raise earlier

    def call(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` after every write queued before it (links and pruning must follow their save)."""
        if not self.background:
            fn(*args)
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending.append(self._thread.submit(self._run, fn, args))

    def _run(self, fn: Any, args: tuple) -> None:
        if self._failure is not None:
            return  # a save failed: the links and the pruning queued after it must not run
        try:
            fn(*args)
        except BaseException as err:
            self._failure = err
            if not isinstance(err, UserError):
                log.error("A checkpoint save failed (%s: %s); the previous checkpoints are kept",
                          type(err).__name__, err)
            raise

    def wait(self) -> None:
        """Block until every queued save is on disk; raises the first error of one that failed."""
        pending, self._pending = self._pending, []
        try:
            _join(pending)
        finally:
            self._failure = None

    def close(self) -> None:
        """Free the thread and the host buffers (a sweep runs many trainers in one process)."""
        self.wait()
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        self._staging = {}

    def _stage(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every tensor into its reused host buffer (allocated on first use or when its shape changes)."""
        staged, devices = {}, set()
        for key, tensor in live.items():
            buffer = self._staging.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            buffer.copy_(tensor, non_blocking=tensor.is_cuda)
            if tensor.is_cuda:
                devices.add(tensor.device)
            staged[key] = buffer
        for device in devices:
            torch.cuda.synchronize(device)  # the non-blocking copies must have landed before the writer reads them
        self._staging = staged  # buffers of tensors the state no longer has are freed
        return staged


def _replace_dir(src: Path, dst: Path, durable: bool = True) -> None:
    """Move a finished `src` to `dst`; an older `dst` is moved aside first and removed last, so at every
    instant one intact copy exists (discovery also accepts `NAME.old`)."""
    old = dst.with_name(dst.name + ".old")
    if dst.exists():
        if old.exists():
            _remove_old(old)
        os.rename(dst, old)  # fails (the previous copy kept) if a leftover `old` could not be removed
    # With no `dst`, an `old` left by a crash is the only intact copy: it goes only once `src` is in place.
    os.rename(src, dst)
    if durable:
        _fsync(dst.parent)
    if old.exists():
        _remove_old(old)


def _remove_old(old: Path) -> None:
    """Best effort: the new copy is already in place, so a leftover `NAME.old` costs only disk space (some
    file systems refuse to delete a file that a process still has open or mapped)."""
    try:
        shutil.rmtree(old)
    except OSError as err:
        log.warning("Could not remove the previous copy %s (%s); it is safe to delete by hand", old, err)


def link_checkpoint(src: Path, dst: Path, durable: bool = True) -> None:
    """Make `dst` a copy of checkpoint `src` (hard links: no data is written twice), atomically."""
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as err:
        raise _save_error(dst, err) from None
    try:
        for name in (MODEL_FILE, STATE_FILE, META_FILE):
            try:
                os.link(src / name, tmp / name)
            except OSError:  # a file system without hard links
                shutil.copy2(src / name, tmp / name)
        _replace_dir(tmp, dst, durable)
    except OSError as err:
        _discard(tmp)
        raise _save_error(dst, err) from None


# ---------------------------------------------------------------------------------------------- reading
_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISLNK, "a symbolic link"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a file of an unknown kind")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
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
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _key(key: Any) -> str:
    text = str(key)
    return text if text.isprintable() and len(text) <= 60 else _shown(key)


def _keys(keys: list[Any], shown: int = 3) -> str:
    return ", ".join(_key(k) for k in keys[:shown]) + (" ..." if len(keys) > shown else "")


def _regular_file(folder: Path, name: str) -> str:
    """The path of checkpoint file `folder/name`, checked without opening it to be a regular file inside
    the checkpoint: opening a FIFO blocks forever, a device never ends, and a link out of the checkpoint
    reads what the checkpoint does not hold."""
    file = folder / name
    try:
        st, real = os.lstat(file), str(file)
        if stat.S_ISLNK(st.st_mode):
            real, inside = os.path.realpath(file), os.path.realpath(folder)
            if os.path.commonpath([real, inside]) != inside:
                raise DamagedCheckpoint(f"{_where(folder)}: {name} is a symbolic link to {_name(real)}, outside the "
                                        "checkpoint; expected a regular file")
            st = os.stat(real)
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{_where(folder)}: {name} is missing") from None
    except OSError as err:
        raise DamagedCheckpoint(f"{_where(folder)}: {name} cannot be read ({err.strerror}); expected a readable "
                                "regular file") from None
    if not stat.S_ISREG(st.st_mode):
        raise DamagedCheckpoint(f"{_where(folder)}: {name} is {_kind(st.st_mode)}; expected a regular file")
    return real


def _open_file(folder: Path, name: str) -> tuple[int, str]:
    """A descriptor of checkpoint file `folder/name` (see `_regular_file`) and its path. Opened non-blocking
    and checked again: a file swapped for a FIFO after the check cannot block either."""
    real = _regular_file(folder, name)
    try:
        fd = os.open(real, _READ_FLAGS)
    except OSError as err:
        raise DamagedCheckpoint(f"{_where(folder)}: {name} cannot be read ({err.strerror}); expected a readable "
                                "regular file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DamagedCheckpoint(f"{_where(folder)}: {name} is {_kind(mode)}; expected a regular file")
    return fd, real


def _fd_path(fd: int, real: str) -> str:
    """A path that opens the very file `fd` is open on (Linux's /proc), for readers that take a path: what
    was checked is what they read, even if the name is replaced in between."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else real


def _identity(fd: int) -> tuple[int, int, int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _check_directory(path: Path) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{_where(path)}: no such directory; expected a checkpoint directory") from None
    except OSError as err:
        raise DamagedCheckpoint(f"{_where(path)} cannot be read ({err.strerror}); expected a readable "
                                "checkpoint directory") from None
    if not stat.S_ISDIR(mode):
        raise DamagedCheckpoint(f"{_where(path)} is {_kind(mode)}; expected a directory holding {MODEL_FILE}, "
                                f"{STATE_FILE} and {META_FILE}")


def _read_meta(path: Path) -> Any:
    """meta.json parsed, read only up to MAX_META_BYTES."""
    fd, _ = _open_file(path, META_FILE)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        data = f.read(MAX_META_BYTES + 1) if size <= MAX_META_BYTES else b""
    if size > MAX_META_BYTES or len(data) > MAX_META_BYTES:
        raise DamagedCheckpoint(f"{_where(path)}: {META_FILE} is {max(size, len(data))} bytes, over the "
                                f"{MAX_META_BYTES // 2**20} MiB it may have; expected counters, metrics, the config "
                                "and the state's structure (a few KiB)")
    try:
        return json.loads(data)
    except RecursionError:
        raise DamagedCheckpoint(f"{_where(path)}: {META_FILE} is nested too deeply to read; expected at most "
                                f"{MAX_META_DEPTH} levels") from None
    except ValueError as err:  # bad JSON, bad UTF-8, an integer of over 4300 digits
        raise DamagedCheckpoint(f"{_where(path)}: {META_FILE} is not valid JSON ({err})") from None


def _too_deep(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in children)
    return False


def _check_meta(path: Path, meta: Any) -> None:
    """meta.json's schema: the type and range of every field the framework reads."""
    where = f"{_where(path)}: {META_FILE}"
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(f"{where} holds {_shown(meta)}; expected a JSON object")
    version = meta.get("format_version")
    if not _is_int(version) or version not in READABLE_VERSIONS:
        if _is_int(version) and version > FORMAT_VERSION:
            raise UnreadableCheckpoint(f"{where}: format version {version} comes from a newer version of "
                                       f"this framework, which reads versions {', '.join(map(str, READABLE_VERSIONS))}"
                                       "; expected one of those (upgrade the framework to load it)")
        raise DamagedCheckpoint(f"{where} has format_version={_shown(version)}; expected one of "
                                f"{', '.join(map(str, READABLE_VERSIONS))}")
    if _too_deep(meta, MAX_META_DEPTH):
        raise DamagedCheckpoint(f"{where} is nested more than {MAX_META_DEPTH} levels deep; expected counters, "
                                "metrics, the config and the state's structure")
    checksums = meta.get("checksums")
    if "checksums" in meta and not isinstance(checksums, dict):
        raise DamagedCheckpoint(f"{where} has checksums={_shown(checksums)}; expected an object of file checksums")
    lacking = [key for key in ("step", "structure", "config") if key not in meta]
    lacking += [f"checksums.{name}" for name in (MODEL_FILE, STATE_FILE) if name not in (checksums or {})]
    if lacking:
        raise DamagedCheckpoint(f"{where} lacks {', '.join(lacking)}")
    for key, least in (("step", 0), ("epoch", 0), ("batch_in_epoch", 0), ("world_size", 1)):
        value = meta.get(key, least)  # only step is required: small checkpoints need no loop position
        if not (_is_int(value) and least <= value <= _MAX_COUNTER):
            raise DamagedCheckpoint(f"{where} has {key}={_shown(value)}; expected a whole number >= {least}")
    metrics = meta.get("metrics", {})
    wrong = [k for k, v in metrics.items() if not _is_number(v)] if isinstance(metrics, dict) else None
    if wrong is None or wrong:
        shown = _shown(metrics) if wrong is None else f"{_key(wrong[0])}={_shown(metrics[wrong[0]])}"
        raise DamagedCheckpoint(f"{where} has metrics {shown}; expected an object of metric names to numbers")
    if not isinstance(meta["config"], dict):
        raise DamagedCheckpoint(f"{where} has config={_shown(meta['config'])}; expected an object (the run's config)")
    for name in (MODEL_FILE, STATE_FILE):
        value = checksums[name]
        if not ((_is_int(value) and 0 <= value < 2**32) if version == 1 else isinstance(value, str)):
            expected = "a CRC-32 (a whole number)" if version == 1 else "a string such as xxh3_64:0123456789abcdef"
            raise DamagedCheckpoint(f"{where} has checksums.{name}={_shown(value)}; expected {expected}")
    _structure_refs(path, meta["structure"])


_MARKERS = ("__tensor__", "__tuple__", "__items__")


def _structure_refs(path: Path, structure: Any) -> list[str]:
    """The tensor names `structure` refers to. Raises DamagedCheckpoint unless it is what `flatten` writes for
    a dict, so that `unflatten` cannot fail on it."""
    refs: list[str] = []

    def malformed(at: str, why: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(f"{_where(path)}: {META_FILE} structure at {at or '/'} {why}; expected what "
                                 "checkpoint.flatten writes")

    def walk(node: Any, at: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{at}/{i}")
            return
        if not isinstance(node, dict):
            return
        marked = [k for k in node if k.startswith("__")]
        if not marked:
            for key, value in node.items():
                walk(value, f"{at}/{_key(key)}")
            return
        if len(node) != 1 or marked[0] not in _MARKERS:
            raise malformed(at, f"has the keys {_keys(list(node))}")
        kind, value = marked[0], node[marked[0]]
        if kind == "__tensor__":
            if not isinstance(value, str):
                raise malformed(at, f"refers to the tensor {_shown(value)}, not a name")
            refs.append(value)
        elif not isinstance(value, list):
            raise malformed(at, f"holds {_shown(value)} under {kind}, not a list")
        elif kind == "__tuple__":
            for i, item in enumerate(value):
                walk(item, f"{at}/{i}")
        else:
            for item in value:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int, float, bool))):
                    raise malformed(at, f"holds the item {_shown(item)} under __items__, not a [key, value] pair")
                walk(item[1], f"{at}/{_key(item[0])}")

    if not isinstance(structure, dict) or "__tensor__" in structure or "__tuple__" in structure:
        raise malformed("", f"is {_shown(structure)}, not a dict of the state")
    walk(structure, "")
    return refs


def _check_refs(path: Path, refs: list[str], names: Iterable[str]) -> None:
    """The structure must use every tensor of state.safetensors, each exactly once."""
    names = set(names)
    seen: set[str] = set()
    twice = [ref for ref in refs if ref in seen or seen.add(ref)]  # type: ignore[func-returns-value]
    problems = []
    missing = [ref for ref in refs if ref not in names]
    unused = sorted(names - seen)
    if missing:
        problems.append(f"it refers to tensors that {STATE_FILE} lacks: {_keys(missing)}")
    if unused:
        problems.append(f"{STATE_FILE} holds tensors it does not use: {_keys(unused)}")
    if twice:
        problems.append(f"it refers twice to {_keys(twice)}")
    if problems:
        raise DamagedCheckpoint(f"{_where(path)}: {META_FILE} structure does not match {STATE_FILE} "
                                f"({'; '.join(problems)}); expected the two files of one save")


def _verify(path: Path, name: str, fd: int, meta: dict[str, Any]) -> None:
    expected = meta["checksums"][name]
    if _digest_fd(fd, crc32=isinstance(expected, int)) != expected:
        raise DamagedCheckpoint(f"{_where(path)}: {name} does not match its checksum (damaged or truncated)")


def _not_safetensors(path: Path, name: str, err: Exception) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{_where(path)}: {name} is not a valid safetensors file "
                             f"({str(err).splitlines()[0] if str(err) else type(err).__name__})")


def _tensor_names(path: Path, name: str, fd: int, real: str) -> list[str]:
    """The tensor names in a checked file's header, which safetensors validates whole (offsets, sizes, dtypes)."""
    try:
        with safe_open(_fd_path(fd, real), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as err:  # a file written with its checksum but not by safetensors
        raise _not_safetensors(path, name, err) from None


def _load_tensors(path: Path, name: str, fd: int, real: str) -> dict[str, torch.Tensor]:
    """The tensors of a checked file, memory-mapped copy-on-write (a change never reaches the file)."""
    try:
        return load_file(_fd_path(fd, real))
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as err:
        raise _not_safetensors(path, name, err) from None


@dataclass
class Checkpoint:
    path: Path
    meta: dict[str, Any]
    # (device, inode, size, mtime) of each file whose checksum open_checkpoint checked: a load of the same
    # file does not hash it again; a file replaced in between is checked again.
    verified: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def model_state(self) -> dict[str, torch.Tensor]:
        """The weights, memory-mapped copy-on-write (`load_state_dict` copies them into the model)."""
        return self._load(MODEL_FILE)

    def state(self) -> dict[str, Any]:
        """The training state, in memory of its own: optimizer state would otherwise keep the file mapped
        for the whole run (load_state_dict does not copy tensors already on the right device), and a mapped
        file cannot be deleted cleanly on every file system when a later save prunes it."""
        tensors = self._load(STATE_FILE)
        _check_refs(self.path, _structure_refs(self.path, self.meta["structure"]), tensors)
        return unflatten(self.meta["structure"], {k: v.clone() for k, v in tensors.items()})

    def _load(self, name: str) -> dict[str, torch.Tensor]:
        fd, real = _open_file(self.path, name)
        try:
            if self.verified.get(name) != _identity(fd):
                _verify(self.path, name, fd, self.meta)
            return _load_tensors(self.path, name, fd, real)
        finally:
            os.close(fd)


def _verify_files(path: Path, meta: dict[str, Any]) -> dict[str, tuple[int, int, int, int]]:
    """Check both data files against their checksums (at once, on two cores), their headers, and the
    structure against the state's tensors; returns the identities of the files checked."""
    opened: dict[str, tuple[int, str]] = {}
    try:
        for name in (MODEL_FILE, STATE_FILE):
            opened[name] = _open_file(path, name)
        _join([_in_helper(_verify, path, name, fd, meta) for name, (fd, _) in opened.items()])
        names = {name: _tensor_names(path, name, *opened[name]) for name in opened}
        _check_refs(path, _structure_refs(path, meta["structure"]), names[STATE_FILE])
        return {name: _identity(fd) for name, (fd, _) in opened.items()}
    finally:
        for fd, _ in opened.values():
            os.close(fd)


def open_checkpoint(path: Path, verify: bool = True) -> Checkpoint:
    """Read a checkpoint's meta.json and check it: its schema, both data files regular files, and with
    `verify` both intact (checksums) and consistent with it (the structure uses exactly the state's tensors).
    Raises DamagedCheckpoint, one line naming the file, or UnreadableCheckpoint for a newer format."""
    _check_directory(path)
    meta = _read_meta(path)
    _check_meta(path, meta)
    if not verify:
        for name in (MODEL_FILE, STATE_FILE):
            _regular_file(path, name)
        return Checkpoint(path, meta)
    return Checkpoint(path, meta, _verify_files(path, meta))


def find_latest(run_dir: Path, below_step: Optional[int] = None) -> Optional[Checkpoint]:
    """The newest intact checkpoint of a run. Anything else in `checkpoints/` (a damaged checkpoint, a file,
    a FIFO, a link out of the folder) is skipped with a warning naming it and why, without being opened.

    Every meta.json is read, but data files are hashed newest first and only until one is intact: a run that
    keeps every periodic checkpoint does not re-read all of them to resume from the last. A checkpoint that
    disappears while being read (a run still saving into this folder replaced it) makes discovery look again.
    `below_step`: only checkpoints of an earlier step (the fallback when a newer one failed to restore)."""
    for _ in range(3):
        found, vanished = _newest_intact(run_dir / "checkpoints", below_step)
        if found is not None or not vanished:
            return found
    return None


def _newest_intact(folder: Path, below_step: Optional[int] = None) -> tuple[Optional[Checkpoint], bool]:
    described, vanished = [], False
    for path in _candidates(folder):
        try:
            described.append(open_checkpoint(path, verify=False))
        except DamagedCheckpoint as err:
            vanished |= _skip(path, err)
    if below_step is not None:
        described = [c for c in described if c.step < below_step]
    # Newest step first; at equal steps any copy will do (last and step-N hold the same state).
    for checkpoint in sorted(described, key=lambda c: (c.step, c.path.name == "last"), reverse=True):
        try:
            return open_checkpoint(checkpoint.path), vanished
        except DamagedCheckpoint as err:
            vanished |= _skip(checkpoint.path, err)
    return None, vanished


def _skip(path: Path, err: DamagedCheckpoint) -> bool:
    """Warn that a checkpoint is skipped; True (and no warning) when it is gone: removed while being read."""
    if not os.path.lexists(path):
        log.debug("%s disappeared while being read", _where(path))
        return True
    log.warning("Skipping a damaged checkpoint: %s", err)
    return False


def _candidates(folder: Path) -> list[Path]:
    """The directories in `folder`, and links to directories inside it; anything else is skipped with a
    warning, from its lstat alone. Leftovers `NAME.tmp` of an interrupted save are ignored."""
    try:
        entries = sorted(entry.name for entry in os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as err:
        raise DamagedCheckpoint(f"{_name(folder)} cannot be listed ({err.strerror}); expected a readable "
                                "folder of checkpoints") from None
    found = []
    inside = os.path.realpath(folder)
    for name in entries:
        if name.endswith(".tmp"):
            continue
        path = folder / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue  # gone since the listing
        except OSError as err:
            log.warning("Skipping a damaged checkpoint: %s cannot be read (%s)", _where(path), err.strerror)
            continue
        problem = None
        if stat.S_ISLNK(mode):
            real = os.path.realpath(path)
            if os.path.commonpath([real, inside]) != inside or real == inside:
                problem = f"is a symbolic link to {_name(real)}, not to a checkpoint inside {_name(folder)}"
            else:
                try:
                    mode = os.stat(real).st_mode
                except OSError as err:
                    problem = f"is a symbolic link to {_name(real)}, which cannot be read ({err.strerror})"
        if problem is None and not stat.S_ISDIR(mode):
            problem = f"is {_kind(mode)}"
        if problem is not None:
            log.warning("Skipping a damaged checkpoint: %s %s; expected a checkpoint directory", _where(path), problem)
            continue
        found.append(path)
    return found


# ---------------------------------------------------------------------------------------------- validation
def _mismatch(at: str, saved: Any, live: Any) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{at}: the checkpoint holds {_shown(saved)}, expected {_shown(live)} as in this run "
                             "(a checkpoint of another model, optimizer or config, or a damaged one)")


def validate_state(saved: Any, live: Any, where: str) -> None:
    """Check that `saved`, a component's state as `Checkpoint.state()` returns it, fits `live`, the same
    component's `state_dict()` in this run, before anything is loaded: a checkpoint that does not fit must end
    the run with one line, not leave it half-restored or fail at its first step. Raises DamagedCheckpoint;
    its message starts with `where` (e.g. f"checkpoint {path}: optimizer") and the path within the state
    ("/state/3/exp_avg"), then says what was saved and what was expected.

    - A tensor must have the live one's dtype and shape; a live tensor with no elements (a buffer that fills
      as the run goes, e.g. a window of losses) takes any length in the same number of dimensions.
    - A dict must have the live one's keys, a list or tuple its length, item by item.
    - A plain value must be of the live one's kind: number (int or float), bool, string; a live None takes
      any plain value.
    The live component has not run yet: an empty live dict or list (no metric yet, no entry in a registry)
    takes saved entries of any key or number. For torch.optim's layout (`state` and `param_groups`) the groups
    must match; per-parameter states are compared where the live optimizer has them, and otherwise (it has
    not stepped) must be dicts belonging to parameters that `param_groups` lists."""
    if isinstance(live, torch.Tensor):
        variable = live.numel() == 0 and isinstance(saved, torch.Tensor) and saved.dim() == live.dim()
        if not isinstance(saved, torch.Tensor) or saved.dtype != live.dtype or (saved.shape != live.shape
                                                                                and not variable):
            raise _mismatch(where, saved, live)
    elif isinstance(live, dict):
        if not isinstance(saved, dict):
            raise _mismatch(where, saved, live)
        if set(live) == {"state", "param_groups"}:
            _validate_optimizer(saved, live, where)
        elif live:
            _same_keys(saved, live, where)
            for key, value in live.items():
                validate_state(saved[key], value, f"{where}/{_key(key)}")
    elif isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or (live and len(saved) != len(live)):
            raise _mismatch(where, saved, live)
        for i, value in enumerate(live):
            validate_state(saved[i], value, f"{where}/{i}")
    elif isinstance(saved, (dict, list, tuple, torch.Tensor)) or (live is not None and _plain_kind(saved) !=
                                                                   _plain_kind(live)):
        raise _mismatch(where, saved, live)


def _plain_kind(value: Any) -> str:
    return "bool" if isinstance(value, bool) else "number" if _is_number(value) else type(value).__name__


def _same_keys(saved: dict, live: dict, where: str) -> None:
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        differences = ([f"lacks {_keys(missing)}"] if missing else []) + (
            [f"has {_keys(unexpected)} too"] if unexpected else [])
        raise DamagedCheckpoint(f"{where}: the checkpoint's state {' and '.join(differences)}; expected the keys "
                                f"{_keys(list(live), 6)} as in this run (a checkpoint of another model, optimizer or "
                                "config, or a damaged one)")


def _validate_optimizer(saved: dict, live: dict, where: str) -> None:
    """torch.optim's state_dict: `param_groups` (with the ids of their parameters) and per-parameter `state`
    keyed by those ids, which load_state_dict matches to this run's parameters by position."""
    _same_keys(saved, live, where)
    validate_state(saved["param_groups"], live["param_groups"], f"{where}/param_groups")
    saved_ids = [i for group in saved["param_groups"] for i in group.get("params", [])]
    live_ids = [i for group in live["param_groups"] for i in group.get("params", [])]
    if not all(_is_int(i) for i in saved_ids) or len(set(saved_ids)) != len(saved_ids):
        raise DamagedCheckpoint(f"{where}/param_groups: the parameter ids {_keys(saved_ids, 6)} are not distinct "
                                "whole numbers; expected the ids torch.optim writes")
    position = dict(zip(saved_ids, live_ids))
    if not isinstance(saved["state"], dict):
        raise _mismatch(f"{where}/state", saved["state"], live["state"])
    for key, entry in saved["state"].items():
        at = f"{where}/state/{_key(key)}"
        if key not in position:
            raise DamagedCheckpoint(f"{at}: the checkpoint holds the state of parameter {_key(key)}, which no param "
                                    f"group lists; expected one of {_keys(saved_ids, 6)}")
        if position[key] in live["state"]:
            validate_state(entry, live["state"][position[key]], at)
        elif not isinstance(entry, dict):
            raise _mismatch(at, entry, {})


def validate_rng_state(state: Any, where: str) -> None:
    """Check one process's RNG state, as `reproducibility.rng_state()` captures it, before any of it is set
    (`set_rng_state` sets python's, numpy's, torch's, then CUDA's: a bad one would leave the others set).
    Python's and numpy's are checked field by field (numpy does not check its position itself: one out of
    range crashes the process later); torch's and CUDA's are set on private generators, which apply torch's
    own checks and leave the global ones alone. Raises DamagedCheckpoint naming `where/python` etc."""
    if not isinstance(state, dict) or any(key not in state for key in ("python", "numpy", "torch")):
        raise DamagedCheckpoint(f"{where}: the checkpoint holds {_shown(state)}; expected the python, numpy and "
                                "torch RNG states")
    python = state["python"]
    internal = python[1] if isinstance(python, (list, tuple)) and len(python) == 3 else None
    if not (isinstance(internal, (list, tuple)) and len(internal) == 625 and python[0] == 3 and _is_int(python[0])
            and all(_is_int(word) and 0 <= word < 2**32 for word in internal[:624])
            and _is_int(internal[624]) and 0 <= internal[624] <= 624
            and (python[2] is None or _is_number(python[2]))):
        raise DamagedCheckpoint(f"{where}/python: the checkpoint holds {_shown(python)} that random.setstate "
                                "cannot take; expected (3, 624 32-bit words and a position <= 624, None or a number)")
    numpy = state["numpy"]
    key = numpy.get("key") if isinstance(numpy, dict) else None
    if not (isinstance(key, torch.Tensor) and key.dtype == torch.int64 and key.shape == (624,)
            and bool(((key >= 0) & (key < 2**32)).all()) and _is_int(numpy.get("pos"))
            and 0 <= numpy["pos"] <= 624 and numpy.get("has_gauss") in (0, 1) and _is_int(numpy["has_gauss"])
            and _is_number(numpy.get("gauss"))):
        raise DamagedCheckpoint(f"{where}/numpy: the checkpoint holds {_shown(numpy)} that is not an MT19937 state; "
                                "expected key (624 32-bit words as int64), pos (0 to 624), has_gauss (0 or 1), gauss")
    _check_generator_state(state["torch"], f"{where}/torch", torch.Generator())
    cuda = state.get("cuda", [])
    if not isinstance(cuda, (list, tuple)):
        raise DamagedCheckpoint(f"{where}/cuda: the checkpoint holds {_shown(cuda)}; expected a list of CUDA RNG "
                                "states, one per device")
    if torch.cuda.is_available() and len(cuda) > torch.cuda.device_count():
        raise DamagedCheckpoint(f"{where}/cuda: the checkpoint holds the RNG states of {len(cuda)} CUDA devices; "
                                f"expected at most the {torch.cuda.device_count()} this machine has")
    for i, value in enumerate(cuda):
        generator = torch.Generator(f"cuda:{i}") if torch.cuda.is_available() else None
        _check_generator_state(value, f"{where}/cuda/{i}", generator)


def _check_generator_state(value: Any, at: str, generator: Optional[torch.Generator]) -> None:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1):
        raise DamagedCheckpoint(f"{at}: the checkpoint holds {_shown(value)}; expected a torch RNG state (a 1-d "
                                "uint8 tensor)")
    if generator is None:
        return
    try:
        generator.set_state(value)
    except (RuntimeError, TypeError, ValueError) as err:
        raise DamagedCheckpoint(f"{at}: the checkpoint holds no valid torch RNG state ({str(err).splitlines()[0]}); "
                                "expected what torch.get_rng_state() returns") from None

# ---------------------------------------------------------------------------------------------- weights
_CONVERTIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                torch.int64, torch.uint8, torch.bool}


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Weights for `init_from`: a checkpoint directory, a .safetensors file, or a plain `torch.save`
    state dict (read with weights_only=True: no code runs). A `module.` prefix (DataParallel/DDP) is dropped."""
    if not path.exists():
        raise ConfigError(f"init_from={str(path)!r}: no such file or directory; expected a checkpoint directory, "
                          "a .safetensors file or a torch.save state dict")
    mode = os.stat(path).st_mode
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):  # reading a FIFO would block, a device never end
        raise ConfigError(f"init_from={str(path)!r}: {_kind(mode)}; expected a checkpoint directory, a "
                          ".safetensors file or a torch.save state dict")
    if path.is_dir():
        state = open_checkpoint(path).model_state()
    elif path.suffix == ".safetensors":
        try:
            state = load_file(str(path))
        except SafetensorError as err:
            raise ConfigError(f"init_from={str(path)!r}: not a valid safetensors file ({err})") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ConfigError(f"init_from={str(path)!r}: cannot read it as weights ({str(err).splitlines()[0]}); "
                              "expected a checkpoint directory, a .safetensors file or a torch.save state dict")
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]  # Lightning-style file
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"init_from={str(path)!r}: expected a state dict of tensors")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def check_compatible(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, strict: bool) -> None:
    """One clear error listing the first missing, unexpected, shape-mismatched and unconvertible keys
    (load_state_dict converts between plain number dtypes, not from e.g. float4 or complex)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = sorted(k for k in state if k not in own)  # a stable order: safetensors loads keys in none
    mismatched = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own
                  if k in state and state[k].shape != own[k].shape]
    unconvertible = [f"{k} {str(state[k].dtype).removeprefix('torch.')} vs {str(own[k].dtype).removeprefix('torch.')}"
                     for k in own if k in state and state[k].dtype != own[k].dtype
                     and not {state[k].dtype, own[k].dtype} <= _CONVERTIBLE]
    problems = []
    for label, keys, shown in (("missing", missing, strict), ("unexpected", unexpected, strict),
                               ("shape mismatch", mismatched, True), ("dtype mismatch", unconvertible, True)):
        if keys and shown:
            problems.append(f"{label} {_keys(keys)}")
    if problems:
        raise ConfigError(f"{source}: its weights do not fit this model ({'; '.join(problems)}); expected a "
                          "checkpoint of the same model config")


# ---------------------------------------------------------------------------------------------- policies
@dataclass
class CheckpointManager:
    """Decides when to save and what to keep: `last`, periodic `step-N`, the top-k by a metric (`best`)."""

    folder: Path
    save_last: bool = False
    every_n_steps: int = 0
    every_n_epochs: int = 0
    keep_last: int = 1
    monitor: Optional[str] = None
    mode: str = "max"
    save_top_k: int = 0
    enabled: bool = True  # False on non-zero ranks and in fast_dev_run: decisions still made, nothing written
    fsync: bool = True  # flush to disk (see write_checkpoint's `durable`)
    async_save: bool = False  # write on a background thread (see CheckpointWriter)
    periodic: list[str] = field(default_factory=list)  # names, oldest first
    top_k: list[tuple[float, str]] = field(default_factory=list)  # (metric, name), best first

    def __post_init__(self) -> None:
        self.writer = CheckpointWriter(durable=self.fsync, background=self.async_save)

    @property
    def active(self) -> bool:
        return self.save_last or self.every_n_steps > 0 or self.every_n_epochs > 0 or self.save_top_k != 0

    def due_periodic(self, step: int, completed_epochs: Optional[int] = None) -> bool:
        """Is a periodic checkpoint due? `completed_epochs` is given only at the end of an epoch."""
        by_step = self.every_n_steps > 0 and step % self.every_n_steps == 0
        by_epoch = (completed_epochs is not None and self.every_n_epochs > 0
                    and completed_epochs % self.every_n_epochs == 0)
        return by_step or by_epoch

    def improves(self, metrics: Optional[dict[str, float]]) -> bool:
        if metrics is None or self.save_top_k == 0 or self.monitor is None:
            return False
        if self.monitor not in metrics:
            raise ConfigError(f"checkpoint.monitor={self.monitor!r}: no such metric; expected one of "
                              f"{', '.join(metrics)}")
        if self.save_top_k < 0 or len(self.top_k) < self.save_top_k:
            return True
        worst = self.top_k[-1][0]
        value = metrics[self.monitor]
        return value > worst if self.mode == "max" else value < worst

    def save(self, step: int, write: Any, *, periodic: bool, metrics: Optional[dict[str, float]] = None) -> None:
        """Write once (as `step-N` when a policy keeps it, else as `last`) and link the other names to it.

        Called on every rank with the same arguments: the registry is kept everywhere so every rank makes
        the same decisions, and `write(path)` runs everywhere (it may gather state from all ranks), but
        files are written and deleted by the enabled rank only (`write(None)` elsewhere). `write` hands the
        state to `self.writer`; the links and the pruning are queued after it."""
        top = self.improves(metrics)
        keep = periodic or top
        if not (keep or self.save_last):
            return
        name = f"step-{step}"
        target = self.folder / (name if keep else "last")
        # The registry is updated before writing, so the checkpoint's own state already lists it.
        if periodic:
            self.periodic.append(name)
        if top:
            self.top_k.append((metrics[self.monitor], name))
            self.top_k.sort(key=lambda item: item[0], reverse=self.mode == "max")
            if self.save_top_k > 0:
                del self.top_k[self.save_top_k:]
        if self.keep_last >= 0 and len(self.periodic) > self.keep_last:
            self.periodic = self.periodic[len(self.periodic) - self.keep_last:] if self.keep_last else []
        write(target if self.enabled else None)
        if not self.enabled:
            return
        if keep and self.save_last:
            self.writer.call(link_checkpoint, target, self.folder / "last", self.fsync)
        if top and self.top_k[0][1] == name:
            self.writer.call(link_checkpoint, target, self.folder / "best", self.fsync)
        self.writer.call(self._prune, set(self.periodic) | {name for _, name in self.top_k})

    def _prune(self, kept: set[str]) -> None:
        """Delete `step-N` folders that no policy keeps any more."""
        for path in self.folder.glob("step-*"):  # never through a link: only folders this run wrote
            if path.is_dir() and not path.is_symlink() and not path.name.endswith((".tmp", ".old")) \
                    and path.name not in kept:
                shutil.rmtree(path, ignore_errors=True)

    def best_path(self) -> Optional[Path]:
        return self.folder / "best" if self.top_k else None

    def state_dict(self) -> dict[str, Any]:
        return {"periodic": list(self.periodic), "top_k": [[v, n] for v, n in self.top_k]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state, "checkpoint state checkpoints")
        self.periodic = list(state.get("periodic", []))
        self.top_k = [(float(v), str(n)) for v, n in state.get("top_k", [])]

    @staticmethod
    def check_state_dict(state: Any, where: str) -> None:
        """Raise DamagedCheckpoint (naming `where`/periodic or `where`/top_k/i) unless `state` is what
        state_dict() returns; for checking a checkpoint before anything is loaded."""
        if not isinstance(state, dict):
            raise _mismatch(where, state, {"periodic": [], "top_k": []})
        periodic, top_k = state.get("periodic", []), state.get("top_k", [])
        if not isinstance(periodic, list) or not all(isinstance(name, str) for name in periodic):
            raise DamagedCheckpoint(f"{where}/periodic: the checkpoint holds {_shown(periodic)} that is not a list "
                                    "of checkpoint names; expected names such as step-500")
        if not isinstance(top_k, list):
            raise DamagedCheckpoint(f"{where}/top_k: the checkpoint holds {_shown(top_k)}; expected a list of "
                                    "[metric value, checkpoint name]")
        for i, item in enumerate(top_k):
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and _is_number(item[0])
                    and isinstance(item[1], str)):
                raise DamagedCheckpoint(f"{where}/top_k/{i}: the checkpoint holds {_shown(item)}; expected [metric "
                                        "value, checkpoint name]")
