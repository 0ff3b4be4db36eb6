"""The multipart uploads that killed writers left under a prefix (invisible, but their parts are
kept, and billed): listed by :func:`pending_uploads` and aborted by :func:`abort_upload`. obstore
has neither, so these are requests of the standard library's, signed (SigV4) with the store's
own configuration (static credentials only), their XML bounded and without entities."""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Mapping
from typing import Any

from .errors import ObjectStoreError
from .object_store import DEADLINES, LIST_KEYS, LIST_PAGES, XML_LIMIT, Location


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
        page = _xml(where, _signed(location, where, "GET", "", query))
        for upload in _children(page, "Upload"):
            key, upload_id = _text(upload, "Key"), _text(upload, "UploadId")
            if (key, upload_id) in seen:
                raise ObjectStoreError(where, f"listing uploads: {key!r} {upload_id!r} listed twice")
            seen.add((key, upload_id))
            if len(seen) > max_uploads:
                raise ObjectStoreError(where, f"listing uploads: over {max_uploads}")
            if key.startswith(prefix):
                out.append((key[len(prefix) :], upload_id, _time(where, _text(upload, "Initiated"))))
        if _text(page, "IsTruncated") != "true":
            return out
        key_marker, upload_marker = _text(page, "NextKeyMarker"), _text(page, "NextUploadIdMarker")
        if (key_marker, upload_marker) in markers:
            raise ObjectStoreError(where, f"listing uploads: the markers {key_marker!r} {upload_marker!r} repeat")
        markers.add((key_marker, upload_marker))
    raise ObjectStoreError(where, f"listing uploads: over {max_pages} pages")


def abort_upload(location: Location, upload_id: str) -> None:
    """Aborts the multipart upload ``upload_id`` of ``location`` (see :func:`pending_uploads`);
    one already gone is not an error."""
    _signed(location, location.url, "DELETE", location.key, {"uploadId": upload_id}, missing_ok=True)


def _signed(
    location: Location, url: str, method: str, key: str, query: dict[str, str], *, missing_ok: bool = False
) -> bytes:
    """The body of a request obstore cannot send (to ``key``, or the bucket with ``""``), signed
    as the store is configured (static credentials only), with its deadlines, read up to
    :data:`XML_LIMIT` bytes. Failures, an error status (but 404 with ``missing_ok``), are
    ObjectStoreErrors naming ``url``."""
    import urllib.parse

    config = _config_of(location.store)
    if not (config.get("access_key_id") and config.get("secret_access_key")):
        raise ObjectStoreError(url, "multipart uploads are listed and aborted with static credentials only")
    base = urllib.parse.urlsplit(_bucket_url(config, location.bucket))
    path = base.path.rstrip("/") + "".join(f"/{_quoted(part)}" for part in key.split("/") if key)
    canonical_query = "&".join(f"{_quoted(k)}={_quoted(v)}" for k, v in sorted(query.items()))
    headers = _signature_v4(config, method, base.netloc, path, canonical_query)
    status, reason, body = _exchange(url, base, method, f"{path}?{canonical_query}", headers, config)
    if status == 404 and missing_ok:
        return b""
    if not 200 <= status < 300:
        try:
            code = _text(_xml(url, body), "Code")
        except ObjectStoreError:  # an error's body that is not S3's XML: the status says enough
            code = ""
        raise ObjectStoreError(url, f"{method} {path}: HTTP {status} {code or reason}")
    return body


def _signature_v4(config: Mapping[str, Any], method: str, host: str, path: str, query: str) -> dict[str, str]:
    """The headers that sign a request without a body (AWS Signature Version 4, service s3)."""
    import hashlib
    import hmac
    import time

    now = time.gmtime()
    stamp, day = time.strftime("%Y%m%dT%H%M%SZ", now), time.strftime("%Y%m%d", now)
    empty = hashlib.sha256(b"").hexdigest()
    headers = {"host": host, "x-amz-content-sha256": empty, "x-amz-date": stamp}
    if config.get("session_token"):
        headers["x-amz-security-token"] = str(config["session_token"])
    names = ";".join(sorted(headers))
    canonical = "\n".join([method, path, query, *(f"{n}:{headers[n]}" for n in sorted(headers)), "", names, empty])
    scope = f"{day}/{config.get('region') or 'us-east-1'}/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    key = f"AWS4{config['secret_access_key']}".encode()
    for part in scope.split("/"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    credential = f"{config['access_key_id']}/{scope}"
    headers["authorization"] = f"AWS4-HMAC-SHA256 Credential={credential}, SignedHeaders={names}, Signature={signature}"
    return headers


def _exchange(
    url: str, base: Any, method: str, target: str, headers: dict[str, str], config: Mapping[str, Any]
) -> tuple[int, str, bytes]:
    """(status, reason, body) of one request to ``base`` (a split URL): the connection within
    ``connect_timeout``, the whole exchange within ``timeout`` (a timer cuts the socket, whatever
    it waits on), the body refused past :data:`XML_LIMIT`, by its declared length if it has one."""
    import http.client
    import threading

    kind = http.client.HTTPSConnection if base.scheme == "https" else http.client.HTTPConnection
    connection = kind(base.hostname or "", base.port, timeout=config["connect_timeout"])
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        if connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)

    deadline = threading.Timer(config["timeout"], cut)
    deadline.start()
    try:
        connection.connect()
        connection.sock.settimeout(config["read_timeout"] or config["timeout"])  # type: ignore[union-attr]
        connection.request(method, target, headers=headers)
        response = connection.getresponse()
        declared = int(response.getheader("Content-Length") or 0)
        if declared > XML_LIMIT:
            raise ObjectStoreError(url, f"the server declares an answer of {declared} bytes, over {XML_LIMIT}")
        body = bytearray()
        while chunk := response.read1(XML_LIMIT + 1 - len(body)):
            body += chunk
            if len(body) > XML_LIMIT:
                raise ObjectStoreError(url, f"the server's answer runs over {XML_LIMIT} bytes")
    except ObjectStoreError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        if expired.is_set():
            raise ObjectStoreError(url, f"{method} {target}: no answer in {config['timeout']} s") from e
        raise ObjectStoreError(url, f"{method} {target}: {type(e).__name__}: {e}") from e
    finally:
        deadline.cancel()
        connection.close()
    if expired.is_set():  # (the cut socket may read as an answer that ended early)
        raise ObjectStoreError(url, f"{method} {target}: no answer in {config['timeout']} s")
    return response.status, response.reason, bytes(body)


def _quoted(text: str) -> str:
    """URI-encoded as Signature Version 4 wants (every byte but the unreserved characters)."""
    import urllib.parse

    return urllib.parse.quote(text, safe="-_.~")


def _bucket_url(config: Mapping[str, Any], bucket: str) -> str:
    """The bucket's URL as obstore addresses it: path-style under an endpoint unless
    ``virtual_hosted_style_request`` (then the endpoint is the bucket's own), else AWS's."""
    virtual = str(config.get("virtual_hosted_style_request", "")).lower() == "true"
    endpoint = config.get("endpoint")
    if endpoint:
        return str(endpoint) if virtual else f"{str(endpoint).rstrip('/')}/{bucket}"
    region = config.get("region") or "us-east-1"
    return f"https://{bucket}.s3.{region}.amazonaws.com" if virtual else f"https://s3.{region}.amazonaws.com/{bucket}"


def _config_of(store: Any) -> dict[str, Any]:
    """What ``store`` (an obstore S3Store) was built from: its S3 settings (``aws_`` prefixes
    dropped) and its deadlines in seconds."""
    config = {str(k).removeprefix("aws_"): v for k, v in (store.config or {}).items()}
    if "token" in config:
        config.setdefault("session_token", config["token"])
    client = store.client_options or {}
    for name, default in DEADLINES.items():
        config[name] = _seconds(client.get(name)) or default
    config["read_timeout"] = _seconds(client.get("read_timeout"))
    return config


_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "day": 86400}


def _seconds(duration: Any) -> float | None:
    """``duration`` as obstore reports it (``"2s 500ms"``, a timedelta) in seconds; None when
    there is none, or it cannot be read."""
    import re

    if isinstance(duration, datetime.timedelta):
        return duration.total_seconds()
    spans = re.findall(r"(\d+)\s*([a-z]+)", str(duration or ""))
    if not spans or any(unit not in _UNITS for _, unit in spans):
        return None
    return sum(int(count) * _UNITS[unit] for count, unit in spans)


def _xml(url: str, body: bytes) -> Any:
    """``body`` parsed as XML: UTF-8, with no document type (no entities to expand or fetch)."""
    import xml.etree.ElementTree as ElementTree

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ObjectStoreError(url, "the server's answer is not UTF-8 XML") from None
    if "<!DOCTYPE" in text or "<!ENTITY" in text:
        raise ObjectStoreError(url, "the server's XML declares a document type (entities): refused")
    try:
        return ElementTree.fromstring(text)
    except ElementTree.ParseError as e:
        raise ObjectStoreError(url, f"the server's XML is unreadable: {e}") from None


def _children(element: Any, name: str) -> list[Any]:
    return [child for child in element if child.tag.rpartition("}")[2] == name]


def _text(element: Any, name: str) -> str:
    """The text of ``element``'s child ``name`` (whatever its namespace), or ``""``."""
    found = _children(element, name)
    return (found[0].text or "") if found else ""


def _time(url: str, text: str) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ObjectStoreError(url, f"the server's time {text!r} is not an ISO 8601 time") from None
