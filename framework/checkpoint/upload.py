"""A run's checkpoints and records on a remote store, and how a checkpoint is published there.

The remote is laid out as a run directory: the run's records at their own paths (`.hydra/`, `summary.json`,
`provenance.json`, TensorBoard's event files, `run.log`, ...) and `checkpoints/`:

    checkpoints/<name>.json               the manifest of checkpoint <name> (`step-500`, `last`, `best`): the marker
    checkpoints/data/<id>/meta.json       <id> = step-<N>-<XXH3-64 of meta.json>, one per checkpoint written
    checkpoints/data/<id>/*.safetensors

Object stores have no atomic rename of a folder, so a checkpoint is published in three steps: its files are
uploaded into `data/<id>/`, where no reader looks until a manifest names it; they are read back and checked against
the checksums its meta.json records (and meta.json byte for byte); then the manifest is written, one PUT, which
an object store makes visible whole or not at all. A reader lists manifests only, so a checkpoint cut short
mid-upload is never chosen. Names that share a checkpoint (`last`, `best` and `step-N` at one step, hard links on
disk) share one <id>, uploaded once; data no manifest names any more is deleted.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any, Optional

import xxhash

from framework.checkpoint.format import META_FILE
from framework.checkpoint.load import MAX_META_BYTES, data_files
from framework.core import files
from framework.core.stores import Store

log = logging.getLogger(__name__)

CHECKPOINTS, DATA = "checkpoints", "data"
MANIFEST_VERSION = 1
CHUNK = 8 * 2**20
# The run's records that go up with each checkpoint: what a resume from the remote continues (TensorBoard's run, the
# log, the saved config and provenance) and what a reader of it wants (the summary).
RECORD_NAMES = ("summary.json", "run.log", "param_groups.json", "folds.json", "trackers.json", "metrics.csv")
RECORD_PREFIXES = ("events.out.tfevents", "provenance", "git")
RECORD_FOLDERS = (".hydra",)


class UploadMismatch(OSError):
    """A file read back from the remote is not what the checkpoint's meta.json records: not published."""


def manifest_path(store: Store, name: str) -> str:
    return store.path(CHECKPOINTS, f"{name}.json")


def read_local(path: Path) -> tuple[str, bytes, dict[str, Any]]:
    """(<id>, meta.json's bytes, meta.json) of local checkpoint `path`. OSError or ValueError where it is not a
    checkpoint this version wrote (or is being replaced: the next sync takes it)."""
    meta_bytes = files.read_bytes(path / META_FILE, MAX_META_BYTES)
    meta = json.loads(meta_bytes)
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("step"), int)
        or not isinstance(meta.get("checksums"), dict)
    ):
        raise ValueError(f"{path / META_FILE}: not a checkpoint's meta.json")
    return f"step-{meta['step']}-{xxhash.xxh3_64_hexdigest(meta_bytes)}", meta_bytes, meta


def publish(store: Store, path: Path, published: dict[str, str]) -> Optional[str]:
    """Make local checkpoint `path` the remote's checkpoint of the same name: its data uploaded and verified (unless
    a published name holds the same <id> already), then its manifest written. Returns its <id>, or None where the
    local copy cannot be read as it is (being replaced, damaged): it is left for the next sync.
    `published`: the remote's name -> <id> as this process knows it."""
    try:
        checkpoint_id, meta_bytes, meta = read_local(path)
        names = data_files(meta)
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.debug("%s: not uploaded now (%s)", path, err)
        return None
    if published.get(path.name) == checkpoint_id:
        return checkpoint_id
    if checkpoint_id not in published.values():
        where = store.path(CHECKPOINTS, DATA, checkpoint_id)
        try:
            for name in names:
                store.fs.put_file(str(path / name), f"{where}/{name}")
            store.fs.pipe_file(f"{where}/{META_FILE}", meta_bytes)
            verify(store, where, meta_bytes, meta, names)
        except (UploadMismatch, FileNotFoundError) as err:
            if not changed(path, checkpoint_id):
                raise  # the store's doing
            # The saver replaced it (`last`) or pruned it while it went up: not the store's failure. Nothing is
            # published; its successor goes up at the next sync, and collect_garbage removes what was uploaded.
            log.debug("%s: replaced or removed while uploading (%s); left for the next sync", path, err)
            return None
    manifest = {"manifest_version": MANIFEST_VERSION, "name": path.name, "step": meta["step"], "data": checkpoint_id}
    store.fs.pipe_file(manifest_path(store, path.name), json.dumps(manifest).encode())
    return checkpoint_id


def changed(path: Path, checkpoint_id: str) -> bool:
    """Is local checkpoint `path` no longer the one with <id> `checkpoint_id` (replaced, pruned, being written)?"""
    try:
        return read_local(path)[0] != checkpoint_id
    except (OSError, ValueError):
        return True


def verify(store: Store, where: str, meta_bytes: bytes, meta: dict[str, Any], names: list[str]) -> None:
    """Read every file of the uploaded checkpoint at `where` back and check it against meta.json's checksums (and
    meta.json itself byte for byte); UploadMismatch naming the first that differs."""
    for name in names:
        expected = meta["checksums"].get(name)
        found = remote_digest(store, f"{where}/{name}", crc32=isinstance(expected, int))
        if found != expected:
            raise UploadMismatch(f"{where}/{name}: read back as {found}, its meta.json records {expected}")
    if store.fs.cat_file(f"{where}/{META_FILE}") != meta_bytes:
        raise UploadMismatch(f"{where}/{META_FILE}: read back with other bytes than were uploaded")


def remote_digest(store: Store, path: str, crc32: bool = False) -> Any:
    """The checksum of a remote file as framework.checkpoint.format.digest gives a local one's, streamed."""
    hasher, crc = xxhash.xxh3_64(), 0
    with store.fs.open(path, "rb", block_size=CHUNK) as f:
        while chunk := f.read(CHUNK):
            if crc32:
                crc = zlib.crc32(chunk, crc)
            else:
                hasher.update(chunk)
    return crc if crc32 else "xxh3_64:" + hasher.hexdigest()


def manifests(store: Store) -> dict[str, dict[str, Any]]:
    """The remote's published checkpoints: name -> manifest. A manifest that is not one is skipped with a warning."""
    found = {}
    try:
        paths = store.fs.glob(store.path(CHECKPOINTS, "*.json"))
    except FileNotFoundError:
        return {}
    for path in sorted(paths):
        try:
            manifest = json.loads(store.fs.cat_file(path))
        except (ValueError, FileNotFoundError) as err:
            log.warning("Skipping %s: not a checkpoint manifest (%s)", path, err)
            continue
        if not (
            isinstance(manifest, dict)
            and isinstance(manifest.get("step"), int)
            and isinstance(manifest.get("data"), str)
            and "/" not in manifest["data"]
            and manifest.get("name") == path.rpartition("/")[2].removesuffix(".json")
        ):
            log.warning("Skipping %s: not a checkpoint manifest", path)
            continue
        found[manifest["name"]] = manifest
    return found


def unpublish(store: Store, name: str) -> None:
    """Withdraw checkpoint `name`: its manifest goes first, so a reader never finds it half deleted."""
    store.fs.rm_file(manifest_path(store, name))


def collect_garbage(store: Store, referenced: set[str]) -> None:
    """Delete the data of every checkpoint no manifest names (withdrawn, or an upload cut short). Only under this
    run's own `checkpoints/data/`, never anything else of the remote."""
    try:
        folders = store.fs.ls(store.path(CHECKPOINTS, DATA), detail=False)
    except FileNotFoundError:
        return
    for folder in folders:
        if str(folder).rstrip("/").rpartition("/")[2] not in referenced:
            store.fs.rm(folder, recursive=True)


def record_files(run_dir: Path) -> list[Path]:
    """The run's records (RECORD_NAMES, RECORD_PREFIXES, RECORD_FOLDERS) that exist, regular files only."""
    found = [
        path for path in sorted(run_dir.iterdir()) if path.name in RECORD_NAMES or path.name.startswith(RECORD_PREFIXES)
    ]
    for folder in RECORD_FOLDERS:
        found += sorted((run_dir / folder).rglob("*")) if (run_dir / folder).is_dir() else []
    return [path for path in found if path.is_file() and not path.is_symlink() and not path.name.endswith(".tmp")]


def upload_records(store: Store, run_dir: Path, sent: dict[str, tuple[int, int]]) -> None:
    """Upload the records that changed since `sent` (relative path -> (size, mtime) of what was uploaded; updated)."""
    for path in record_files(run_dir):
        relative = path.relative_to(run_dir).as_posix()
        try:
            st = os.stat(path)
            if sent.get(relative) == (st.st_size, st.st_mtime_ns):
                continue
            data = files.read_bytes(path)
        except OSError:
            continue  # gone since the listing
        store.fs.pipe_file(store.path(relative), data)
        sent[relative] = (st.st_size, st.st_mtime_ns)
