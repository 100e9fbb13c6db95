"""Atomic writes: a checkpoint is written as `NAME.tmp/`, flushed to disk, then renamed into place, so a crash
mid-save never damages an existing checkpoint; `last` and `best` are hard-linked copies made the same way."""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from framework.checkpoint.format import (
    FORMAT_VERSION,
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointSaveError,
    _in_helper,
    _join,
    digest,
    flatten,
)
from framework.core import files

log = logging.getLogger(__name__)


def _save_error(path: Path, err: BaseException) -> CheckpointSaveError:
    if isinstance(err, OSError) and err.strerror:
        file = Path(err.filename) if isinstance(err.filename, (str, Path)) else None
        shown = file.relative_to(path.parent) if file is not None and file.is_relative_to(path.parent) else file
        reason = f"{shown}: {err.strerror}" if shown is not None else err.strerror
    else:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return CheckpointSaveError(
        f"could not save checkpoint {path} ({reason}); the previous checkpoints are kept. "
        f"Expected free space and write permission in {path.parent}"
    )


def _discard(tmp: Path) -> None:
    """Remove a half-written `NAME.tmp` (best effort: discovery ignores it and the next save replaces it)."""
    shutil.rmtree(tmp, ignore_errors=True)


def _write(path: Path, data: bytes, durable: bool = True) -> None:
    files.write_bytes(path, data, fsync=durable)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two overlapping in memory: safetensors refuses overlapping tensors (tied weights,
    e.g. an embedding reused as the output layer), so a tensor whose bytes overlap an earlier one's is stored
    as a copy (load_state_dict ties them again, since it copies into the model's own parameters). Disjoint
    views of one buffer (the background writer's staging) are written as they are."""
    out: dict[str, torch.Tensor] = {}
    taken: list[tuple[int, int]] = []  # the byte ranges of the tensors kept so far: sorted, disjoint
    for key, value in tensors.items():
        value = value.detach().cpu().contiguous()
        span = _span(value)
        if span[0] != span[1] and _overlaps(taken, span):
            value = value.clone()
            span = _span(value)
        if span[0] != span[1]:
            bisect.insort(taken, span)
        out[key] = value
    return out


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _overlaps(taken: list[tuple[int, int]], span: tuple[int, int]) -> bool:
    """Does `span` overlap one of the sorted, disjoint ranges `taken`? Only its neighbours can."""
    i = bisect.bisect_left(taken, span)
    return (i > 0 and taken[i - 1][1] > span[0]) or (i < len(taken) and taken[i][0] < span[1])


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


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    path: Path, model_state: dict[str, torch.Tensor], state: dict[str, Any], meta: dict[str, Any], durable: bool = True
) -> None:
    """Write atomically: everything goes to `path.tmp/`, then one rename makes it visible.

    `durable`: flush every file and the directory to disk before and after the rename (fsync), so that even a
    machine crash or power cut leaves an intact checkpoint. Without it the write is still atomic for the
    process (a kill, an OOM, a crash of Python), since the page cache outlives the process.
    A failure to write (a full disk, a file over the size limit, no permission) removes `path.tmp/` and raises
    `CheckpointSaveError`; the previous checkpoints are untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        files.fresh_dir(tmp)
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
        files.remove(old)
    except OSError as err:
        log.warning("Could not remove the previous copy %s (%s); it is safe to delete by hand", old, err)


def link_checkpoint(src: Path, dst: Path, durable: bool = True) -> None:
    """Make `dst` a copy of checkpoint `src` (hard links: no data is written twice), atomically."""
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        files.fresh_dir(tmp)
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
