"""One run per directory: the lock a run holds on its directory, cleaning up after an attempt refused or a
fast_dev_run (which keeps nothing), and setting aside a failed attempt that a new run takes the place of.

The lock is a POSIX record lock (`fcntl.lockf`) on `RUN_DIR/.lock`, held for the life of the process: the kernel
releases it when the process dies however it dies, so a lock left by a killed run is simply free again (no
stale-PID guessing). Not `flock`: a flock belongs to the open file, which forked children share (DataLoader
workers), so a run SIGKILLed with workers kept its directory locked until they noticed (seconds), and an
immediate `resume=` was refused naming a dead PID; a record lock belongs to the process alone. It also holds over
NFS, where flock may be local to one machine. The file records the holder's PID and host for the error message of
a second process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterable, Optional

from framework.core import files
from framework.core.errors import ConfigError
from framework.core.runlog import file_handlers, loggers_writing_to

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class RunDirLock:
    """`with RunDirLock(run_dir):` the one process writing into `run_dir`; a second one gets a ConfigError."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: Optional[int] = None

    def __enter__(self) -> "RunDirLock":
        try:
            fd = files.own_file(self.path)  # a link planted at .lock is replaced, never written through
        except OSError as err:
            raise ConfigError(
                f"hydra.run.dir={str(self.path.parent)!r}: cannot write there ({err.strerror}); "
                "expected a directory this user can write"
            ) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                f"hydra.run.dir={str(self.path.parent)!r}: {holder} is already running this run; "
                "expected one process per run directory (wait for it to end, or stop it, then "
                "resume)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"PID {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (removing it would race a waiting process)
            self._fd = None


def _close_file_logs(folder: Path) -> None:
    """Close the log handlers writing into `folder` (Hydra's run.log), so the folder can be removed."""
    for handler in file_handlers():
        if handler.path.resolve().is_relative_to(folder.resolve()):
            for logger in loggers_writing_to(handler):
                logger.removeHandler(handler)
            handler.close()


def discard_attempt(run_dir: Path, hydra_subdir: Optional[str], *, started: bool, also: Iterable[str] = ()) -> None:
    """Undo what this invocation left in `run_dir` when it failed: in a directory that already held a run, its
    own `.hydra/<attempt>` record, unless it had `started` training there; a new directory that holds nothing
    but this invocation's `.hydra/`, `run.log`, lock and the files named in `also` (written before training),
    whole. Nothing of an earlier run is ever touched."""
    if hydra_subdir and hydra_subdir.startswith(".hydra/"):
        if not started:
            shutil.rmtree(run_dir / hydra_subdir, ignore_errors=True)
        return
    if hydra_subdir != ".hydra" or not run_dir.is_dir():
        return
    if {p.name for p in run_dir.iterdir()} <= {".hydra", "run.log", LOCK_FILE, *also}:
        _close_file_logs(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)


def entries(run_dir: Path) -> frozenset[str]:
    """The names in `run_dir` now (none where it is missing): what a fast_dev_run must leave as it found it."""
    try:
        return frozenset(os.listdir(run_dir))
    except OSError:
        return frozenset()


def discard_dev_run(run_dir: Path, before: Iterable[str], own: Iterable[str] = (".hydra", "run.log")) -> None:
    """Remove what a fast_dev_run wrote into `run_dir`, a directory that held no run: every entry that was not in
    it `before` it started but those of `own` (this invocation's own: Hydra's `.hydra/`, and `run.log` unless it
    holds a failed attempt's log), then the directory itself where nothing else is left. What was there before is
    not touched."""
    kept = set(before) - set(own)
    _close_file_logs(run_dir)
    for entry in sorted(entries(run_dir) - kept):
        path = run_dir / entry
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    if not kept:
        with contextlib.suppress(OSError):
            run_dir.rmdir()


FAILED_ATTEMPT = re.compile(r"failed-\d+")  # a failed attempt set aside, RUN_DIR/failed-<n>/


def set_aside(run_dir: Path, hydra_subdir: str) -> Path:
    """Make room in `run_dir` for a new run, where a run failed before its first checkpoint (which the caller
    checked, holding the lock): every file of the failed attempt is moved into `RUN_DIR/failed-<n>/` (its
    `.hydra/` records in `failed-<n>/.hydra/`), and this invocation's record, which Hydra wrote beside the failed
    attempt's (`hydra_subdir`, `.hydra/attempt-<time>`), becomes the run's `.hydra/`. Nothing is deleted; run.log
    stays where it is, continued by the new run, and failed attempts set aside before stay as they are. The
    summary.json that marks the attempt as failed moves last: cut short, the next run finds it and goes on.
    Returns the folder."""
    n = 1
    while (run_dir / f"failed-{n}").exists():
        n += 1
    aside, hydra, own = run_dir / f"failed-{n}", run_dir / ".hydra", run_dir / hydra_subdir
    (aside / ".hydra").mkdir(parents=True)
    staying = {"run.log", LOCK_FILE, ".hydra", "summary.json"}
    for name in sorted(entries(run_dir)):
        if name not in staying and not FAILED_ATTEMPT.fullmatch(name):
            os.rename(run_dir / name, aside / name)
    for path in sorted(hydra.iterdir()):
        if path != own:
            os.rename(path, aside / ".hydra" / path.name)
    for path in sorted(own.iterdir()):
        os.rename(path, hydra / path.name)
    own.rmdir()
    os.rename(run_dir / "summary.json", aside / "summary.json")
    return aside
