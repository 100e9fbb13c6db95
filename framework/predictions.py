"""Predictions as Apache Parquet: each rank streams its rows to part files, rank 0 merges them in dataset order.

A predict run shards the data set with `predict_indices` (rank r gets r, r+W, r+2W, ...: the evaluator's unpadded
shards), so every sample is predicted once whatever the size modulo the world size; no padding, no duplicate.
Each rank's `PredictionWriter` turns a batch's outputs into columns as it comes and, every `chunk_rows` rows
(whole batches), writes them as one part file, `part-r<rank>-<seq>.parquet`: written to a `.tmp` beside it,
fsync'd, renamed. A killed run leaves complete parts and at most one `.tmp` per rank, which the next attempt
discards; `done()` gives the indices the complete parts hold, so the caller predicts only the others.
`merge` then reads every part (a window of indices at a time, never the whole data set), checks that each index
0..total-1 appears exactly once, and writes one file in dataset order: row groups of a fixed size with fixed
writer options, so the file depends only on its rows, and a resumed run ends with the same bytes as an
uninterrupted one.

Columns: `index` (int64) first, then the step's outputs in the order it returns them. A tensor with one row per
sample is a column of its dtype (bfloat16 is stored as float32, which Parquet holds exactly); its other
dimensions become fixed-size lists (`[N, C]` probabilities: a list of C per row). A list of N str, int, float or
bool is a column of that type. Anything else is a UserError naming the column. No pickle: Parquet only.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from framework.errors import UserError

INDEX = "index"
MERGED_ROW_GROUP_ROWS = 16384
# Fixed, so that equal rows make equal bytes (pyarrow writes no timestamp; its version is in `created_by`).
# No dictionary encoding: predictions are mostly floats and unique indices, which it only slows down (it cost
# ~2 ms per 4,096-row chunk here, most of what writing a part costs besides fsync) and makes larger after zstd.
WRITE_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "use_dictionary": False,
    "write_statistics": True,
    "version": "2.6",
    "data_page_version": "1.0",
}
# Parts live until the merge: written fast, not small.
PART_OPTIONS = {**WRITE_OPTIONS, "compression": "none"}
PART = re.compile(r"part-r(\d+)-(\d+)\.parquet")
EXPECTED = "a tensor with one row per sample (shape [N] or [N, K]) or a list of N str, int, float or bool"


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
    """One rank's predictions, streamed to Parquet part files in `out_dir` in chunks as they come."""

    def __init__(self, out_dir: Path, rank: int, world_size: int, chunk_rows: int = 4096) -> None:
        if not 0 <= rank < world_size or chunk_rows < 1:
            raise ValueError(f"rank {rank} of {world_size} with chunk_rows={chunk_rows}")
        self.out_dir, self.rank, self.chunk_rows = Path(out_dir), rank, chunk_rows
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        # A chunk is written in a thread of its own while the next is predicted (pyarrow and fsync release the GIL).
        self._writing: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            # This rank's half-written chunk of a killed attempt; other ranks' .tmp files may be in progress.
            for stale in self.out_dir.glob(f"part-r{rank:05d}-*.parquet.tmp"):
                stale.unlink()
        except OSError as err:
            raise _unwritable(self.out_dir, err) from None
        parts = part_files(self.out_dir)
        own = [int(m.group(2)) for m in map(PART.fullmatch, (p.name for p in parts)) if m and int(m.group(1)) == rank]
        self._seq = max(own, default=-1) + 1
        # An earlier attempt's columns: a resumed run must write the same ones, or the merge could not join them.
        self._schema: Optional[pa.Schema] = _read_schema(parts[0]) if parts else None

    def done(self) -> set[int]:
        """The sample indices already in complete part files (an earlier attempt's kept chunks, any rank's), which
        the caller skips."""
        found: set[int] = set()
        for part in part_files(self.out_dir):
            found.update(_read(part, [INDEX]).column(0).to_numpy().tolist())
        return found

    def write(self, indices: torch.Tensor, outputs: Mapping[str, Any] | torch.Tensor) -> None:
        """One batch: its samples' dataset indices (1-D int64) and the step's outputs, a mapping of column name
        to values (a bare tensor is the column "output"). Written out once `chunk_rows` rows are pending."""
        if indices.dim() != 1 or indices.dtype != torch.int64:
            raise TypeError(f"indices: expected a 1-D int64 tensor, got {_describe(indices)}")
        batch = record_batch(indices.to("cpu", copy=True).numpy(), outputs)
        if self._schema is None:
            self._schema = batch.schema
        elif not batch.schema.equals(self._schema):
            raise UserError(_schema_change(self._schema, batch.schema))
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        if self._pending_rows >= self.chunk_rows:
            self._flush()

    def close(self) -> None:
        """Write the last partial chunk and wait until every chunk is on disk (fsync'd, renamed into place)."""
        self._flush()
        self._wait()

    def _flush(self) -> None:
        if not self._pending_rows:
            return
        self._wait()  # one chunk in flight at most: memory holds two chunks, not the data set
        path = self.out_dir / f"part-r{self.rank:05d}-{self._seq:06d}.parquet"
        self._writing = threading.Thread(
            target=self._write, args=(self._pending, path), name=f"predictions {path.name}"
        )
        self._writing.start()
        self._seq += 1
        self._pending, self._pending_rows = [], 0

    def _wait(self) -> None:
        """The chunk in flight written, or its error (a UserError naming the folder) raised here."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(self, batches: list[pa.RecordBatch], path: Path) -> None:
        """In the chunk's thread (not a daemon: a process exiting waits for its chunk to land)."""
        try:
            table = pa.Table.from_batches(batches).combine_chunks()
            with _atomic_parquet(path, table.schema, PART_OPTIONS) as writer:
                writer.write_table(table, row_group_size=table.num_rows)
        except BaseException as err:  # raised in the caller's thread, at its next chunk or close
            self._error = err


def record_batch(indices: np.ndarray, outputs: Mapping[str, Any] | torch.Tensor) -> pa.RecordBatch:
    """A batch's rows: `index` then one column per output, each checked to hold one value per sample."""
    if isinstance(outputs, torch.Tensor):
        outputs = {"output": outputs}
    if not isinstance(outputs, Mapping) or not outputs:
        raise UserError(
            f"predict_step returned {_describe(outputs)}; expected a dict of column name to {EXPECTED}, "
            'e.g. {"prediction": logits.argmax(-1)}'
        )
    columns = {INDEX: pa.array(indices, type=pa.int64())}
    for name, value in outputs.items():
        if not isinstance(name, str) or name == INDEX:
            raise UserError(
                f"predict_step output {name!r}: expected a column name of type str other than {INDEX!r} "
                "(the sample's index is written there)"
            )
        columns[name] = column(name, value, len(indices))
    return pa.RecordBatch.from_pydict(columns)


def column(name: str, value: Any, rows: int) -> pa.Array:
    """One output as an Arrow column of `rows` values, or a UserError naming it."""
    if isinstance(value, torch.Tensor):
        return _tensor_column(name, value, rows)
    if isinstance(value, (list, tuple)) and len(value) == rows:
        kinds = {type(v) for v in value}
        if len(kinds) == 1 and kinds <= {str, int, float, bool}:
            try:
                return pa.array(value)
            except (pa.ArrowException, OverflowError):  # an int beyond int64
                pass
    raise _bad(name, value, rows)


def _tensor_column(name: str, value: torch.Tensor, rows: int) -> pa.Array:
    if value.dim() == 0 or len(value) != rows or 0 in value.shape[1:] or value.is_complex():
        raise _bad(name, value, rows)
    value = value.detach().to("cpu", copy=True)  # a copy: Arrow shares numpy's memory, and a step may reuse it
    if value.dtype == torch.bfloat16:  # Arrow has no bfloat16; float32 holds each of its values exactly
        value = value.float()
    try:
        flat = pa.array(value.contiguous().numpy().reshape(-1))
    except (TypeError, pa.ArrowException):  # a dtype numpy or Arrow has not (quantized, float8, ...)
        raise _bad(name, value, rows) from None
    for size in reversed(value.shape[1:]):
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
    """A part file's index range, then (once the merge reaches it) its rows sorted by index."""

    low: int
    high: int
    path: Path
    table: Optional[pa.Table] = None
    index: Optional[np.ndarray] = None

    def load(self) -> None:
        table = _read(self.path)
        index = table.column(INDEX).to_numpy()
        if not _ascending(index):  # a rank writes its rows in index order: sorted already, but trust no file
            order = np.argsort(index, kind="stable")
            table, index = table.take(order), index[order]
        self.table, self.index = table, index

    def rows(self, start: int, stop: int) -> pa.Table:
        assert self.table is not None and self.index is not None
        first, last = np.searchsorted(self.index, [start, stop])
        return self.table.slice(first, last - first)


def merge(out_dir: Path, total: int, dest: Path, *, row_group_rows: int = MERGED_ROW_GROUP_ROWS) -> int:
    """After every rank closed its writer (the caller runs a barrier first), on one rank: every part file of
    `out_dir` read, each index 0..total-1 exactly once (a duplicate or a missing index is a RuntimeError naming
    it), rows in dataset order, written to `dest` (a `.tmp` renamed) in row groups of `row_group_rows`. Parts are
    read as the merge reaches their indices and dropped after them, so memory holds a window, not the data set.
    Returns the rows written; the part files are removed afterwards."""
    out_dir, dest = Path(out_dir), Path(dest)
    paths = part_files(out_dir)
    schema = _common_schema(paths)
    waiting = deque(sorted((_index_range(path, total) for path in paths), key=lambda part: part.low))
    live: list[_Part] = []
    with _atomic_parquet(dest, schema) as writer:
        for start in range(0, total, row_group_rows):
            stop = min(start + row_group_rows, total)
            while waiting and waiting[0].low < stop:
                live.append(waiting.popleft())
                live[-1].load()
            pieces = [part.rows(start, stop) for part in live]
            live = [part for part in live if part.high >= stop]
            window = pa.concat_tables(pieces) if pieces else schema.empty_table()
            writer.write_table(_in_order(window, start, stop, out_dir, total), row_group_size=row_group_rows)
    for path in [*paths, *out_dir.glob("part-r*.parquet.tmp")]:
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


def _index_range(path: Path, total: int) -> _Part:
    """A part's lowest and highest index, from the statistics of its index column (no rows read)."""
    meta = pq.ParquetFile(path).metadata
    stats = [meta.row_group(i).column(0).statistics for i in range(meta.num_row_groups)]
    if not stats or not all(s is not None and s.has_min_max for s in stats):
        index = _read(path, [INDEX]).column(0).to_numpy()
        low, high = (int(index.min()), int(index.max())) if len(index) else (0, -1)
    else:
        low, high = min(s.min for s in stats), max(s.max for s in stats)
    for bad in (low, high):
        if not 0 <= bad < total and high >= low:
            raise RuntimeError(f"predictions in {path}: index {bad} is outside 0..{total - 1}")
    return _Part(low, high, path)


def _common_schema(paths: list[Path]) -> pa.Schema:
    schema = _read_schema(paths[0]) if paths else pa.schema([(INDEX, pa.int64())])
    for path in paths[1:]:
        other = _read_schema(path)
        if not other.equals(schema):
            raise UserError(f"predictions: {path} has columns {other}; expected {schema}, as in {paths[0]}")
    return schema


def _read_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path).remove_metadata()
    except (pa.ArrowException, OSError) as err:
        raise _damaged(path, err) from None


def _read(path: Path, columns: Optional[list[str]] = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns).replace_schema_metadata(None)
    except (pa.ArrowException, OSError) as err:
        raise _damaged(path, err) from None


def _damaged(path: Path, err: Exception) -> UserError:
    return UserError(f"predictions: part file {path} cannot be read ({err}); delete it to predict its rows again")


def _unwritable(path: Path, err: OSError) -> UserError:
    return UserError(f"predictions: cannot write to {path} ({err.strerror or err}); expected a writable directory")


@contextlib.contextmanager
def _atomic_parquet(
    path: Path, schema: pa.Schema, options: Mapping[str, Any] = WRITE_OPTIONS
) -> Iterator[pq.ParquetWriter]:
    """A ParquetWriter whose file appears at `path` only once complete: written to `path.tmp`, fsync'd, renamed
    (then the folder fsync'd, so the rename survives a crash). An OSError is a UserError naming the path."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as file:
            with pq.ParquetWriter(file, schema, **options) as writer:
                yield writer
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise _unwritable(path.parent, err) from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
