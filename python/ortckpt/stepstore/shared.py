"""The data objects that an object store's steps share (:mod:`.objects`): what a step of a mostly
frozen model uploads is what changed.

- **Layout.** A manager's checkpoint of SHARE_MIN_BYTES of values or more (and each rank's shard
  of such values in a manager's sharded step: ``shard-RRRRR-of-WWWWW.data`` entries, one object
  per rank, which that rank's shard of the next step shares) goes up as a pair: its
  values in a data object of the run's shared folder, ``shared/<pair id>.data``, its tables (and
  the values not in that object) in the checkpoint object of the attempt's folder, whose pair
  trailer is the data object's. The step's metadata.json entry for ``checkpoint.data`` names the
  object (``object``) with its size, SHA-256, ETag and pair id: readers fetch it from there.
- **Sharing, by content.** The writer takes the SHA-256 of every value as its data object goes
  up. The next step hashes its own values: each one whose bytes are in that object (whatever
  tensor held them) is read from there at its offset, every other one is inline in the new
  checkpoint object: only the changed tensors are uploaded. Shared when the previous step names
  the object this writer uploaded last, it is still there with its size, the values found fill
  at least half of it (an object mostly stale is not kept alive step after step) and the rest
  fit ONNX Runtime's 2 GiB inline; else the step goes up whole with a new data object, which the
  next steps share. The digests live in this writer's memory, each taken from bytes it had: no
  document is trusted for them.
- **A rank's shard** is committed by rank 0, not by the rank's own store: the object a rank
  uploaded becomes its basis when the previous step of its next save (read from the store,
  committed) names it exactly (key, size, SHA-256, pair id). A rank whose upload fails after its
  data object went up removes that object itself; rank 0's abandon removes the data objects of
  the ranks that succeeded (none that a committed step names).
- **A resumed writer** (a new process after a preemption, a crash, a redeploy) has none, until
  it restores: the values its restore downloads from the data object a step shares (the object
  proven to be the one the step records, by its ETag or SHA-256, and read by a GET conditional
  on the ETag the server declared) are hashed at their offsets, and that object becomes the
  basis, as if this writer had uploaded it, for a save whose previous step is the very step
  restored (same number, same attempt): a manager's checkpoint, and each shard a rank's restore
  of a sharded step downloads (its own, on the world size it was saved with). Else (no restore,
  an older step restored, another writer's step committed since, a reader) the first step goes
  up whole, as it always did.
- **Checks at each save**, whichever writer hashed the object: the previous step still names it
  (key, size, SHA-256, pair id), and it is still there with that size and the ETag it had when
  hashed, where the server gives ETags (an object replaced meanwhile, even by one of the same
  size, is not shared from).
- **Collection.** A data object is deleted only when no committed step names it, no save of this
  writer in flight holds it, and no step this writer committed since the collection's scan began
  names it: after a retirement (the step's document gone first, so a reader is never shown a step
  whose objects are missing) and by the sweep (a save killed before its commit).
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _boundary, documents, object_store, steps, targets
from .._boundary import CoreState
from ..errors import CheckpointError
from ..object_store import Location
from .base import Attempt, Step

# A manager's checkpoint whose values reach this many bytes is uploaded as a pair whose data object
# the next steps share. Below it, one object (a pair costs a second PUT and GET; little to share).
SHARE_MIN_BYTES = 64 << 20
# Values under this many bytes are always inline (the core's rule): never shared.
EXTERNAL_MIN_BYTES = 64


@dataclass(frozen=True)
class SharedData:
    """A data object of the run's shared folder that this writer uploaded, and where each value
    it holds is in it, by the SHA-256 of the value's bytes (taken from the buffers that went up)."""

    entry: dict[str, Any]  # its metadata.json entry: bytes, sha256, etag, pair, object
    pair: bytes  # the pair id its trailer carries (a checkpoint sharing it takes it)
    # SHA-256 of a value's bytes -> its offsets in the object (one per value that had them: no two
    # tensors of a checkpoint may read the same bytes, which a load refuses as overlapping)
    offsets: dict[str, list[int]]
    etag: str | None = None  # the ETag the server gave for the bytes hashed (None: not given)


class SharedObjects:
    """One writer's side of the run's shared data objects (see the module's description)."""

    def __init__(self, saves: bool) -> None:
        self._saves = saves  # (whether its process saves into the run: a reader's restores hash nothing)
        # By data file name ("checkpoint.data", or a shard's): the object of the last step that
        # names the one this writer uploaded, what the next save shares from; and the one it
        # uploaded last, with its attempt (promoted when a step naming it is committed: by this
        # store, or, for a rank's shard, by rank 0's, which the next save's previous step shows).
        self._basis: dict[str, SharedData] = {}
        self._uploaded: dict[str, tuple[str, SharedData]] = {}
        # By data file name: the object of the step this writer last restored, hashed from the bytes
        # downloaded, with the step's (number, attempt): the basis of a save whose previous step is that one.
        self._restored: dict[str, tuple[tuple[int, Any], SharedData]] = {}
        # Objects that saves in flight use, by attempt: never collected while they are.
        self._held: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        # When this writer last committed a step naming each object (a count of its commits): a
        # collection leaves the ones committed since it began (its scan may predate them).
        self._commits = 0
        self._named_at: dict[str, int] = {}

    @staticmethod
    def values_to_share(name: str, state: CoreState, shareable: bool) -> list[Any] | None:
        """The values of the checkpoint ``name`` if it goes up sharing (a manager's checkpoint, or
        a ``shareable`` shard: a manager's sharded step, whose metadata.json names every object it
        reads, with values of SHARE_MIN_BYTES or more), else None (whole, into the attempt's
        folder, as before)."""
        if not (name == steps.CHECKPOINT_NAME or shareable) or state.nominal:
            return None
        values = _value_buffers(state)
        return values if sum(memoryview(v).nbytes for v in values) >= SHARE_MIN_BYTES else None

    def write(
        self,
        run: Location,
        attempt: Attempt,
        name: str,
        state: CoreState,
        values: list[Any],
        previous: Step | None,
        *,
        progress: bool,
    ) -> dict[str, dict[str, Any]]:
        """Uploads the checkpoint into the attempt's folder, sharing with ``previous`` the data
        object it names when it can, else whole with a new one. Its data object's entry goes in
        ``attempt.shared``; returns the checkpoint object's entry (also in ``attempt.written``)."""
        data_name = f"{name}.data"
        basis = self._basis.get(data_name)
        if basis is not None and not _names_shared(previous, data_name, basis.entry):
            basis = None  # (not the previous step's: e.g. another writer's, or a step restored from elsewhere)
        uploaded = self._uploaded.get(data_name)
        if basis is None and uploaded is not None and _names_shared(previous, data_name, uploaded[1].entry):
            # (a rank's shard: rank 0 committed the step naming it, and the previous step is that one)
            basis = self._basis[data_name] = uploaded[1]
        restored = self._restored.get(data_name)
        if basis is None and restored is not None and previous is not None:
            step, data = restored
            if step == (previous.number, previous.document.get("attempt")) and _names_shared(
                previous, data_name, data.entry
            ):
                basis = self._basis[data_name] = data  # (the restored step is the previous one: as if uploaded here)
        if basis is not None:
            self._hold(attempt, basis.entry["object"])
            written = self._upload_sharing(run, attempt, name, state, values, basis, progress=progress)
            if written is not None:
                attempt.shared[data_name] = dict(basis.entry)
                return written
            self.release(attempt)
        return self._upload_whole(run, attempt, name, state, progress=progress)

    def _upload_sharing(
        self,
        run: Location,
        attempt: Attempt,
        name: str,
        state: CoreState,
        values: list[Any],
        basis: SharedData,
        *,
        progress: bool,
    ) -> dict[str, dict[str, Any]] | None:
        """The checkpoint object, uploaded sharing ``basis``, or None when it should not (nothing
        uploaded)."""
        found = object_store.head(run.child(basis.entry["object"]))
        if found is None or found.size != basis.entry["bytes"]:
            return None  # (removed meanwhile, e.g. by another job's sweep: the next step shares the new one)
        if None not in (basis.etag, found.etag) and found.etag != basis.etag:
            return None  # (replaced since its values were hashed, whatever its size: not shared from)
        shared: dict[tuple[int, int], int] = {}
        free = {digest: list(offsets) for digest, offsets in basis.offsets.items()}
        keys = [_boundary.buffer_key(value) for value in values]
        # (the core finds a value by its buffer: one that two tensors hand over stays inline, and
        # each place is taken once: no two tensors may read the same bytes, a load refuses that)
        once = {key for key, count in Counter(keys).items() if count == 1}
        for key, value in zip(keys, values, strict=True):
            places = free.get(hashlib.sha256(value).hexdigest())
            if places and key in once:
                shared[key] = places.pop()
        if 2 * sum(length for (_, length) in shared) < basis.entry["bytes"]:
            return None
        try:
            main = _boundary.encode_sharing_segments(state, basis.pair, shared)
        except CheckpointError:
            return None  # (the changed values pass ONNX Runtime's 2 GiB inline: whole)
        written = {name: put_hashed(_folder(attempt).child(name), main, progress)}
        attempt.written.update(written)
        return written

    def _upload_whole(
        self, run: Location, attempt: Attempt, name: str, state: CoreState, *, progress: bool
    ) -> dict[str, dict[str, Any]]:
        """The checkpoint uploaded whole: its values in a new data object of the run's shared
        folder, its tables in the attempt's folder. Every value's SHA-256 is taken (for the next
        step to share by), then the object's as it goes up."""
        main, external = _boundary.encode_segments(state, external_data_threshold=0)
        assert external is not None  # (values of SHARE_MIN_BYTES: external with a threshold of 0)
        size, parts = external
        pair = _tail(main, targets.PAIR_TRAILER_BYTES)[16:]
        offsets: dict[str, list[int]] = {}
        for offset, piece in parts:
            if _is_value(piece):
                offsets.setdefault(hashlib.sha256(piece).hexdigest(), []).append(offset)
        key = steps.shared_data_name(pair.hex())
        self._hold(attempt, key)  # (from before its first byte: a collection meanwhile leaves it)
        entry = put_hashed(run.child(key), targets.filled(size, parts), progress)
        entry.update(pair=pair.hex(), object=key)
        attempt.shared[f"{name}.data"] = entry
        self._uploaded[f"{name}.data"] = (attempt.where, SharedData(dict(entry), pair, offsets, entry.get("etag")))
        written = {name: put_hashed(_folder(attempt).child(name), main, progress)}
        attempt.written.update(written)
        return written

    def restored(self, step: Step, name: str, checkpoint: Path, etag: str | None) -> None:
        """This writer restored ``step``, its checkpoint ``name`` (a manager's, or a shard's)
        downloaded to ``checkpoint`` and the data object it shares to ``checkpoint.data``, both
        proven to be the ones the step records, the data read by a GET conditional on ``etag``.
        Each value the checkpoint reads from that object is hashed at its offset, from the bytes
        downloaded: the basis of a save whose previous step is ``step`` (see the module's
        description). A checkpoint sharing none: nothing."""
        key = (step.number, step.document.get("attempt"))
        # (another step restored: what was restored of any before is no basis any more)
        self._restored = {k: v for k, v in self._restored.items() if v[0] == key and k != f"{name}.data"}
        entry = step.document.get("files", {}).get(f"{name}.data")
        if not self._saves or entry is None or "object" not in entry or "pair" not in entry:
            return
        loaded = _boundary.load(checkpoint, follow_symlinks=False)
        if loaded.mappings[1] is None:
            return
        data = memoryview(loaded.mappings[1]).cast("B")
        offsets: dict[str, list[int]] = {}
        for _key, (_name, _code, _dims, stored) in loaded.tensors():
            if isinstance(stored, tuple) and stored[2] and stored[1] >= EXTERNAL_MIN_BYTES:
                offset, nbytes, _external = stored
                offsets.setdefault(hashlib.sha256(data[offset : offset + nbytes]).hexdigest(), []).append(offset)
        self._restored[f"{name}.data"] = (key, SharedData(dict(entry), bytes.fromhex(entry["pair"]), offsets, etag))

    def _hold(self, attempt: Attempt, key: str) -> None:
        with self._lock:
            self._held.setdefault(attempt.where, []).append(key)

    def release(self, attempt: Attempt) -> None:
        """Gives up the objects the attempt held (its save committed or failed)."""
        with self._lock:
            self._held.pop(attempt.where, None)

    def committed(self, attempt: Attempt, step: Step) -> None:
        """The attempt's save committed ``step``: the objects it uploaded are the next step's basis."""
        for data_name, (where, uploaded) in list(self._uploaded.items()):
            if where == attempt.where:
                del self._uploaded[data_name]
                if step.document.get("attempt") == attempt.where:
                    self._basis[data_name] = uploaded
        with self._lock:
            self._commits += 1
            for entry in step.document.get("files", {}).values():
                if "object" in entry:
                    self._named_at[entry["object"]] = self._commits
        self.release(attempt)

    def abandoned(self, attempt: Attempt) -> set[str]:
        """The attempt's save failed: the keys of the objects this writer uploaded for it and of
        those its entries name (another rank's, recorded by rank 0), which the caller removes
        when no commit naming them may have landed and no committed step names them."""
        self.release(attempt)
        keys = {entry["object"] for entry in attempt.shared.values() if "object" in entry}
        for data_name, (where, uploaded) in list(self._uploaded.items()):
            if where == attempt.where:
                del self._uploaded[data_name]
                keys.add(uploaded.entry["object"])
        return keys

    def failed(self, attempt: Attempt, name: str) -> set[str]:
        """The upload of the checkpoint ``name`` into the attempt failed: the key of the data
        object it uploaded new for it, if any (forgotten here; the caller removes it when no
        committed step names it)."""
        data_name = f"{name}.data"
        uploaded = self._uploaded.get(data_name)
        if uploaded is None or uploaded[0] != attempt.where:
            return set()
        del self._uploaded[data_name]
        attempt.shared.pop(data_name, None)
        key = uploaded[1].entry["object"]
        with self._lock:
            held = self._held.get(attempt.where, [])
            if key in held:
                held.remove(key)
        return {key}

    def holds(self) -> set[str]:
        """The objects that saves of this writer in flight use."""
        with self._lock:
            return {key for keys in self._held.values() for key in keys}

    def collection_began(self) -> int:
        with self._lock:
            return self._commits

    def collect(self, run: Location, named: set[str], began: int) -> list[str]:
        """Removes the objects of the run's shared folder that neither ``named`` (what committed
        steps name, scanned after ``began``: :meth:`collection_began`) holds, nor a save in flight,
        nor a step this writer committed since. Returns the URLs removed."""
        folder = run.child(steps.SHARED_FOLDER)
        with self._lock:  # (a save that holds one from now on finds it here, or uploads it anew)
            kept = named | {key for keys in self._held.values() for key in keys}
            kept |= {key for key, at in self._named_at.items() if at > began}
            unused = [
                name
                for name, _ in object_store.list_keys(folder)
                if steps.SHARED_DATA.fullmatch(name) and f"{steps.SHARED_FOLDER}/{name}" not in kept
            ]
            object_store.remove([folder.child(name) for name in unused])
            for name in unused:
                self._named_at.pop(f"{steps.SHARED_FOLDER}/{name}", None)
        return [folder.child(name).url for name in unused]


def objects_named(document: Mapping[str, Any]) -> set[str]:
    """The shared data objects a step's document names."""
    return {entry["object"] for entry in document.get("files", {}).values() if "object" in entry}


def where(run: Location, folder: Location, name: str, entry: Mapping[str, Any]) -> Location:
    """Where the file ``name`` of a step's (or attempt's) ``folder`` is: in the run's shared folder
    when its entry says so (``object``), else in the folder."""
    key = entry.get("object")
    return run.child(key) if isinstance(key, str) else folder.child(name)


def put_hashed(where: Location, pieces: Iterable[Any], progress: bool) -> dict[str, Any]:
    """Uploads ``pieces`` as ``where``: its entry ({"bytes", "sha256", and the "etag" the server
    gave}: a restore's proof of this object), the SHA-256 taken as the bytes go."""
    from ..progress import maybe_bar

    pieces = list(pieces)
    with maybe_bar(progress, f"uploading {where.key.rsplit('/', 1)[-1]}", targets.size_of(pieces)) as bar:
        digest = hashlib.sha256()
        put = object_store.put_stream(where, pieces, digest, bar.update)
    entry: dict[str, Any] = {"bytes": put.size, "sha256": digest.hexdigest()}
    if put.etag is not None and documents.is_etag(put.etag):
        entry["etag"] = put.etag
    return entry


def _value_buffers(state: CoreState) -> list[Any]:
    """Every tensor value of ``state`` that a data file may hold (a buffer of EXTERNAL_MIN_BYTES
    or more: strings and nominal values never)."""
    tensors = [*state.trainable, *state.frozen]
    for _group, _step, _rate, parameters in state.groups:
        for _parameter, momentums in parameters:
            tensors += momentums
    return [
        values
        for _name, _code, _dims, values in tensors
        if values is not None and not isinstance(values, list) and memoryview(values).nbytes >= EXTERNAL_MIN_BYTES
    ]


def _is_value(piece: Any) -> bool:
    """Whether a piece of an encoded data file is a tensor's values (not the trailer's bytes)."""
    return not isinstance(piece, bytes) or len(piece) != targets.PAIR_TRAILER_BYTES


def _names_shared(step: Step | None, name: str, entry: Mapping[str, Any]) -> bool:
    """Whether ``step`` records its file ``name`` as the shared data object ``entry`` records."""
    if step is None:
        return False
    found = step.document.get("files", {}).get(name, {})
    return all(found.get(kind) == entry[kind] for kind in ("object", "bytes", "sha256", "pair"))


def _tail(pieces: list[Any], count: int) -> bytes:
    """The last ``count`` bytes of the concatenated ``pieces``."""
    tail = b""
    for piece in reversed(pieces):
        tail = bytes(memoryview(piece).cast("B")[-(count - len(tail)) :]) + tail
        if len(tail) >= count:
            break
    return tail


def _folder(attempt: Attempt) -> Location:
    assert isinstance(attempt.folder, Location), attempt.folder
    return attempt.folder


__all__ = ["SHARE_MIN_BYTES", "SharedData", "SharedObjects", "objects_named", "put_hashed", "where"]
