"""A hostile S3 endpoint for the tests: an http.server on 127.0.0.1, in a thread, answering just
enough of S3 for obstore (HEAD, GET, ListObjectsV2) and for ortckpt's own signed requests
(ListMultipartUploads, AbortMultipartUpload), accepting any signature, and lying in the ways a
broken or malicious server can. What it does is chosen by the key or the prefix asked for:

- objects: ``huge`` (``Content-Length: 2**40``, then zeros), ``longer`` (``Content-Length: 16``
  but a chunked body of :data:`SENT_AT_MOST` bytes; for a range, the range declared and as much
  sent), ``shorter`` (declares 1 MiB, sends 100 bytes), ``silent`` (accepts the connection and never
  answers), ``drip`` (declares 1 MiB, sends a byte every 0.2 s), anything else: :data:`SMALL`;
- listings (ListObjectsV2 and ListMultipartUploads alike): prefix ``same/`` (the same page and the
  same continuation token forever), ``endless/`` (pages of new keys forever), ``empty/`` (empty
  truncated pages forever), ``silent/``, ``flaky/`` (every other request answered 503, the others
  one honest page), anything else one honest page; for uploads also ``drip/``,
  ``bomb/`` (an entity-expansion bomb), ``oversized/`` (``Content-Length: 2**40``) and
  ``unbounded/`` (a chunked body that never ends).

Whatever it streams stops after :data:`SENT_AT_MOST` bytes, so a client that does not stop shows
in its memory, not as a test that never ends.
"""

from __future__ import annotations

import http.server
import threading
import urllib.parse
from typing import Any

HUGE = 2**40
SENT_AT_MOST = 256 << 20
SMALL = b"a small object"
LAST_MODIFIED = "Mon, 01 Jan 2024 00:00:00 GMT"
ISO_DATE = "2024-01-01T00:00:00.000Z"
S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"


class HostileS3:
    def __init__(self) -> None:
        self.released = threading.Event()  # lets the never-answering handlers go, at stop()
        self.requests: list[str] = []
        handler = type("Handler", (_Handler,), {"hostile": self})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def storage_options(self, **more: Any) -> dict[str, Any]:
        """Deadlines of a few seconds and no retries, so that each case ends quickly."""
        return {
            "endpoint_url": self.url,
            "access_key_id": "hostile",
            "secret_access_key": "hostile-secret",
            "timeout": 3,
            "connect_timeout": 2,
            "max_retries": 0,
            **more,
        }

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:  # a client that hung up: expected
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    hostile: HostileS3
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # (headers and body are separate writes)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _target(self) -> tuple[str, dict[str, str]]:
        """(key, query) of the request, the bucket dropped (path-style)."""
        url = urllib.parse.urlsplit(self.path)
        _, _, key = url.path.lstrip("/").partition("/")
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        self.hostile.requests.append(f"{self.command} {self.path}")
        return urllib.parse.unquote(key), query

    def _headers(self, status: int, headers: dict[str, Any]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, str(value))
        self.end_headers()

    def _silent(self) -> None:
        self.hostile.released.wait()
        self.close_connection = True

    def _drip(self, headers: dict[str, Any]) -> None:
        """Declares a mebibyte, then sends a byte at a time, never leaving a read waiting long."""
        self._headers(200, {**headers, "Content-Length": 1 << 20})
        try:
            while not self.hostile.released.wait(0.2):
                self.wfile.write(b"<")
        except OSError:
            pass
        self.close_connection = True

    def _zeros(self, count: int, *, chunked: bool = False) -> None:
        chunk = bytes(1 << 20)
        try:
            while count > 0:
                piece = chunk[: min(count, len(chunk))]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                count -= len(piece)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client gave up: what it should do
            pass
        self.close_connection = True

    def do_HEAD(self) -> None:
        key, _ = self._target()
        if key == "silent":
            return self._silent()
        size = {"huge": HUGE, "longer": 16, "shorter": 1 << 20}.get(key, len(SMALL))
        self._headers(200, {"Content-Length": size, "ETag": '"e"', "Last-Modified": LAST_MODIFIED})

    def do_GET(self) -> None:
        key, query = self._target()
        if "uploads" in query:
            return self._uploads(query)
        if query.get("list-type") == "2":
            return self._objects(query)
        meta = {"ETag": '"e"', "Last-Modified": LAST_MODIFIED}
        if key == "silent":
            return self._silent()
        if key == "drip":
            return self._drip(meta)
        if key in ("huge", "longer") and self.headers.get("Range"):  # the range asked for, and more
            first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
            length = int(last) - int(first) + 1
            ranged = {"Content-Range": f"bytes {first}-{last}/{HUGE}", "Content-Length": length}
            self._headers(206, {**meta, **ranged, "Transfer-Encoding": "chunked"})
            return self._zeros(SENT_AT_MOST, chunked=True)
        if key == "huge":
            self._headers(200, {**meta, "Content-Length": HUGE})
            return self._zeros(SENT_AT_MOST)
        if key == "longer":  # a chunked body is as long as the server likes, whatever it declared
            self._headers(200, {**meta, "Content-Length": 16, "Transfer-Encoding": "chunked"})
            return self._zeros(SENT_AT_MOST, chunked=True)
        if key == "shorter":
            self._headers(200, {**meta, "Content-Length": 1 << 20})
            self.wfile.write(bytes(100))
            self.close_connection = True
            return None
        self._headers(200, {**meta, "Content-Length": len(SMALL)})
        self.wfile.write(SMALL)
        return None

    def do_DELETE(self) -> None:
        key, query = self._target()
        if key == "silent" or query.get("uploadId") == "silent":
            return self._silent()
        self._headers(204, {"Content-Length": 0})
        return None

    def _xml(self, body: str) -> None:
        data = body.encode()
        self._headers(200, {"Content-Type": "application/xml", "Content-Length": len(data)})
        self.wfile.write(data)

    def _objects(self, query: dict[str, str]) -> None:
        """ListObjectsV2."""
        prefix, token = query.get("prefix", ""), query.get("continuation-token", "")
        if prefix.startswith("silent/"):
            return self._silent()
        if prefix.startswith("flaky/") and sum("flaky" in r for r in self.hostile.requests) % 2:
            data = b"<Error><Code>SlowDown</Code></Error>"
            self._headers(503, {"Content-Type": "application/xml", "Content-Length": len(data)})
            self.wfile.write(data)
            return None
        keys: list[str] = []
        following = "again"
        if prefix.startswith("same/"):
            keys = [f"{prefix}a", f"{prefix}b"]
        elif prefix.startswith("endless/"):
            page = int(token or 0)
            keys = [f"{prefix}{page:09d}-{i:04d}" for i in range(1000)]
            following = str(page + 1)
        elif prefix.startswith("empty/"):
            following = str(int(token or 0) + 1)
        else:  # an honest listing: one key, one page
            keys, following = [f"{prefix}only"], ""
        truncated = "true" if following else "false"
        contents = "".join(
            f"<Contents><Key>{k}</Key><LastModified>{ISO_DATE}</LastModified><ETag>&quot;e&quot;</ETag>"
            f"<Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>"
            for k in keys
        )
        self._xml(
            f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{S3_NS}"><Name>b</Name>'
            f"<Prefix>{prefix}</Prefix><KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<IsTruncated>{truncated}</IsTruncated>{contents}"
            + (f"<NextContinuationToken>{following}</NextContinuationToken>" if following else "")
            + "</ListBucketResult>"
        )
        return None

    def _uploads(self, query: dict[str, str]) -> None:
        """ListMultipartUploads."""
        prefix, marker = query.get("prefix", ""), query.get("key-marker", "")
        if prefix.startswith("silent/"):
            return self._silent()
        if prefix.startswith("drip/"):
            return self._drip({"Content-Type": "application/xml"})
        if prefix.startswith("bomb/"):
            laughs = "".join(f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 10))
            return self._xml(
                f'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY l0 "lol">{laughs}]>'
                f'<ListMultipartUploadsResult xmlns="{S3_NS}"><Upload><Key>&l9;</Key></Upload>'
                "</ListMultipartUploadsResult>"
            )
        if prefix.startswith("oversized/"):
            self._headers(200, {"Content-Type": "application/xml", "Content-Length": HUGE})
            return self._zeros(SENT_AT_MOST)
        if prefix.startswith("unbounded/"):
            self._headers(200, {"Content-Type": "application/xml", "Transfer-Encoding": "chunked"})
            return self._zeros(SENT_AT_MOST, chunked=True)
        uploads: list[tuple[str, str]] = []
        following = ("again", "again")
        if prefix.startswith("same/"):
            uploads = [(f"{prefix}a", "1"), (f"{prefix}b", "2")]
            following = (f"{prefix}b", "2")
        elif prefix.startswith("endless/"):
            page = int(marker.rpartition("/")[2].partition("-")[0] or -1) + 1
            uploads = [(f"{prefix}{page:09d}-{i:04d}", str(i)) for i in range(1000)]
            following = uploads[-1]
        elif prefix.startswith("empty/"):
            page = int(marker.rpartition("/")[2] or 0) + 1
            following = (f"{prefix}{page:09d}", "x")
        else:  # an honest listing: one upload, one page
            uploads, following = [(f"{prefix}only", "1")], ("", "")
        truncated = "true" if following[0] else "false"
        body = "".join(
            f"<Upload><Key>{k}</Key><UploadId>{u}</UploadId><Initiated>{ISO_DATE}</Initiated></Upload>"
            for k, u in uploads
        )
        self._xml(
            f'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult xmlns="{S3_NS}"><Bucket>b</Bucket>'
            f"<KeyMarker>{marker}</KeyMarker><Prefix>{prefix}</Prefix><MaxUploads>1000</MaxUploads>"
            f"<IsTruncated>{truncated}</IsTruncated><NextKeyMarker>{following[0]}</NextKeyMarker>"
            f"<NextUploadIdMarker>{following[1]}</NextUploadIdMarker>{body}</ListMultipartUploadsResult>"
        )
        return None
