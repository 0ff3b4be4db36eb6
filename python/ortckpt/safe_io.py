"""Every file ortckpt's Python side creates, and every file it reads by a name it did not choose.

The rules, kept in one place so that no caller can forget one (a test fails if other modules
call ``open`` for writing, ``os.replace`` or ``mkdir`` themselves):

- A file that replaces another is written through the core's one commit (``src/io/commit.rs``,
  :func:`atomic_file`): a locked temporary file of an unpredictable name, renamed over its
  target under the target's commit lock, which replaces a planted symlink rather than
  following it. Python itself renames nothing into place.
- Files in a directory this process has just created privately are created exclusively
  (O_CREAT|O_EXCL|O_NOFOLLOW) by :func:`write_new`.
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
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from . import _boundary
from .errors import CheckpointError, CheckpointFormatError, SpecialFileError

FILE_MODE = 0o644  # before the umask, as for any file a program creates
_NAME_ATTEMPTS = 16
# What a name read from a document may be: one path component, no separators, not . or ..
_PLAIN_NAME = re.compile(r"[^/\x00]{1,255}")


def _with_filename(e: OSError, path: os.PathLike[str] | str) -> OSError:
    if e.filename is None:
        e.filename = os.fspath(path)
    return e


def create_exclusive(path: Path) -> int:
    """Creates ``path`` (it must not exist, not even as a dangling symlink) and returns a
    write-only file descriptor: for files of a directory this process created privately."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        raise _with_filename(e, path) from None


def write_all(fd: int, data: bytes | memoryview, path: Path) -> None:
    view = memoryview(data).cast("B")
    while view:
        try:
            written = os.write(fd, view)
        except OSError as e:
            raise _with_filename(e, path) from None
        view = view[written:]


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, durable: bool = False) -> Iterator[IO[bytes]]:
    """A file to write that replaces ``path`` when the block ends, all or nothing, through the
    core's one commit (a locked temporary file beside ``path``, renamed over it under its commit
    lock; temporary files of saves killed earlier are swept). On any failure the temporary
    file goes and ``path`` is as it was; OS errors name ``path``."""
    staging = _boundary.stage(os.fspath(path))
    try:
        try:
            with staged_writer(staging.fileno()) as f:
                yield f
        except OSError as e:
            raise _with_filename(e, path) from None
        staging.commit(durable=durable)
    finally:
        staging.discard()  # (nothing left to discard once committed)


def staged_writer(fd: int) -> IO[bytes]:
    """A binary file object over a staged file's descriptor (``Staging.fileno()``), which it
    leaves open: the core owns it."""
    return open(fd, "wb", closefd=False)


def write_atomically(path: str | os.PathLike[str], data: bytes, *, durable: bool = False) -> None:
    """Replaces ``path`` with ``data``, as :func:`atomic_file`."""
    with atomic_file(path, durable=durable) as f:
        f.write(data)


STREAM_PIECE = 64 << 20  # what one write() to a stream is given: a progress bar moves between them


def write_stream(stream: Any, data: Any, on_bytes: Any = None) -> None:
    """Writes every byte of ``data`` to a binary stream, or raises: a raw stream's ``write``
    may take fewer bytes than given (its count is checked), or none (None: it would block).
    ``on_bytes`` (a progress bar's update) is told each write's count."""
    view = memoryview(data).cast("B")
    while view:
        written = stream.write(view[:STREAM_PIECE])
        if written is None:
            raise BlockingIOError(errno.EAGAIN, "the stream took no bytes (it would block)")
        asked = min(view.nbytes, STREAM_PIECE)
        if type(written) is not int or not 0 < written <= asked:  # (True is an int: not a count)
            raise OSError(errno.EIO, f"the stream's write() returned {written!r} for {asked} bytes")
        view = view[written:]
        if on_bytes is not None:
            on_bytes(written)
    flush = getattr(stream, "flush", None)
    if flush is not None:
        flush()


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


def copy_new(source: str | os.PathLike[str], path: Path, *, durable: bool = False) -> tuple[int, str]:
    """Copies the regular file ``source`` (a FIFO, device or directory refused before a byte is
    read) into the new file ``path`` (created exclusively), read-only once written; returns the
    copy's (size, SHA-256), taken from the bytes written. On failure, what was written goes."""
    import hashlib

    digest = hashlib.sha256()
    size = 0
    with open_regular(source) as f:
        fd = create_exclusive(path)
        try:
            buffer = bytearray(8 << 20)
            view = memoryview(buffer)
            while n := f.readinto(buffer):
                digest.update(view[:n])
                write_all(fd, view[:n], path)
                size += n
            os.fchmod(fd, 0o444 & ~current_umask())  # (shared by hard links: nobody writes it in place)
            if durable:
                os.fsync(fd)
        except BaseException:
            _unlink_quietly(path)
            raise
        finally:
            os.close(fd)
    return size, digest.hexdigest()


def link_into_place(done: Path, path: Path) -> None:
    """Gives the finished file ``done`` the name ``path`` unless a file has it already (another
    thread's, of the same content: names of content), then removes the name ``done``: whoever
    comes second finds a whole file, never a half-written one."""
    try:
        os.link(done, path)
    except FileExistsError:
        pass
    finally:
        _unlink_quietly(done)


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


def sha256_of(path: Path, on_bytes: Any = None) -> tuple[int, str]:
    """(size, SHA-256) of a regular file, opened without following a symlink (hashlib releases
    the GIL on large chunks); ``on_bytes(n)`` after each chunk."""
    import hashlib

    digest = hashlib.sha256()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    size = 0
    with open_regular(path, follow_symlinks=False) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
            if on_bytes:
                on_bytes(n)
    return size, digest.hexdigest()


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


# Scratch directories (ortckpt's private temporary directories in TMPDIR): each holds the lock file
# that proves its process alive; one made but not yet locked has another name.
SCRATCH_PREFIX = "ortckpt-scratch-"
_SCRATCH_LOCK = ".ortckpt-alive"


@contextmanager
def scratch_directory() -> Iterator[Path]:
    """A private temporary directory, removed when the block ends. A process killed inside the
    block leaves it behind, so it holds a lock file of its process's: the next scratch directory
    removes every one whose lock it can take (its process gone), never a live one. Made under
    another name and renamed once locked, so a cleaner never sees one unlocked."""
    remove_dead_scratch_directories()
    made = Path(tempfile.mkdtemp(prefix="ortckpt-making-"))
    lock = None
    try:
        lock = _boundary.acquire_lock(made / _SCRATCH_LOCK, timeout=0)
        path = made.with_name(SCRATCH_PREFIX + made.name.removeprefix("ortckpt-making-"))
        _boundary.rename_directory(made, path)
        made = path
        yield path
    finally:
        remove_tree_quietly(made)  # (its lock file with it, while still held)
        if lock is not None:
            lock.release()


def remove_dead_scratch_directories() -> None:
    """Removes the scratch directories that killed processes left (their locks free)."""
    for entry in entries(Path(tempfile.gettempdir())):
        if not (entry.name.startswith(SCRATCH_PREFIX) and entry.is_dir(follow_symlinks=False)):
            continue
        try:
            lock = _boundary.acquire_lock(os.path.join(entry.path, _SCRATCH_LOCK), timeout=0)
        except (CheckpointError, OSError):
            continue  # held: a live process's (or not ours to judge)
        if lock is not None:  # (without locks nothing proves it dead)
            remove_tree_quietly(entry.path)
            lock.release()


@contextmanager
def pinned_files(directory: Path, names: Iterable[str]) -> Iterator[Path]:
    """A private temporary directory whose entries are the named files of ``directory`` as
    opened now: each opened without following a symlink and checked to be a regular file
    (a FIFO would hang the reader), then linked to by its descriptor (/proc/self/fd), so a
    library that reads files by path (an uploader) reads those files, whatever is renamed or
    planted in ``directory`` meanwhile."""
    files = []
    with scratch_directory() as scratch:
        view = scratch / "files"  # (beside the scratch directory's own lock file)
        make_private_directory(view)
        try:
            for name in names:
                opened = open_regular(member(directory, name), follow_symlinks=False)
                files.append(opened)
                os.symlink(f"/proc/self/fd/{opened.fileno()}", view / name)
            yield view
        finally:
            for opened in files:
                opened.close()


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


READ_ONLY_MODE = 0o444  # a committed step's files, before the umask: see publish_read_only


def publish_read_only(directory: Path) -> None:
    """Makes every regular file directly in ``directory`` (a step being committed) read-only to
    everyone: a file that later steps share by hard link must not be written in place by
    ordinary means (``cp`` onto it, a writable ``numpy.memmap``, ONNX Runtime's saver), since
    that would change every step sharing it. (Root ignores modes: restore notices instead.)"""
    mode = READ_ONLY_MODE & ~current_umask()
    for entry in entries(directory):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, mode)


def current_umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:  # no race with other threads
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def pwrite_all(fd: int, writes: Iterable[tuple[int, Any]], path: Path) -> None:
    """Writes each (offset, bytes) into the open file ``fd`` (a staged file of the core's),
    short writes continued; OS errors name ``path``."""
    try:
        for start, data in writes:
            view, offset = memoryview(data).cast("B"), start
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
    except OSError as e:
        raise _with_filename(e, path) from None


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
