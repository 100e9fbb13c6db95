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
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import signal
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from framework.errors import ConfigError, UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # written; 1 (same layout, CRC-32 checksums) is still read
READABLE_VERSIONS = (1, 2)
MODEL_FILE, STATE_FILE, META_FILE = "model.safetensors", "state.safetensors", "meta.json"


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
        if os.fstat(f.fileno()).st_size == 0:
            data: Any = b""
            return zlib.crc32(data) if crc32 else "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
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
    save_file(tensors, str(path))
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
    process (a kill, an OOM, a crash of Python), since the page cache outlives the process."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    structure = flatten(state, tensors)
    checksums, flushes = {}, []
    for name, content in ((MODEL_FILE, model_state), (STATE_FILE, tensors)):
        checksums[name] = _write_tensors(tmp / name, _unshared(content))
        if durable:
            flushes.append(_in_helper(_fsync, tmp / name))
    meta = {**meta, "format_version": FORMAT_VERSION, "structure": structure, "checksums": checksums}
    _write(tmp / META_FILE, json.dumps(meta, indent=1).encode(), durable)
    for flush in flushes:
        flush.result()  # every file is on disk before the rename makes the checkpoint visible (raises its error)
    _replace_dir(tmp, path, durable)


class CheckpointWriter:
    """Writes checkpoints in order, inline or (`background`) on one background thread.

    In the background, `write` returns once the state is copied into host buffers that the next save reuses
    (no allocation after the first save; pinned memory for CUDA tensors): the loop then goes on while the
    files are written, hashed, flushed and renamed into place. Only one save is in flight: the next `write`
    first waits for the previous one. A failure is logged when it happens, skips what was queued after it
    (the links and the pruning that assumed the save), and is raised by the next `write` (after it has
    queued its own save) or `wait`. A crash at any point leaves the previous checkpoint intact, as an inline
    save does."""

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
            log.error("A checkpoint save failed (%s: %s); the previous checkpoints are kept", type(err).__name__, err)
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
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name in (MODEL_FILE, STATE_FILE, META_FILE):
        try:
            os.link(src / name, tmp / name)
        except OSError:  # a file system without hard links
            shutil.copy2(src / name, tmp / name)
    _replace_dir(tmp, dst, durable)


class DamagedCheckpoint(UserError):
    pass


class UnreadableCheckpoint(UserError):
    """Intact, maybe, but of a format this version cannot read: never skipped (resume=auto would start over
    and its first saves would prune the checkpoints it could not read)."""


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
        tensors = {k: v.clone() for k, v in self._load(STATE_FILE).items()}
        return unflatten(self.meta["structure"], tensors)

    def _load(self, name: str) -> dict[str, torch.Tensor]:
        if self.verified.get(name) != _identity(self.path / name):
            _verify(self.path, name, self.meta)
        return _load_tensors(self.path, name)


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _verify(path: Path, name: str, meta: dict[str, Any]) -> None:
    expected = meta["checksums"][name]
    if digest(path / name, crc32=isinstance(expected, int)) != expected:
        raise DamagedCheckpoint(f"checkpoint {path}: {name} does not match its checksum (damaged or truncated)")


def _load_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a checked file, memory-mapped copy-on-write (a change never reaches the file)."""
    try:
        return load_file(str(path / name))
    except SafetensorError as err:  # a file written with its checksum but not by safetensors
        raise DamagedCheckpoint(f"checkpoint {path}: {name} is not a valid safetensors file ({err})") from None


def open_checkpoint(path: Path, verify: bool = True) -> Checkpoint:
    """Read a checkpoint's meta.json and check both data files are present and intact."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"checkpoint {path}: {META_FILE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedCheckpoint(f"checkpoint {path}: {META_FILE} is not valid JSON ({err})") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version not in READABLE_VERSIONS:
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise UnreadableCheckpoint(f"checkpoint {path}: format version {version} comes from a newer version of "
                                       f"this framework, which reads versions {', '.join(map(str, READABLE_VERSIONS))}"
                                       "; expected one of those (upgrade the framework to load it)")
        raise DamagedCheckpoint(f"checkpoint {path}: format version {version!r}; expected one of "
                                f"{', '.join(map(str, READABLE_VERSIONS))}")
    checksums = meta["checksums"] if isinstance(meta.get("checksums"), dict) else {}
    lacking = [key for key in ("step", "structure", "config") if key not in meta]
    lacking += [f"checksums.{name}" for name in (MODEL_FILE, STATE_FILE) if name not in checksums]
    if lacking:
        raise DamagedCheckpoint(f"checkpoint {path}: {META_FILE} lacks {', '.join(lacking)}")
    for name in (MODEL_FILE, STATE_FILE):
        if not (path / name).is_file():
            raise DamagedCheckpoint(f"checkpoint {path}: {name} is missing")
    verified = {}
    if verify:
        names = (MODEL_FILE, STATE_FILE)
        identities = [_identity(path / name) for name in names]
        _join([_in_helper(_verify, path, name, meta) for name in names])  # both files at once
        verified = dict(zip(names, identities))
    return Checkpoint(path, meta, verified)


def find_latest(run_dir: Path) -> Optional[Checkpoint]:
    """The newest intact checkpoint of a run; damaged ones are skipped with a warning naming them.

    Every meta.json is read, but data files are hashed newest first and only until one is intact: a run that
    keeps every periodic checkpoint does not re-read all of them to resume from the last."""
    folder = run_dir / "checkpoints"
    candidates = [p for p in folder.iterdir() if p.is_dir() and not p.name.endswith(".tmp")] if folder.is_dir() else []
    described = []
    for path in candidates:
        try:
            described.append(open_checkpoint(path, verify=False))
        except DamagedCheckpoint as err:
            log.warning("Skipping a damaged checkpoint: %s", err)
    # Newest step first; at equal steps any copy will do (last and step-N hold the same state).
    for checkpoint in sorted(described, key=lambda c: (c.step, c.path.name == "last"), reverse=True):
        try:
            return open_checkpoint(checkpoint.path)
        except DamagedCheckpoint as err:
            log.warning("Skipping a damaged checkpoint: %s", err)
    return None


# ---------------------------------------------------------------------------------------------- weights
def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Weights for `init_from`: a checkpoint directory, a .safetensors file, or a plain `torch.save`
    state dict (read with weights_only=True: no code runs). A `module.` prefix (DataParallel/DDP) is dropped."""
    if not path.exists():
        raise ConfigError(f"init_from={str(path)!r}: no such file or directory; expected a checkpoint directory, "
                          "a .safetensors file or a torch.save state dict")
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
    """One clear error listing the first missing, unexpected and shape-mismatched keys."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = sorted(k for k in state if k not in own)  # a stable order: safetensors loads keys in none
    mismatched = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own
                  if k in state and state[k].shape != own[k].shape]
    problems = []
    if missing and strict:
        problems.append(f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    if unexpected and strict:
        problems.append(f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}")
    if mismatched:
        problems.append(f"shape mismatch {', '.join(mismatched[:3])}{' ...' if len(mismatched) > 3 else ''}")
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
        for path in self.folder.glob("step-*"):
            if path.is_dir() and not path.name.endswith((".tmp", ".old")) and path.name not in kept:
                shutil.rmtree(path, ignore_errors=True)

    def best_path(self) -> Optional[Path]:
        return self.folder / "best" if self.top_k else None

    def state_dict(self) -> dict[str, Any]:
        return {"periodic": list(self.periodic), "top_k": [[v, n] for v, n in self.top_k]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.periodic = list(state.get("periodic", []))
        self.top_k = [(float(v), str(n)) for v, n in state.get("top_k", [])]


# ---------------------------------------------------------------------------------------------- signals
class SignalWatch:
    """On SIGTERM or SIGINT, ask the loop to stop after the current step (it saves `last` and exits);
    a second signal aborts at once."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "SignalWatch":
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(sig) is signal.SIG_IGN:  # e.g. spawned DDP workers: the parent forwards SIGINT
                continue
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is not None:
            self.__exit__()
            raise KeyboardInterrupt
        self.received = signum
        log.warning("Received %s: finishing this step, then saving checkpoints/last (send again to abort)",
                    signal.Signals(signum).name)

    def __exit__(self, *_exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
