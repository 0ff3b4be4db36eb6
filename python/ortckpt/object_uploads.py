"""The multipart uploads that killed writers left under a prefix (invisible, but their parts are
kept, and billed): listed by :func:`pending_uploads` and aborted by :func:`abort_upload`. obstore
has neither, so these are ortckpt's own requests (:mod:`ortckpt.object_requests`: the standard
library's, signed (SigV4) with the store's own configuration, static credentials only), their XML
bounded and without entities."""

from __future__ import annotations

import datetime

from .errors import ObjectStoreError
from .object_requests import children, signed, text, xml
from .object_store import LIST_KEYS, LIST_PAGES, Location


def pending_uploads(
    location: Location, *, max_uploads: int = LIST_KEYS, max_pages: int = LIST_PAGES
) -> list[tuple[str, str, datetime.datetime]]:
    """The multipart uploads begun under ``location`` taken as a prefix and neither completed
    nor aborted (a writer killed mid-upload leaves one: invisible, but its parts are kept, and
    billed): (key relative to ``location``, upload ID, when it began). An
    :class:`ObjectStoreError` naming the prefix when the listing passes ``max_uploads`` uploads
    or ``max_pages`` pages, repeats an upload or its markers, or answers other than bounded,
    entity-free XML."""
    prefix = f"{location.key}/" if location.key else ""
    where = f"{location.url.rstrip('/')}/"
    out: list[tuple[str, str, datetime.datetime]] = []
    seen: set[tuple[str, str]] = set()
    markers = {("", "")}  # those asked with: a server that sends one twice would loop
    key_marker = upload_marker = ""
    for _ in range(max_pages):
        query = {"uploads": "", "prefix": prefix, "max-uploads": "1000"}
        if key_marker:
            query["key-marker"], query["upload-id-marker"] = key_marker, upload_marker
        page = xml(where, signed(location, where, "GET", "", query))
        for upload in children(page, "Upload"):
            key, upload_id = text(upload, "Key"), text(upload, "UploadId")
            if (key, upload_id) in seen:
                raise ObjectStoreError(where, f"listing uploads: {key!r} {upload_id!r} listed twice")
            seen.add((key, upload_id))
            if len(seen) > max_uploads:
                raise ObjectStoreError(where, f"listing uploads: over {max_uploads}")
            if key.startswith(prefix):
                out.append((key[len(prefix) :], upload_id, _time(where, text(upload, "Initiated"))))
        if text(page, "IsTruncated") != "true":
            return out
        key_marker, upload_marker = text(page, "NextKeyMarker"), text(page, "NextUploadIdMarker")
        if (key_marker, upload_marker) in markers:
            raise ObjectStoreError(where, f"listing uploads: the markers {key_marker!r} {upload_marker!r} repeat")
        markers.add((key_marker, upload_marker))
    raise ObjectStoreError(where, f"listing uploads: over {max_pages} pages")


def abort_upload(location: Location, upload_id: str) -> None:
    """Aborts the multipart upload ``upload_id`` of ``location`` (see :func:`pending_uploads`);
    one already gone is not an error."""
    signed(location, location.url, "DELETE", location.key, {"uploadId": upload_id}, missing_ok=True)


def _time(url: str, text: str) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ObjectStoreError(url, f"the server's time {text!r} is not an ISO 8601 time") from None
