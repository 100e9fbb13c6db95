"""The checkpoint writer: saves in order, inline or (`async_save`) on one background thread. In the background
the training loop waits only for a copy of the state into a reused host buffer; writing, hashing, flushing and
renaming happen on the thread (as torch.distributed.checkpoint.async_save)."""

from __future__ import annotations

import logging
import mmap
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch

from framework.checkpoint.format import _join, flatten, unflatten
from framework.checkpoint.save import write_checkpoint
from framework.checkpoint.sharded import LocalParts, Ranks, commit_sharded, write_sharded
from framework.core.errors import UserError

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes checkpoints in order, inline or (`background`) on one background thread.

    In the background, `write` returns once the state is copied into a host buffer that the next save reuses
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
        self._staging: dict[str, torch.Tensor] = {}  # views into one host buffer, reused by every save
        self._buffer: Optional[torch.Tensor] = None  # the host buffer those views share
        self._unpin: Optional[weakref.finalize] = None  # unregisters its page-locking, once
        self._layout: Optional[list] = None  # the (key, shape, dtype) of each tensor staged
        self._failure: Optional[BaseException] = None  # set by the writer thread, cleared by wait()

    def write(
        self, path: Path, model_state: dict[str, torch.Tensor], state: dict[str, Any], meta: dict[str, Any]
    ) -> None:
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

    def write_sharded(
        self,
        path: Path,
        model_state: dict[str, torch.Tensor],
        state: dict[str, Any],
        meta: dict[str, Any],
        ranks: Ranks,
        background_ranks: Optional[Ranks] = None,
    ) -> None:
        """This rank's part of sharded checkpoint `path` (every rank calls it). In the background the loop waits
        only for the copy of this rank's shards into the host buffer; the files are written and committed on the
        thread, the ranks agreeing through `background_ranks` (a process group of their own)."""
        if not self.background or background_ranks is None:
            write_sharded(path, model_state, state, meta, ranks, self.durable)
            return
        try:
            self.wait()  # the staging buffers are about to be overwritten
            earlier = None
        except Exception as err:  # noqa: BLE001  (as in write)
            earlier = err
        parts = LocalParts.of(model_state, state)
        staged = self._stage(
            {**{"m" + k: v for k, v in parts.model.items()}, **{"s" + k: v for k, v in parts.state.items()}}
        )
        parts.model = {k: staged["m" + k] for k in parts.model}
        parts.state = {k: staged["s" + k] for k in parts.state}
        self.call(commit_sharded, path, parts, meta, background_ranks, self.durable)
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
                log.error(
                    "A checkpoint save failed (%s: %s); the previous checkpoints are kept", type(err).__name__, err
                )
            raise

    def wait(self) -> None:
        """Block until every queued save is on disk; raises the first error of one that failed."""
        pending, self._pending = self._pending, []
        try:
            _join(pending)
        finally:
            self._failure = None

    def close(self) -> None:
        """Free the thread and the host buffer (a sweep runs many trainers in one process)."""
        self.wait()
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        self._release()

    def _release(self) -> None:
        """Drop the host buffer, unpinned at once (its pages are unmapped when the last view of it goes)."""
        if self._unpin is not None:
            self._unpin()
        self._staging, self._layout, self._buffer, self._unpin = {}, None, None, None

    def _stage(self, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every tensor into its place in the host buffer, laid out (and allocated) again only when the
        state's keys, shapes or dtypes change."""
        layout = [(key, tuple(t.shape), t.dtype) for key, t in live.items()]
        if layout != self._layout:
            self._release()
            self._buffer, self._staging = _host_views(live)
            self._unpin = _pin(self._buffer) if any(t.is_cuda for t in live.values()) else None
            self._layout = layout
        devices = set()
        for key, tensor in live.items():
            self._staging[key].copy_(tensor, non_blocking=tensor.is_cuda)
            if tensor.is_cuda:
                devices.add(tensor.device)
        for device in devices:
            torch.cuda.synchronize(device)  # the non-blocking copies must have landed before the writer reads them
        return dict(self._staging)


_ALIGN = 64  # bytes: each tensor's place in the buffer starts on a cache line


def _host_views(live: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One host buffer of exactly the bytes `live` needs (each tensor's place aligned), and a tensor like each of
    `live`'s, all of them disjoint views into it.

    One buffer outside malloc's heap, not one allocation per tensor in it: the ~120 buffers of a ResNet-18
    state, left in the heap by the first save, were enough to tip glibc's thresholds so that every later
    training step page-faulted its activations again (steps 14-20% slower for the rest of the run; see
    framework/parallel/allocator.py). The buffer is an anonymous memory map; for CUDA tensors the writer pins it
    (`_pin`). Not `torch.empty(pin_memory=True)`: torch's caching host allocator rounds that up to a power of
    two and keeps it for the life of the process, after `close()` (a 17 GB state would pin 32 GB for good)."""
    offsets, total = {}, 0
    for key, tensor in live.items():
        offsets[key] = total
        total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    flat = torch.frombuffer(mmap.mmap(-1, max(total, 1)), dtype=torch.uint8)
    views = {}
    for key, tensor in live.items():
        start = offsets[key]
        views[key] = flat[start : start + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
    return flat, views


# cudaHostRegisterPortable: page-locked for every device's context, as torch.distributed.checkpoint registers it
_PORTABLE = 1


def _pin(flat: torch.Tensor) -> Optional[weakref.finalize]:
    """Page-lock exactly `flat`'s bytes (registered with CUDA, as torch.distributed.checkpoint pins its staging),
    so the copies from the device are asynchronous; returns what unpins them, once: at `close()`, or when `flat`
    is collected (before its memory map, which its views may keep, is unmapped). A failure leaves the buffer
    pageable: the copies are then synchronous, the checkpoint the same."""
    error = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), _PORTABLE))
    if error != 0:
        log.warning(
            "Pinning the %d-byte checkpoint staging buffer failed (CUDA error %d); it stays pageable: "
            "copies from the GPU are synchronous",
            flat.numel(),
            error,
        )
        return None
    unpin = weakref.finalize(flat, _unregister, flat.data_ptr())
    unpin.atexit = False  # at exit the process's memory goes anyway, and CUDA may be gone first
    return unpin


def _unregister(ptr: int) -> None:
    error = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if error != 0:
        log.warning("Unpinning the checkpoint staging buffer failed (CUDA error %d)", error)
