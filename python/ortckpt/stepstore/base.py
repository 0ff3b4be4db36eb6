"""The step transaction's types (see :mod:`ortckpt.stepstore` for the transaction)."""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

from .. import documents, targets
from ..errors import ScanTimeoutError

if TYPE_CHECKING:
    from .._boundary import CoreState
    from ..checkpoint_state import CheckpointState
    from ..object_store import Location

# Where a step's (or an attempt's) files are: a Path in a directory, a Location on object
# storage. Only the store that made it reads it: everyone else hands it back to that store.
Folder: TypeAlias = "Path | Location"
# What a step's metadata.json records of its files, by name (see .entries).
Recorded: TypeAlias = Mapping[str, dict[str, Any]]

# A reader's scan that finds steps deleted under it looks again, at most this many times and for
# at most this many seconds: retention deletes a step only after a newer one is committed, so a
# fresh look finds the newer one. One whose every look found its newest step gone, and nothing
# older committed, raises ScanTimeoutError: never "no checkpoint" while one may exist.
SCAN_ATTEMPTS = 20
SCAN_SECONDS = 10.0
# A scan that finds nothing at all looks again this many times: neither a directory's listing nor an
# object store's is a snapshot, so one that began before the newest step appeared and reached the
# step retention deleted after it was gone saw neither (and cannot tell: nothing of it is left).
EMPTY_RESCANS = 3


def missed(found: dict[int, Any], vanished: int, attempt: int) -> bool:
    """Whether a scan may have missed a committed step: one it listed was deleted (or is being
    retired) with nothing newer found, or it found nothing at all (a few looks)."""
    if vanished >= 0 and vanished >= max(found, default=-1):
        return True
    return not found and attempt < EMPTY_RESCANS


@dataclass(frozen=True)
class Step:
    """A committed step: its number, its commit document (validated), where its files are."""

    number: int
    document: dict[str, Any]
    folder: Folder  # each backend reads its own


@dataclass
class Attempt:
    """One save of a step, staged and not yet committed: where its files go (``folder``), how
    other ranks find it (``where``: a path or URL), and what was written into it."""

    step: int
    folder: Folder
    where: str
    written: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Files shared with the previous step (hard links), by name: their metadata entries, copied
    # from that step's (see shared_file_entry), never recomputed.
    shared: dict[str, dict[str, Any]] = field(default_factory=dict)
    sent: bool = False  # its commit was sent: from then on it may have landed, whatever was heard
    # The run's graphs recorded for the step (store_graph), by role: their metadata entries.
    graphs: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalStep:
    """A step's files on this machine, for checking them (:meth:`StepStore.local_step`)."""

    folder: Path  # the step's files, under their plain names
    # The files already hashed on their way here (downloaded): (size, SHA-256), or the error.
    hashed: Mapping[str, tuple[int, str] | BaseException]
    name: Path | str  # the step as messages name it
    # The files kept elsewhere than the step's folder (a data object the steps share), as
    # messages name them: by file name.
    places: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Scan:
    """What a scan found: committed steps, and the steps whose document is damaged (a
    reason each), kept for a person to look at."""

    steps: dict[int, Step]
    damaged: dict[int, str]


class SourceDigests:
    """The SHA-256 of each graph file a run records, by its path, while the file is unchanged
    (the same inode, size, mtime and ctime: what a write or a replacement changes), so that a
    save does not read an unchanged graph again."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[int, ...], int, str]] = {}

    @staticmethod
    def identity(path: Path) -> tuple[int, ...]:
        found = os.stat(path)
        return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)

    def get(self, path: Path) -> tuple[int, str] | None:
        """(size, SHA-256) of ``path`` as last recorded, if it is unchanged since."""
        known = self._known.get(os.fspath(path))
        if known is None or known[0] != self.identity(path):
            return None
        return known[1], known[2]

    def put(self, path: Path, identity: tuple[int, ...], size: int, digest: str) -> None:
        """Records (size, digest) of ``path``, read while it had ``identity``, if it still has."""
        if self.identity(path) == identity:
            self._known[os.fspath(path)] = (identity, size, digest)


def check_graph_size(source: Path, size: int) -> None:
    """A graph recorded with a step is an ONNX model: one protobuf, under 2 GiB (what
    metadata.json's schema takes), checked before it is stored (its file may have grown since
    the manager was made)."""
    if size > documents.MAX_ARTIFACT_BYTES:
        raise ValueError(
            f"{source}: {size} bytes, more than an ONNX model can hold ({documents.MAX_ARTIFACT_BYTES}): not recorded"
        )


def shared_file_entry(previous: Step, name: str) -> dict[str, Any]:
    """The metadata entry of a file shared with the previous step (the same inode, hard-linked):
    that step's recorded entry, copied, not computed again. A store copies it only for a file
    proven to be what the entry says (a directory: see DirectoryStore._shares_proven_file), so
    no step inherits a digest that is wrong from birth. Were the file damaged after, both
    steps' entries disagree with it alike, and verify says so."""
    return dict(previous.document["files"][name])


class StepStore(abc.ABC):
    """A run of steps: see :mod:`ortckpt.stepstore` for the transaction."""

    name: str  # the directory's path or the prefix's URL, for messages
    # Whether a save's bytes are written by the core, so that a Ctrl-C can be held until the
    # step commits (a directory); not when Python streams them (an upload: a Ctrl-C stops it).
    holds_interrupts: ClassVar[bool]
    # Whether other writers may save and retire steps beside this one's (an object store: no lock
    # keeps them away), so that any manager's read of a step deleted meanwhile looks again.
    shared_with_writers: ClassVar[bool]

    @classmethod
    @abc.abstractmethod
    def check_options(cls, where: Any, storage_options: Mapping[str, Any] | None) -> None:
        """Refuses ``storage_options`` where they configure nothing (a directory)."""

    @classmethod
    @abc.abstractmethod
    def refuse_needing_files(cls, where: Any, needing: list[str]) -> None:
        """Refuses the options in ``needing`` (set by a manager, each needing the steps' files
        on this machine) where the steps are not (object storage)."""

    # --- naming ----------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def run_folder(self) -> Path | str:
        """The run as a user names it: its directory, or its prefix's URL."""

    @abc.abstractmethod
    def step_folder(self, number: int) -> Path | str:
        """The step's folder as a user names it: its directory, or the step folder's URL (on
        object storage its files are in the folder of the save that committed it)."""

    @abc.abstractmethod
    def user_path(self, folder: Folder, name: str | None = None) -> Path | str:
        """A step's (or an attempt's) files' folder, or a file in it, as a user names it and
        ``load_checkpoint`` takes it: a path, or a URL."""

    @abc.abstractmethod
    def local_path(self, folder: Folder, name: str | None = None) -> Path | None:
        """The same, where a library can open it by its path on this machine (a directory's);
        None on object storage."""

    @abc.abstractmethod
    def attempt_fields(self, attempt: Attempt) -> dict[str, str]:
        """What a commit document records so that readers find the attempt's files: nothing in
        a directory (the step's own); on object storage, the attempt's folder (``attempt``)."""

    def scan(self, document: str) -> Scan:
        """The steps that ``document`` (metadata.json, index.json) commits; one whose document is
        damaged is reported in ``damaged`` (and kept, for a person to look at); one without it is
        not this document's (e.g. a save_sharded step seen by a manager) and is ignored. A look
        that may have missed a committed step (see :func:`missed`) is taken again."""
        deadline = time.monotonic() + SCAN_SECONDS
        for attempt in range(SCAN_ATTEMPTS):
            scan, vanished = self._look(document)
            if not missed(scan.steps, vanished, attempt):
                return scan
            if time.monotonic() > deadline:
                break
            time.sleep(min(0.001 * attempt, 0.05))
        if scan.steps or vanished < 0:
            return scan  # (committed steps, read: the newer one the looks kept missing aside)
        raise ScanTimeoutError(
            self.name,
            f"each of {attempt + 1} looks found the newest step it listed (step {vanished}) deleted or being "
            "retired, and no step committed: steps are retired faster than they can be read (or a retirement "
            "was left half done: remove_leftovers() finishes it)",
        )

    @abc.abstractmethod
    def _look(self, document: str) -> tuple[Scan, int]:
        """One look at the steps ``document`` commits: the scan, and the newest step found gone
        or being retired meanwhile (-1: none)."""

    @abc.abstractmethod
    def read(self, step: int, document: str) -> Step | None:
        """One step, if ``document`` commits it (CheckpointFormatError if it is damaged)."""

    @abc.abstractmethod
    def listed_steps(self) -> list[int]:
        """The steps the run holds, from one listing (a hint for messages: no document is read)."""

    @abc.abstractmethod
    def locate(self) -> Step | None:
        """The step whose folder is the store's own (a step directory, a step folder's URL),
        committed by its metadata.json or index.json, or None if it is none."""

    @abc.abstractmethod
    def file(self, folder: Folder, name: str) -> targets.LocalFile | targets.ObjectFile:
        """A file of a step (or an attempt), as a checkpoint target."""

    def place(self, folder: Folder, name: str, entry: Mapping[str, Any]) -> str:
        """Where the file ``name`` of a step's folder is kept, as messages name it: given its
        metadata.json ``entry``, which on object storage may put it in the run's shared folder."""
        return str(self.file(folder, name).name)

    @abc.abstractmethod
    def load(
        self, folder: Folder, name: str, *, recorded: Recorded | None = None, resuming: Step | None = None
    ) -> CheckpointState:
        """A checkpoint of a step, loaded; it stays usable whatever later retention deletes.
        With ``recorded`` (the step's metadata.json entries), the checkpoint and its data file
        are first checked against their entries, by what costs no second read: sizes, checksum
        root and pair id (see each store's ``load``); one that is not the file the step saved is
        refused, :class:`~ortckpt.CheckpointIntegrityError` naming it. ``resuming``: the step,
        when its writer restores it to go on saving (an object store's writer then shares the
        step's data object from its next save: see :mod:`.shared`)."""

    def download(self, folder: Folder, name: str, path: Path, *, recorded: Recorded | None = None) -> None:
        """A step's checkpoint copied to the new local file ``path`` (and its data file): where
        the store's files are not on this machine (object storage; a directory's are read in place)."""
        raise NotImplementedError(f"{self.name}: its steps' files are read in place")

    def shares_data(self, step: Step) -> bool:
        """Whether the step's checkpoint reads values from a data file other steps share outside
        its folder (on object storage), so that only a copy (:meth:`download`) is whole on its own."""
        return any("object" in entry for entry in step.document.get("files", {}).values())

    @abc.abstractmethod
    def load_shard(
        self, folder: Folder, name: str, recorded: Mapping[str, dict[str, Any]], *, resuming: Step | None = None
    ) -> CheckpointState:
        """A shard of a sharded step, loaded: a directory's mapped (its pieces checked as they
        are read); on object storage downloaded no further than the sizes its ``recorded``
        entries (file -> {"bytes", ...}) give, each checked against its entry, a data object
        the steps share read from where its entry says (``object``). ``resuming``: the step,
        when a writer restores it to go on saving (as :meth:`load`'s)."""

    @abc.abstractmethod
    def local_step(self, step: Step) -> AbstractContextManager[LocalStep]:
        """The step's files on this machine while the context lasts, for checking: a
        directory's own; on object storage each file its document names streamed into a
        scratch folder (its size and SHA-256 taken as it comes; no more bytes read than the
        document records), removed after."""

    @abc.abstractmethod
    def read_document(self, folder: Folder, name: str) -> bytes:
        """A document of a step (index.json inside it), within its kind's size cap."""

    # --- writing -------------------------------------------------------------------------

    @abc.abstractmethod
    def begin(self, step: int) -> Attempt:
        """A fresh, private place for the files of a save of ``step``."""

    @abc.abstractmethod
    def join(self, where: str, step: int) -> Attempt:
        """The attempt ``begin`` made on another rank, from its ``where``."""

    @abc.abstractmethod
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
        """Writes a checkpoint into the attempt; returns its files: {name: {"bytes": size,
        "sha256": hex digest}} (also recorded in ``attempt.written``). ``share_with``: the
        previous step, whose data file a store may share for the values that are unchanged (a
        directory links it; an object store shares a data object of the run's shared folder,
        recorded in ``attempt.shared``). ``shareable``: a shard that may share so (a manager's
        sharded step: its metadata.json names every file); a manager's checkpoint always may.
        ``watch_writes``: ``state``'s values are the caller's own arrays, kept in place between
        saves (a manager's synchronous save, never its copy): a store may watch their pages (see
        :func:`ortckpt._boundary.watch_writes`) so that the next step need not compare the values
        none of whose pages was written since (a directory does; an object store hashes)."""

    def staged_checkpoint(self, attempt: Attempt, name: str) -> Path | None:
        """Where another writer (a forked save: :mod:`ortckpt.forked_save`) may put the checkpoint
        ``name`` of the attempt itself, a local path, then :meth:`record_checkpoint` it; None where
        the store writes its checkpoints only itself (an object store)."""
        return None

    def record_checkpoint(self, attempt: Attempt, name: str) -> dict[str, dict[str, Any]]:
        """Records in ``attempt.written`` the checkpoint ``name`` (and its data file) that another
        writer put at :meth:`staged_checkpoint`; returns their entries."""
        raise NotImplementedError(f"{self.name}: checkpoints are written by the store itself")

    @abc.abstractmethod
    def write_document(self, attempt: Attempt, name: str, data: bytes, *, durable: bool) -> dict[str, Any]:
        """Writes a document into the attempt (a manager's sharded step keeps its index there);
        returns its {"bytes", "sha256"}."""

    @abc.abstractmethod
    def commit(self, attempt: Attempt, document: str, data: bytes, *, durable: bool) -> Step:
        """Publishes the attempt as its step with ``data`` as the ``document`` that commits it;
        CheckpointExistsError when another save committed the step first (this one's files
        are then removed)."""

    @abc.abstractmethod
    def abandon(self, attempt: Attempt) -> None:
        """Removes what a failed save wrote (what cannot be removed now is a leftover)."""

    @abc.abstractmethod
    def retire(self, step: Step) -> None:
        """Deletes a committed step: at once hidden from every reader, then its files removed
        (what fails to be removed is retried by the next sweep). FileNotFoundError when it is
        gone already."""

    @abc.abstractmethod
    def remove_proven_leftovers(self) -> list[str]:
        """:meth:`remove_leftovers` where a held lock proves their writers gone (a directory's
        writer); nothing where nothing can prove it (an object store)."""

    @abc.abstractmethod
    def describe(self, attempt: Attempt, on_bytes: Any = None, *, sha256: bool = False) -> dict[str, dict[str, Any]]:
        """The metadata entry of every file written into the attempt (see :mod:`.entries`);
        with ``sha256``, each with its SHA-256."""

    @abc.abstractmethod
    def remove_leftovers(self) -> list[str]:
        """Removes what saves that failed or were killed left, and finishes retirements that
        failed: returns what it removed."""

    # --- the run's graphs (CheckpointManager(artifacts=...)) ---------------------------------

    @abc.abstractmethod
    def store_graph(self, attempt: Attempt, role: str, source: Path, *, durable: bool) -> dict[str, Any]:
        """Records the ONNX model at ``source`` (a local file) as the step's graph of ``role``:
        stored once per distinct content in the run's artifacts folder, shared by every step
        that uses it. Returns its metadata entry ({"name", "bytes", "sha256"}), also kept in
        ``attempt.graphs``."""

    @abc.abstractmethod
    def graph_file(self, step: Step, role: str, cache: Callable[[], Path]) -> Path:
        """A local file holding the step's graph of ``role``, checked against its entry (size
        and SHA-256; CheckpointIntegrityError naming it otherwise): a directory's own file, or
        on object storage a download into the private folder ``cache()`` (asked for only then;
        no more bytes read than the entry records; one download per content)."""

    @abc.abstractmethod
    def remove_unused_graphs(self) -> list[str]:
        """Removes the stored graphs that no step uses any more; returns what it removed."""

    def close(self) -> None:  # noqa: B027 (nothing to give up but a directory's lock)
        """Gives up the store (a directory's writer lock)."""


__all__ = [
    "EMPTY_RESCANS",
    "SCAN_ATTEMPTS",
    "SCAN_SECONDS",
    "Attempt",
    "Folder",
    "LocalStep",
    "Scan",
    "SourceDigests",
    "Step",
    "StepStore",
    "check_graph_size",
    "missed",
    "shared_file_entry",
]
