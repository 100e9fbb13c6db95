"""Predictions as Apache Parquet: each rank streams its rows to part files, rank 0 merges them in dataset order.

A predict run shards the data set with `predict_indices` (rank r gets r, r+W, r+2W, ...: the evaluator's unpadded
shards), so every sample is predicted once whatever the size modulo the world size; no padding, no duplicate.
Each rank's `PredictionWriter` keeps a batch's outputs as CPU tensors and, every `chunk_rows` rows (whole
batches), turns them into Arrow columns at once and writes them as one part file, `part-r<rank>-<seq>.arrow` (Arrow's
IPC file format, uncompressed: a copy of the columns, read back memory-mapped), to a `.tmp` beside it, renamed.
Parts are scratch, so they are not fsync'd: a killed process leaves complete parts and at most one `.tmp` per
rank, which the next attempt discards, and a part a machine crash left damaged is predicted again (`done()` counts
only the parts that read back; the merge drops the others with a warning). `done()` gives the indices the
readable parts hold, so the caller predicts only the others.
`merge` then reads every part (a window of indices at a time, never the whole data set), checks that each index
0..total-1 appears exactly once, and writes one Parquet file in dataset order, fsync'd: row groups of a fixed size
with fixed writer options, so the file depends only on its rows, and a resumed run ends with the same bytes as an
uninterrupted one.

Columns: `index` (int64) first, then the step's outputs in the order it returns them. A tensor with one row per
sample is a column of its dtype (bfloat16 is stored as float32, which Parquet holds exactly); its other
dimensions become fixed-size lists (`[N, C]` probabilities: a list of C per row). A list of N str, int, float or
bool is a column of that type. Anything else is a UserError naming the column. No pickle: Arrow and Parquet only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from framework.core import files
from framework.core.errors import UserError

log = logging.getLogger(__name__)
INDEX = "index"
MERGED_ROW_GROUP_ROWS = 16384
# Fixed, so that equal rows make equal bytes (pyarrow writes no timestamp; its version is in `created_by`).
# Snappy, pyarrow's default codec, which every Parquet reader has: zstd took twice as long (42-90 ms against 22-54
# for 65,536 rows of a class and 10 probabilities) to save little on floats. No dictionary encoding: predictions
# are mostly floats and unique indices, which it only slows down (~2 ms per 4,096 rows here) and makes larger.
WRITE_OPTIONS: dict[str, Any] = {
    "compression": "snappy",
    "use_dictionary": False,
    "write_statistics": True,
    "version": "2.6",
    "data_page_version": "1.0",
}
PART = re.compile(r"part-r(\d+)-(\d+)\.arrow")
EXPECTED = "a tensor with one row per sample (shape [N] or [N, K]) or a list of N str, int, float or bool"
# One output of one batch, as kept until its chunk is written: a CPU tensor (bfloat16 made float32) or, for a
# list of Python values, an Arrow array.
Piece = Union[torch.Tensor, pa.Array]


def predict_indices(total: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s share of `total` samples: rank, rank + world_size, ... (strided, no padding), in dataset
    order; over the ranks, every index once, whatever total % world_size."""
    return range(rank, total, world_size)


def part_files(out_dir: Path) -> list[Path]:
    """The complete part files in `out_dir` (renamed into place: a `.tmp` is not one), by rank then sequence."""
    if not out_dir.is_dir():
        return []
    found = [(PART.fullmatch(p.name), p) for p in out_dir.iterdir()]
    return [p for _, p in sorted(((int(m.group(1)), int(m.group(2))), p) for m, p in found if m)]


class PredictionWriter:
    """One rank's predictions, streamed to Arrow part files in `out_dir` in chunks as they come."""

    def __init__(self, out_dir: Path, rank: int, world_size: int, chunk_rows: int = 4096) -> None:
        if not 0 <= rank < world_size or chunk_rows < 1:
            raise ValueError(f"rank {rank} of {world_size} with chunk_rows={chunk_rows}")
        self.out_dir, self.rank, self.chunk_rows = Path(out_dir), rank, chunk_rows
        self._pending: list[tuple[torch.Tensor, dict[str, Piece]]] = []
        self._pending_rows = 0
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            # This rank's half-written chunk of a killed attempt; other ranks' .tmp files may be in progress.
            for stale in self.out_dir.glob(f"part-r{rank:05d}-*.arrow.tmp"):
                stale.unlink()
        except OSError as err:
            raise _unwritable(self.out_dir, err) from None
        parts = part_files(self.out_dir)
        own = [int(m.group(2)) for m in map(PART.fullmatch, (p.name for p in parts)) if m and int(m.group(1)) == rank]
        self._seq = max(own, default=-1) + 1
        # An earlier attempt's columns: a resumed run must write the same ones, or the merge could not join them.
        readable = (table for table in map(_read, parts) if table is not None)
        self._schema: Optional[pa.Schema] = next((table.schema for table in readable), None)
        self._signatures: dict[tuple[Any, ...], pa.Schema] = {}  # a batch's column kinds -> its schema, checked

    def done(self) -> set[int]:
        """The sample indices already in readable part files (an earlier attempt's kept chunks, any rank's), which
        the caller skips."""
        found: set[int] = set()
        for table in map(_read, part_files(self.out_dir)):
            if table is not None:
                found.update(table.column(INDEX).to_numpy().tolist())
        return found

    def write(self, indices: torch.Tensor, outputs: Mapping[str, Any] | torch.Tensor) -> None:
        """One batch: its samples' dataset indices (1-D int64) and the step's outputs, a mapping of column name
        to values (a bare tensor is the column "output"). Written out once `chunk_rows` rows are pending."""
        if indices.dim() != 1 or indices.dtype != torch.int64:
            raise TypeError(f"indices: expected a 1-D int64 tensor, got {_describe(indices)}")
        rows = indices.shape[0]
        pieces = batch_pieces(outputs, rows)
        signature = tuple((name, _kind(piece)) for name, piece in pieces.items())
        if signature not in self._signatures:
            schema = pa.schema([(INDEX, pa.int64()), *((name, _arrow_type(name, p)) for name, p in pieces.items())])
            if self._schema is None:
                self._schema = schema
            elif not schema.equals(self._schema):
                raise UserError(_schema_change(self._schema, schema))
            self._signatures[signature] = schema
        self._pending.append((indices.to("cpu", copy=True), pieces))
        self._pending_rows += rows
        if self._pending_rows >= self.chunk_rows:
            self._flush()

    def close(self) -> None:
        """Write the last partial chunk: every row written is then in a part file (renamed into place)."""
        self._flush()

    def _flush(self) -> None:
        """The pending batches as one part file. In this thread: converting and writing 4,096 rows takes ~1 ms
        (the copy of the columns), less than a thread's start and join cost here."""
        if not self._pending_rows:
            return
        assert self._schema is not None
        path = self.out_dir / f"part-r{self.rank:05d}-{self._seq:06d}.arrow"
        batches, self._pending, self._pending_rows = self._pending, [], 0
        columns = [pa.array(torch.cat([i for i, _ in batches]).numpy(), type=pa.int64())]
        columns += [_joined([pieces[name] for _, pieces in batches]) for name in self._schema.names[1:]]
        chunk = pa.RecordBatch.from_arrays(columns, schema=self._schema)
        try:
            with files.replacing(path, fsync=False) as sink, pa.ipc.new_file(sink, self._schema) as part:
                part.write_batch(chunk)  # (a part lost to a power cut is predicted again: see done())
        except OSError as err:
            raise _unwritable(path.parent, err) from None
        self._seq += 1


def batch_pieces(outputs: Mapping[str, Any] | torch.Tensor, rows: int) -> dict[str, Piece]:
    """A batch's outputs, each checked to hold one value per sample and copied off the step's memory: tensors to
    the CPU (bfloat16 as float32), lists of Python values to Arrow."""
    if isinstance(outputs, torch.Tensor):
        outputs = {"output": outputs}
    if not isinstance(outputs, Mapping) or not outputs:
        raise UserError(
            f"predict_step returned {_describe(outputs)}; expected a dict of column name to {EXPECTED}, "
            'e.g. {"prediction": logits.argmax(-1)}'
        )
    pieces: dict[str, Piece] = {}
    for name, value in outputs.items():
        if not isinstance(name, str) or name == INDEX:
            raise UserError(
                f"predict_step output {name!r}: expected a column name of type str other than {INDEX!r} "
                "(the sample's index is written there)"
            )
        pieces[name] = _piece(name, value, rows)
    return pieces


def _piece(name: str, value: Any, rows: int) -> Piece:
    if isinstance(value, torch.Tensor):
        shape = value.shape
        if not shape or shape[0] != rows or 0 in shape[1:] or _numpy_type(value.dtype) is None:
            raise _bad(name, value, rows)
        # A copy: the step may reuse its memory, and Arrow will share numpy's.
        dtype = torch.float32 if value.dtype == torch.bfloat16 else value.dtype
        return value.detach().to("cpu", dtype, copy=True)
    if isinstance(value, (list, tuple)) and len(value) == rows:
        kinds = {type(v) for v in value}
        if len(kinds) == 1 and kinds <= {str, int, float, bool}:
            try:
                return pa.array(value)
            except (pa.ArrowException, OverflowError):  # an int beyond int64
                pass
    raise _bad(name, value, rows)


@functools.lru_cache(maxsize=None)
def _numpy_type(dtype: torch.dtype) -> Optional[pa.DataType]:
    """The Arrow type of a tensor's values (bfloat16: float32), or None for what numpy or Arrow has not (complex,
    quantized, float8, ...)."""
    if dtype == torch.bfloat16:
        return pa.float32()
    try:
        return pa.from_numpy_dtype(torch.empty(0, dtype=dtype).numpy().dtype)
    except (TypeError, RuntimeError, pa.ArrowException):
        return None


def _kind(piece: Piece) -> Any:
    return (piece.dtype, piece.shape[1:]) if isinstance(piece, torch.Tensor) else piece.type


def _arrow_type(name: str, piece: Piece) -> pa.DataType:
    if not isinstance(piece, torch.Tensor):
        return piece.type
    kind = _numpy_type(piece.dtype)
    assert kind is not None  # checked by _piece
    for size in reversed(piece.shape[1:]):
        kind = pa.list_(kind, size)
    return kind


def _joined(pieces: list[Piece]) -> pa.Array:
    """One column of a chunk: its batches' pieces as one Arrow array (a tensor's other dimensions nested as
    fixed-size lists)."""
    if not isinstance(pieces[0], torch.Tensor):
        return pa.concat_arrays(pieces)
    values = torch.cat(pieces)
    flat = pa.array(values.numpy().reshape(-1))
    for size in reversed(values.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, size)
    return flat


def _bad(name: str, value: Any, rows: int) -> UserError:
    return UserError(f"predict_step output {name!r}: got {_describe(value)}; expected {EXPECTED}, N={rows}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)):
        kinds = "/".join(sorted({type(v).__name__ for v in value}))
        return f"a {type(value).__name__} of {len(value)} {kinds}".rstrip()
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(map(str, value))}"
    return "None" if value is None else f"a {type(value).__name__}"


def _schema_change(before: pa.Schema, now: pa.Schema) -> str:
    for field in now:
        if before.get_field_index(field.name) < 0:
            return f"predict_step output {field.name!r}: a new column; expected the same columns in every batch"
        if before.field(field.name).type != field.type:
            return (
                f"predict_step output {field.name!r}: got {field.type} where an earlier batch (or attempt) gave "
                f"{before.field(field.name).type}; expected the same type in every batch"
            )
    missing = [name for name in before.names if name not in now.names]
    if missing:
        return f"predict_step output {missing[0]!r}: missing; expected the same columns in every batch"
    return f"predict_step outputs: columns {now.names} in a new order; expected {before.names} in every batch"


@dataclass
class _Part:
    """A part file's rows (memory-mapped) sorted by index, and its lowest and highest index."""

    path: Path
    table: pa.Table
    index: np.ndarray

    @property
    def low(self) -> int:
        return int(self.index[0]) if len(self.index) else 0

    @property
    def high(self) -> int:
        return int(self.index[-1]) if len(self.index) else -1

    def rows(self, start: int, stop: int) -> pa.Table:
        first, last = np.searchsorted(self.index, [start, stop])
        return self.table.slice(first, last - first)


def merge(out_dir: Path, total: int, dest: Path, *, row_group_rows: int = MERGED_ROW_GROUP_ROWS) -> int:
    """After every rank closed its writer (the caller runs a barrier first), on one rank: every part file of
    `out_dir` read (memory-mapped: the OS pages in a window of rows, not the data set), each index 0..total-1
    exactly once (a duplicate or a missing index is a RuntimeError naming it), rows in dataset order, written to
    `dest` (a `.tmp`, fsync'd and renamed) in row groups of `row_group_rows`. A part that cannot be read (a
    machine crash's, whose rows `done()` did not count, so they were predicted again) is dropped with a warning.
    Returns the rows written; the part files are removed afterwards."""
    out_dir, dest = Path(out_dir), Path(dest)
    paths = part_files(out_dir)
    parts = []
    for path in paths:
        part = _load(path, total)
        if part is None:
            log.warning("predictions: part file %s cannot be read; its rows were predicted again", path)
        else:
            parts.append(part)
    schema = _common_schema(parts)
    waiting = deque(sorted(parts, key=lambda part: part.low))
    live: list[_Part] = []
    with _atomic_parquet(dest, schema) as writer:
        for start in range(0, total, row_group_rows):
            stop = min(start + row_group_rows, total)
            while waiting and waiting[0].low < stop:
                live.append(waiting.popleft())
            pieces = [part.rows(start, stop) for part in live]
            live = [part for part in live if part.high >= stop]
            window = pa.concat_tables(pieces) if pieces else schema.empty_table()
            writer.write_table(_in_order(window, start, stop, out_dir, total), row_group_size=row_group_rows)
    del parts, waiting, live  # the memory maps, closed before their files are removed
    for path in [*paths, *out_dir.glob("part-r*.arrow.tmp")]:
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # a folder the caller put something else in stays
        out_dir.rmdir()
    return total


def _in_order(window: pa.Table, start: int, stop: int, out_dir: Path, total: int) -> pa.Table:
    """The window's rows sorted by index, which must be start..stop-1, each once."""
    index = window.column(INDEX).to_numpy()
    counts = np.bincount(index - start, minlength=stop - start)
    wrong = np.flatnonzero(counts != 1)
    if len(wrong):
        first = int(wrong[0])
        what = "is missing" if counts[first] == 0 else f"is written {counts[first]} times"
        raise RuntimeError(
            f"predictions in {out_dir}: index {start + first} {what}; expected each index 0..{total - 1} exactly once"
        )
    if _ascending(index):  # one rank's rows (one process): in order already
        return window.combine_chunks()
    return window.take(np.argsort(index, kind="stable")).combine_chunks()


def _ascending(index: np.ndarray) -> bool:
    return bool(np.all(index[:-1] <= index[1:]))


def _load(path: Path, total: int) -> Optional[_Part]:
    """A part's rows sorted by index (a rank writes them in order: sorted already, but trust no file), or None
    when the file cannot be read."""
    table = _read(path)
    if table is None:
        return None
    index = table.column(INDEX).to_numpy()
    if not _ascending(index):
        order = np.argsort(index, kind="stable")
        table, index = table.take(order), index[order]
    for bad in index[[0, -1]] if len(index) else ():
        if not 0 <= bad < total:
            raise RuntimeError(f"predictions in {path}: index {bad} is outside 0..{total - 1}")
    return _Part(path, table, index)


def _common_schema(parts: list[_Part]) -> pa.Schema:
    schema = parts[0].table.schema if parts else pa.schema([(INDEX, pa.int64())])
    for part in parts[1:]:
        if not part.table.schema.equals(schema):
            raise UserError(
                f"predictions: {part.path} has columns {part.table.schema}; expected {schema}, as in {parts[0].path}"
            )
    return schema


def _read(path: Path) -> Optional[pa.Table]:
    """A part file's table, memory-mapped, or None when it is not a whole Arrow file with an int64 index first."""
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except (pa.ArrowException, OSError):
        return None
    if not table.schema.names or table.schema.names[0] != INDEX or table.schema.types[0] != pa.int64():
        return None
    return table


def _unwritable(path: Path, err: OSError) -> UserError:
    return UserError(f"predictions: cannot write to {path} ({err.strerror or err}); expected a writable directory")


@contextlib.contextmanager
def _atomic_parquet(
    path: Path, schema: pa.Schema, options: Mapping[str, Any] = WRITE_OPTIONS
) -> Iterator[pq.ParquetWriter]:
    """A ParquetWriter whose file appears at `path` only once complete (framework.core.files: a new inode, never
    through a link, fsync'd and renamed). An OSError is a UserError naming the path."""
    try:
        with files.replacing(path) as file, pq.ParquetWriter(file, schema, **options) as writer:
            yield writer
    except OSError as err:
        raise _unwritable(path.parent, err) from None
