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

Configuration, as boto3 finds it: ``storage_options`` first (``endpoint_url``, ``region``,
``access_key_id``/``key``, ``secret_access_key``/``secret``, ``session_token``/``token``,
``profile``, ``max_retries``, ``retry_timeout`` in seconds, or any obstore S3 setting), then
the ``AWS_*`` environment variables, then the profile (``AWS_PROFILE`` or ``default``) in
``~/.aws/credentials`` and ``~/.aws/config``.
"""

from __future__ import annotations

import configparser
import datetime
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ObjectStoreError

# Multipart upload parts: S3 allows 10,000 per object, so up to 160 GiB per object.
PART_BYTES = 16 << 20
PARTS_IN_FLIGHT = 8


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


def location(bucket: str, key: str, url: str, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The object ``key`` of ``bucket`` (``url`` names it in messages), its store configured
    from ``storage_options``, the environment and the AWS profile files."""
    return Location(_store(bucket, dict(storage_options or {})), bucket, key, url)


def _store(bucket: str, options: dict[str, Any]) -> Any:
    from obstore.store import S3Store

    aliases = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}
    options = {aliases.get(k, k): v for k, v in options.items()}
    profile_name = options.pop("profile", None)
    retry = {name: options.pop(name) for name in ("max_retries", "retry_timeout") if options.get(name) is not None}
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
    client_options = {"allow_http": str(config.get("endpoint", "")).startswith("http://")}
    retry_config: dict[str, Any] = {}
    if "max_retries" in retry:
        retry_config["max_retries"] = int(retry["max_retries"])
    if "retry_timeout" in retry:
        retry_config["retry_timeout"] = datetime.timedelta(seconds=float(retry["retry_timeout"]))
    try:
        settings: dict[str, Any] = {"config": config, "client_options": client_options}
        return S3Store(bucket, **settings, retry_config=retry_config or None)  # type: ignore[arg-type]
    except Exception as e:  # obstore's configuration errors
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


def put_stream(location: Location, pieces: Iterable[Any], digest: Any = None) -> int:
    """Uploads the concatenated ``pieces`` (buffers) as ``location``: one PUT when they fit in
    a part, else a multipart upload that the object appears with when it completes (aborted if
    a piece fails). Large buffers are sliced into parts without copying. ``digest`` (a hashlib
    object) is fed the bytes as they go. Returns the object's size."""
    import obstore

    pieces = list(pieces)
    size = sum(memoryview(p).nbytes for p in pieces)
    if size <= PART_BYTES:
        data = b"".join(memoryview(p).cast("B") for p in pieces)
        if digest is not None:
            digest.update(data)
        _calling(location, obstore.put, location.store, location.key, data, use_multipart=False)
        return size
    _calling(
        location,
        obstore.put,
        location.store,
        location.key,
        _parts(pieces, digest),
        use_multipart=True,
        chunk_size=PART_BYTES,
        max_concurrency=PARTS_IN_FLIGHT,
    )
    return size


def _parts(pieces: list[Any], digest: Any = None) -> Iterator[memoryview]:
    for piece in pieces:
        view = memoryview(piece).cast("B")
        for start in range(0, view.nbytes, PART_BYTES):
            part = view[start : start + PART_BYTES]
            if digest is not None:  # the upload takes parts in order (hashlib lets the GIL go)
                digest.update(part)
            yield part


def put(location: Location, data: bytes) -> None:
    """Writes ``location`` with ``data`` (one PUT), replacing it."""
    import obstore

    _calling(location, obstore.put, location.store, location.key, data, use_multipart=False)


def put_new(location: Location, data: bytes) -> bool:
    """Creates ``location`` with ``data`` only if no object has its key (a conditional PUT:
    of two writers, one wins). False when another object is there. An object holding exactly
    ``data`` is this PUT's own, found by a retry after its answer was lost (callers' documents
    name a random attempt, so no other writer's has the same bytes): True."""
    import obstore
    from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError

    try:
        obstore.put(location.store, location.key, data, use_multipart=False, mode="create")
    except (AlreadyExistsError, PreconditionError):
        try:
            return bytes(get(location)) == data
        except FileNotFoundError:  # deleted since: not ours to claim
            return False
    except (BaseError, FileNotFoundError) as e:
        raise _failure(location, e) from e
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


def get(location: Location, etag: str | None = None) -> Any:
    """The whole object, in memory (a read-only buffer); with ``etag``, only that version."""
    import obstore

    options = {"if_match": etag} if etag else None
    result = _calling(location, obstore.get, location.store, location.key, options=options)
    return _calling(location, result.bytes)


def get_range(location: Location, start: int, length: int, etag: str | None = None) -> Any:
    """``length`` bytes of the object from ``start`` (a read-only buffer); with ``etag``, only that version."""
    import obstore

    if length == 0:
        return b""
    options: dict[str, Any] = {"range": (start, start + length)}
    if etag:
        options["if_match"] = etag
    result = _calling(location, obstore.get, location.store, location.key, options=options)
    data = _calling(location, result.bytes)
    if len(data) != length:
        raise ObjectStoreError(location.url, f"asked for {length} bytes at {start}, got {len(data)}")
    return data


def sha256_of(location: Location) -> tuple[int, str]:
    """The object's size and SHA-256, read as a stream (memory: one chunk)."""
    import hashlib

    import obstore

    def read() -> tuple[int, str]:  # every chunk a read that can fail: mapped by _calling
        digest, size = hashlib.sha256(), 0
        for chunk in obstore.get(location.store, location.key).stream(min_chunk_size=PART_BYTES):
            digest.update(chunk)
            size += memoryview(chunk).nbytes
        return size, digest.hexdigest()

    return _calling(location, read)


def list_keys(location: Location) -> list[tuple[str, int]]:
    """(key relative to ``location`` as a prefix, size) of every object under it."""
    import obstore

    prefix = f"{location.key}/" if location.key else ""
    return _calling(location, _listed, obstore.list(location.store, prefix or None), prefix)


def _listed(pages: Any, prefix: str) -> list[tuple[str, int]]:
    """The listing's pages, each a request (so their failures are mapped by the caller)."""
    out = []
    for batch in pages:
        for meta in batch:
            path = meta["path"]
            if path.startswith(prefix):
                out.append((path[len(prefix) :], meta["size"]))
    return out


def remove(locations: list[Location]) -> None:
    """Deletes the objects (of one store); missing ones are not an error."""
    import obstore

    for start in range(0, len(locations), 1000):  # S3 deletes up to 1000 keys a request
        batch = locations[start : start + 1000]
        _calling(batch[0], obstore.delete, batch[0].store, [location.key for location in batch])


def remove_under(location: Location) -> None:
    """Deletes every object under ``location`` taken as a prefix (a step's, an attempt's folder)."""
    remove([location.child(key) for key, _ in list_keys(location)])


def download_to(
    location: Location, fd: int, *, expected_size: int | None = None, etag: str | None = None, digest: Any = None
) -> int:
    """Streams the object into the open file ``fd`` (one chunk in memory at a time), feeding
    ``digest`` (a hashlib object) if given; returns its size. ObjectStoreError when it is not
    ``expected_size`` bytes."""
    import obstore

    def read() -> int:
        options: Any = {"if_match": etag} if etag else None
        size = 0
        for chunk in obstore.get(location.store, location.key, options=options).stream(min_chunk_size=PART_BYTES):
            view = memoryview(chunk).cast("B")
            if digest is not None:
                digest.update(view)
            if expected_size is not None and size + view.nbytes > expected_size:
                raise ObjectStoreError(location.url, f"more than the {expected_size} bytes expected")
            while view:
                written = os.pwrite(fd, view, size)
                view, size = view[written:], size + written
        return size

    size = _calling(location, read)
    if expected_size is not None and size != expected_size:
        raise ObjectStoreError(location.url, f"{size} bytes, {expected_size} expected")
    return size
