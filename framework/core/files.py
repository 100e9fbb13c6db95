"""The one way the framework writes a file into a run or checkpoint directory.

Every write makes a new inode and never follows a link:
- `replacing(path)` writes a temporary name opened with `O_CREAT | O_EXCL | O_NOFOLLOW` (a leftover there, a
  crash's or a planted link, is unlinked first: the name goes, its target is untouched), fsyncs it, renames it over
  `path` and fsyncs the directory. A file that another name links to (checkpoints share files by hard links) is
  replaced, never rewritten in place: the other names keep their bytes.
- `growing(path, initial)` does the same for a file that is appended to afterwards (metrics.csv): the handle it
  returns writes into the new inode, already renamed into place.
- `appending(path)` continues a log (run.log): the file itself when it is a regular file no other name shares, else
  a copy of it put in its place first; a link is never written through.
- `private_dir(folder)` is for writers of other libraries (torch's trace export, ONNX): they write into a new
  directory of ours, whose names nobody could have planted, and `publish` renames the result into place.
`fsync=False` (checkpoint.fsync=false) keeps the writes atomic for the process, not across a power cut.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Optional, Union

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
TMP_SUFFIX = ".tmp"


def temp_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place."""
    return path.with_name(path.name + TMP_SUFFIX)


def _create(path: Path) -> int:
    """A new, empty file at `path`, which nothing else names. Whatever is at that name (a leftover of a crash, a
    link) is unlinked first: `unlink` removes a name, never what a link points to."""
    try:
        return os.open(path, _CREATE, 0o644)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, _CREATE, 0o644)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a crash after it keeps the new name)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open(fd: int, text: bool) -> IO[Any]:
    return os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb")


@contextlib.contextmanager
def replacing(path: Path, *, text: bool = False, fsync: bool = True) -> Iterator[IO[Any]]:
    """`with replacing(path) as f: f.write(...)`: `path` holds what was written once the block ends, and its old
    content (or nothing) if the block raises or the process dies in it. Missing parent folders are made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    file = _open(_create(tmp), text)
    try:
        with file:
            yield file
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)


def write_bytes(path: Path, data: Union[bytes, memoryview], *, fsync: bool = True) -> None:
    with replacing(path, fsync=fsync) as f:
        f.write(data)


def write_text(path: Path, text: str, *, fsync: bool = True) -> None:
    with replacing(path, text=True, fsync=fsync) as f:
        f.write(text)


def json_safe(value: Any) -> Any:
    """`value` with every NaN or infinite float as None: they are not JSON (a reader in another language fails on
    `NaN`), and null says what they mean in a record, no number."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, data: Union[Mapping[str, Any], list[Any]], *, fsync: bool = True) -> None:
    """JSON as the run's records are written: indented, one trailing newline, a non-finite number as null."""
    write_text(path, json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n", fsync=fsync)


def growing(path: Path, initial: Union[str, bytes] = b"", *, fsync: bool = True) -> IO[Any]:
    """A file appended to for the rest of a run: `initial` is written to a new inode, made durable and renamed
    over `path`; the returned handle (text when `initial` is text) goes on writing into that inode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, text = temp_name(path), isinstance(initial, str)
    file = _open(_create(tmp), text)
    try:
        file.write(initial)
        file.flush()
        if fsync:
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        file.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)
    return file


def read_bytes(path: Path, limit: Optional[int] = None) -> bytes:
    """A regular file's bytes, never through a link, never blocking on a FIFO; OSError otherwise (ELOOP for a
    link), ValueError when it is larger than `limit`."""
    fd = os.open(path, _READ)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if limit is not None and st.st_size > limit:
            raise ValueError(f"{path} is {st.st_size} bytes, more than {limit}")
        return f.read()


def appending(path: Path) -> IO[str]:
    """A text log continued where it ends: `path` itself when it is a regular file that no other name links to;
    otherwise (a hard link, a symbolic link, anything else) a new file holding the old one's text (a symbolic
    link's target is not read) is put in its place first. New when there was none."""
    path = Path(path)
    try:
        fd = os.open(path, _APPEND)
    except FileNotFoundError:
        return growing(path, "", fsync=False)
    except OSError:  # ELOOP: a symbolic link, replaced by a new, empty log
        return growing(path, "", fsync=False)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        return os.fdopen(fd, "a", encoding="utf-8")
    os.close(fd)
    try:
        old = read_bytes(path).decode("utf-8", errors="replace")
    except (OSError, ValueError):
        old = ""
    return growing(path, old, fsync=False)


def own_file(path: Path) -> int:
    """A descriptor, read-write, of the regular file at `path` that no other name shares (a lock file, whose inode
    must stay the same across processes), created where missing; a link at that name, symbolic or hard, is
    replaced by a new file, so that what is written into it never lands in another file."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            os.unlink(path)
            continue
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            return fd
        os.close(fd)
        os.unlink(path)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def remove(path: Path) -> None:
    """Remove what is at `path`: a link or a file as a name (never what a link points to), a directory whole."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def fresh_dir(path: Path) -> None:
    """An empty directory at `path`, made now (a checkpoint's `NAME.tmp/`), so nothing in it was planted: whatever
    was at that name (a crash's leftover, a link, a file) goes first."""
    remove(path)
    path.mkdir(parents=True)


@contextlib.contextmanager
def private_dir(folder: Path) -> Iterator[Path]:
    """A new directory in `folder` (its name chosen and created by the OS, so nothing in it was planted), for
    another library to write into; removed, with whatever was not published, when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".writing-", dir=folder))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def publish(written: Path, path: Path, *, fsync: bool = True) -> None:
    """Rename a file written in a `private_dir` over `path` (on the same file system), made durable first."""
    if fsync:
        fd = os.open(written, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(written, path)
    if fsync:
        fsync_dir(path.parent)
