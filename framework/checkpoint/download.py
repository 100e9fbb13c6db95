"""Reading a run's remote copy back (framework/checkpoint/upload.py has its layout): a published checkpoint into a
local folder, verified against its checksums before it is renamed into place, and the run's records.

Only what is asked for is downloaded: `fetch_run` (resume=URL) takes the newest intact published checkpoint, `best`
where that is another one, and the records; `fetch_cached` (ckpt=URL, init_from=URL) one checkpoint, into a cache
folder where the next command finds it again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from framework.checkpoint.format import META_FILE, DamagedCheckpoint
from framework.checkpoint.load import MAX_META_BYTES, data_files, open_checkpoint
from framework.checkpoint.save import link_checkpoint
from framework.checkpoint.upload import CHECKPOINTS, CHUNK, DATA, RECORD_FOLDERS, RECORD_NAMES, RECORD_PREFIXES
from framework.core import files
from framework.core.stores import Store

log = logging.getLogger(__name__)


def candidates(published: dict[str, dict[str, Any]], best_first: bool = False) -> list[dict[str, Any]]:
    """The published checkpoints newest first (at one step, `step-N` before `last`); `best_first`: `best` first."""
    ordered = sorted(published.values(), key=lambda m: (m["step"], m["name"] != "last"), reverse=True)
    if best_first and "best" in published:
        ordered.remove(published["best"])
        ordered.insert(0, published["best"])
    return ordered


def fetch(store: Store, manifest: dict[str, Any], dest: Path) -> None:
    """Download published checkpoint `manifest` into `dest`: written as `dest.tmp/`, verified (open_checkpoint), then
    renamed into place. DamagedCheckpoint where what the remote holds is not intact; nothing is left then."""
    where = store.path(CHECKPOINTS, DATA, manifest["data"])
    tmp = dest.with_name(dest.name + ".tmp")
    files.fresh_dir(tmp)
    try:
        meta_bytes = store.fs.cat_file(f"{where}/{META_FILE}")
        if len(meta_bytes) > MAX_META_BYTES:
            raise DamagedCheckpoint(f"{where}/{META_FILE}: {len(meta_bytes)} bytes, more than {MAX_META_BYTES}")
        files.write_bytes(tmp / META_FILE, meta_bytes)
        try:
            names = data_files(json.loads(meta_bytes))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DamagedCheckpoint(f"{where}/{META_FILE}: not a checkpoint's meta.json ({err})") from None
        for name in names:
            with store.fs.open(f"{where}/{name}", "rb", block_size=CHUNK) as src, files.replacing(tmp / name) as out:
                shutil.copyfileobj(src, out, CHUNK)
        open_checkpoint(tmp)  # every file against meta.json's checksums
        files.remove(dest)
        os.rename(tmp, dest)
        files.fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("Downloaded %s (step %d) from %s", dest, manifest["step"], store.url)


def _first_intact(store: Store, manifests: list[dict[str, Any]], dest: Any) -> Optional[dict[str, Any]]:
    """The first of `manifests` that downloads intact to `dest(manifest)`; the others skipped with a warning."""
    for manifest in manifests:
        try:
            fetch(store, manifest, dest(manifest))
            return manifest
        except DamagedCheckpoint as err:
            log.warning("Skipping a damaged checkpoint: %s", err)
        except FileNotFoundError as err:  # withdrawn since the listing
            log.warning("Skipping checkpoint %s of %s: %s", manifest["name"], store.url, err)
    return None


def fetch_run(store: Store, published: dict[str, dict[str, Any]], run_dir: Path) -> Optional[int]:
    """Make `run_dir` a local copy of the remote run, for resume=RUN_DIR: its newest intact checkpoint under every
    name that shares it (`step-N`, `last`), `best` where it is another, and the records. Returns the step of the
    checkpoint, or None where no published checkpoint is intact (nothing is written then)."""
    folder = run_dir / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    chosen = _first_intact(store, candidates(published), lambda m: folder / m["name"])
    if chosen is None:
        return None
    for name, manifest in published.items():
        if name != chosen["name"] and manifest["data"] == chosen["data"]:
            link_checkpoint(folder / chosen["name"], folder / name)
    best = published.get("best")
    if best is not None and best["data"] != chosen["data"]:
        _first_intact(store, [best], lambda m: folder / "best")
    fetch_records(store, run_dir)
    return int(chosen["step"])


def fetch_cached(
    store: Store, published: dict[str, dict[str, Any]], cache: Path, best_first: bool = False
) -> Optional[Path]:
    """The newest intact published checkpoint (`best_first`: best, if intact), as a local folder under `cache`, named
    by its <id>: downloaded unless an intact copy is there already. None where none is intact."""
    for manifest in candidates(published, best_first):
        dest = cache / manifest["data"]
        try:
            open_checkpoint(dest)
            log.info("Using %s, downloaded before from %s", dest, store.url)
            return dest
        except DamagedCheckpoint:
            pass  # not there yet, or not intact: downloaded again
        if _first_intact(store, [manifest], lambda m: dest) is not None:
            return dest
    return None


def fetch_records(store: Store, run_dir: Path) -> None:
    """Download the run's records (upload.RECORD_*) from the remote into `run_dir`; any other key is left alone."""
    root = store.root + "/"
    for path in sorted(store.fs.find(store.root)):
        relative = str(path)[len(root) :] if str(path).startswith(root) else ""
        parts = relative.split("/")
        if not relative or ".." in parts or "" in parts or parts[0] == CHECKPOINTS:
            continue
        if len(parts) == 1 and not (parts[0] in RECORD_NAMES or parts[0].startswith(RECORD_PREFIXES)):
            continue
        if len(parts) > 1 and parts[0] not in RECORD_FOLDERS:
            continue
        files.write_bytes(run_dir.joinpath(*parts), store.fs.cat_file(path))
