"""A step's documents on an object store (:mod:`.objects`), read bounded: one over its kind's
cap is refused before a byte of it is read."""

from __future__ import annotations

from typing import Any

from .. import documents, object_store
from ..object_store import Location


def read(where: Location, kind: documents.Kind, size: int | None = None) -> Any:
    """A document object, validated; refused unread when over its kind's cap (by the size a
    listing gave, or the size the GET declares)."""
    if size is not None and size > kind.max_bytes:
        raise documents.DocumentError(f"{where.url}: {size} bytes, more than a {kind.name} may have")
    return documents.parse(kind, bytes(bounded_get(where, kind)), where.url)


def bounded_get(where: Location, kind: documents.Kind) -> Any:
    """A document's bytes: refused (DocumentError) before a byte is read when the server
    declares more than its kind's cap."""
    found = object_store.head(where)
    if found is None:
        raise FileNotFoundError(2, "no such object", where.url)
    if found.size > kind.max_bytes:
        raise documents.DocumentError(f"{where.url}: {found.size} bytes, more than a {kind.name} may have")
    return object_store.get(where, found.etag, expected_size=found.size)


__all__ = ["bounded_get", "read"]
