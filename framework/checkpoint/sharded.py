"""Sharded saves (parallel=fsdp): every rank writes its own shards of a checkpoint; rank 0 makes it whole.

No rank gathers the model to save it. Rank r writes `model-rank{r}-of{n}.safetensors` and
`state-rank{r}-of{n}.safetensors`: its local part of every DTensor (its shard) and its own copy of every
other tensor, with the state's structure. The save is atomic as a plain one is: everything goes to
`NAME.tmp/`; once every rank has written its files (an all-gather of what each wrote, which is the barrier),
rank 0 writes meta.json, the last file, and renames the folder into place. A rank killed at any instant leaves
at most `NAME.tmp/`, which discovery ignores, and the previous checkpoints intact. A failure on any rank is
one CheckpointSaveError on every rank. With `checkpoint.async_save` each rank copies its parts into a host
buffer and writes on the checkpoint writer's thread (framework/checkpoint/writer.py); the ranks then agree through
a process group of their own (the strategy's `background_ranks`), so those collectives never interleave with
training's.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from framework.checkpoint.format import (
    META_FILE,
    SHARDED_VERSION,
    CheckpointSaveError,
    _in_helper,
    _join,
    chunk,
    flatten,
    shard_file,
    shard_files,
)
from framework.checkpoint.save import _discard, _fsync, _replace_dir, _save_error, _unshared, _write, _write_tensors
from framework.core import files


class Ranks(Protocol):
    """The processes saving together (framework.parallel.strategy's strategies are): this one's rank, how many there
    are, an all-gather and a broadcast of small picklable objects."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def gather_objects(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any) -> Any: ...


class Shards(Ranks, Protocol):
    """A sharded run's ranks (framework.parallel.strategy's FSDPStrategy), which can also make the ranks a background
    save agrees through: a process group of their own, so that a writer thread's collectives never interleave with
    training's (every rank calls it, once, at the same point)."""

    def background_ranks(self) -> Ranks: ...


def local_shards(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Each DTensor replaced by this rank's part of it, and the layout of each: its global shape, the dimension
    it is split along, and this rank's offset and length there. Other tensors are kept as they are."""
    from torch.distributed.tensor import DTensor, Shard

    local, layout = {}, {}
    for key, tensor in tensors.items():
        if not isinstance(tensor, DTensor):
            local[key] = tensor
            continue
        placements, mesh = tensor.placements, tensor.device_mesh
        if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard:
            raise TypeError(
                f"checkpoint state at {key!r} is a DTensor placed as {placements} on a {mesh.ndim}-d mesh; "
                "sharded checkpoints hold DTensors sharded along one dimension of a 1-d mesh (FSDP's)"
            )
        dim, part = placements[0].dim, tensor.to_local()
        offset, length = chunk(tensor.shape[dim], mesh.size(), mesh.get_local_rank())
        if part.shape[dim] != length:
            raise RuntimeError(
                f"checkpoint state at {key!r}: this rank's shard has {part.shape[dim]} rows along "
                f"dimension {dim}, where torch.chunk's split gives {length}"
            )
        local[key] = part
        layout[key] = {"shape": list(tensor.shape), "dim": dim, "offset": offset, "length": length}
    return local, layout


@dataclass
class LocalParts:
    """What this rank writes of a checkpoint: its parts of the model's and the state's tensors (each DTensor's
    shard, every other tensor whole), their layouts, and the state's structure."""

    model: dict[str, torch.Tensor]
    model_layout: dict[str, dict[str, Any]]
    state: dict[str, torch.Tensor]
    state_layout: dict[str, dict[str, Any]]
    structure: Any

    @classmethod
    def of(cls, model_state: dict[str, torch.Tensor], state: dict[str, Any]) -> LocalParts:
        tensors: dict[str, torch.Tensor] = {}
        structure = flatten(state, tensors)
        model_local, model_layout = local_shards(model_state)
        state_local, state_layout = local_shards(tensors)
        return cls(model_local, model_layout, state_local, state_layout, structure)


def write_sharded(
    path: Path,
    model_state: dict[str, torch.Tensor],
    state: dict[str, Any],
    meta: dict[str, Any],
    ranks: Ranks,
    durable: bool = True,
) -> None:
    """Write this rank's files of checkpoint `path`; rank 0 then writes meta.json and renames `path.tmp/` into
    place. Every rank calls it, with its own tensors; `meta` is rank 0's. `durable` as for write_checkpoint."""
    commit_sharded(path, LocalParts.of(model_state, state), meta, ranks, durable)


def commit_sharded(path: Path, parts: LocalParts, meta: dict[str, Any], ranks: Ranks, durable: bool = True) -> None:
    """write_sharded from this rank's parts, already taken (the background writer's copies of them): every rank
    calls it, and the ranks agree through `ranks` alone (a group of their own when it runs on a thread)."""
    tmp = path.with_name(path.name + ".tmp")
    failure: Optional[str] = None
    if ranks.rank == 0:
        try:
            files.fresh_dir(tmp)
        except OSError as err:
            failure = str(_save_error(path, err))
    _agree(ranks.gather_objects(failure))  # the folder exists before any rank writes into it
    record: Any
    try:
        record = _write_own(tmp, parts, ranks, durable)
    except OSError as err:
        record = str(_save_error(path, err))
    records = ranks.gather_objects(record)  # also the barrier: every rank's files are written
    failure = next((r for r in records if isinstance(r, str)), None)
    unexpected: Optional[BaseException] = None
    if ranks.rank == 0:
        try:
            if failure is None:
                _write(tmp / META_FILE, json.dumps(_meta(meta, records), indent=1).encode(), durable)
                _replace_dir(tmp, path, durable)
        except OSError as err:
            failure = str(_save_error(path, err))
        except Exception as err:  # noqa: BLE001  (re-raised below, once the other ranks know the save failed)
            unexpected, failure = err, f"could not save checkpoint {path} ({type(err).__name__}: {err})"
        if failure is not None:
            _discard(tmp)
    failure = ranks.broadcast_object(failure)
    if unexpected is not None:
        raise unexpected
    if failure is not None:
        raise CheckpointSaveError(failure)


def _agree(failures: list[Optional[str]]) -> None:
    failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise CheckpointSaveError(failure)


def _write_own(tmp: Path, parts: LocalParts, ranks: Ranks, durable: bool) -> dict[str, Any]:
    """This rank's two files in `tmp`; returns what rank 0 needs for meta.json."""
    checksums: dict[str, str] = {}
    flushes: list[Future] = []
    try:
        for kind, content in (("model", parts.model), ("state", parts.state)):
            name = shard_file(kind, ranks.rank, ranks.world_size)
            checksums[name] = _write_tensors(tmp / name, _unshared(content))
            if durable:
                flushes.append(_in_helper(_fsync, tmp / name))
        _join(flushes)
    except OSError:
        for flush in flushes:
            flush.exception()  # a flush still running must not race rank 0's removal of the folder
        raise
    return {
        "structure": parts.structure,
        "checksums": checksums,
        "model": parts.model_layout,
        "state": parts.state_layout,
    }


def _meta(meta: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """meta.json of a sharded checkpoint: rank 0's meta, its structure (and any other rank's that differs), the
    checksum of every file, and every sharded tensor's global shape with each rank's offset and length."""
    first = records[0]
    layout: dict[str, Any] = {"world_size": len(records)}
    for kind in ("model", "state"):
        layout[kind] = {
            key: {
                "shape": entry["shape"],
                "dim": entry["dim"],
                "offsets": [record[kind][key]["offset"] for record in records],
                "lengths": [record[kind][key]["length"] for record in records],
            }
            for key, entry in first[kind].items()
        }
    layout["structures"] = {
        str(rank): record["structure"]
        for rank, record in enumerate(records)
        if rank and record["structure"] != first["structure"]
    }
    checksums = {name: value for record in records for name, value in record["checksums"].items()}
    return {
        **meta,
        "world_size": len(records),
        "format_version": SHARDED_VERSION,
        "structure": first["structure"],
        "checksums": checksums,
        "shards": layout,
    }


def link_sharded(src: Path, dst: Path, world_size: int, durable: bool = True) -> None:
    """Make `dst` a copy of sharded checkpoint `src` (hard links: no data is written twice), atomically."""
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        files.fresh_dir(tmp)
    except OSError as err:
        raise _save_error(dst, err) from None
    try:
        for name in (*shard_files(world_size), META_FILE):  # meta.json last, as in a save
            try:
                os.link(src / name, tmp / name)
            except OSError:  # a file system without hard links
                shutil.copy2(src / name, tmp / name)
        _replace_dir(tmp, dst, durable)
    except OSError as err:
        _discard(tmp)
        raise _save_error(dst, err) from None
