"""The one place a private API of a dependency is used, because no public one does the job; each checks the version
it was written for, so another version fails loudly here (tests/test_compat.py) rather than silently elsewhere.

- torchmetrics 1.x keeps a Metric's update count in `_update_count`, which `compute()` and `forward()` read and
  `load_state_dict()` never restores; there is a public getter (`update_count`) and no setter. An exact resume of a
  task's metrics needs the count back.
- torch.compile keeps a record of each compilation (`torch._dynamo.utils.get_compilation_metrics()`: when it
  started, the code compiled and, for a recompilation, the guard that failed); no public API counts
  recompilations, which trainer.compile reports in summary.json.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Iterator

TORCHMETRICS_MAJOR = 1  # the release series `set_update_count` was written and tested for
_UPDATE_COUNT = "_update_count"


def set_update_count(metric: Any, count: int) -> None:
    """Give a torchmetrics Metric back the number of updates it had seen (see the module docstring)."""
    import torchmetrics

    major = int(torchmetrics.__version__.split(".")[0])
    if major != TORCHMETRICS_MAJOR or not hasattr(metric, _UPDATE_COUNT):
        raise RuntimeError(
            f"framework.core.compat.set_update_count was written for torchmetrics {TORCHMETRICS_MAJOR}.x "
            f"(Metric.{_UPDATE_COUNT}); this is torchmetrics {torchmetrics.__version__}: check that "
            "the private attribute still holds the update count, then update TORCHMETRICS_MAJOR"
        )
    setattr(metric, _UPDATE_COUNT, int(count))


# wandb 0.31 has no reader of its own `.wandb` files (the Python DataStore of earlier versions is gone), so this
# reads the transaction log's framing (LevelDB's log format, the header W&B puts before it) and parses each record
# with wandb's protocol buffers (`wandb.proto.wandb_internal_pb2`, which `wandb sync` also reads). A file with
# another header is refused by name, not misread.
WANDB_HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version 0
WANDB_RECORD_HEADER = struct.Struct("<IHB")  # crc32c, length, type
WANDB_BLOCK = 32 * 1024
WANDB_FULL, WANDB_FIRST, WANDB_MIDDLE, WANDB_LAST = 1, 2, 3, 4  # a record's part


def wandb_records(path: Path) -> Iterator[Any]:
    """Every record of a `.wandb` file, in order; a record cut short (a killed run's last) ends the file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < WANDB_HEADER.size:  # killed before its header was written
        return
    if WANDB_HEADER.unpack_from(data) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path}: not a W&B transaction log of version 0 (written by wandb 0.31)")
    pos, parts = WANDB_HEADER.size, b""
    while pos + WANDB_RECORD_HEADER.size <= len(data):
        room = WANDB_BLOCK - pos % WANDB_BLOCK
        if room < WANDB_RECORD_HEADER.size:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = WANDB_RECORD_HEADER.unpack_from(data, pos)
        body = data[pos + WANDB_RECORD_HEADER.size : pos + WANDB_RECORD_HEADER.size + length]
        if len(body) < length:  # the write was cut short
            return
        if kind == 0:  # zeros: the rest of the block is padding
            pos += room
            continue
        pos += WANDB_RECORD_HEADER.size + length
        parts += body
        if kind in (WANDB_FULL, WANDB_LAST):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated, no stubs
            record.ParseFromString(parts)
            parts = b""
            yield record


TORCH_MAJOR = 2  # the release series `compilations` was written and tested for (2.14)
_COMPILATION_FIELDS = ("start_time", "co_name", "co_filename", "co_firstlineno", "recompile_reason")


def compilations(since: float) -> list[Any]:
    """torch.compile's records of the compilations that started at or after `since` (time.time()), oldest first;
    each has `co_name`, `co_filename`, `co_firstlineno` and `recompile_reason` (None unless a recompilation).
    torch keeps the last 64 records."""
    import torch
    from torch._dynamo.utils import get_compilation_metrics

    records = get_compilation_metrics()
    major = int(torch.__version__.split(".")[0])
    if major != TORCH_MAJOR or not all(hasattr(r, f) for r in records for f in _COMPILATION_FIELDS):
        raise RuntimeError(
            f"framework.core.compat.compilations was written for torch {TORCH_MAJOR}.x's CompilationMetrics (fields "
            f"{', '.join(_COMPILATION_FIELDS)}); this is torch {torch.__version__}: check that "
            "torch._dynamo.utils.get_compilation_metrics still records them, then update TORCH_MAJOR"
        )
    return [r for r in records if r.start_time is not None and r.start_time >= since]
