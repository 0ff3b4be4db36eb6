"""ortckpt's own requests to S3, signed (SigV4) with a store's own configuration, where obstore has
no call (the multipart uploads killed writers left: :mod:`ortckpt.object_uploads`) or hides what
must be bounded (the pages of a listing: :func:`list_pages`, for
:func:`ortckpt.object_store.list_keys` and ``list_folders``; obstore asks for empty ones for ever).
Each has the store's deadlines, and a read is tried again as obstore tries its own
(:func:`signed`); their XML is read up to :data:`XML_LIMIT` bytes, without entities. Static
credentials only (:func:`signs`)."""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import ObjectStoreError

# Keys a page of a listing (S3's most), and pages in a row without keys, each saying more follow,
# past which a listing is an error (S3 may send a few; a server that sends them for ever would be
# listed for ever).
LIST_PAGE_KEYS = 1000
LIST_EMPTY_PAGES = 100
# The largest XML answer read (a page of 1000 keys or multipart uploads is under 1 MiB).
XML_LIMIT = 4 << 20
# Every request's deadlines, in seconds (storage_options of the same names override them):
# connecting, and the whole request (a part of an upload; a GET's body cut by it is resumed
# from where it stopped, a retry of obstore's).
DEADLINES = {"connect_timeout": 10.0, "timeout": 60.0}


def signs(store: Any) -> bool:
    """Whether ortckpt signs requests to ``store`` itself: it has static credentials."""
    config = config_of(store)
    return bool(config.get("access_key_id") and config.get("secret_access_key"))


def list_pages(
    location: Any, prefix: str, delimiter: str, max_pages: int
) -> Iterator[tuple[dict[str, int], list[str]]]:
    """The pages of a ListObjectsV2 of ``prefix`` (by ``delimiter`` if not empty), as they come:
    ({key: size}, common prefixes). Each is one request within the store's deadlines (tried
    again as obstore tries its own: :func:`_signed`), its XML read up to :data:`XML_LIMIT`
    bytes; the pages stop (an ObjectStoreError naming the prefix) at ``max_pages``, at a
    continuation token that comes twice, or after :data:`LIST_EMPTY_PAGES` pages in a row
    that hold nothing."""
    where = f"{location.url.rstrip('/')}/"
    tokens: set[str] = set()
    token = ""
    empty = 0
    for _ in range(max_pages):
        query = {"list-type": "2", "prefix": prefix, "max-keys": str(LIST_PAGE_KEYS)}
        if delimiter:
            query["delimiter"] = delimiter
        if token:
            query["continuation-token"] = token
        page = xml(where, signed(location, where, "GET", "", query, retried=True))
        keys = {}
        for content in children(page, "Contents"):
            fields = {child.tag.rpartition("}")[2]: child.text or "" for child in content}  # (one pass each)
            try:
                keys[fields.get("Key", "")] = int(fields.get("Size", ""))
            except ValueError:
                raise ObjectStoreError(where, f"listing: the size of {fields.get('Key')!r} is no number") from None
        folders = [text(common, "Prefix") for common in children(page, "CommonPrefixes")]
        yield keys, folders
        if text(page, "IsTruncated") != "true":
            return
        empty = 0 if keys or folders else empty + 1
        if empty >= LIST_EMPTY_PAGES:
            raise ObjectStoreError(where, f"listing: {empty} pages in a row hold nothing, each saying more follow")
        token = text(page, "NextContinuationToken")
        if not token or token in tokens:
            raise ObjectStoreError(
                where, f"listing: the continuation token {token!r} {'repeats' if token else 'is missing'}"
            )
        tokens.add(token)
    raise ObjectStoreError(where, f"listing: over {max_pages} pages")


def signed(
    location: Any,
    url: str,
    method: str,
    key: str,
    query: dict[str, str],
    *,
    missing_ok: bool = False,
    retried: bool = False,
) -> bytes:
    """The body of a request obstore cannot send (to ``key``, or the bucket with ``""``), signed
    as the store is configured (static credentials only), with its deadlines, read up to
    :data:`XML_LIMIT` bytes. Failures, an error status (but 404 with ``missing_ok``), are
    ObjectStoreErrors naming ``url``. With ``retried`` (a read), one that trying again may mend
    (a server error: 5xx, 429; no connection; no answer in time) is tried again as obstore tries
    its own requests: up to the store's ``max_retries`` (10 by default) within its
    ``retry_timeout`` (180 s), waiting 0.1 s, then twice as long each time, up to 15 s."""
    import time
    import urllib.parse

    config = config_of(location.store)
    if not (config.get("access_key_id") and config.get("secret_access_key")):
        raise ObjectStoreError(url, "multipart uploads are listed and aborted with static credentials only")
    base = urllib.parse.urlsplit(_bucket_url(config, location.bucket))
    path = base.path.rstrip("/") + "".join(f"/{_quoted(part)}" for part in key.split("/") if key)
    canonical_query = "&".join(f"{_quoted(k)}={_quoted(v)}" for k, v in sorted(query.items()))
    retry = (location.store.retry_config or {}) if retried else {"max_retries": 0}
    tries = int(retry.get("max_retries", 10))
    ends = time.monotonic() + (seconds_of(retry.get("retry_timeout")) or 180.0)
    wait = 0.1
    for attempt in range(tries + 1):
        headers = _signature_v4(config, method, base.netloc, path, canonical_query)
        try:
            status, reason, body = _exchange(url, base, method, f"{path}?{canonical_query}", headers, config)
        except _NoAnswer as e:
            failure = ObjectStoreError(url, e.problem)
        else:
            if status == 404 and missing_ok:
                return b""
            if 200 <= status < 300:
                return body
            try:
                code = text(xml(url, body), "Code")
            except ObjectStoreError:  # an error's body that is not S3's XML: the status says enough
                code = ""
            failure = ObjectStoreError(url, f"{method} {path}: HTTP {status} {code or reason}")
            if status < 500 and status != 429:
                raise failure
        if attempt == tries or time.monotonic() + wait > ends:
            raise failure
        time.sleep(wait)
        wait = min(wait * 2, 15.0)
    raise AssertionError("unreachable")


class _NoAnswer(Exception):
    """A request that got no answer (no connection, none in time): worth another try."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(problem)


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
            raise _NoAnswer(f"{method} {target}: no answer in {config['timeout']} s") from e
        raise _NoAnswer(f"{method} {target}: {type(e).__name__}: {e}") from e
    finally:
        deadline.cancel()
        connection.close()
    if expired.is_set():  # (the cut socket may read as an answer that ended early)
        raise _NoAnswer(f"{method} {target}: no answer in {config['timeout']} s")
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


def config_of(store: Any) -> dict[str, Any]:
    """What ``store`` (an obstore S3Store) was built from: its S3 settings (``aws_`` prefixes
    dropped) and its deadlines in seconds."""
    config = {str(k).removeprefix("aws_"): v for k, v in (store.config or {}).items()}
    if "token" in config:
        config.setdefault("session_token", config["token"])
    client = store.client_options or {}
    for name, default in DEADLINES.items():
        config[name] = seconds_of(client.get(name)) or default
    config["read_timeout"] = seconds_of(client.get("read_timeout"))
    return config


_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "day": 86400}


def seconds_of(duration: Any) -> float | None:
    """``duration`` as obstore reports it (``"2s 500ms"``, a timedelta) in seconds; None when
    there is none, or it cannot be read."""
    import re

    if isinstance(duration, datetime.timedelta):
        return duration.total_seconds()
    spans = re.findall(r"(\d+)\s*([a-z]+)", str(duration or ""))
    if not spans or any(unit not in _UNITS for _, unit in spans):
        return None
    return sum(int(count) * _UNITS[unit] for count, unit in spans)


def xml(url: str, body: bytes) -> Any:
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


def children(element: Any, name: str) -> list[Any]:
    return [child for child in element if child.tag.rpartition("}")[2] == name]


def text(element: Any, name: str) -> str:
    """The text of ``element``'s child ``name`` (whatever its namespace), or ``""``."""
    found = children(element, name)
    return (found[0].text or "") if found else ""
