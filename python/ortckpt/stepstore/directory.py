"""Steps in a local directory: the step transaction by renames (the layout: :mod:`ortckpt.steps`).

- **One writer at a time.** A writer holds the lock file ``.ortckpt-writer.lock`` of the
  directory (the core's locks: mode 0600, so nobody else can hold it) from when it opens the
  store until it closes it, and records who it is there (pid, host, start time, command). A
  second writer, in this process or any other, gets
  :class:`~ortckpt.CheckpointDirectoryInUseError` naming the holder. Readers take no lock. The
  kernel releases the lock when its holder dies.
- **Liveness is a held lock, never a pid.** Since only the lock's holder writes, every
  temporary or half-deleted step directory it finds is a leftover of a writer that is gone
  (every container's trainer is pid 1; pids are reused). The files inside follow the same rule
  one level down (the core's locked temporary files).
- **A step is written privately, committed by rename.** ``.step_<n>.tmp-<random>/`` is created
  writable by this user only, filled (its commit document last), then given its final
  permissions (its files read-only: steps share data files by hard link) and renamed to
  ``step_<n>`` by the core, which never replaces an existing one. So a directory under a
  step's name is always complete; what is not is hidden.
- **A step is loaded as it was committed** (:func:`check_recorded`): files that are not the
  ones its metadata.json records, or that changed since, are refused.
- **Deletion renames first** (``.step_<n>.deleting-<random>``), then removes, so no step
  directory is ever half deleted under its own name.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import stat
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import _boundary, documents, safe_io, steps, targets
from .._boundary import CoreState
from ..checkpoint_state import CheckpointState, open_checkpoint
from ..errors import (
    CheckpointDirectoryInUseError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIntegrityError,
    CheckpointLockedError,
)
from . import entries
from .base import (
    Attempt,
    Folder,
    LocalStep,
    Recorded,
    Scan,
    SourceDigests,
    Step,
    StepStore,
    check_graph_size,
    shared_file_entry,
)

# The documents a step may be committed by, with their caps and schemas.
KINDS = {steps.METADATA_NAME: documents.METADATA, steps.INDEX_NAME: documents.SHARDED_INDEX}


class DirectoryStore(StepStore):
    """A run of steps in ``directory`` (see the module's description)."""

    holds_interrupts = True
    shared_with_writers = False  # (the writer lock keeps every other writer away)

    def __init__(self, directory: Path, *, writer: bool, create: bool = False) -> None:
        self.directory = directory
        self.name = str(directory)
        self.writer: WriterLock | None = None
        # The data file whose SHA-256 this store last computed (written or shared), by what tells
        # its bytes unchanged since (see _shares_proven_file): {(dev, inode, size, mtime): digest}.
        self._hashed: dict[tuple[int, int, int, int], str] = {}
        # The run's graphs: their sources' digests, and the stored graphs proven to hold their
        # digest's bytes ({digest: identity}: written by this store, or hashed once).
        self._sources = SourceDigests()
        self._stored: dict[str, tuple[int, int, int, int]] = {}
        if writer:
            if create:
                safe_io.make_directories(directory)
            self.writer = WriterLock(directory)

    @classmethod
    def check_options(cls, where: Any, storage_options: Mapping[str, Any] | None) -> None:
        if storage_options is not None:
            raise ValueError(f"{where}: storage_options are for an object store URL ({targets.SCHEME}bucket/prefix)")

    @classmethod
    def refuse_needing_files(cls, where: Any, needing: list[str]) -> None:
        pass  # (a directory's steps are files of this machine)

    # --- naming ----------------------------------------------------------------------------

    @property
    def run_folder(self) -> Path:
        return self.directory

    def step_folder(self, number: int) -> Path:
        return steps.step_directory(self.directory, number)

    def user_path(self, folder: Folder, name: str | None = None) -> Path:
        return _path(folder) if name is None else safe_io.member(_path(folder), name)

    def local_path(self, folder: Folder, name: str | None = None) -> Path:
        return self.user_path(folder, name)

    def attempt_fields(self, attempt: Attempt) -> dict[str, str]:
        return {}  # (a step's files are in its own directory)

    # --- reading -------------------------------------------------------------------------

    def _look(self, document: str) -> tuple[Scan, int]:
        found: dict[int, Step] = {}
        damaged: dict[int, str] = {}
        vanished = -1
        for number, path in step_directories(self.directory).items():
            try:
                found[number] = self._read(number, path, document)
            except FileNotFoundError:
                if not os.path.lexists(path):  # deleted since it was listed
                    vanished = max(vanished, number)
            except (CheckpointError, OSError, ValueError) as e:
                damaged[number] = str(e)
        return Scan(found, damaged), vanished

    def _read(self, number: int, path: Path, document: str) -> Step:
        where = path / document
        data = safe_io.read_regular(where, limit=KINDS[document].max_bytes, follow_symlinks=False)
        parsed = documents.parse(KINDS[document], data, os.fspath(where))
        if parsed["step"] != number:
            raise documents.DocumentError(f"{where}: step {parsed['step']}, but the directory is of step {number}")
        return Step(number, parsed, path)

    def read(self, step: int, document: str) -> Step | None:
        path = steps.step_directory(self.directory, step)
        try:
            return self._read(step, path, document)
        except FileNotFoundError:
            return None

    def listed_steps(self) -> list[int]:
        """Every step folder: a save renames a step into place committed."""
        named = (steps.step_of(entry.name) for entry in safe_io.entries(self.directory) if entry.is_dir())
        return sorted(number for number in named if number is not None)

    def locate(self) -> Step | None:
        """The step whose directory is this store's, if a commit document is there. One that is
        there but not a regular file (a symlink, dangling or not, a directory, a FIFO) is
        refused (:class:`documents.DocumentError`), unread, as damage is."""
        path = self.directory
        for document in steps.COMMIT_DOCUMENTS:
            where = path / document
            try:
                mode = os.lstat(where).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):
                what = (
                    "a symlink"
                    if stat.S_ISLNK(mode)
                    else "a directory"
                    if stat.S_ISDIR(mode)
                    else "a FIFO"
                    if stat.S_ISFIFO(mode)
                    else "a special file"
                )
                raise documents.DocumentError(f"{where}: {what}, not a regular file: refused as the step's {document}")
            data = safe_io.read_regular(where, limit=KINDS[document].max_bytes, follow_symlinks=False)
            parsed = documents.parse(KINDS[document], data, os.fspath(where))
            return Step(parsed["step"], parsed, path)
        return None

    def file(self, folder: Folder, name: str) -> targets.LocalFile:
        return targets.LocalFile(safe_io.member(_path(folder), name))

    def load(
        self, folder: Folder, name: str, *, recorded: Recorded | None = None, resuming: Step | None = None
    ) -> CheckpointState:
        """The checkpoint, mapped; with ``recorded``, checked first (:func:`check_recorded`).
        (``resuming`` changes nothing: a directory's steps share by comparing bytes.)"""
        if recorded is not None:
            check_recorded(_path(folder), name, recorded)
        # (documents name plain files inside the step: never followed through a symlink)
        return open_checkpoint(safe_io.member(_path(folder), name), follow_symlinks=False)

    def load_shard(
        self, folder: Folder, name: str, recorded: Mapping[str, dict[str, Any]], *, resuming: Step | None = None
    ) -> CheckpointState:
        return self.load(folder, name)  # (mapped: its pieces are checked as they are read)

    @contextlib.contextmanager
    def local_step(self, step: Step) -> Iterator[LocalStep]:
        yield LocalStep(_path(step.folder), {}, _path(step.folder))

    def read_document(self, folder: Folder, name: str) -> bytes:
        kind = KINDS.get(name, documents.SHARDED_INDEX)
        return safe_io.read_regular(safe_io.member(_path(folder), name), limit=kind.max_bytes, follow_symlinks=False)

    # --- writing -------------------------------------------------------------------------

    def begin(self, step: int) -> Attempt:
        final = steps.step_directory(self.directory, step)
        if os.path.lexists(final):
            raise CheckpointExistsError(
                f"{final}: a directory of step {step} exists already "
                "(not a checkpoint this manager lists: look at it, or delete it)"
            )
        temp = self.directory / steps.temporary_name(step, "tmp")
        safe_io.make_private_directory(temp)
        return Attempt(step, temp, str(temp))

    def join(self, where: str, step: int) -> Attempt:
        return Attempt(step, Path(where), where)

    def write_checkpoint(
        self,
        attempt: Attempt,
        name: str,
        state: CoreState,
        *,
        external_data_threshold: int,
        durable: bool,
        progress: bool = False,
        share_with: Step | None = None,
        shareable: bool = False,
        watch_writes: bool = False,
    ) -> dict[str, dict[str, Any]]:
        path = safe_io.member(_path(attempt.folder), name)
        shared, unchanged, values = False, 0, 0
        watched = _boundary.watch_writes(path, state) if watch_writes else None
        if share_with is not None:
            shared, unchanged, values = self._save_sharing(
                attempt, path, state, share_with, durable=durable, watched=watched
            )
        if not shared:
            if unchanged and 2 * unchanged >= values:
                # Mostly unchanged, yet nothing (or too little) to share from: saved whole with its
                # values in checkpoint.data, which the next step can share.
                external_data_threshold = 0
            targets.LocalFile(path).save(
                state, external_data_threshold=external_data_threshold, durable=durable, progress=progress
            )
        if watched is not None:
            _boundary.record_watched(watched, path, state)
        return self.record_checkpoint(attempt, name)

    def staged_checkpoint(self, attempt: Attempt, name: str) -> Path:
        return safe_io.member(_path(attempt.folder), name)

    def record_checkpoint(self, attempt: Attempt, name: str) -> dict[str, dict[str, Any]]:
        path = safe_io.member(_path(attempt.folder), name)
        written = {p.name: {"bytes": p.stat().st_size} for p in (path, Path(f"{path}.data")) if p.exists()}
        attempt.written.update(written)
        return written

    def _save_sharing(
        self,
        attempt: Attempt,
        path: Path,
        state: CoreState,
        previous: Step,
        *,
        durable: bool,
        watched: _boundary.Watched | None,
    ) -> tuple[bool, int, int]:
        """Saves the checkpoint sharing the previous step's data file for the values that are
        byte-identical there (see :func:`ortckpt._boundary.save_sharing`, which says whether it
        did and how much is unchanged). Compared only with a step of this directory's, under its
        own name and no symlink, whose files its metadata records (not compressed, not sharded);
        the link lands in the attempt's private directory, published with the step by its one
        rename."""
        folder = _path(previous.folder)
        data_name = f"{path.name}.data"
        files = previous.document.get("files", {})
        if (
            folder.parent != self.directory
            or folder.name != steps.step_directory_name(previous.number)
            or not _is_directory(folder)
            or path.name not in files
        ):
            return False, 0, 0
        # Only a data file its metadata records is shared (its entry is copied from there).
        compare_only = data_name not in files
        shared, unchanged, values, _ = _boundary.save_sharing(
            path, folder / path.name, state, compare_only=compare_only, durable=durable, watched=watched
        )
        if shared:
            entry = shared_file_entry(previous, data_name)
            if not self._shares_proven_file(Path(f"{path}.data"), entry):
                # Not the file the entry describes, or one another user may change: unshared (the
                # link and the checkpoint pointing into it removed), for a whole save instead.
                for name in (path, Path(f"{path}.data")):
                    name.unlink()
                return False, unchanged, values
            attempt.shared[data_name] = entry
        return shared, unchanged, values

    def _shares_proven_file(self, link: Path, entry: dict[str, Any]) -> bool:
        """Whether the data file just linked (``link``, in the attempt's private directory: the
        very inode shared) may take ``entry``, the previous step's record of it, as its own: a
        file of this user's with a step file's permissions (no other user can change what every
        later step shares, and each step reads as a whole one would) that is what ``entry``
        records. For a checksummed entry that is its size and pair id, read from its last bytes
        (the values this step reads were compared byte for byte, and its checkpoint's checksums
        cover them). A SHA-256 entry (``digest="sha256"``, or an older step) is proven by the
        digest this store computed when it wrote (or last shared) that inode, the file unchanged
        since (same size and mtime), else hashed once now: a copied digest is never a wrong one."""
        before = os.lstat(link)
        umask = safe_io.current_umask()
        # (read-only: a committed step's; 0644: a step committed before steps were made read-only)
        modes = (safe_io.READ_ONLY_MODE & ~umask, safe_io.FILE_MODE & ~umask)
        if before.st_uid != os.geteuid() or stat.S_IMODE(before.st_mode) not in modes:
            return False
        if "sha256" not in entry:
            problem, _ = entries.check(link, entry)
            return problem is None
        identity = _identity(before)
        digest = self._hashed.get(identity)
        if digest is None:
            size, digest = safe_io.sha256_of(link)
            if size != before.st_size or _identity(os.lstat(link)) != identity:
                return False  # written to while hashed
            self._hashed = {identity: digest}
        return entry.get("bytes") == before.st_size and entry.get("sha256") == digest

    # --- the run's graphs ----------------------------------------------------------------

    def store_graph(self, attempt: Attempt, role: str, source: Path, *, durable: bool) -> dict[str, Any]:
        """The step's ``<role>_model.onnx`` is a hard link to the run's stored graph of that content
        (``artifacts/<sha256>.onnx``): no space taken twice, and the step folder whole on its own
        (copied alone, it holds its graphs). Where no link can be made (a planted entry that is
        not a stored graph of this user's, a file system without hard links), the step keeps a
        copy of its own."""
        name = steps.artifact_name(role)
        target = safe_io.member(_path(attempt.folder), name)
        folder = self._graphs_folder()
        known = self._sources.get(source)
        if known is not None and self._link_stored(folder, known[1], target):
            size, digest = known
        else:
            identity = SourceDigests.identity(source)
            check_graph_size(source, identity[2])
            size, digest = safe_io.copy_new(source, target, durable=durable)
            check_graph_size(source, size)  # (grown while copied: the attempt is abandoned)
            self._sources.put(source, identity, size, digest)
            self._share(folder, target, digest, durable=durable)
        entry = {"name": name, "bytes": size, "sha256": digest}
        attempt.graphs[role] = entry
        return entry

    def _graphs_folder(self) -> Path:
        """The run's artifacts folder (made if missing): a directory of its own, never a symlink."""
        folder = self.directory / steps.ARTIFACTS_FOLDER
        try:
            safe_io.make_private_directory(folder)
            safe_io.publish_directory(folder)
        except FileExistsError:
            pass
        if not _is_directory(folder):
            raise NotADirectoryError(
                20, "not a directory of this run's graphs (a symlink or a file is in its place)", str(folder)
            )
        return folder

    def _proven(self, stored: Path, digest: str) -> bool:
        """Whether ``stored`` is a regular file of this user's holding the bytes of ``digest``:
        known to this store (written or hashed by it, unchanged since), else hashed now."""
        try:
            found = os.lstat(stored)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            return False
        identity = _identity(found)
        if self._stored.get(digest) == identity:
            return True
        _, actual = safe_io.sha256_of(stored)
        if actual != digest or _identity(os.lstat(stored)) != identity:
            return False
        self._stored[digest] = identity
        return True

    def _link_stored(self, folder: Path, digest: str, target: Path) -> bool:
        """Links the stored graph of ``digest`` into the attempt as ``target``: whether it did."""
        stored = folder / steps.stored_graph_name(digest)
        if not self._proven(stored, digest):
            return False
        try:
            os.link(stored, target)
        except OSError:
            return False
        if os.lstat(target).st_ino != os.lstat(stored).st_ino:  # (replaced in between)
            os.unlink(target)
            return False
        return True

    def _share(self, folder: Path, copy: Path, digest: str, *, durable: bool) -> None:
        """The graph just copied into the attempt, shared with the run: replaced by a link to the
        stored one of the same content, or made the stored one. What stands in a stored graph's
        place and is not one (a symlink, another's file, bytes of another digest) is removed
        first; what cannot be (a directory) leaves the step its copy."""
        stored = folder / steps.stored_graph_name(digest)
        if self._proven(stored, digest):
            os.unlink(copy)
            try:
                os.link(stored, copy)
                return
            except OSError:
                safe_io.copy_new(stored, copy, durable=durable)  # (the step keeps a copy of its own)
                return
        try:
            if os.path.lexists(stored) and not os.path.isdir(stored):
                os.unlink(stored)  # (a symlink itself, never what it points to)
            os.link(copy, stored)
        except OSError:
            return  # no link: the step keeps its own copy
        self._stored[digest] = _identity(os.lstat(stored))
        if durable:
            safe_io.fsync_directory(folder)

    def graph_file(self, step: Step, role: str, cache: Callable[[], Path]) -> Path:
        entry = step.document["artifacts"][role]
        path = safe_io.member(_path(step.folder), entry["name"])
        entries.check_graph(path, entry, os.fspath(path))
        return path

    def remove_unused_graphs(self) -> list[str]:
        """Removes the stored graphs no step links to any more (one link left: the stored
        name), and whatever else stands under a stored graph's name that is not a regular file.
        Only the writer (its lock proves no save of another is linking one meanwhile)."""
        if self.writer is None or not self.writer.locked:
            return []
        folder = self.directory / steps.ARTIFACTS_FOLDER
        if not _is_directory(folder):
            return []
        removed = []
        for entry in safe_io.entries(folder):
            if not steps.STORED_GRAPH.fullmatch(entry.name) or entry.is_dir(follow_symlinks=False):
                continue
            found = os.lstat(entry.path)
            if stat.S_ISREG(found.st_mode) and found.st_nlink > 1:
                continue
            os.unlink(entry.path)
            self._stored.pop(entry.name.removesuffix(".onnx"), None)
            removed.append(entry.path)
        return removed

    def write_document(self, attempt: Attempt, name: str, data: bytes, *, durable: bool) -> dict[str, Any]:
        safe_io.write_new(safe_io.member(_path(attempt.folder), name), data, durable=durable)
        entry = entries.of_document(data)
        attempt.written[name] = entry
        return entry

    def describe(self, attempt: Attempt, on_bytes: Any = None, *, sha256: bool = False) -> dict[str, dict[str, Any]]:
        """The entry of every file written into the attempt (:mod:`.entries`): checkpoint files
        by the checksums the core took as it wrote them (nothing is read back), documents by the
        SHA-256 taken as they were written; with ``sha256``, every file's SHA-256 too (read back)."""
        described = {}
        for name in sorted(attempt.written):
            if name in attempt.shared:  # hard-linked from the previous step: its entry, copied
                described[name] = attempt.shared[name]
                if sha256 and "sha256" not in described[name]:  # (first written without the digest)
                    described[name] = {
                        **described[name],
                        "sha256": self._sha256_of_shared(_path(attempt.folder) / name),
                    }
            elif "sha256" in attempt.written[name]:  # a document
                described[name] = attempt.written[name]
            else:
                path = _path(attempt.folder) / name
                described[name] = entries.of_written(path, sha256=sha256, on_bytes=on_bytes)
                if name.endswith(entries.DATA_SUFFIX) and "sha256" in described[name]:
                    # what the next step may share without hashing it again: see _shares_proven_file
                    self._hashed = {_identity(os.lstat(path)): described[name]["sha256"]}
        return described

    def _sha256_of_shared(self, path: Path) -> str:
        """The SHA-256 of a shared data file whose entry has none: hashed once (the next step
        copies this one's entry), remembered as describe remembers a written file's."""
        identity = _identity(os.lstat(path))
        digest = self._hashed.get(identity)
        if digest is None:
            _, digest = safe_io.sha256_of(path)
            self._hashed = {identity: digest}
        return digest

    def commit(self, attempt: Attempt, document: str, data: bytes, *, durable: bool) -> Step:
        temp = _path(attempt.folder)
        safe_io.write_new(temp / document, data, durable=durable)
        safe_io.publish_read_only(temp)
        safe_io.publish_directory(temp)
        final = steps.step_directory(self.directory, attempt.step)
        try:
            _boundary.rename_directory(temp, final, durable=durable)  # never over an existing step
        except FileExistsError:
            raise CheckpointExistsError(
                f"{final}: a directory of step {attempt.step} exists already "
                "(not a checkpoint this manager lists: look at it, or delete it)"
            ) from None
        return Step(attempt.step, documents.parse(KINDS[document], data, os.fspath(final / document)), final)

    def abandon(self, attempt: Attempt) -> None:
        safe_io.remove_tree_quietly(_path(attempt.folder))

    def retire(self, step: Step) -> None:
        folder = _path(step.folder)
        doomed = folder.with_name(steps.temporary_name(step.number, "deleting"))
        _boundary.rename_directory(folder, doomed)  # out of sight at once: no half-deleted step
        safe_io.remove_tree(doomed)

    def remove_proven_leftovers(self) -> list[str]:
        return self.remove_leftovers()

    def remove_leftovers(self) -> list[str]:
        """Removes temporary and half-deleted step directories: only a writer that holds the
        lock may (holding it proves their writers gone); without locks nothing is removed."""
        if self.writer is None or not self.writer.locked:
            return []
        removed = []
        for entry in safe_io.entries(self.directory):
            if steps.TEMPORARY.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                safe_io.remove_tree(Path(entry.path))
                removed.append(entry.path)
        return removed + self.remove_unused_graphs()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.release()


def _path(folder: Folder) -> Path:
    """A folder of this store: a directory's steps and attempts are Paths."""
    assert isinstance(folder, Path), folder
    return folder


def check_recorded(folder: Path, name: str, recorded: Mapping[str, dict[str, Any]]) -> None:
    """Refuses (:class:`~ortckpt.CheckpointIntegrityError`, naming the file) a step's checkpoint
    ``name`` or its data file that is not the file its step records (``recorded``: the entries of
    its metadata.json, or a shard's sizes in index.json), without reading either in full:

    - another size, checksum root or pair id (:func:`entries.check_cheaply`: a file replaced by
      another save's, or by anything else);
    - changed since the step was committed: its mtime later than the commit document's, the last
      file a save writes. Step files are read-only (0444 less the umask), but root ignores that, and a
      file that steps share by hard link, edited in place, changes every one of them. Such a
      file is then checked in full, against the checksums the checkpoint carries (else its
      SHA-256): refused only if its bytes differ (a copied run, its times not kept, reads right).
    """
    problems = []
    changed = []
    committed = _committed_at(folder)
    for file in (name, f"{name}{entries.DATA_SUFFIX}"):
        entry = recorded.get(file)
        if entry is None:
            continue
        path = safe_io.member(folder, file)
        problem = entries.check_cheaply(path, dict(entry))  # (FileNotFoundError: missing, raised)
        if problem is not None:
            problems.append(f"{path}: {problem}")
        elif os.lstat(path).st_mtime_ns > committed:
            changed.append(file)
    if changed and not problems:
        problems = _check_in_full(folder, name, recorded, changed)
    if problems:
        raise CheckpointIntegrityError(
            safe_io.member(folder, name),
            [f"{p} (not the file its step records: refused)" for p in problems],
        )


def _committed_at(folder: Path) -> int:
    """The mtime of the document that commits a step (metadata.json, else a sharded step's
    index.json): the last file its save wrote."""
    for document in steps.COMMIT_DOCUMENTS:
        with contextlib.suppress(FileNotFoundError):
            return os.lstat(folder / document).st_mtime_ns
    raise FileNotFoundError(2, "no such file (the step was deleted)", str(folder / steps.METADATA_NAME))


def _check_in_full(folder: Path, name: str, recorded: Mapping[str, dict[str, Any]], changed: list[str]) -> list[str]:
    """The problems of files written to since their step's commit, read in full."""
    try:
        if _boundary.verify_checksums(safe_io.member(folder, name), follow_symlinks=False) is not None:
            return []  # every value this checkpoint reads, in both files, as it was saved
    except CheckpointIntegrityError as e:
        return [f"changed since its step was saved: {p}" for p in e.problems]
    problems = []
    for file in changed:  # no checksums (an older step's): its SHA-256, if recorded
        entry = dict(recorded[file])
        if "sha256" in entry:
            problem, _ = entries.check(safe_io.member(folder, file), entry)
            if problem is not None:
                problems.append(f"{safe_io.member(folder, file)}: changed since its step was saved: {problem}")
    return problems


def step_directories(directory: Path) -> dict[int, Path]:
    """Every step directory of ``directory`` (a directory, not a symlink, under a step's
    name), by step. A missing ``directory`` has none."""
    found = {}
    for entry in safe_io.entries(directory):
        step = steps.step_of(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            found[step] = Path(entry.path)
    return found


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file's bytes unchanged since it was last looked at (short of reading them):
    a write changes its mtime, a replacement its inode. (A byte rotting on disk, or an mtime set
    back on purpose, is left to verify: no check short of hashing sees those.)"""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _is_directory(path: Path) -> bool:
    """Whether ``path`` is a directory itself (not a symlink to one), and still there."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def acquire_lock(path: Path, record: str) -> _boundary.Lock | None:
    """The core's lock (one try): here so that a test can stand in a filesystem without locks."""
    return _boundary.acquire_lock(os.fspath(path), timeout=0, record=record)


class WriterLock:
    """The right to write ``directory``: taken at once or refused with
    :class:`~ortckpt.CheckpointDirectoryInUseError`. Released by :meth:`release`, when the
    object is collected, or by the kernel when the process dies.

    On a filesystem without locks (some NFS and Lustre mounts) it warns and goes on unlocked:
    then nothing proves another writer absent, and leftovers are never removed.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / steps.WRITER_LOCK_NAME
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:200],
        }
        try:
            lock = acquire_lock(self.path, json.dumps(record))
        except CheckpointLockedError as e:
            raise CheckpointDirectoryInUseError(directory, _holder(str(e.holder or ""))) from None
        if lock is None:
            warnings.warn(
                f"{directory}: this filesystem has no file locks: a second writer cannot be detected, "
                "and leftovers of crashed saves are kept",
                RuntimeWarning,
                stacklevel=4,
            )
        self.locked = lock is not None
        self._release = weakref.finalize(self, lock.release) if lock is not None else None

    def release(self) -> None:
        """Gives the directory up (idempotent)."""
        if self._release is not None:
            self._release()


def _holder(record: str) -> dict[str, Any]:
    """Who holds the lock, as it recorded itself (a JSON object; other text as it is)."""
    try:
        return documents.parse(documents.WRITER_HOLDER, record, "lock record")  # type: ignore[no-any-return]
    except documents.DocumentError:
        return {"holder": record} if record else {}


__all__ = ["DirectoryStore", "WriterLock", "check_recorded", "step_directories"]
