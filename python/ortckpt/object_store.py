"""S3-compatible object storage: moving bytes to and from objects, and nothing of checkpoints
(:mod:`ortckpt.targets` turns checkpoints into the pieces uploaded here, and back).

The client is obstore (the Python binding of the Rust ``object_store`` crate, which Apache
Arrow maintains). Chosen by measurement against boto3 on a local S3 server (benches/README.md):
loads through it took 1.06-2.0x less time than boto3's download_file of the same bytes and saves
as long as upload_file (the server bounds both here), and it takes any buffer without a copy
(a streamed save's peak memory grew 9 MiB), aborts a multipart upload its input fails in, and
puts conditionally (``mode="create"``), which commits a manager's step and a sharded index (of
two writers of one step, one wins). s3fs was not a candidate: next to a current boto3 it resolves to a
years-old release.

An upload streams buffers (the caller's own memory, never copied) to a multipart upload in
parts of :data:`PART_BYTES`, at most :data:`PARTS_IN_FLIGHT` at once; memory is bounded by the
parts in flight. An object only becomes visible when its upload completes; a failed upload is
aborted; a killed one stays invisible. Reads may name the ETag of the version they expect, so
an object replaced meanwhile is an error, never a mix of two versions.

Every read has a limit known before memory is allocated. A body is streamed, in chunks of
:data:`STREAM_CHUNK`, and refused (:class:`ObjectStoreError`) before a byte is read when the size
the server declares is over the caller's limit or is not the size the caller expects, and as soon
as more bytes arrive than it declared, or when fewer did; a whole read goes into one buffer of the
declared size. :func:`get_checkpoint` also refuses an object that cannot be a checkpoint, from its
size and its first chunk; :func:`download_to` and :func:`sha256_of` hold one chunk. A listing
ends in an error at :data:`LIST_KEYS` keys or :data:`LIST_PAGES` pages, at a key or continuation
token listed twice (a page repeated), or after :data:`LIST_EMPTY_PAGES` pages in a row that hold
nothing yet say more follow (a server that sends them for ever).

Listings' pages (ListObjectsV2, for :func:`list_keys` and :func:`list_folders`) and the multipart
uploads that killed writers left (invisible, but their parts are kept) are ortckpt's own requests
(:mod:`ortckpt.object_requests`, :mod:`ortckpt.object_uploads`), signed (SigV4) with the store's
own configuration, their XML bounded (:data:`XML_LIMIT`) and without entities: obstore has no call
for the uploads, and its listing hides the pages (it asks for empty ones for ever). That takes
static credentials (given, from the environment or a profile); a store without them (an
instance's role, a web identity) is listed by obstore, its pages unbounded, and cannot list
uploads.

Configuration, as boto3 finds it: ``storage_options`` first (``endpoint_url``, ``region``,
``access_key_id``/``key``, ``secret_access_key``/``secret``, ``session_token``/``token``,
``profile``, ``max_retries``, ``retry_timeout`` in seconds, or any obstore S3 setting), then
the ``AWS_*`` environment variables, then the profile (``AWS_PROFILE`` or ``default``) in
``~/.aws/credentials`` and ``~/.aws/config``. Every request has deadlines, in seconds:
``connect_timeout`` (10 by default), ``timeout`` for the whole request (60 by default; a GET's
body cut by it is resumed where it stopped) and, if given, ``read_timeout``, the longest wait for
a byte (obstore's client options of those names; see :data:`DEADLINES`). A request that fails is
retried by obstore, up to ``max_retries`` times within ``retry_timeout``, and so is a page of a
listing; the multipart requests above are not retried.
"""

from __future__ import annotations

import configparser
import datetime
import mmap
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointFormatError, ObjectStoreError
from .extras import require
from .object_requests import DEADLINES, LIST_PAGE_KEYS, list_pages, signs
from .object_requests import LIST_EMPTY_PAGES as LIST_EMPTY_PAGES  # (named here: the listing's bounds)
from .object_requests import XML_LIMIT as XML_LIMIT

# Multipart upload parts: S3 allows 10,000 per object, so up to 160 GiB per object.
PART_BYTES = 16 << 20
PARTS_IN_FLIGHT = 8
# Reads stream in chunks of this size (obstore's min_chunk_size): the memory a streamed read holds.
STREAM_CHUNK = 4 << 20
# ONNX Runtime's format without external data is one flatbuffer, which cannot reach 2 GiB; its
# bytes 4..8 are the flatbuffers file identifier.
CHECKPOINT_LIMIT = 2**31
CHECKPOINT_IDENTIFIER = b"ODTC"
IDENTIFIED_BY = 8
# Listings: the bounds past which a listing is an error (keys a page, pages in a row without
# keys, the largest XML answer and every request's deadlines: ortckpt.object_requests).
LIST_PAGES = 100_000
LIST_KEYS = 1_000_000


@dataclass(frozen=True)
class Location:
    """One object, or a prefix: its store (a bucket, configured), key, and URL (for messages;
    :mod:`ortckpt.targets` parses and makes URLs)."""

    store: Any
    bucket: str
    key: str
    url: str

    def child(self, name: str) -> Location:
        """The object ``name`` under this one taken as a prefix."""
        key = f"{self.key.rstrip('/')}/{name}" if self.key else name
        return Location(self.store, self.bucket, key, f"{self.url.rstrip('/')}/{name}")

    def sibling(self, suffix: str) -> Location:
        """The object whose key is this one's plus ``suffix`` (``.data``)."""
        return Location(self.store, self.bucket, self.key + suffix, self.url + suffix)

    def parent(self) -> Location:
        """The folder this object is in, as a prefix."""
        folder, _, last = self.key.rpartition("/")
        return Location(self.store, self.bucket, folder, self.url[: len(self.url) - len(last)].rstrip("/"))

    def beside(self, name: str) -> Location:
        """The object ``name`` in the same folder as this one."""
        folder, _, last = self.key.rpartition("/")
        key = f"{folder}/{name}" if folder else name
        return Location(self.store, self.bucket, key, self.url[: len(self.url) - len(last)] + name)


def location(bucket: str, key: str, url: str, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The object ``key`` of ``bucket`` (``url`` names it in messages), its store configured
    from ``storage_options``, the environment and the AWS profile files."""
    return Location(_store(bucket, dict(storage_options or {})), bucket, key, url)


def _store(bucket: str, options: dict[str, Any]) -> Any:
    S3Store = require("obstore.store", "checkpoints on object storage").S3Store

    aliases = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}
    options = {aliases.get(k, k): v for k, v in options.items()}
    profile_name = options.pop("profile", None)
    retry = {name: options.pop(name) for name in ("max_retries", "retry_timeout") if options.get(name) is not None}
    given = {name: options.pop(name, None) for name in (*DEADLINES, "read_timeout")}
    deadlines = {**DEADLINES, **{name: seconds for name, seconds in given.items() if seconds is not None}}
    if "endpoint_url" in options:
        options["endpoint"] = options.pop("endpoint_url")
    # An explicit profile outranks the environment (as in boto3's Session(profile_name=...)).
    sources = [_environment(), _profile(profile_name or os.environ.get("AWS_PROFILE") or "default")]
    if profile_name:
        sources.reverse()
    config: dict[str, Any] = {}
    for source in sources:
        for name, value in source.items():
            config.setdefault(name, value)
    config.update(options)
    if "region" not in config:
        config["region"] = "us-east-1"  # S3-compatible servers ignore it; AWS needs one
    client_options: dict[str, Any] = {"allow_http": str(config.get("endpoint", "")).startswith("http://")}
    retry_config: dict[str, Any] = {}
    try:
        for name, seconds in deadlines.items():
            client_options[name] = datetime.timedelta(seconds=float(seconds))
        if "max_retries" in retry:
            retry_config["max_retries"] = int(retry["max_retries"])
        if "retry_timeout" in retry:
            retry_config["retry_timeout"] = datetime.timedelta(seconds=float(retry["retry_timeout"]))
        settings: dict[str, Any] = {"config": config, "client_options": client_options}
        return S3Store(bucket, **settings, retry_config=retry_config or None)  # type: ignore[arg-type]
    except Exception as e:  # obstore's configuration errors, numbers that are not
        raise ValueError(f"bucket {bucket}: {e}") from e


_ENVIRONMENT = {
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN",),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
}


def _environment() -> dict[str, str]:
    found = {}
    for name, variables in _ENVIRONMENT.items():
        value = next((os.environ[v] for v in variables if os.environ.get(v)), None)
        if value is not None:
            found[name] = value
    return found


_PROFILE_KEYS = {
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "aws_session_token": "session_token",
    "region": "region",
    "endpoint_url": "endpoint",
}


def _profile(name: str) -> dict[str, str]:
    """The profile's settings: the credentials file first, then the config file (whose
    sections are ``[profile NAME]``, but ``[default]``)."""
    home = os.path.expanduser("~")
    files = [
        (os.environ.get("AWS_SHARED_CREDENTIALS_FILE", os.path.join(home, ".aws", "credentials")), name),
        (
            os.environ.get("AWS_CONFIG_FILE", os.path.join(home, ".aws", "config")),
            name if name == "default" else f"profile {name}",
        ),
    ]
    found: dict[str, str] = {}
    for path, section in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: {e}") from e
        if parser.has_section(section):
            for key, value in parser.items(section):
                if key in _PROFILE_KEYS and value:
                    found.setdefault(_PROFILE_KEYS[key], value)
    return found


def _failure(location: Location, e: BaseException) -> BaseException:
    """An obstore error as ortckpt reports it, naming the object."""
    from obstore import exceptions

    if isinstance(e, (exceptions.NotFoundError, FileNotFoundError)):  # (obstore's GET raises the builtin)
        return FileNotFoundError(2, "no such object", location.url)
    if isinstance(e, exceptions.PreconditionError):
        return ObjectStoreError(location.url, "the object was replaced while it was being read")
    return ObjectStoreError(location.url, e)


def _calling(location: Location, call: Any, *args: Any, **kwargs: Any) -> Any:
    from obstore.exceptions import BaseError

    try:
        return call(*args, **kwargs)
    except (BaseError, FileNotFoundError) as e:
        raise _failure(location, e) from e


# Bytes of object content this process sent by PUT (every upload, part and document): what a
# step costs on the wire, read by bytes_put().
_put_total = [0]
_put_lock = threading.Lock()


def bytes_put() -> int:
    """Bytes of object content this process has uploaded so far (a running total: a step's
    upload is the difference taken around it)."""
    return _put_total[0]


def _count_put(size: int) -> None:
    with _put_lock:
        _put_total[0] += size


def put_stream(location: Location, pieces: Iterable[Any], digest: Any = None, on_bytes: Any = None) -> Head:
    """Uploads the concatenated ``pieces`` (buffers) as ``location``: one PUT when they fit in
    a part, else a multipart upload that the object appears with when it completes (aborted if
    a piece fails). Large buffers are sliced into parts without copying. ``digest`` (a hashlib
    object) is fed the bytes as they go, ``on_bytes`` (a progress bar's update) their count.
    Returns the object's size and the ETag the server gave it."""
    import obstore

    pieces = list(pieces)
    size = sum(memoryview(p).nbytes for p in pieces)
    if size <= PART_BYTES:
        data = b"".join(memoryview(p).cast("B") for p in pieces)
        if digest is not None:
            digest.update(data)
        put = _calling(location, obstore.put, location.store, location.key, data, use_multipart=False)
        _count_put(size)
        if on_bytes is not None:
            on_bytes(size)
        return Head(size, put.get("e_tag"))
    put = _calling(
        location,
        obstore.put,
        location.store,
        location.key,
        _parts(pieces, digest, on_bytes),
        use_multipart=True,
        chunk_size=PART_BYTES,
        max_concurrency=PARTS_IN_FLIGHT,
    )
    _count_put(size)
    return Head(size, put.get("e_tag"))


def _parts(pieces: list[Any], digest: Any = None, on_bytes: Any = None) -> Iterator[memoryview]:
    for piece in pieces:
        view = memoryview(piece).cast("B")
        for start in range(0, view.nbytes, PART_BYTES):
            part = view[start : start + PART_BYTES]
            if digest is not None:  # the upload takes parts in order (hashlib lets the GIL go)
                digest.update(part)
            yield part
            if on_bytes is not None:  # taken: the upload asks for the next part once this one is on its way
                on_bytes(part.nbytes)


def put(location: Location, data: bytes) -> None:
    """Writes ``location`` with ``data`` (one PUT), replacing it."""
    import obstore

    _calling(location, obstore.put, location.store, location.key, data, use_multipart=False)
    _count_put(len(data))


def put_new(location: Location, data: bytes) -> bool:
    """Creates ``location`` with ``data`` only if no object has its key (a conditional PUT:
    of two writers, one wins). False when another object is there. An object holding exactly
    ``data`` is this PUT's own, found by a retry after its answer was lost (callers' documents
    name a random attempt, so no other writer's has the same bytes): True. The object found is
    read only when its size is that of ``data``."""
    import obstore
    from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError

    try:
        obstore.put(location.store, location.key, data, use_multipart=False, mode="create")
    except (AlreadyExistsError, PreconditionError):
        found = head(location)
        if found is None or found.size != len(data):  # deleted since, or another's: not ours to claim
            return False
        try:
            return bytes(get(location, found.etag, expected_size=len(data))) == data
        except FileNotFoundError:
            return False
    except (BaseError, FileNotFoundError) as e:
        raise _failure(location, e) from e
    _count_put(len(data))
    return True


@dataclass(frozen=True)
class Head:
    size: int
    etag: str | None


def head(location: Location) -> Head | None:
    """The object's size and ETag, or None when there is none."""
    import obstore

    try:
        meta = _calling(location, obstore.head, location.store, location.key)
    except FileNotFoundError:
        return None
    return Head(meta["size"], meta.get("e_tag"))


def get(
    location: Location, etag: str | None = None, *, expected_size: int | None = None, limit: int | None = None
) -> Any:
    """The whole object, in memory (a read-only buffer); with ``etag``, only that version.

    Refused (:class:`ObjectStoreError`) before a byte is read when the size the server declares
    is over ``limit`` (by default ``expected_size``, or else the machine's memory) or is not
    ``expected_size``; and when more or fewer bytes arrive than it declared. The buffer is
    allocated once, of the declared size, and takes memory as the bytes arrive."""
    if limit is None:
        limit = expected_size if expected_size is not None else _memory()
    result, size = _opened(location, _options(etag), expected_size=expected_size, limit=limit)
    return _filled_from(location, result, size)


def get_range(location: Location, start: int, length: int, etag: str | None = None) -> Any:
    """``length`` bytes of the object from ``start`` (a read-only buffer); with ``etag``, only
    that version. Exactly ``length`` bytes, or :class:`ObjectStoreError`."""
    if length == 0:
        return b""
    options = _options(etag, range=(start, start + length))
    result, size = _opened(location, options, expected_size=length, limit=length)
    if result.range != (start, start + length):  # (a server answering another range)
        raise ObjectStoreError(location.url, f"asked for bytes {start}-{start + length}, got {result.range}")
    return _filled_from(location, result, size)


def get_checkpoint(location: Location, etag: str | None = None, *, limit: int = CHECKPOINT_LIMIT) -> Any:
    """:func:`get` of an object that must be a checkpoint without external data: one
    flatbuffer, under :data:`CHECKPOINT_LIMIT` (2 GiB), whose bytes 4..8 are ``ODTC``. One over
    ``limit`` by its declared size is refused before a byte is read, and one with other bytes
    from its first chunk (:class:`CheckpointFormatError`, naming the URL); transport failures
    and a server sending other than it declared are :class:`ObjectStoreError`."""
    result, size = _opened(location, _options(etag))
    if size > limit:
        raise _not_a_checkpoint(location, f"{size} bytes, over the {limit} a checkpoint can hold")
    if size < IDENTIFIED_BY:
        raise _not_a_checkpoint(location, f"{size} bytes, too short to be a checkpoint")

    def identified(first: memoryview) -> None:
        if first[4:8] != CHECKPOINT_IDENTIFIER:
            raise _not_a_checkpoint(location, f"no {CHECKPOINT_IDENTIFIER.decode()} identifier in its first bytes")

    return _filled_from(location, result, size, identified)


def _not_a_checkpoint(location: Location, problem: str) -> CheckpointFormatError:
    error = CheckpointFormatError(f"{location.url}: not an ONNX Runtime training checkpoint: {problem}")
    error.filename = location.url
    return error


def download_to(
    location: Location,
    fd_or_file: Any,
    *,
    expected_size: int | None = None,
    etag: str | None = None,
    digest: Any = None,
) -> int:
    """Streams the object into ``fd_or_file`` (a file descriptor, or an open binary file, at its
    position), feeding ``digest`` (a hashlib object) if given; memory: one chunk. Returns the
    number of bytes written. The bytes checked as :func:`get` checks them (``expected_size``,
    the size declared), an error (:class:`ObjectStoreError`) may come after some were written.
    The file's own failures (a full disk) are its ``OSError``."""
    fd = fd_or_file if isinstance(fd_or_file, int) else fd_or_file.fileno()
    if not isinstance(fd_or_file, int):
        fd_or_file.flush()  # what the file object holds goes first
    result, size = _opened(location, _options(etag), expected_size=expected_size)
    for chunk in _chunks(location, result, size):
        if digest is not None:
            digest.update(chunk)
        view = memoryview(chunk)
        while view.nbytes:  # a write may take fewer bytes than given
            view = view[os.write(fd, view) :]
    return size


def sha256_of(location: Location, *, expected_size: int | None = None) -> tuple[int, str]:
    """The object's size and SHA-256, read as a stream (memory: one chunk); the bytes checked as
    :func:`get` checks them (``expected_size``, the size declared)."""
    import hashlib

    digest = hashlib.sha256()
    result, size = _opened(location, {}, expected_size=expected_size)
    for chunk in _chunks(location, result, size):
        digest.update(chunk)
    return size, digest.hexdigest()


def _options(etag: str | None, **more: Any) -> dict[str, Any]:
    return {"if_match": etag, **more} if etag else more


def _opened(
    location: Location, options: dict[str, Any], *, expected_size: int | None = None, limit: int | None = None
) -> tuple[Any, int]:
    """A GET's result, its body not yet read, and the body's size as the server declares it:
    refused when it is not ``expected_size`` or is over ``limit``."""
    import obstore

    result = _calling(location, obstore.get, location.store, location.key, options=options or None)
    first, end = result.range
    size = end - first
    if expected_size is not None and size != expected_size:
        raise ObjectStoreError(location.url, f"the server declares {size} bytes, {expected_size} were expected")
    if limit is not None and size > limit:
        raise ObjectStoreError(location.url, f"the server declares {size} bytes, over the limit of {limit}")
    return result, size


def _chunks(location: Location, result: Any, size: int) -> Iterator[Any]:
    """The body of ``result`` (:func:`_opened`), in chunks of about :data:`STREAM_CHUNK`, stopped
    as soon as more than the declared ``size`` bytes arrive, and an error if fewer did."""
    stream = _calling(location, result.stream, min_chunk_size=STREAM_CHUNK)
    arrived = 0
    while True:
        chunk = _calling(location, next, stream, None)  # each chunk a read that can fail
        if chunk is None:
            break
        arrived += memoryview(chunk).nbytes
        if arrived > size:
            raise ObjectStoreError(location.url, f"the server sent more than the {size} bytes it declared")
        yield chunk
    if arrived < size:
        raise ObjectStoreError(location.url, f"the server sent {arrived} of the {size} bytes it declared")


def _filled_from(location: Location, result: Any, size: int, check: Any = None) -> Any:
    """The body of ``result`` in one buffer of its declared ``size`` (read-only), which takes
    memory as the bytes arrive (an anonymous map: no copy of the chunks, no zeros written
    first). ``check`` is shown the first :data:`IDENTIFIED_BY` bytes as soon as they are in."""
    if size == 0:
        return b""
    buffer = memoryview(mmap.mmap(-1, size))
    at = 0
    for chunk in _chunks(location, result, size):
        count = memoryview(chunk).nbytes
        buffer[at : at + count] = chunk
        at += count
        if check is not None and at >= IDENTIFIED_BY:
            check(buffer[:IDENTIFIED_BY])
            check = None
    return buffer.toreadonly()


def _memory() -> int:
    """The machine's memory: no object larger can be read into it."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def list_keys(location: Location, *, max_keys: int = LIST_KEYS, max_pages: int = LIST_PAGES) -> list[tuple[str, int]]:
    """(key relative to ``location`` as a prefix, size) of every object under it.

    An :class:`ObjectStoreError` naming the prefix, rather than a listing without end, when the
    listing passes ``max_keys`` keys or ``max_pages`` pages, when a key or a continuation token
    comes twice (a page repeated), or after :data:`LIST_EMPTY_PAGES` pages in a row without
    keys (``IsTruncated`` and a new token each time, for ever). The pages are ortckpt's own
    requests (ListObjectsV2: :func:`ortckpt.object_requests.list_pages`) where the store has
    static credentials, each within the request deadlines and :data:`XML_LIMIT` bytes; otherwise
    obstore's, which hides
    them: it hands over :data:`LIST_PAGE_KEYS` keys at a time, each counted as a page, and a
    server's pages without keys it asks for until it is stopped."""
    prefix = f"{location.key}/" if location.key else ""
    if signs(location.store):
        batches: Iterable[Any] = (keys for keys, _ in list_pages(location, prefix, "", max_pages))
    else:
        import obstore

        batches = (
            {m["path"]: m["size"] for m in batch}
            for batch in obstore.list(location.store, prefix or None, chunk_size=LIST_PAGE_KEYS)
        )
    return _calling(location, _listed, location, batches, prefix, max_keys, max_pages)


def list_folders(location: Location, *, max_folders: int = LIST_KEYS, max_pages: int = LIST_PAGES) -> list[str]:
    """The names of the folders directly under ``location`` taken as a prefix (a listing by
    ``/``: S3's common prefixes), bounded as :func:`list_keys` is. It is the listing of one
    folder, where :func:`list_keys` may be a walk of many: a server that walks a tree (SeaweedFS,
    MinIO) lists each folder at another moment, each one after the first perhaps gone by then
    and what replaced it not yet there when the walk began. With a store without static
    credentials, obstore's listing (its pages hidden: one without end is not stopped)."""
    prefix = f"{location.key}/" if location.key else ""
    if not signs(location.store):
        import obstore

        listed = _calling(location, obstore.list_with_delimiter, location.store, prefix or None)
        found = [str(p) for p in listed["common_prefixes"]]
    else:
        found = []
        for _, folders in list_pages(location, prefix, "/", max_pages):
            found += folders
            if len(found) > max_folders:
                raise ObjectStoreError(f"{location.url.rstrip('/')}/", f"listing: over {max_folders} folders")
    return [name[len(prefix) :].strip("/") for name in found if name.startswith(prefix)]


def _listed(location: Location, batches: Any, prefix: str, max_keys: int, max_pages: int) -> list[tuple[str, int]]:
    """The listing's batches ({key: size}), each a request (so their failures are mapped by the
    caller), checked: bounded, no key twice."""

    def failed(problem: str) -> ObjectStoreError:
        return ObjectStoreError(f"{location.url.rstrip('/')}/", f"listing: {problem}")

    out: list[tuple[str, int]] = []
    seen: set[str] = set()  # (S3 lists keys in order, but some servers not quite: a set, not a comparison)
    for count, batch in enumerate(batches, 1):
        if count > max_pages:
            raise failed(f"over {max_pages} pages")
        for path, size in batch.items():
            if path in seen:
                raise failed(f"{path!r} listed twice (a page repeated: the server repeats its continuation token)")
            seen.add(path)
            if path.startswith(prefix):
                out.append((path[len(prefix) :], size))
        if len(seen) > max_keys:
            raise failed(f"over {max_keys} keys")
    return out


def remove(locations: list[Location]) -> None:
    """Deletes the objects (of one store); missing ones are not an error."""
    import obstore

    for start in range(0, len(locations), 1000):  # S3 deletes up to 1000 keys a request
        batch = locations[start : start + 1000]
        _calling(batch[0], obstore.delete, batch[0].store, [location.key for location in batch])


def remove_under(location: Location, *, max_keys: int = LIST_KEYS) -> None:
    """Deletes every object under ``location`` taken as a prefix (a step's, an attempt's folder)."""
    remove([location.child(key) for key, _ in list_keys(location, max_keys=max_keys)])
