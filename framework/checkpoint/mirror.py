"""The remote copy of a run (`checkpoint.remote=URL`), kept up to date on a thread of its own.

After each save (once the checkpoint is intact on disk: the writer calls `request` after the save, its links and
its pruning) the mirror makes the remote match the run: every local checkpoint it does not hold yet is published
(framework/checkpoint/upload.py: uploaded, verified, then its manifest), every `step-N` the policies no longer keep
is withdrawn, and the run's records go up. The training loop never waits for it: `request` only hands over the
names the policies keep; requests that come while one is being served are merged into the next. A store that fails
is one warning; training goes on with its local checkpoints and the next request tries again, whole. `close` (at
the end of fit) waits for the last request.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Optional

from framework.checkpoint.upload import collect_garbage, manifests, publish, unpublish, upload_records
from framework.core.stores import Store, cause

log = logging.getLogger(__name__)


class RemoteMirror:
    """Publishes a run's checkpoints and records to `store`, in the background (see the module's docstring)."""

    def __init__(self, store: Store, run_dir: Path) -> None:
        self.store, self.run_dir = store, run_dir
        self._published: Optional[dict[str, str]] = None  # the remote's name -> <id>, read once, then kept here
        self._sent: dict[str, tuple[int, int]] = {}  # the records uploaded: path -> (size, mtime)
        self._kept: Optional[set[str]] = None  # the newest request's names, not yet served
        self._closing, self._failing = False, False
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def request(self, kept: set[str]) -> None:
        """Bring the remote up to date with the run's checkpoints; `kept`: the `step-N` names the policies keep
        (any other published `step-N` is withdrawn). Returns at once."""
        with self._wake:
            self._kept = set(kept)
            self._wake.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="checkpoint-remote", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Wait for the request in flight and the one queued (each bounded by the store's timeouts), then stop."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._wake:
            self._thread, self._closing = None, False

    def _serve(self) -> None:
        while True:
            with self._wake:
                while self._kept is None and not self._closing:
                    self._wake.wait()
                kept, self._kept = self._kept, None
            if kept is None:
                return
            self._sync(kept)

    def _sync(self, kept: set[str]) -> None:
        try:
            self._publish_all(kept)
        except Exception as err:  # noqa: BLE001  (any failure of the store: training goes on, the next save retries)
            log.debug("Upload to %s failed", self.store.url, exc_info=True)
            if not self._failing:
                log.warning(
                    "checkpoint.remote=%r: upload failed: %s; training goes on with the local checkpoints, and the "
                    "upload is tried again at the next checkpoint",
                    self.store.url,
                    cause(err),
                )
            self._failing = True
            self._published = None  # what the remote holds is read again
            return
        if self._failing:
            log.info("checkpoint.remote=%r: uploading again; the remote holds the run's checkpoints", self.store.url)
        self._failing = False

    def _publish_all(self, kept: set[str]) -> None:
        if self._published is None:
            self._published = {name: manifest["data"] for name, manifest in manifests(self.store).items()}
        published = self._published
        for path in _local_checkpoints(self.run_dir / "checkpoints"):
            checkpoint_id = publish(self.store, path, published)
            if checkpoint_id is not None:
                published[path.name] = checkpoint_id
        for name in [n for n in published if n.startswith("step-") and n not in kept]:
            unpublish(self.store, name)
            del published[name]
        collect_garbage(self.store, set(published.values()))
        upload_records(self.store, self.run_dir, self._sent)


def _local_checkpoints(folder: Path) -> list[Path]:
    """The run's checkpoint folders, `step-N` oldest first, then `last` and `best` (which share their data)."""
    try:
        found = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and "." not in p.name]
    except FileNotFoundError:
        return []

    def order(path: Path) -> tuple[int, int]:
        step = path.name.removeprefix("step-")
        return (0, int(step)) if path.name.startswith("step-") and step.isdigit() else (1, 0)

    return sorted(found, key=order)
