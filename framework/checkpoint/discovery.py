"""Resume discovery: what a directory holds (a checkpoint, a run), and the newest intact checkpoint of a run,
skipping (with a warning) whatever else its `checkpoints/` folder holds."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Optional

from framework.checkpoint.format import DamagedCheckpoint, _kind, _name, _where
from framework.checkpoint.load import Checkpoint, open_checkpoint

log = logging.getLogger(__name__)


def is_checkpoint(path: Path) -> bool:
    return (path / "meta.json").is_file() or (path / "model.safetensors").is_file()


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and not is_checkpoint(path) and ((path / "checkpoints").is_dir() or (path / ".hydra").is_dir())


def holds_run(path: Path) -> bool:
    """Does `path` already hold a run (its config, checkpoints, summary or TensorBoard events)?"""
    if not path.is_dir():
        return False
    if (path / ".hydra" / "config.yaml").is_file() or (path / "summary.json").exists():
        return True
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return True
    return any(p.name.startswith("events.out.tfevents") for p in path.iterdir())


def find_latest(run_dir: Path, below_step: Optional[int] = None) -> Optional[Checkpoint]:
    """The newest intact checkpoint of a run. Anything else in `checkpoints/` (a damaged checkpoint, a file,
    a FIFO, a link out of the folder) is skipped with a warning naming it and why, without being opened.

    Every meta.json is read, but data files are hashed newest first and only until one is intact: a run that
    keeps every periodic checkpoint does not re-read all of them to resume from the last. A checkpoint that
    disappears while being read (a run still saving into this folder replaced it) makes discovery look again.
    `below_step`: only checkpoints of an earlier step (the fallback when a newer one failed to restore)."""
    for _ in range(3):
        found, vanished = _newest_intact(run_dir / "checkpoints", below_step)
        if found is not None or not vanished:
            return found
    return None


def _newest_intact(folder: Path, below_step: Optional[int] = None) -> tuple[Optional[Checkpoint], bool]:
    described, vanished = [], False
    for path in _candidates(folder):
        try:
            described.append(open_checkpoint(path, verify=False))
        except DamagedCheckpoint as err:
            vanished |= _skip(path, err)
    if below_step is not None:
        described = [c for c in described if c.step < below_step]
    # Newest step first; at equal steps any copy will do (last and step-N hold the same state).
    for checkpoint in sorted(described, key=lambda c: (c.step, c.path.name == "last"), reverse=True):
        try:
            return open_checkpoint(checkpoint.path), vanished
        except DamagedCheckpoint as err:
            vanished |= _skip(checkpoint.path, err)
    return None, vanished


def _skip(path: Path, err: DamagedCheckpoint) -> bool:
    """Warn that a checkpoint is skipped; True (and no warning) when it is gone: removed while being read."""
    if not os.path.lexists(path):
        log.debug("%s disappeared while being read", _where(path))
        return True
    log.warning("Skipping a damaged checkpoint: %s", err)
    return False


def _candidates(folder: Path) -> list[Path]:
    """The directories in `folder`, and links to directories inside it; anything else is skipped with a
    warning, from its lstat alone. Leftovers `NAME.tmp` of an interrupted save are ignored."""
    try:
        entries = sorted(entry.name for entry in os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as err:
        raise DamagedCheckpoint(
            f"{_name(folder)} cannot be listed ({err.strerror}); expected a readable folder of checkpoints"
        ) from None
    found = []
    inside = os.path.realpath(folder)
    for name in entries:
        if name.endswith(".tmp"):
            continue
        path = folder / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue  # gone since the listing
        except OSError as err:
            log.warning("Skipping a damaged checkpoint: %s cannot be read (%s)", _where(path), err.strerror)
            continue
        problem = None
        if stat.S_ISLNK(mode):
            real = os.path.realpath(path)
            if os.path.commonpath([real, inside]) != inside or real == inside:
                problem = f"is a symbolic link to {_name(real)}, not to a checkpoint inside {_name(folder)}"
            else:
                try:
                    mode = os.stat(real).st_mode
                except OSError as err:
                    problem = f"is a symbolic link to {_name(real)}, which cannot be read ({err.strerror})"
        if problem is None and not stat.S_ISDIR(mode):
            problem = f"is {_kind(mode)}"
        if problem is not None:
            log.warning("Skipping a damaged checkpoint: %s %s; expected a checkpoint directory", _where(path), problem)
            continue
        found.append(path)
    return found
