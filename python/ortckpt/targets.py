"""Where a checkpoint goes or comes from, classified once, at the public edge.

The public API takes a path, an ``s3://bucket/key`` URL or a binary file object wherever it
takes a checkpoint, and a directory or an ``s3://bucket/prefix`` wherever it takes a run of
steps (a manager, a sharded save). :func:`checkpoint` and :func:`run` turn each into a target,
once; below this module nothing asks what a name is (``tests/python/design/test_design_rules.py``
holds every other module to it):

- :class:`LocalFile`: a checkpoint file (and ``<path>.data``), written through the core's one
  commit and opened by memory-mapping;
- :class:`ObjectFile`: a checkpoint object (and ``<key>.data``), streamed up from the arrays in
  multipart parts and downloaded with a limit known before memory is allocated;
- :class:`StreamFile`: a binary file object, written whole (every byte or an error) and read
  at most as far as a checkpoint can reach.

A run is a local directory (a :class:`pathlib.Path`) or an object prefix
(:class:`ortckpt.object_store.Location`); :mod:`ortckpt.stepstore` gives each its backend.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _boundary
from .errors import CheckpointError, CheckpointFormatError, CheckpointStateError, InvalidArgumentError

# What a checkpoint without external data can be (one flatbuffer: at most 2 GiB, bytes 4..8 its
# file identifier): past that a stream or an object is refused unread. One definition, the byte
# mover's (object_store imports only the standard library at first).
from .object_store import CHECKPOINT_IDENTIFIER as CHECKPOINT_IDENTIFIER
from .object_store import CHECKPOINT_LIMIT as MAX_CHECKPOINT_BYTES

if TYPE_CHECKING:
    from .object_store import Location

SCHEME = "s3://"
# The pair trailer (see the core's format::pairing) that ends a checkpoint and its data file.
PAIR_TRAILER_BYTES = 32
PAIR_MAGIC = b"ortckpt pair id\0"


def is_object_url(where: Any) -> bool:
    """Whether ``where`` names an object store location (``s3://bucket/key``): the one place
    this is asked."""
    return isinstance(where, str) and where.startswith(SCHEME)


def is_stream(where: Any) -> bool:
    """Whether ``where`` is a binary file object rather than a name."""
    return not isinstance(where, (str, bytes, os.PathLike)) and (hasattr(where, "read") or hasattr(where, "write"))


def object_location(url: str, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The object (or prefix) ``url`` names, its store configured from ``storage_options``,
    the environment and the AWS profile files (see :mod:`ortckpt.object_store`)."""
    from . import object_store

    if not is_object_url(url):
        raise ValueError(f"not an object URL ({SCHEME}bucket/key): {url!r}")
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket")
    if any(part in (".", "..") for part in key.split("/")) or "//" in key.strip("/"):
        raise ValueError(f"{url!r}: a key with empty, '.' or '..' segments is refused")
    key = key.strip("/")
    try:
        return object_store.location(bucket, key, f"{SCHEME}{bucket}/{key}", storage_options)
    except ValueError as e:  # the store's configuration
        raise ValueError(f"{SCHEME}{bucket}: {e}") from e


# --- checkpoints ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalFile:
    """A checkpoint file (and its ``.data``): written by the core's one commit, opened by map."""

    path: Path

    @property
    def name(self) -> str:
        return os.fspath(self.path)

    def save(
        self,
        state: _boundary.CoreState,
        *,
        external_data_threshold: int,
        durable: bool,
        progress: bool,
        lock_timeout: float | None = None,
    ) -> None:
        from .interrupts import before_commit
        from .progress import save_progress

        with save_progress(progress, f"saving {self.path.name}") as counter:
            # Written staged, then committed: a Ctrl-C held meanwhile is raised before the
            # commit (the staged files discarded), never after it (see ortckpt.interrupts).
            staging, _ = _boundary.save_staged(
                self.path,
                state,
                external_data_threshold=external_data_threshold,
                durable=durable,
                progress=counter,
            )
            before_commit()
            staging.commit(durable=durable, lock_timeout=lock_timeout)


@dataclass(frozen=True)
class StreamFile:
    """A binary file object: written whole, read no further than a checkpoint can reach."""

    stream: Any

    @property
    def name(self) -> str:
        return str(getattr(self.stream, "name", "<stream>"))

    def save(self, state: _boundary.CoreState, *, progress: bool = False) -> None:
        from .progress import maybe_bar
        from .safe_io import write_stream

        data = _boundary.save_bytes(state)
        with maybe_bar(progress, f"saving {self.name}", memoryview(data).nbytes) as bar:
            write_stream(self.stream, data, bar.update)

    def read(self) -> bytearray:
        """The stream's bytes to its end, refused (CheckpointFormatError) as soon as they cannot
        be a checkpoint: when its first 8 bytes lack the file identifier, or once they pass what
        one checkpoint buffer can hold, before more is read."""
        data = bytearray()
        while True:
            chunk = self.stream.read(min(16 << 20, MAX_CHECKPOINT_BYTES + 1 - len(data)))
            if chunk is None:
                raise BlockingIOError(11, "the stream has no bytes ready (non-blocking)")
            if not chunk:
                return data
            data += chunk
            if len(data) >= 8 and data[4:8] != CHECKPOINT_IDENTIFIER:
                raise CheckpointFormatError(
                    f"{self.name}: not an ONNX Runtime training checkpoint: file identifier is "
                    f"{bytes(data[4:8])!r}, expected {CHECKPOINT_IDENTIFIER!r}"
                )
            if len(data) > MAX_CHECKPOINT_BYTES:
                raise CheckpointFormatError(
                    f"{self.name}: more than {MAX_CHECKPOINT_BYTES} bytes, more than one checkpoint "
                    "buffer holds (a checkpoint with external data is two files: load it from its path)"
                )


@dataclass(frozen=True)
class ObjectFile:
    """A checkpoint object (``key``, and ``key.data`` with external data)."""

    location: Location

    @property
    def name(self) -> str:
        return self.location.url

    @property
    def data(self) -> Location:
        return self.location.sibling(".data")

    def save(self, state: _boundary.CoreState, *, external_data_threshold: int, progress: bool = False) -> None:
        """Uploads ``state`` in place of what is there. An object appears whole when its upload
        completes; with external data there are two, so the checkpoint goes up first beside its
        key (a pending object), then the data object, then the checkpoint at its key: a save
        killed between the last two leaves the new data object beside the old checkpoint, and a
        load finds the new checkpoint in the pending object (see :meth:`load`). A data object
        the replaced checkpoint had (one carrying its pair trailer), and no other, is removed
        when this one has none. ``progress``: a bar over the bytes uploaded."""
        from . import object_store
        from .progress import maybe_bar

        replaced = _trailer_of(self.location)
        main, external = _boundary.encode_segments(state, external_data_threshold=external_data_threshold)
        main_bytes = size_of(main)
        total = main_bytes if external is None else 2 * main_bytes + external[0]
        with maybe_bar(progress, f"uploading {self.location.key.rpartition('/')[2]}", total) as bar:
            on_bytes = bar.update
            if external is None:
                object_store.put_stream(self.location, main, on_bytes=on_bytes)
                if replaced is not None and _trailer_of(self.data) == replaced:
                    object_store.remove([self.data])  # the replaced checkpoint's data object
                return
            import secrets

            pending = self.location.beside(f"{self._pending_name()}{secrets.token_hex(16)}")
            object_store.put_stream(pending, main, on_bytes=on_bytes)
            size, parts = external
            object_store.put_stream(self.data, filled(size, parts), on_bytes=on_bytes)
            object_store.put_stream(self.location, main, on_bytes=on_bytes)
            object_store.remove([pending])  # (a killed save's stays: small, it names a data object no longer there)

    def _pending_name(self) -> str:
        """How the pending objects of this key begin (as the core names its temporary files)."""
        return f".{self.location.key.rpartition('/')[2]}{_boundary.TEMP_MARKER}"

    def _pending_objects(self) -> list[tuple[Location, int]]:
        """The pending checkpoints of this key that saves left, with their sizes (a listing of
        its folder: only on the rare path that needs them)."""
        from . import object_store

        name = self._pending_name()
        return [
            (self.location.beside(key), size)
            for key, size in object_store.list_keys(self.location.parent())
            if key.startswith(name) and "/" not in key
        ]

    def upload(
        self,
        state: _boundary.CoreState,
        *,
        external_data_threshold: int,
        hashed: bool = True,
        progress: bool = False,
    ) -> dict[str, dict[str, Any]]:
        """Streams ``state`` up (its data object first: the checkpoint names it). Returns what
        was uploaded as a step's metadata records files: {last part of the key: {"bytes":
        size, "sha256": hex digest, "etag": the ETag the server gave it}}, each SHA-256 taken as
        the bytes went (sizes alone without ``hashed``). ``progress``: a bar over the bytes
        uploaded."""
        import hashlib

        from . import documents, object_store
        from .progress import maybe_bar

        main, external = _boundary.encode_segments(state, external_data_threshold=external_data_threshold)
        name = self.location.key.rsplit("/", 1)[-1]
        uploads: list[tuple[Location, str, Iterable[Any]]] = [(self.location, name, main)]
        if external is not None:
            size, parts = external
            uploads.insert(0, (self.data, name + ".data", filled(size, parts)))
        total = size_of(main) + (external[0] if external is not None else 0)
        uploaded: dict[str, dict[str, Any]] = {}
        with maybe_bar(progress, f"uploading {name}", total) as bar:
            for where, file, pieces in uploads:
                digest = hashlib.sha256() if hashed else None
                put = object_store.put_stream(where, pieces, digest, bar.update)
                uploaded[file] = {"bytes": put.size}
                if digest is not None:
                    uploaded[file]["sha256"] = digest.hexdigest()
                if put.etag is not None and documents.is_etag(put.etag):
                    uploaded[file]["etag"] = put.etag  # (what a restore takes as proof of this object)
        return uploaded

    def load(self, *, lazy: bool = True) -> _boundary.Loaded:
        """Downloads the checkpoint and opens it; its external data, if any, is read lazily by
        ranged GETs of the version the load saw (or downloaded whole without ``lazy``)."""
        from . import object_store

        # One GET: one version of the object, refused unread past 2 GiB or without the identifier.
        view = memoryview(object_store.get_checkpoint(self.location))
        data_head = object_store.head(self.data)
        if data_head is None:
            try:
                return _boundary.load_buffer(view)
            except CheckpointStateError as e:  # it has external data, and the data object is gone
                raise FileNotFoundError(2, "no such object (the checkpoint's external data)", self.data.url) from e
            except CheckpointError as e:
                e.filename = self.location.url
                raise
        tail_start = max(0, data_head.size - PAIR_TRAILER_BYTES)
        tail = bytes(object_store.get_range(self.data, tail_start, data_head.size - tail_start, data_head.etag))
        if _paired(tail) and _paired(view[-PAIR_TRAILER_BYTES:]) and bytes(view[-PAIR_TRAILER_BYTES:]) != tail:
            view = self._interrupted(tail, view)  # a save killed between its data object and its checkpoint
        external: Any = (
            RemoteRanges(self.data, data_head.size, data_head.etag)
            if lazy
            else object_store.get(self.data, data_head.etag, expected_size=data_head.size)
        )
        try:
            return _boundary.load_buffer_paired(view, external, data_head.size, tail)
        except CheckpointError as e:
            e.filename = self.location.url
            raise

    def download(self, path: Path) -> None:
        """Streams the checkpoint (and its data object) into new files ``path`` (and
        ``path.data``) with bounded memory: a local copy that later deletions cannot touch."""
        from . import object_store
        from .safe_io import create_exclusive

        for source, local in ((self.location, path), (self.data, Path(f"{path}.data"))):
            found = object_store.head(source)
            if found is None:
                if source is self.location:
                    raise FileNotFoundError(2, "no such object", source.url)
                continue  # no external data
            if source is self.location and found.size > MAX_CHECKPOINT_BYTES:
                raise CheckpointFormatError(f"{source.url}: {found.size} bytes, more than a checkpoint can be")
            fd = create_exclusive(local)
            try:
                object_store.download_to(source, fd, expected_size=found.size, etag=found.etag)
            finally:
                os.close(fd)

    def _interrupted(self, data_tail: bytes, main: memoryview) -> memoryview:
        """The checkpoint of the save whose data object is in place but whose checkpoint is not
        (it was killed between the two): its pending object, whose pair trailer is the data
        object's. Without one, ``main`` as it is (the load then says the pair is mismatched)."""
        from . import object_store

        for pending, size in self._pending_objects():
            if size < PAIR_TRAILER_BYTES or size > MAX_CHECKPOINT_BYTES:
                continue
            found = object_store.get_range(pending, size - PAIR_TRAILER_BYTES, PAIR_TRAILER_BYTES)
            if bytes(found) == data_tail:
                return memoryview(object_store.get_checkpoint(pending))
        return main


class RemoteRanges:
    """An external data object read lazily: each tensor's bytes by one ranged GET on first use,
    of the version the load saw (its ETag)."""

    def __init__(self, location: Location, size: int, etag: str | None) -> None:
        self.location = location
        self.size = size
        self.etag = etag

    def read_range(self, offset: int, nbytes: int) -> Any:
        from . import object_store

        return object_store.get_range(self.location, offset, nbytes, self.etag)


def _trailer_of(location: Location) -> bytes | None:
    """The pair trailer an object ends with, if it exists and ends with one."""
    from . import object_store

    found = object_store.head(location)
    if found is None or found.size < PAIR_TRAILER_BYTES:
        return None
    try:
        tail = bytes(object_store.get_range(location, found.size - PAIR_TRAILER_BYTES, PAIR_TRAILER_BYTES, found.etag))
    except (FileNotFoundError, OSError):
        return None
    return tail if _paired(tail) else None


def _paired(tail: Any) -> bool:
    """Whether the last bytes of a file are a pair trailer (see the core's format::pairing)."""
    return bytes(tail[:16]) == PAIR_MAGIC


def size_of(pieces: list[Any]) -> int:
    return sum(memoryview(p).nbytes for p in pieces)


def filled(size: int, parts: list[tuple[int, Any]]) -> Iterator[Any]:
    """The external data file's pieces in order, zeros where nothing is placed."""
    at = 0
    for offset, piece in parts:
        if offset > at:
            yield bytes(offset - at)
        yield piece
        at = offset + memoryview(piece).nbytes
    if size > at:
        yield bytes(size - at)


CheckpointTarget = LocalFile | ObjectFile | StreamFile


def checkpoint(where: Any, storage_options: Mapping[str, Any] | None = None) -> CheckpointTarget:
    """The target a checkpoint argument names: an ``s3://`` URL, a binary file object, or a path."""
    if is_stream(where):
        return StreamFile(where)
    if is_object_url(where):
        location = object_location(where, storage_options)
        if not location.key:
            raise ValueError(f"{where!r} names a bucket, not an object: {SCHEME}bucket/key")
        return ObjectFile(location)
    return LocalFile(Path(where))  # (storage_options configure object stores only)


def output(where: Any, argument: str) -> None:
    """Refuses an output name that ends with a slash: it names a directory (or an object
    store's folder), and a path made of it would quietly drop the slash and write a file
    under the directory's name."""
    if isinstance(where, (str, os.PathLike)):
        name = os.fspath(where)
        if isinstance(name, str) and name.endswith(("/", os.sep)):
            raise InvalidArgumentError(
                f"{name}: names a directory (it ends with '/'); a checkpoint or model is written as a file: "
                "give its file name",
                argument,
            )


def run(where: Any, storage_options: Mapping[str, Any] | None = None) -> Path | Location:
    """Where a run of steps lives: a local directory, or an object store prefix."""
    if is_object_url(where):
        return object_location(where, storage_options)
    return Path(where)  # (storage_options configure object stores only)


__all__ = [
    "SCHEME",
    "CheckpointTarget",
    "LocalFile",
    "ObjectFile",
    "StreamFile",
    "checkpoint",
    "filled",
    "is_object_url",
    "is_stream",
    "object_location",
    "output",
    "run",
    "size_of",
]
