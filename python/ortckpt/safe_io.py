"""Every file ortckpt's Python side creates, and every file it reads by a name it did not choose.

The rules, kept in one place so that no caller can forget one (a test fails if other modules
call ``open`` for writing, ``os.replace`` or ``mkdir`` themselves):

- Files are created exclusively (O_CREAT|O_EXCL|O_NOFOLLOW), so a symlink or file planted at
  the name is never written through: a temporary file gets a fresh unpredictable name (128
  random bits) and is renamed over its target, which replaces a planted symlink rather than
  following it.
- A temporary file is locked (flock) by its writer until renamed, as the Rust core's are: a
  cleaner removes only files whose lock it can take (see ``src/io/locks.rs``).
- Files are opened for reading only if they are regular files, checked on the open file
  descriptor (O_NONBLOCK, so a FIFO never blocks the open): a directory is IsADirectoryError,
  anything else SpecialFileError.
- A name read from a document (a shard of an index, a file of metadata.json) is a plain name,
  and the file it names inside its directory is opened without following symlinks.
- Write errors carry the file's name (a full disk says which file).
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from ._boundary import TEMP_MARKER
from .errors import CheckpointFormatError, SpecialFileError

FILE_MODE = 0o644  # before the umask, as for any file a program creates
_NAME_ATTEMPTS = 16
# What a name read from a document may be: one path component, no separators, not . or ..
_PLAIN_NAME = re.compile(r"[^/\x00]{1,255}")


def temp_name(name: str) -> str:
    """A hidden, unpredictable sibling name for a file being written to ``name``."""
    return f".{name}{TEMP_MARKER}{secrets.token_hex(16)}"


def _with_filename(e: OSError, path: os.PathLike[str] | str) -> OSError:
    if e.filename is None:
        e.filename = os.fspath(path)
    return e


def create_exclusive(path: Path, *, lock: bool = False) -> int:
    """Creates ``path`` (it must not exist, not even as a dangling symlink) and returns a
    write-only file descriptor; with ``lock``, the file is flocked before it is returned."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        raise _with_filename(e, path) from None
    if lock:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in LOCKS_UNSUPPORTED:
                os.close(fd)
                raise _with_filename(e, path) from None
    return fd


LOCKS_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def write_all(fd: int, data: bytes | memoryview, path: Path) -> None:
    view = memoryview(data).cast("B")
    while view:
        try:
            written = os.write(fd, view)
        except OSError as e:
            raise _with_filename(e, path) from None
        view = view[written:]


def still_named(fd: int, path: Path) -> bool:
    """Whether the open ``fd`` is what ``path`` names now (a symlink there is not followed):
    after taking a lock on a file, proof that nobody removed or replaced it meanwhile."""
    try:
        named, opened = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _new_locked_temp(path: Path) -> tuple[Path, int]:
    """A fresh temporary file beside ``path``: created exclusively, locked by us."""
    last: OSError | None = None
    for _ in range(_NAME_ATTEMPTS):
        temp = path.parent / temp_name(path.name)
        try:
            fd = create_exclusive(temp, lock=True)
        except FileExistsError as e:  # planted, or a 1-in-2^128 coincidence: another name
            last = e
            continue
        if still_named(fd, temp):
            return temp, fd
        os.close(fd)  # a cleaner took it for a dead save's before we locked it: another name
    raise last or FileExistsError(errno.EEXIST, "no temporary name was free", os.fspath(path.parent))


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, durable: bool = False) -> Iterator[IO[bytes]]:
    """A file to write that replaces ``path`` when the block ends, all or nothing: it is a
    locked temporary file of a fresh name beside ``path``, renamed over it at the end. On any
    failure the temporary file goes and ``path`` is as it was; OS errors name ``path`` (a
    full disk says which file could not be written). After the rename, temporary files of
    earlier saves to ``path`` whose writers are gone (killed mid-save) are removed."""
    path = Path(path)
    temp, fd = _new_locked_temp(path)
    try:
        try:
            with open(fd, "wb", closefd=False) as f:
                yield f
            if durable:
                os.fsync(fd)
            os.replace(temp, path)
        except OSError as e:
            raise _with_filename(e, path) from None
    except BaseException:
        _unlink_quietly(temp)
        raise
    finally:
        os.close(fd)
    if durable:
        fsync_directory(path.parent)
    remove_abandoned_temps(path)


def remove_abandoned_temps(path: Path) -> None:
    """Removes the temporary files of saves to ``path`` that no writer holds locked (as the Rust
    core does for checkpoints): a held lock means a live save, in any process, and is left alone."""
    prefix = f".{path.name}{TEMP_MARKER}"
    for entry in entries(path.parent):
        if not entry.name.startswith(prefix):
            continue
        try:
            fd = os.open(entry.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its writer lives
                if still_named(fd, Path(entry.path)):
                    os.unlink(entry.path)
        except OSError:
            pass  # alive, or no locks on this filesystem: nothing proves it abandoned
        finally:
            os.close(fd)


def write_atomically(path: str | os.PathLike[str], data: bytes, *, durable: bool = False) -> None:
    """Replaces ``path`` with ``data``, as :func:`atomic_file`."""
    with atomic_file(path, durable=durable) as f:
        f.write(data)


def write_new(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Writes a file that must not exist yet (in a directory this process just created); on
    failure, what was written goes."""
    fd = create_exclusive(path)
    try:
        write_all(fd, data, path)
        if durable:
            os.fsync(fd)
    except OSError as e:
        _unlink_quietly(path)
        raise _with_filename(e, path) from None
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with suppress(OSError):
        os.unlink(path)


def fsync_directory(path: Path) -> None:
    """Makes a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading -----------------------------------------------------------------------------------------


def open_regular(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> io.FileIO:
    """Opens a regular file for reading (binary, unbuffered). Refuses anything else before
    reading a byte: IsADirectoryError, SpecialFileError (FIFO, socket, device), and with
    ``follow_symlinks=False`` a symlink (ELOOP)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise _with_filename(e, path) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise special_file(path, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return open(fd, "rb", buffering=0, closefd=True)
    except BaseException:
        os.close(fd)
        raise


def special_file(path: str | os.PathLike[str], mode: int) -> SpecialFileError:
    what = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "not a file"
    )
    error = SpecialFileError(f"{os.fspath(path)}: {what}, not a regular file: refused before reading")
    error.filename = os.fspath(path)
    return error


def read_regular(path: str | os.PathLike[str], *, limit: int | None = None, follow_symlinks: bool = True) -> bytes:
    """The bytes of a regular file; with ``limit``, a file larger than that is refused
    (CheckpointFormatError) before it is read."""
    with open_regular(path, follow_symlinks=follow_symlinks) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise CheckpointFormatError(f"{os.fspath(path)}: {size} bytes, more than the {limit} such a file may have")
        return f.read()


@contextmanager
def pinned_files(directory: Path, names: Iterable[str]) -> Iterator[Path]:
    """A private temporary directory whose entries are the named files of ``directory`` as
    opened now: each opened without following a symlink and checked to be a regular file
    (a FIFO would hang the reader), then linked to by its descriptor (/proc/self/fd), so a
    library that reads files by path (an uploader) reads those files, whatever is renamed or
    planted in ``directory`` meanwhile."""
    files = []
    view = Path(tempfile.mkdtemp(prefix="ortckpt-pinned-"))
    try:
        for name in names:
            opened = open_regular(member(directory, name), follow_symlinks=False)
            files.append(opened)
            os.symlink(f"/proc/self/fd/{opened.fileno()}", view / name)
        yield view
    finally:
        for opened in files:
            opened.close()
        remove_tree_quietly(view)


def is_plain_name(name: object) -> bool:
    """Whether ``name`` (read from a document) names a file directly inside its directory."""
    return isinstance(name, str) and name not in (".", "..") and _PLAIN_NAME.fullmatch(name) is not None


def member(directory: Path, name: str) -> Path:
    """``directory / name`` for a plain name (ValueError otherwise): what documents may name."""
    if not is_plain_name(name):
        raise ValueError(f"{name!r} is not a plain file name")
    return directory / name


# --- directories -------------------------------------------------------------------------------------


def make_private_directory(path: Path) -> None:
    """Creates ``path`` (it must not exist) writable by this user only, while it is being filled."""
    try:
        os.mkdir(path, 0o700)
    except OSError as e:
        raise _with_filename(e, path) from None


def make_directories(path: Path) -> None:
    """``mkdir -p``: the directories a user names (their permissions follow the umask)."""
    path.mkdir(parents=True, exist_ok=True)


def publish_directory(path: Path) -> None:
    """Gives a directory filled by :func:`make_private_directory` its final permissions: readable
    as the umask allows, never writable by others."""
    os.chmod(path, 0o755 & ~current_umask())


def current_umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:  # no race with other threads
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


@contextmanager
def staging_directory(target: Path) -> Iterator[Path]:
    """A private directory beside ``target`` for a library that writes files by name itself
    (onnx's external data), removed with whatever is left in it when the block ends."""
    staging = target.parent / f".{target.name}.ortckpt-staging.{secrets.token_hex(16)}"
    make_private_directory(staging)
    try:
        yield staging
    finally:
        remove_tree_quietly(staging)


def publish_staged(staging: Path, target: Path, *, durable: bool = False) -> None:
    """Moves ``staging/<name>`` over ``target`` (whose name it has), its ``<name>.data`` first
    when one was staged (the file that points into it goes last); without one, an earlier
    ``<target>.data``, which the new file does not use, is removed."""
    data = f"{target.name}.data"
    if (staging / data).exists():
        move_into_place(staging, target.parent, [data, target.name])
    else:
        move_into_place(staging, target.parent, [target.name])
        _unlink_quietly(target.parent / data)
    if durable:
        fsync_directory(target.parent)


def move_into_place(staging: Path, directory: Path, names: Iterable[str]) -> None:
    """Renames files of a staging directory over their namesakes in ``directory``, in order."""
    for name in names:
        try:
            os.replace(staging / name, directory / name)
        except OSError as e:
            raise _with_filename(e, directory / name) from None


def pwrite_all(path: Path, writes: Iterable[tuple[int, Any]], *, durable: bool = False) -> None:
    """Writes each (offset, bytes) into the existing regular file ``path`` (not following a
    symlink; never creating it): for files of a private staging directory filled in place."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise special_file(path, mode)
        for start, data in writes:
            view, offset = memoryview(data).cast("B"), start
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
        if durable:
            os.fsync(fd)
    except OSError as e:
        raise _with_filename(e, path) from None
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Removes a directory tree without following symlinks in it (shutil.rmtree uses the
    fd-based, symlink-attack-resistant walk on Linux)."""
    shutil.rmtree(path)


def remove_tree_quietly(path: str | os.PathLike[str]) -> None:
    """:func:`remove_tree` for cleanup after a failure, which must not hide the failure."""
    shutil.rmtree(path, ignore_errors=True)


def entries(directory: Path) -> Iterable[os.DirEntry[str]]:
    """The entries of ``directory`` (none if it does not exist)."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except FileNotFoundError:
        return []
