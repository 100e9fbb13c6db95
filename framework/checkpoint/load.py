"""Reading a checkpoint: `open_checkpoint` checks meta.json's schema, that both data files (every rank's, for
a sharded checkpoint) are regular files inside the checkpoint, their checksums and headers, and that the
structure uses exactly the state's tensors. Loading reads only JSON and safetensors: a checkpoint cannot run code.

A sharded checkpoint is read back by any number of ranks: given the DeviceMesh of the run, each sharded tensor
comes back as a DTensor of which this rank reads only its own part (from the slices of the saved shards that
overlap it); without a mesh, as the whole tensor (export, a run without FSDP). Same ranks, same parts: a
resume with the same number of processes gets exactly the shards it saved.

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
from typing import Any, Iterable, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from framework.checkpoint.format import (
    META_FILE,
    MODEL_FILE,
    READABLE_VERSIONS,
    SHARDED_VERSION,
    STATE_FILE,
    DamagedCheckpoint,
    UnreadableCheckpoint,
    _digest_fd,
    _in_helper,
    _is_int,
    _is_number,
    _join,
    _key,
    _keys,
    _kind,
    _name,
    _shown,
    _where,
    chunk,
    plain_keys,
    shard_file,
    shard_files,
    unflatten,
)

# A meta.json is a few KiB (a big model's structure: a few MiB). The caps bound what a hostile one costs: its
# parsed objects take at most ~20x its size in memory, and every recursive reader of it (ours, OmegaConf's
# for the config) stays far from Python's recursion limit.
MAX_META_BYTES = 16 * 2**20


MAX_META_DEPTH = 32


_MAX_COUNTER = 2**63 - 1  # counters end up in int64 tensors and TensorBoard steps


_MAX_RANKS = 2**20  # a sharded checkpoint's ranks: far above any job, far below what would exhaust memory


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
                raise DamagedCheckpoint(
                    f"{_where(folder)}: {name} is a symbolic link to {_name(real)}, outside the "
                    "checkpoint; expected a regular file"
                )
            st = os.stat(real)
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{_where(folder)}: {name} is missing") from None
    except OSError as err:
        raise DamagedCheckpoint(
            f"{_where(folder)}: {name} cannot be read ({err.strerror}); expected a readable regular file"
        ) from None
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
        raise DamagedCheckpoint(
            f"{_where(folder)}: {name} cannot be read ({err.strerror}); expected a readable regular file"
        ) from None
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
        raise DamagedCheckpoint(
            f"{_where(path)} cannot be read ({err.strerror}); expected a readable checkpoint directory"
        ) from None
    if not stat.S_ISDIR(mode):
        raise DamagedCheckpoint(
            f"{_where(path)} is {_kind(mode)}; expected a directory holding {MODEL_FILE}, {STATE_FILE} and {META_FILE}"
        )


def _read_meta(path: Path) -> Any:
    """meta.json parsed, read only up to MAX_META_BYTES."""
    fd, _ = _open_file(path, META_FILE)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        data = f.read(MAX_META_BYTES + 1) if size <= MAX_META_BYTES else b""
    if size > MAX_META_BYTES or len(data) > MAX_META_BYTES:
        raise DamagedCheckpoint(
            f"{_where(path)}: {META_FILE} is {max(size, len(data))} bytes, over the "
            f"{MAX_META_BYTES // 2**20} MiB it may have; expected counters, metrics, the config "
            "and the state's structure (a few KiB)"
        )
    try:
        return json.loads(data)
    except RecursionError:
        raise DamagedCheckpoint(
            f"{_where(path)}: {META_FILE} is nested too deeply to read; expected at most {MAX_META_DEPTH} levels"
        ) from None
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
        if _is_int(version) and version > max(READABLE_VERSIONS):
            raise UnreadableCheckpoint(
                f"{where}: format version {version} comes from a newer version of "
                f"this framework, which reads versions {', '.join(map(str, READABLE_VERSIONS))}"
                "; expected one of those (upgrade the framework to load it)"
            )
        raise DamagedCheckpoint(
            f"{where} has format_version={_shown(version)}; expected one of {', '.join(map(str, READABLE_VERSIONS))}"
        )
    if _too_deep(meta, MAX_META_DEPTH):
        raise DamagedCheckpoint(
            f"{where} is nested more than {MAX_META_DEPTH} levels deep; expected counters, "
            "metrics, the config and the state's structure"
        )
    checksums = meta.get("checksums")
    if "checksums" in meta and not isinstance(checksums, dict):
        raise DamagedCheckpoint(f"{where} has checksums={_shown(checksums)}; expected an object of file checksums")
    lacking = [key for key in ("step", "structure", "config") if key not in meta]
    if version == SHARDED_VERSION:
        _check_shards(path, meta)
    lacking += [f"checksums.{name}" for name in data_files(meta) if name not in (checksums or {})]
    if lacking:
        raise DamagedCheckpoint(f"{where} lacks {', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''}")
    assert isinstance(checksums, dict)  # an object when present, and when absent `lacking` named its files
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
    for name in data_files(meta):
        value = checksums[name]
        if not ((_is_int(value) and 0 <= value < 2**32) if version == 1 else isinstance(value, str)):
            expected = "a CRC-32 (a whole number)" if version == 1 else "a string such as xxh3_64:0123456789abcdef"
            raise DamagedCheckpoint(f"{where} has checksums.{name}={_shown(value)}; expected {expected}")
    _structure_refs(path, meta["structure"])
    for structure in (meta.get("shards") or {}).get("structures", {}).values():
        _structure_refs(path, structure)


def data_files(meta: dict[str, Any]) -> list[str]:
    """The data files a checkpoint holds, as its (schema-checked) meta.json says: two, or two per rank."""
    if meta.get("format_version") == SHARDED_VERSION:
        return shard_files(meta["shards"]["world_size"])
    return [MODEL_FILE, STATE_FILE]


def _check_shards(path: Path, meta: dict[str, Any]) -> None:
    """A sharded checkpoint's `shards`: the number of ranks, and for each sharded tensor a global shape, a
    dimension of it and each rank's (offset, length) there, the parts tiling that dimension exactly."""
    where = f"{_where(path)}: {META_FILE}"
    shards = meta.get("shards")
    if not isinstance(shards, dict):
        raise DamagedCheckpoint(f"{where} has shards={_shown(shards)}; expected the layout of a sharded checkpoint")
    n = shards.get("world_size")
    if not (_is_int(n) and 1 <= n <= _MAX_RANKS) or meta.get("world_size") != n:
        raise DamagedCheckpoint(
            f"{where} has shards.world_size={_shown(n)} and world_size="
            f"{_shown(meta.get('world_size'))}; expected the same number of ranks, >= 1, in both"
        )
    listed = len(meta.get("checksums") or {})
    if listed < 2 * n:  # (before any per-rank list is made: the checksums bound the ranks by meta.json's size)
        raise DamagedCheckpoint(
            f"{where} has checksums of {listed} files for {n} ranks; expected two per rank, "
            f"model-rank<r>-of{n}.safetensors and state-rank<r>-of{n}.safetensors"
        )
    structures = shards.get("structures", {})
    if not isinstance(structures, dict) or not all(
        isinstance(k, str) and k.isdigit() and 0 < int(k) < n for k in structures
    ):
        raise DamagedCheckpoint(
            f"{where} has shards.structures={_shown(structures)}; expected an object of rank "
            f"numbers 1..{n - 1} to structures"
        )
    for kind in ("model", "state"):
        tensors = shards.get(kind)
        if not isinstance(tensors, dict):
            raise DamagedCheckpoint(
                f"{where} has shards.{kind}={_shown(tensors)}; expected an object of tensor names to their layout"
            )
        for key, entry in tensors.items():
            problem = _layout_problem(entry, n)
            if problem is not None:
                raise DamagedCheckpoint(
                    f"{where}: shards.{kind}.{_key(key)} {problem}; expected shape, dim, offsets "
                    f"and lengths of {n} parts tiling that dimension"
                )


def _layout_problem(entry: Any, n: int) -> Optional[str]:
    if not isinstance(entry, dict):
        return f"is {_shown(entry)}"
    shape, dim, offsets, lengths = (entry.get(k) for k in ("shape", "dim", "offsets", "lengths"))
    if not (
        isinstance(shape, list)
        and 0 < len(shape) <= MAX_META_DEPTH
        and all(_is_int(size) and 0 <= size <= _MAX_COUNTER for size in shape)
    ):
        return f"has shape={_shown(shape)}"
    if not (_is_int(dim) and 0 <= dim < len(shape)):
        return f"has dim={_shown(dim)} for a shape of {len(shape)} dimensions"
    if not (
        isinstance(offsets, list)
        and isinstance(lengths, list)
        and all(len(v) == n and all(_is_int(x) and x >= 0 for x in v) for v in (offsets, lengths))
    ):
        return f"has offsets={_shown(offsets)} and lengths={_shown(lengths)}"
    covered = 0
    for offset, length in sorted((o, n) for o, n in zip(offsets, lengths) if n):
        if offset != covered:
            return f"has parts that {'overlap' if offset < covered else 'leave a gap'} at {min(offset, covered)}"
        covered += length
    if covered != shape[dim] or any(o > shape[dim] for o in offsets):
        return f"has parts covering {covered} of the {shape[dim]} rows along dimension {dim}"
    return None


_MARKERS = ("__tensor__", "__tuple__", "__items__")


def _structure_refs(path: Path, structure: Any) -> list[str]:
    """The tensor names `structure` refers to. Raises DamagedCheckpoint unless it is what `flatten` writes for
    a dict, so that `unflatten` cannot fail on it."""
    refs: list[str] = []

    def malformed(at: str, why: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(
            f"{_where(path)}: {META_FILE} structure at {at or '/'} {why}; expected what checkpoint.flatten writes"
        )

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


def _check_refs(path: Path, refs: list[str], names: Iterable[str], file: str = STATE_FILE) -> None:
    """The structure must use every tensor of the state file, each exactly once."""
    names = set(names)
    seen: set[str] = set()
    twice = [ref for ref in refs if ref in seen or seen.add(ref)]  # type: ignore[func-returns-value]
    problems = []
    missing = [ref for ref in refs if ref not in names]
    unused = sorted(names - seen)
    if missing:
        problems.append(f"it refers to tensors that {file} lacks: {_keys(missing)}")
    if unused:
        problems.append(f"{file} holds tensors it does not use: {_keys(unused)}")
    if twice:
        problems.append(f"it refers twice to {_keys(twice)}")
    if problems:
        raise DamagedCheckpoint(
            f"{_where(path)}: {META_FILE} structure does not match {file} "
            f"({'; '.join(problems)}); expected the files of one save"
        )


def _verify(path: Path, name: str, fd: int, meta: dict[str, Any]) -> None:
    expected = meta["checksums"][name]
    if _digest_fd(fd, crc32=isinstance(expected, int)) != expected:
        raise DamagedCheckpoint(f"{_where(path)}: {name} does not match its checksum (damaged or truncated)")


def _not_safetensors(path: Path, name: str, err: Exception) -> DamagedCheckpoint:
    return DamagedCheckpoint(
        f"{_where(path)}: {name} is not a valid safetensors file "
        f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    )


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

    @property
    def sharded(self) -> bool:
        """Written by every rank of a sharded run (parallel=fsdp), a model and a state file each."""
        return self.meta["format_version"] == SHARDED_VERSION

    def model_state(self, mesh: Any = None) -> dict[str, torch.Tensor]:
        """The weights, memory-mapped copy-on-write (`load_state_dict` copies them into the model). Of a sharded
        checkpoint: given this run's DeviceMesh, its sharded weights as DTensors of which only this rank's
        part is read; without one, whole."""
        if self.sharded:
            return plain_keys(self._read_shards("model", mesh))
        return plain_keys(self._load(MODEL_FILE))  # one written before keys were plain may hold `_orig_mod.`

    def state(self, mesh: Any = None) -> dict[str, Any]:
        """The training state, in memory of its own: optimizer state would otherwise keep the file mapped
        for the whole run (load_state_dict does not copy tensors already on the right device), and a mapped
        file cannot be deleted cleanly on every file system when a later save prunes it. Of a sharded
        checkpoint, `mesh` as for `model_state`; the rest of the state is this rank's own (rank 0's for a rank
        the checkpoint has none of, and without a mesh)."""
        if self.sharded:
            own = str(_own_rank(self, mesh))
            structure = self.meta["shards"].get("structures", {}).get(own, self.meta["structure"])
            tensors = self._read_shards("state", mesh)
            _check_refs(self.path, _structure_refs(self.path, structure), tensors)
            return unflatten(structure, tensors)
        tensors = self._load(STATE_FILE)
        _check_refs(self.path, _structure_refs(self.path, self.meta["structure"]), tensors)
        return unflatten(self.meta["structure"], {k: v.clone() for k, v in tensors.items()})

    def _load(self, name: str) -> dict[str, torch.Tensor]:
        fd, real = self._open_verified(name)
        try:
            return _load_tensors(self.path, name, fd, real)
        finally:
            os.close(fd)

    def _open_verified(self, name: str) -> tuple[int, str]:
        fd, real = _open_file(self.path, name)
        try:
            if self.verified.get(name) != _identity(fd):
                _verify(self.path, name, fd, self.meta)
        except BaseException:
            os.close(fd)
            raise
        return fd, real

    def _read_shards(self, kind: str, mesh: Any) -> dict[str, torch.Tensor]:
        """Every tensor of a sharded checkpoint's `kind` files (model or state) for this rank of `mesh`: its part
        of each sharded tensor, as a DTensor, read from the saved shards overlapping it; the other tensors from
        its own file. Without a mesh, whole tensors and rank 0's own."""
        shards = self.meta["shards"]
        layout, saved = shards[kind], shards["world_size"]
        rank, world = (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)
        files = _ShardFiles(self, kind, saved)
        try:
            own = files.get(_own_rank(self, mesh))
            tensors = {}
            for key in own.keys():
                if key not in layout:
                    tensors[key] = own.get_tensor(key).clone()
                    continue
                entry = layout[key]
                start, length = chunk(entry["shape"][entry["dim"]], world, rank)
                part = self._assemble(files, key, entry, start, length)
                tensors[key] = part if mesh is None else _dtensor(part, mesh, entry)
            return tensors
        finally:
            files.close()

    def _assemble(self, files: "_ShardFiles", key: str, entry: dict[str, Any], start: int, length: int) -> torch.Tensor:
        """Rows [start, start + length) along the tensor's split dimension, from the saved parts overlapping them
        (none overlaps an empty range: it is cut from rank 0's part, for its dtype and other dimensions)."""
        dim, shape = entry["dim"], entry["shape"]
        pieces, dtypes = [], set()
        for saved_rank, (offset, saved_length) in enumerate(zip(entry["offsets"], entry["lengths"])):
            low, high = max(start, offset), min(start + length, offset + saved_length)
            if length == 0:
                if saved_rank:
                    break
                low = high = offset
            elif high <= low:
                continue
            piece = files.get(saved_rank).get_slice(key)
            expected = shape[:dim] + [saved_length] + shape[dim + 1 :]
            if list(piece.get_shape()) != expected:
                raise DamagedCheckpoint(
                    f"{_where(self.path)}: {files.name(saved_rank)} holds {_key(key)} of shape "
                    f"{tuple(piece.get_shape())}; expected {tuple(expected)} as {META_FILE} says"
                )
            dtypes.add(piece.get_dtype())
            pieces.append(piece[(slice(None),) * dim + (slice(low - offset, high - offset),)])
        if len(dtypes) > 1:
            raise DamagedCheckpoint(
                f"{_where(self.path)}: the shards of {_key(key)} have different dtypes "
                f"({', '.join(sorted(dtypes))}); expected the files of one save"
            )
        return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone()


def _own_rank(checkpoint: Checkpoint, mesh: Any) -> int:
    """The saved rank whose own (unsharded) state this rank reads: its own, or rank 0's."""
    rank = mesh.get_local_rank() if mesh is not None else 0
    return rank if rank < checkpoint.meta["shards"]["world_size"] else 0


def _dtensor(part: torch.Tensor, mesh: Any, entry: dict[str, Any]) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    shape = torch.Size(entry["shape"])
    return DTensor.from_local(
        part, mesh, [Shard(entry["dim"])], run_check=False, shape=shape, stride=_contiguous_stride(shape)
    )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _ShardFiles:
    """The opened (checked, then verified unless open_checkpoint already did) files of one kind of a sharded
    checkpoint, each opened on first use."""

    def __init__(self, checkpoint: Checkpoint, kind: str, world_size: int) -> None:
        self.checkpoint, self.kind, self.world_size = checkpoint, kind, world_size
        self.fds: list[int] = []
        self.handles: dict[int, Any] = {}

    def name(self, rank: int) -> str:
        return shard_file(self.kind, rank, self.world_size)

    def get(self, rank: int) -> Any:
        if rank not in self.handles:
            name = self.name(rank)
            fd, real = self.checkpoint._open_verified(name)
            self.fds.append(fd)
            try:
                self.handles[rank] = safe_open(_fd_path(fd, real), framework="pt")
            except (SafetensorError, OSError, ValueError) as err:
                raise _not_safetensors(self.checkpoint.path, name, err) from None
        return self.handles[rank]

    def close(self) -> None:
        self.handles.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def _verify_files(path: Path, meta: dict[str, Any]) -> dict[str, tuple[int, int, int, int]]:
    """Check every data file against its checksum (two at once, on two cores), their headers, and the
    structure against the state's tensors; returns the identities of the files checked."""
    identities = {}
    files = data_files(meta)
    for first in range(0, len(files), 2):  # a sharded checkpoint of many ranks: two files open at a time
        opened: dict[str, tuple[int, str]] = {}
        try:
            for name in files[first : first + 2]:
                opened[name] = _open_file(path, name)
            _join([_in_helper(_verify, path, name, fd, meta) for name, (fd, _) in opened.items()])
            for name, (fd, real) in opened.items():
                _check_names(path, meta, name, _tensor_names(path, name, fd, real))
                identities[name] = _identity(fd)
        finally:
            for fd, _ in opened.values():
                os.close(fd)
    return identities


def _check_names(path: Path, meta: dict[str, Any], name: str, names: list[str]) -> None:
    """A state file's tensors are exactly those its structure uses; a sharded model file holds every tensor
    its layout names (and the same ones as rank 0's, as every rank saves the same model)."""
    if meta.get("format_version") != SHARDED_VERSION:
        if name == STATE_FILE:
            _check_refs(path, _structure_refs(path, meta["structure"]), names)
        return
    shards = meta["shards"]
    kind, rank = name.split("-rank")[0], int(name.split("-rank")[1].split("-of")[0])
    if kind == "state":
        structure = shards.get("structures", {}).get(str(rank), meta["structure"])
        _check_refs(path, _structure_refs(path, structure), names, name)
    missing = [key for key in shards[kind] if key not in names]
    if missing:
        raise DamagedCheckpoint(
            f"{_where(path)}: {name} lacks the sharded tensors {_keys(missing)} that "
            f"{META_FILE} describes; expected the files of one save"
        )


def open_checkpoint(path: Path, verify: bool = True) -> Checkpoint:
    """Read a checkpoint's meta.json and check it: its schema, both data files regular files, and with
    `verify` both intact (checksums) and consistent with it (the structure uses exactly the state's tensors).
    Raises DamagedCheckpoint, one line naming the file, or UnreadableCheckpoint for a newer format."""
    _check_directory(path)
    meta = _read_meta(path)
    _check_meta(path, meta)
    if not verify:
        for name in data_files(meta):
            _regular_file(path, name)
        return Checkpoint(path, meta)
    return Checkpoint(path, meta, _verify_files(path, meta))
