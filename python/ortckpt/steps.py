"""A directory of step directories (``step_00000100/``): the one owner of its on-disk layout.

CheckpointManager and sharded saves share it, and every name, temporary, commit, deletion
and liveness rule of a step directory is spelled here (other modules ask this one):

- **What a step holds.** A manager's step: ``checkpoint`` (its ``.data`` beside it when large)
  and ``metadata.json`` (files, sizes, SHA-256s); once compressed (``compress_kept``),
  ``checkpoint.zst`` in their place. A sharded step: one ``shard-RRRRR-of-WWWWW``
  checkpoint per rank that held tensors and ``index.json`` (whose schema, in
  :mod:`ortckpt.documents`, checks those names); a manager's sharded step has both documents.
- **One writer at a time.** A writer holds an exclusive flock on ``.ortckpt-writer.lock`` in the
  directory for as long as it writes (a manager: from start to ``close()``; ``save_sharded``:
  for one save), and records who it is in the file (pid, host, start time, command). A second
  writer, in this process or any other, gets :class:`~ortckpt.CheckpointDirectoryInUseError`
  naming the holder. Readers take no lock. The kernel releases the lock when its holder dies.
- **Liveness is a held lock, never a pid.** Since only the lock's holder writes, every
  temporary or half-deleted step directory it finds is a leftover of a writer that is gone
  (every container's trainer is pid 1; pids are reused). The files inside follow the same rule
  one level down: a file being replaced is a locked temporary (``.<name>.ortckpt-tmp.<random>``,
  the Rust core's marker), removed by a cleaner only when it can take the lock.
- **A step is written privately, committed by rename.** ``.step_<n>.tmp-<random>/`` is
  created writable by this user only, filled (its documents last), then given its final
  permissions and renamed to ``step_<n>``; the rename fails rather than replace an existing
  step. So a directory under a step's name is always complete; what is not is hidden.
- **Deletion renames first** (``.step_<n>.deleting-<random>``), then removes, so no step
  directory is ever half deleted under its own name.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import re
import secrets
import socket
import stat
import sys
import time
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import documents, safe_io
from .documents import INDEX_NAME as INDEX_NAME  # checked by the index's schema
from .documents import shard_file_name as shard_file_name
from .errors import CheckpointDirectoryInUseError, CheckpointExistsError
from .safe_io import fsync_directory

STEP_DIR = re.compile(r"step_(\d+)")
_TEMPORARY = re.compile(r"\.step_\d+\.(tmp|deleting)-.*", re.DOTALL)
WRITER_LOCK_NAME = ".ortckpt-writer.lock"
CHECKPOINT_NAME = "checkpoint"  # a manager's checkpoint file
METADATA_NAME = "metadata.json"  # a manager's record of the step: files, sizes, SHA-256s, metrics
COMPRESSED_NAME = "checkpoint.zst"  # a kept step's checkpoint files, compressed (compress_kept=True)


def step_directory_name(step: int) -> str:
    return f"step_{step:08d}"


def step_directory(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / step_directory_name(step)


def step_directories(directory: Path) -> dict[int, Path]:
    """Every committed step directory of ``directory`` (a directory, not a symlink, under a
    step's name), by step. A missing ``directory`` has none."""
    found = {}
    for entry in safe_io.entries(directory):
        step = step_of(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            found[step] = Path(entry.path)
    return found


def steps_holding(listed: Iterable[tuple[str, int]], name: str) -> dict[int, int]:
    """step -> size of ``step_<n>/<name>``, from an object store prefix's listing ((key under
    the prefix, size) pairs): the steps that ``name`` (metadata.json, index.json) commits."""
    found = {}
    for key, size in listed:
        folder, _, rest = key.partition("/")
        step = step_of(folder)
        if step is not None and rest == name:
            found[step] = size
    return found


def step_of(name: str) -> int | None:
    """The step a committed step directory's name gives, or None for any other name."""
    match = STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


class WriterLock:
    """The right to write ``directory``: taken at once or refused with
    :class:`~ortckpt.CheckpointDirectoryInUseError`. Released by :meth:`release`, when the
    object is collected, at exit, or by the kernel when the process dies.

    On a filesystem without locks (some NFS and Lustre mounts) it warns and goes on unlocked:
    then nothing proves another writer absent, and leftovers are never removed.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / WRITER_LOCK_NAME
        self.locked = False
        while True:
            flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            try:
                fd = os.open(self.path, os.O_RDWR | flags, safe_io.FILE_MODE)
            except PermissionError:  # left by another user's writer that died: a lock needs no write access
                fd = os.open(self.path, os.O_RDONLY | flags)
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):  # something planted under the lock's name
                os.close(fd)
                raise safe_io.special_file(self.path, mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_of(fd)
                os.close(fd)
                raise CheckpointDirectoryInUseError(directory, holder) from None
            except OSError as e:
                if e.errno not in safe_io.LOCKS_UNSUPPORTED:
                    os.close(fd)
                    raise
                warnings.warn(
                    f"{directory}: this filesystem has no file locks ({e.strerror}): a second writer "
                    "cannot be detected, and leftovers of crashed saves are kept",
                    RuntimeWarning,
                    stacklevel=3,
                )
                break
            if safe_io.still_named(fd, self.path):
                self.locked = True
                break
            os.close(fd)  # the previous holder removed this file after we opened it: take the new one
        self._fd = fd
        if self.locked and os.access(self.path, os.W_OK, follow_symlinks=False):
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "command": " ".join(sys.argv)[:200],
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        self._release = weakref.finalize(self, _release, fd, self.path, self.locked)

    def release(self) -> None:
        """Gives the directory up (idempotent)."""
        self._release()


def _release(fd: int, path: Path, locked: bool) -> None:
    # Removed while still locked (a waiter that then locks the removed file sees it is no longer
    # named and opens the path again); unlocked explicitly, since a child process forked
    # meanwhile shares the lock.
    try:
        if locked and safe_io.still_named(fd, path):
            os.unlink(path)
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


def _holder_of(fd: int) -> dict[str, Any]:
    """Who holds the lock, as it wrote (it may not have written yet: a few tries)."""
    for _ in range(5):
        try:
            data = os.pread(fd, documents.WRITER_HOLDER.max_bytes + 1, 0)
            if data:
                return documents.parse(documents.WRITER_HOLDER, data, "lock record")
        except (OSError, documents.DocumentError):
            pass
        time.sleep(0.01)
    return {}


def remove_leftovers(directory: Path, lock: WriterLock) -> None:
    """Removes what crashed saves and deletions left (temporary and half-deleted directories).
    Only the lock's holder may: holding it proves their writers gone."""
    if not lock.locked:
        return
    for entry in safe_io.entries(directory):
        if _TEMPORARY.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            safe_io.remove_tree(Path(entry.path))


def new_temp_directory(directory: Path, step: int) -> Path:
    """A fresh private directory for the files of ``step``, committed later by :func:`commit`."""
    temp = directory / f".{step_directory_name(step)}.tmp-{secrets.token_hex(16)}"
    safe_io.make_private_directory(temp)
    return temp


def commit(temp: Path, directory: Path, step: int, *, durable: bool) -> Path:
    """Publishes a filled temporary directory as ``step``'s; CheckpointExistsError if that step
    directory exists (committed earlier, or something else under its name)."""
    if durable:
        fsync_directory(temp)
    safe_io.publish_directory(temp)
    final = directory / step_directory_name(step)
    try:
        os.rename(temp, final)  # fails, rather than replaces, when final is a non-empty directory
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise CheckpointExistsError(
                f"{final}: a directory of step {step} exists already "
                "(not a checkpoint this manager lists: look at it, or delete it)"
            ) from None
        raise
    if durable:
        fsync_directory(directory)
    return final


def delete(step_directory: Path) -> None:
    """Deletes a committed step directory: renamed out of sight first (atomic), then removed.
    FileNotFoundError when it is gone already."""
    doomed = step_directory.with_name(f".{step_directory.name}.deleting-{secrets.token_hex(16)}")
    os.rename(step_directory, doomed)
    safe_io.remove_tree(doomed)
