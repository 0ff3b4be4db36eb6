"""Downloads of a step's objects on object storage (:mod:`.objects`), each checked against what
the step's metadata.json records as it comes: no download is larger than its entry, and no object
that is not the one the step recorded is taken for it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import object_store, safe_io
from ..checkpoint_state import CheckpointState, open_checkpoint
from ..errors import CheckpointError, CheckpointIntegrityError
from ..object_store import Location
from . import entries


def hashed(source: Location, local: Path, recorded: int) -> tuple[int, str] | BaseException:
    """Streams an object into the new file ``local``: its (size, SHA-256), or the error (the
    file then absent). One the server declares of another size than the ``recorded`` one is
    refused before a byte of it is read (no download is larger than its step records)."""
    digest = hashlib.sha256()
    fd = safe_io.create_exclusive(local)
    try:
        found = object_store.head(source)
        if found is None:
            raise FileNotFoundError(2, "no such object", source.url)
        if found.size != recorded:
            raise CheckpointIntegrityError(source.url, [f"{source.url}: {found.size} bytes, metadata says {recorded}"])
        size = object_store.download_to(source, fd, expected_size=recorded, etag=found.etag, digest=digest)
    except (OSError, CheckpointError) as e:
        os.close(fd)
        os.unlink(local)
        return e
    os.close(fd)
    return size, digest.hexdigest()


def recorded(
    folder: Location, name: str, recorded: Mapping[str, dict[str, Any]], path: Path, run: Location
) -> dict[str, str | None]:
    """Streams the checkpoint object ``name`` of a step's ``folder`` (and its data object, when
    metadata.json records one) into ``path`` (and ``path.data``), refusing, with
    :class:`~ortckpt.CheckpointIntegrityError` naming the object, one that is not what the step
    recorded: another size (refused before a byte is read: no download is larger than its
    entry), another checksum root or pair id (its last bytes). Its content is proven by the ETag
    its upload recorded, the one the server declares, and the GET conditional on it (free); an
    object without that (another ETag: copied over, or the same bytes copied from elsewhere; an
    older step's entry) by its SHA-256, taken as the bytes come (no second read). A missing
    object is FileNotFoundError naming it. A data object the steps share is read from the run's
    shared folder (``run``), where its entry says (``object``). Returns, by file, the ETag its GET
    was conditional on (None: the server gave none)."""
    problems = []
    etags: dict[str, str | None] = {}
    for file, local in ((name, path), (f"{name}.data", Path(f"{path}.data"))):
        entry = recorded.get(file)
        if entry is None:
            continue
        key = entry.get("object")
        source = run.child(key) if isinstance(key, str) else folder.child(file)
        found = object_store.head(source)
        if found is None:
            raise FileNotFoundError(2, "no such object", source.url)
        if found.size != entry["bytes"]:
            problems.append(f"{source.url}: {found.size} bytes, metadata says {entry['bytes']}")
            continue
        proven = found.etag is not None and entry.get("etag") == found.etag
        digest = None if proven or "sha256" not in entry else hashlib.sha256()
        fd = safe_io.create_exclusive(local)
        try:
            object_store.download_to(source, fd, expected_size=entry["bytes"], etag=found.etag, digest=digest)
        finally:
            os.close(fd)
        etags[file] = found.etag
        if digest is not None and "sha256" in entry and digest.hexdigest() != entry["sha256"]:
            problems.append(f"{source.url}: SHA-256 {digest.hexdigest()} differs from metadata's {entry['sha256']}")
            continue
        problem = entries.check_cheaply(local, dict(entry))  # (a step uploaded from a directory: root, pair id)
        if problem is not None:
            problems.append(f"{source.url}: {problem}")
    if problems:
        raise CheckpointIntegrityError(
            folder.child(name).url,
            [f"{p} (not the object its step records: refused)" for p in problems],
        )
    return etags


def opened(path: Path, url: str, data: str | None = None) -> CheckpointState:
    """The checkpoint downloaded to ``path``, mapped (the maps keep the bytes); an error in it
    names the objects the user knows (``url``, its data object ``data``), not the scratch copy."""
    try:
        return open_checkpoint(path, follow_symlinks=False)
    except CheckpointError as e:
        e.filename = url
        e.args = (str(e).replace(f"{path}.data", data or f"{url}.data").replace(str(path), url),)
        raise


__all__ = ["hashed", "opened", "recorded"]
