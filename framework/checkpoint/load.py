"""Reading a checkpoint: `open_checkpoint` checks meta.json's schema, that both data files are regular files
inside the checkpoint, their checksums and headers, and that the structure uses exactly the state's tensors.
Loading reads only JSON and safetensors: a checkpoint cannot run code.

Whatever a checkpoint directory holds (a damaged file, a FIFO or a link to a device, a meta.json of the wrong
shape or of gigabytes, a structure that does not match its tensors), reading it ends in one
`DamagedCheckpoint` line naming the file: never a hang, a traceback or unbounded memory.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from framework.checkpoint.format import (FORMAT_VERSION, META_FILE, MODEL_FILE, READABLE_VERSIONS, STATE_FILE,
                                         DamagedCheckpoint, UnreadableCheckpoint, _digest_fd, _in_helper, _is_int,
                                         _is_number, _join, _key, _keys, _kind, _name, _shown, _where, unflatten)

# A meta.json is a few KiB (a big model's structure: a few MiB). The caps bound what a hostile one costs: its
# parsed objects take at most ~20x its size in memory, and every recursive reader of it (ours, OmegaConf's
# for the config) stays far from Python's recursion limit.
MAX_META_BYTES = 16 * 2**20


MAX_META_DEPTH = 32


_MAX_COUNTER = 2**63 - 1  # counters end up in int64 tensors and TensorBoard steps


# Never follow a final symlink, never block (a FIFO swapped in after the check), never leak into children.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


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
