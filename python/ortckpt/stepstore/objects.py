"""Steps under an object store prefix: the step transaction by conditional PUTs (the layout:
:mod:`ortckpt.steps`).

- **A save writes into a folder of its own**, ``step_<n>/<attempt>/`` (32 random hex digits: no
  other save writes there), taking each object's size and SHA-256 as the bytes go up.
- **It commits by creating the step's document** (``metadata.json``, or ``index.json`` for a
  sharded save without a manager), which names the attempt, with a conditional PUT: of two
  writers of one step, one commits; the other gets CheckpointExistsError and its upload is
  removed. Before the PUT and after it, every object the save wrote must still be there: a
  restarted job's sweep may have deleted the upload of a zombie writer beside it, and a step
  never names objects that do not exist (a commit found broken after its PUT is withdrawn).
  A commit whose answer was lost is recognised as this save's (the document names its
  attempt), also by a retried save of the step by the same writer; an error is not proof
  that it failed, so its objects stay for the sweep. A commit that landed but whose check
  after it could not be made (server errors) counts, with a warning.
- **Reading.** A scan lists the prefix and reads the documents it lists. A listing is no snapshot
  (a server that walks a tree lists each folder at another moment), so a scan that finds a step
  gone or being retired looks again (see :meth:`StepStore.scan`), and one whose listing shows no
  committed step reads the step folders a listing of the prefix's folders alone shows, newest
  first, up to the first committed one (see :meth:`ObjectStore._look`).
- **Retiring a step** first creates ``step_<n>/retired-<attempt>``, which hides it from every
  reader at once, then deletes its document, its objects and last the marker: a deletion that
  fails is finished by the next :meth:`ObjectStore.remove_leftovers`.
- **Leftovers.** An object store holds no lock, so nothing proves another writer absent: the
  objects of saves that never committed, and multipart uploads that killed writers left, are
  removed only by :meth:`ObjectStore.remove_leftovers`, which its caller runs when no other
  writer is saving under the prefix. It never runs by itself.
- **Steps share their unchanged values** (:mod:`.shared`): a manager's checkpoint (or each
  rank's shard of a manager's sharded step) of 64 MiB of values or more keeps them in a data
  object of the run's ``shared/`` folder that its metadata.json names; later steps upload only
  the values not in it. Such an object is deleted
  only when no committed step names it (after a retirement, by the sweep, and when the save
  that uploaded it fails before its commit).
- **The run's graphs** are objects ``artifacts/<sha256>.onnx`` under the prefix, one per distinct
  content, uploaded by the first save that records it; a step's metadata.json names them by
  digest. A save checks they are there before and after its commit, as for its own objects.
  Retention removes the ones no committed step names (an object store has no hard links to
  count), and :meth:`ObjectStore.remove_leftovers` those that saves killed before their commit
  left.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import documents, object_store, object_uploads, safe_io, steps, targets
from .._boundary import CoreState
from ..checkpoint_state import CheckpointState
from ..errors import CheckpointError, CheckpointExistsError, CheckpointIntegrityError
from ..object_store import Location
from . import downloads, graph_uploads, object_documents, shared
from .base import Attempt, Folder, LocalStep, Recorded, Scan, SourceDigests, Step, StepStore, check_graph_size
from .shared import SharedObjects

KINDS = {steps.METADATA_NAME: documents.METADATA, steps.INDEX_NAME: documents.SHARDED_INDEX}


class ObjectStore(StepStore):
    """A run of steps under ``prefix`` (see the module's description)."""

    holds_interrupts = False  # (Python streams every upload: a Ctrl-C stops it at once)
    shared_with_writers = True  # (no lock on a prefix)

    def __init__(self, prefix: Location, *, writer: bool = False, saves: bool | None = None) -> None:
        self.prefix = prefix
        self.name = prefix.url
        self._sources = SourceDigests()
        self._stored: set[str] = set()  # digests of graphs this store uploaded or checked under the prefix
        self._run = prefix  # the run's prefix: this one, or for a step folder located on its own, its parent
        # Attempts whose commit was sent but not known to have landed (an error answered it), by
        # step: a later save of the step that finds one of them committed takes it as its own.
        self._unsure: dict[int, set[str]] = {}
        # The data objects the run's steps share (see .shared): a restore hashed by whoever saves.
        self._shared = SharedObjects(writer if saves is None else saves)

    def _folder(self, step: int) -> Location:
        return self.prefix.child(steps.step_directory_name(step))

    def _files_of(self, folder: Location, document: dict[str, Any]) -> Location:
        """Where a committed step's files are: its attempt's folder (a step uploaded from a
        directory, e.g. by ``aws s3 sync``, names none: its files are beside the document)."""
        attempt = document.get("attempt")
        return folder.child(attempt) if attempt else folder

    @classmethod
    def check_options(cls, where: Any, storage_options: Mapping[str, Any] | None) -> None:
        pass  # (they configure the store: see ortckpt.object_store)

    @classmethod
    def refuse_needing_files(cls, where: Any, needing: list[str]) -> None:
        if needing:
            raise ValueError(f"{where}: not available for a manager on object storage: {', '.join(needing)}")

    # --- naming ----------------------------------------------------------------------------

    @property
    def run_folder(self) -> str:
        return self.name

    def step_folder(self, number: int) -> str:
        return f"{self.name.rstrip('/')}/{steps.step_directory_name(number)}"

    def user_path(self, folder: Folder, name: str | None = None) -> str:
        return _location(folder).url if name is None else self.file(folder, name).name

    def local_path(self, folder: Folder, name: str | None = None) -> None:
        return None  # (objects: downloaded by the store's readers, never opened by a path)

    def attempt_fields(self, attempt: Attempt) -> dict[str, str]:
        return {"attempt": attempt.where}  # (readers find the files in the attempt's folder)

    # --- reading -------------------------------------------------------------------------

    def _look(self, document: str) -> tuple[Scan, int]:
        scan, vanished = self._steps_listed(object_store.list_keys(self.prefix), document)
        if scan.steps:
            return scan, vanished
        # A listing is no snapshot: a server that walks a tree (SeaweedFS, MinIO) takes the
        # prefix's folders at its start and lists each one later; the step it took may be retired
        # by then and the newer one, committed meanwhile, never taken. One folder's listing of the
        # prefix shows a step committed while it ran, or the newer one whose commit retention's
        # deletion of it proves (a newer step sorts after it): each step folder is then read on its
        # own, newest first, up to the first committed one (SeaweedFS keeps emptied folders listed).
        numbers = (steps.step_of(name) for name in object_store.list_folders(self.prefix))
        for number in sorted((n for n in numbers if n is not None and n not in scan.damaged), reverse=True):
            name = steps.step_directory_name(number)
            listed = [(f"{name}/{key}", size) for key, size in object_store.list_keys(self._folder(number))]
            probe, gone = self._steps_listed(listed, document)
            scan.damaged.update(probe.damaged)
            vanished = max(vanished, gone)
            if probe.steps:
                scan.steps.update(probe.steps)
                break
        return scan, vanished

    def _steps_listed(self, listing: list[tuple[str, int]], document: str) -> tuple[Scan, int]:
        """The steps ``document`` commits in a listing of the prefix, and the newest step found
        gone or being retired meanwhile (-1: none)."""
        retired = _retired(listing)
        found: dict[int, Step] = {}
        damaged: dict[int, str] = {}
        # A retirement marker, with or without its step's document still listed, means a newer
        # step was committed before it.
        vanished = max((number for number, _ in retired), default=-1)
        for number, size in sorted(steps.steps_holding(listing, document).items()):
            try:
                step = self._read(number, document, size)
            except FileNotFoundError:  # deleted since it was listed
                vanished = max(vanished, number)
                continue
            except (CheckpointError, OSError) as e:
                damaged[number] = str(e)
                continue
            if (number, step.document.get("attempt")) not in retired:  # (a retired one is hidden)
                found[number] = step
        return Scan(found, damaged), vanished

    def _read(self, number: int, document: str, size: int | None = None) -> Step:
        folder = self._folder(number)
        where = folder.child(document)
        parsed = object_documents.read(where, KINDS[document], size)
        if parsed["step"] != number:
            raise documents.DocumentError(f"{where.url}: step {parsed['step']}, but the folder is of step {number}")
        return Step(number, parsed, self._files_of(folder, parsed))

    def read(self, step: int, document: str) -> Step | None:
        try:
            return self._read(step, document)
        except FileNotFoundError:
            return None

    def listed_steps(self) -> list[int]:
        """The steps whose document is listed."""
        listing = object_store.list_keys(self.prefix)
        return sorted(
            {*steps.steps_holding(listing, steps.METADATA_NAME), *steps.steps_holding(listing, steps.INDEX_NAME)}
        )

    def locate(self) -> Step | None:
        """The step whose folder is this store's prefix itself, if it is one."""
        for document in steps.COMMIT_DOCUMENTS:
            try:
                parsed = object_documents.read(self.prefix.child(document), KINDS[document])
            except FileNotFoundError:
                continue
            # (a step folder named on its own: the run's graphs are beside it, in its run's prefix)
            self._run = self.prefix.parent()
            return Step(parsed["step"], parsed, self._files_of(self.prefix, parsed))
        return None

    def file(self, folder: Folder, name: str) -> targets.ObjectFile:
        return targets.ObjectFile(_location(folder).child(name))

    def load(
        self, folder: Folder, name: str, *, recorded: Recorded | None = None, resuming: Step | None = None
    ) -> CheckpointState:
        """A local copy of the checkpoint (an unlinked temporary file, mapped): downloaded as a
        stream, so memory stays bounded, and usable whatever later retention deletes. With
        ``recorded`` (the step's entries), each object checked as it comes (:func:`.downloads.recorded`);
        a writer ``resuming`` from the step hashes its data object's values (:meth:`.SharedObjects.restored`)."""
        with safe_io.scratch_directory() as scratch:  # (a restore killed mid-download leaves it for the next to sweep)
            path = scratch / steps.CHECKPOINT_NAME
            if recorded is None:
                self.download(folder, name, path)
                return downloads.opened(path, _location(folder).child(name).url)
            etags = downloads.recorded(_location(folder), name, recorded, path, self._run)
            data = self.place(folder, f"{name}.data", recorded.get(f"{name}.data", {}))
            state = downloads.opened(path, _location(folder).child(name).url, data)
            if resuming is not None:  # (a writer's: see .shared)
                self._shared.restored(resuming, name, path, etags.get(f"{name}.data"))
            return state

    def download(self, folder: Folder, name: str, path: Path, *, recorded: Recorded | None = None) -> None:
        """Streams the checkpoint ``name`` of a step's folder into the new file ``path`` (and its
        data, from the run's shared folder when the step shares it, into ``path.data``); with
        ``recorded``, checked as :meth:`load` checks it."""
        if recorded is None:
            self.file(folder, name).download(path)
        else:
            downloads.recorded(_location(folder), name, recorded, path, self._run)

    def load_shard(
        self, folder: Folder, name: str, recorded: Mapping[str, dict[str, Any]], *, resuming: Step | None = None
    ) -> CheckpointState:
        return self.load(folder, name, recorded=recorded, resuming=resuming)

    @contextlib.contextmanager
    def local_step(self, step: Step) -> Iterator[LocalStep]:
        folder = _location(step.folder)
        if "files" in step.document:  # a manager's step: its metadata names every file
            sizes = {name: entry["bytes"] for name, entry in step.document["files"].items()}
        else:  # a sharded step without a manager: its index is the document
            sizes = {name: size for shard in step.document["shards"] for name, size in shard["files"].items()}
        recorded = step.document.get("files", {})
        places = {}
        with safe_io.scratch_directory() as scratch:
            hashed: dict[str, tuple[int, str] | BaseException] = {}
            for name, size in sorted(sizes.items()):
                source = self.shared_object(folder, name, recorded.get(name, {}))
                if "object" in recorded.get(name, {}):
                    places[name] = source.url
                hashed[name] = downloads.hashed(source, safe_io.member(scratch, name), size)
            for role, entry in sorted(step.document.get("artifacts", {}).items()):
                # (the run's stored graph, by digest: no more bytes read than the metadata records)
                try:
                    graph = self.graph_file(step, role, lambda: scratch)
                    hashed[entry["name"]] = (entry["bytes"], entry["sha256"])
                    os.link(graph, safe_io.member(scratch, entry["name"]))
                except (OSError, CheckpointError) as e:
                    hashed[entry["name"]] = e
            yield LocalStep(scratch, hashed, folder.url, places)

    def read_document(self, folder: Folder, name: str) -> bytes:
        where = _location(folder).child(name)
        kind = KINDS.get(name, documents.SHARDED_INDEX)
        return bytes(object_documents.bounded_get(where, kind))

    # --- writing -------------------------------------------------------------------------

    def begin(self, step: int) -> Attempt:
        attempt = steps.new_attempt()
        return Attempt(step, self._folder(step).child(attempt), attempt)

    def join(self, where: str, step: int) -> Attempt:
        if not documents.ATTEMPT.fullmatch(where):
            raise ValueError(f"{where!r} is not an attempt")
        return Attempt(step, self._folder(step).child(where), where)

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
        """A manager's checkpoint (or ``shareable`` shard) of values of SHARE_MIN_BYTES or more
        goes up sharing what did not change with the previous step (see :mod:`.shared`); any
        other (a small one, a shard of a step without metadata) whole into the attempt's folder."""
        values = SharedObjects.values_to_share(name, state, shareable)
        if values is not None:
            try:
                return self._shared.write(self._run, attempt, name, state, values, share_with, progress=progress)
            except Exception:
                # (its new data object went up, then this failed: on a rank of a sharded save, no
                # one else knows the object; on any, it goes now rather than at the next sweep)
                self._remove_unnamed_shared(self._shared.failed(attempt, name))
                raise
        target = self.file(attempt.folder, name)
        written = target.upload(state, external_data_threshold=external_data_threshold, progress=progress)
        attempt.written.update(written)
        return written

    def shared_object(self, folder: Folder, name: str, entry: Mapping[str, Any]) -> Location:
        """Where the file ``name`` of a step's (or attempt's) folder is (see :func:`.shared.where`)."""
        return shared.where(self._run, _location(folder), name, entry)

    def place(self, folder: Folder, name: str, entry: Mapping[str, Any]) -> str:
        return self.shared_object(folder, name, entry).url

    def write_document(self, attempt: Attempt, name: str, data: bytes, *, durable: bool) -> dict[str, Any]:
        object_store.put(_location(attempt.folder).child(name), data)
        entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        attempt.written[name] = entry
        return entry

    # --- the run's graphs ----------------------------------------------------------------

    def _graph(self, digest: str) -> Location:
        return self._run.child(steps.ARTIFACTS_FOLDER).child(steps.stored_graph_name(digest))

    def store_graph(self, attempt: Attempt, role: str, source: Path, *, durable: bool) -> dict[str, Any]:
        """Uploads the graph unless an object of its digest is there already with its bytes (checked
        once by reading it: a damaged or planted object is replaced)."""
        known = self._sources.get(source)
        if known is None:
            identity = SourceDigests.identity(source)
            check_graph_size(source, identity[2])
            with safe_io.open_regular(source) as f:  # (a FIFO or a directory refused unread)
                known = graph_uploads.sha256_of_file(f)
            self._sources.put(source, identity, *known)
        size, digest = known
        check_graph_size(source, size)
        where = self._graph(digest)
        if digest not in self._stored:
            found = object_store.head(where)
            if found is None or found.size != size or object_store.sha256_of(where, expected_size=size)[1] != digest:
                graph_uploads.upload_file(source, where, digest)
            self._stored.add(digest)
        entry = {"name": steps.artifact_name(role), "bytes": size, "sha256": digest}
        attempt.graphs[role] = entry
        return entry

    def graph_file(self, step: Step, role: str, cache: Callable[[], Path]) -> Path:
        """The object of the graph's digest (or, for a step copied up from a directory, its own
        file beside its checkpoint), downloaded once into ``cache()`` as ``<sha256>.onnx``."""
        entry = step.document["artifacts"][role]
        folder = cache()
        local = folder / steps.stored_graph_name(entry["sha256"])
        if os.path.lexists(local):  # (downloaded and checked before, into this private folder)
            return local
        places = [self._graph(entry["sha256"]), _location(step.folder).child(entry["name"])]
        for where in places:
            found = object_store.head(where)
            if found is not None and found.size == entry["bytes"]:
                break
        else:
            if not self._still_committed(step):
                raise FileNotFoundError(
                    2, f"step {step.number} was deleted meanwhile (its graph {role} with it)", places[0].url
                )
            raise CheckpointIntegrityError(
                places[0].url,
                [f"{places[0].url}: missing (the graph {role}, {entry['name']}, of step {step.number})"],
            )
        digest = hashlib.sha256()
        partial = folder / f".{entry['sha256']}.{steps.new_attempt()}"  # (threads may fetch one graph at once)
        fd = safe_io.create_exclusive(partial)
        try:
            object_store.download_to(where, fd, expected_size=entry["bytes"], etag=found.etag, digest=digest)
        except BaseException:
            os.close(fd)
            os.unlink(partial)
            raise
        os.close(fd)
        if digest.hexdigest() == entry["sha256"]:
            safe_io.link_into_place(partial, local)
            return local
        os.unlink(partial)
        raise CheckpointIntegrityError(
            where.url,
            [
                f"{where.url}: SHA-256 {digest.hexdigest()} differs from metadata's {entry['sha256']} "
                f"(the graph {role}, {entry['name']}, of step {step.number})"
            ],
        )

    def _still_committed(self, step: Step) -> bool:
        """Whether ``step`` is still committed as it was read (not retired, nor replaced)."""
        attempt = step.document.get("attempt")
        if self._run is not self.prefix:
            return True  # (a step folder on its own: no run listed to be deleted from)
        try:
            current = self.read(step.number, steps.METADATA_NAME)
        except (CheckpointError, OSError):
            return True  # (damaged now: say what is wrong with the graph, not that the step went)
        if current is None or current.document.get("attempt") != attempt:
            return False
        marker = self._folder(step.number).child(steps.retired_marker(attempt)) if attempt else None
        return marker is None or object_store.head(marker) is None

    def remove_unused_graphs(self) -> list[str]:
        """Removes the stored graphs that no committed step names. A step whose document is
        damaged may name any: then nothing is removed (as the sweep keeps such a step whole)."""
        scan = self.scan(steps.METADATA_NAME)
        if scan.damaged:
            return []
        used = {e["sha256"] for step in scan.steps.values() for e in step.document.get("artifacts", {}).values()}
        folder = self.prefix.child(steps.ARTIFACTS_FOLDER)
        unused = [
            name
            for name, _ in object_store.list_keys(folder)
            if steps.STORED_GRAPH.fullmatch(name) and name.removesuffix(".onnx") not in used
        ]
        object_store.remove([folder.child(name) for name in unused])
        self._stored -= {name.removesuffix(".onnx") for name in unused}
        return [folder.child(name).url for name in unused]

    def describe(self, attempt: Attempt, on_bytes: Any = None, *, sha256: bool = False) -> dict[str, dict[str, Any]]:
        """What was uploaded, with the SHA-256s taken as the bytes went (on object storage a
        step is verified by downloading it, SHA-256 as it comes: kept whatever ``sha256``); a data
        object in the run's shared folder with its key (``object``)."""
        return {**attempt.written, **attempt.shared}

    def commit(self, attempt: Attempt, document: str, data: bytes, *, durable: bool) -> Step:
        step = self._commit(attempt, document, data)
        self._shared.committed(attempt, step)
        return step

    def _commit(self, attempt: Attempt, document: str, data: bytes) -> Step:
        folder = self._folder(attempt.step)
        where = folder.child(document)
        self._check_present(attempt, "before its commit")
        attempt.sent = True  # from here on the commit may land whatever this process hears
        try:
            committed = object_store.put_new(where, data)
        except (OSError, CheckpointError):
            if self._names(attempt.step, document) != attempt.where:  # (not known to have landed)
                self._unsure.setdefault(attempt.step, set()).add(attempt.where)
                raise
            committed = True  # it landed; only its answer was lost
        if not committed and self._finish_retirement(attempt.step, document):
            committed = object_store.put_new(where, data)  # (a deletion killed half way was in the way)
        if not committed:
            attempt.sent = False  # another commit: ours certainly did not land
            self.abandon(attempt)
            earlier = self._names(attempt.step, document)
            if earlier is not None and earlier in self._unsure.get(attempt.step, ()):
                # This writer's own earlier save of the step, whose commit landed unheard: committed.
                step = self._read(attempt.step, document)
                return Step(step.number, step.document, step.folder)
            raise CheckpointExistsError(f"{folder.url}: another writer committed step {attempt.step} first")
        try:
            self._check_present(attempt, "after its commit")
        except CheckpointIntegrityError:
            object_store.remove([where])  # withdrawn: no step names objects that are gone
            raise
        except (OSError, CheckpointError) as e:
            # The commit landed (its PUT said so) and every object was there just before it; only
            # the check after it could not be made (the server failing). Raising would make the
            # writer forget a step that exists: retention would never delete it, and a retried
            # save would find it taken. It counts, with a warning to verify it.
            warnings.warn(
                f"{folder.url}: step {attempt.step} committed, but the check that its objects are still "
                f"there after the commit failed ({e}); `ortckpt verify {folder.url}` checks it",
                RuntimeWarning,
                stacklevel=3,
            )
        return Step(attempt.step, documents.parse(KINDS[document], data, where.url), attempt.folder)

    def _names(self, number: int, document: str) -> str | None:
        """The attempt the committed document of step ``number`` names, if it can be read."""
        try:
            return self._read(number, document).document.get("attempt")
        except (OSError, CheckpointError):
            return None

    def _finish_retirement(self, number: int, document: str) -> bool:
        """Finishes the retirement of step ``number`` if one was begun and not finished (its
        marker is there, and the document naming its attempt still is): whether it did."""
        try:
            step = self._read(number, document)
        except (FileNotFoundError, CheckpointError, OSError):
            return False
        attempt = step.document.get("attempt")
        if attempt is None or object_store.head(self._folder(number).child(steps.retired_marker(attempt))) is None:
            return False
        self.retire(step)
        return True

    def _check_present(self, attempt: Attempt, when: str) -> None:
        """Every object the attempt wrote is there with its size, or CheckpointIntegrityError."""
        problems = []
        for name, entry in sorted(attempt.written.items()):
            found = object_store.head(_location(attempt.folder).child(name))
            if found is None or found.size != entry["bytes"]:
                shown = _location(attempt.folder).child(name).url
                problems.append(
                    f"{shown}: {'gone' if found is None else f'{found.size} bytes'} "
                    f"{when} (written: {entry['bytes']} bytes); another job's sweep may have removed it"
                )
        for name, entry in sorted(attempt.shared.items()):
            where = self.shared_object(attempt.folder, name, entry)
            found = object_store.head(where)
            if found is None or found.size != entry["bytes"]:
                problems.append(
                    f"{where.url}: the shared data object is {'gone' if found is None else f'{found.size} bytes'} "
                    f"{when} (written: {entry['bytes']} bytes); another job's sweep may have removed it"
                )
        for role, entry in sorted(attempt.graphs.items()):
            where = self._graph(entry["sha256"])
            found = object_store.head(where)
            if found is None or found.size != entry["bytes"]:
                self._stored.discard(entry["sha256"])  # (the next save uploads it again)
                problems.append(
                    f"{where.url}: the graph {role} is gone {when}; another job's sweep may have removed it"
                )
        if problems:
            raise CheckpointIntegrityError(self._folder(attempt.step).url, problems)

    def abandon(self, attempt: Attempt) -> None:
        uploaded = self._shared.abandoned(attempt)
        if attempt.sent:
            return  # the commit may have landed: its objects stay (remove_leftovers judges them)
        _remove_quietly(_location(attempt.folder))
        if uploaded:  # (its data objects: objects, not folders)
            self._remove_unnamed_shared(uploaded)

    def _remove_unnamed_shared(self, keys: set[str]) -> None:
        """Removes the data objects ``keys`` of a failed save (its ranks' new ones, and those it
        shared), but none that a committed step names (a hostile or copied document may: never
        delete what a step reads), nor when a damaged one may, nor one that a save of this writer
        in flight holds; what stays is for the sweep."""
        try:
            named = self._named_shared()
            if named is not None:
                object_store.remove([self._run.child(key) for key in sorted(keys - named - self._shared.holds())])
        except (OSError, CheckpointError) as e:
            warnings.warn(
                f"{self._run.url}: could not remove a failed save's data objects: {e}", RuntimeWarning, stacklevel=4
            )

    def retire(self, step: Step) -> None:
        folder = self._folder(step.number)
        attempt = step.document.get("attempt")
        marker = folder.child(steps.retired_marker(attempt)) if attempt else None
        if marker is not None:
            object_store.put(marker, b"")  # hidden from every reader from now on
        # The step's documents, while they name this step's attempt (no S3 DELETE is conditional:
        # read first, so that another writer's commit of the step is not deleted with it).
        for document in steps.COMMIT_DOCUMENTS:
            with contextlib.suppress(FileNotFoundError, CheckpointError, OSError):
                if self._read(step.number, document).document.get("attempt") == attempt:
                    object_store.remove([folder.child(document)])
        object_store.remove_under(_location(step.folder) if attempt else folder)
        if marker is not None:
            object_store.remove([marker])
        if shared.objects_named(step.document):
            # (the step is gone: the data objects only it named go too; what a failing server leaves
            # now, the next retirement or remove_leftovers() collects)
            with contextlib.suppress(OSError, CheckpointError):
                self.remove_unused_shared()

    def remove_unused_shared(self) -> list[str]:
        """Removes the data objects of the run's shared folder that no committed step names and
        no save of this store in flight uses. Runs after a retirement (the step's document gone
        first, so no reader is shown a step whose objects are missing: one that read it before
        finds it retired, as it would its own objects). A step whose document is damaged may
        name any: then nothing is removed. Returns the URLs removed."""
        began = self._shared.collection_began()
        named = self._named_shared()
        return [] if named is None else self._shared.collect(self._run, named, began)

    def _named_shared(self) -> set[str] | None:
        """The shared data objects that committed steps name; None when a step's document is
        damaged (it may name any)."""
        scan = self.scan(steps.METADATA_NAME)
        if scan.damaged:
            return None
        return {key for step in scan.steps.values() for key in shared.objects_named(step.document)}

    def remove_proven_leftovers(self) -> list[str]:
        return []  # nothing on an object store proves a writer gone: remove_leftovers() is the caller's call

    def remove_leftovers(self) -> list[str]:
        """Deletes, under the prefix, everything in step folders that no committed document
        names (saves that failed or were killed, uploads of writers that lost a step), the
        steps whose retirement did not finish, and the multipart uploads killed writers left.
        A step whose document is damaged is kept whole, for a person to look at. Run it only
        when no other writer is saving under the prefix (nothing on an object store proves
        that, so it never runs by itself). Returns the URLs removed."""
        listing = object_store.list_keys(self.prefix)
        by_step: dict[int, set[str]] = {}
        for key, _ in listing:
            parts = steps.split_key(key)
            if parts is not None:
                by_step.setdefault(parts[0], set()).add(parts[1])
        retired = _retired(listing)
        removed: list[str] = []
        for number, names in sorted(by_step.items()):
            keep = self._kept(number, names, retired)
            if keep is None:
                continue  # a damaged document: kept whole
            removed += self._remove_unnamed(number, [name for name in sorted(names) if not keep(name)])
        for key, upload_id, _began in object_uploads.pending_uploads(self.prefix):
            object_uploads.abort_upload(self.prefix.child(key), upload_id)
            removed.append(f"{self.prefix.child(key).url} (multipart upload {upload_id})")
        return removed + self.remove_unused_shared() + self.remove_unused_graphs()

    def _remove_unnamed(self, number: int, names: list[str]) -> list[str]:
        """Removes the objects ``names`` of step ``number`` that the listing found no document
        naming. An attempt's folder is first marked retired: a zombie's commit naming it that
        lands meanwhile is then hidden from every reader, and withdrawn here, rather than left
        naming objects that are gone. Returns the URLs removed."""
        folder = self._folder(number)
        attempts: dict[str, list[str]] = {}
        for name in names:
            attempt, _, rest = name.partition("/")
            key = attempt if rest and documents.ATTEMPT.fullmatch(attempt) else ""
            attempts.setdefault(key, []).append(name)
        removed = []
        for attempt, members in sorted(attempts.items()):
            marker = folder.child(steps.retired_marker(attempt)) if attempt else None
            if marker is not None:
                object_store.put(marker, b"")
            object_store.remove([folder.child(name) for name in members])
            removed += [folder.child(name).url for name in members]
            if marker is not None:
                for document in steps.COMMIT_DOCUMENTS:
                    with contextlib.suppress(FileNotFoundError, CheckpointError, OSError):
                        if self._read(number, document).document.get("attempt") == attempt:
                            object_store.remove([folder.child(document)])  # a zombie's, committed meanwhile
                            removed.append(folder.child(document).url)
                object_store.remove([marker])
        return removed

    def _kept(self, number: int, names: set[str], retired: set[tuple[int, Any]]) -> Any:
        """Which names of a step folder the sweep keeps: a predicate, or None to keep all."""
        attempts: set[str | None] = set()
        kept_documents = set()
        for document in steps.COMMIT_DOCUMENTS:
            if document not in names:
                continue
            try:
                parsed = object_documents.read(self._folder(number).child(document), KINDS[document])
            except FileNotFoundError:
                continue
            except (CheckpointError, OSError):
                return None
            if (number, parsed.get("attempt")) in retired:
                continue  # a retirement that did not finish: its document goes too
            attempts.add(parsed.get("attempt"))
            kept_documents.add(document)

        def keep(name: str) -> bool:
            if name in kept_documents:
                return True
            if None in attempts and "/" not in name and not name.startswith(steps.RETIRED_PREFIX):
                return True  # files beside a document that names no attempt
            return name.partition("/")[0] in attempts

        return keep


def _location(folder: Folder) -> Location:
    """A folder of this store: an object store's steps and attempts are Locations."""
    assert isinstance(folder, Location), folder
    return folder


def _retired(listing: Iterable[tuple[str, int]]) -> set[tuple[int, Any]]:
    """(step, attempt) of every retirement marker in a listing."""
    found = set()
    for key, _ in listing:
        parts = steps.split_key(key)
        if parts is not None and parts[1].startswith(steps.RETIRED_PREFIX):
            found.add((parts[0], parts[1].removeprefix(steps.RETIRED_PREFIX)))
    return found


def _remove_quietly(folder: Location) -> None:
    """Removes what a failed save uploaded; what stays is for remove_leftovers()."""
    try:
        object_store.remove_under(folder)
    except OSError as e:
        warnings.warn(f"{folder.url}: could not remove a failed save's objects: {e}", RuntimeWarning, stacklevel=3)


__all__ = ["ObjectStore"]
