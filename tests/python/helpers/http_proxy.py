"""A small HTTP reverse proxy in front of the tests' MLflow server, where a deployment puts nginx:
it answers 413 Request Entity Too Large to a request body over its limit (nginx's
``client_max_body_size``, 1 MiB by default), or resets its connection, and forwards every other
request. A test can make
it hold every request until released (a server that accepts and has not answered yet), or
answer the requests of one method with a status of its choice (an outage: 503)."""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NGINX_LIMIT = 2**20
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}


class Proxy:
    def __init__(self, upstream: str, limit: int = NGINX_LIMIT) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.limit = limit
        self.reset_over_limit = False  # True: a body over the limit gets its connection reset, no answer
        self.outage: dict[str, int] = {}  # method -> the status every such request is answered with
        self.delay = 0.0  # seconds each request waits before it is forwarded: a slow server that answers
        self.answered: list[tuple[str, str, int]] = []  # (method, path, status): what it answered itself
        self.released = threading.Event()
        self.released.set()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="proxy", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        """Requests wait (their bodies read, nothing answered) until :meth:`release`."""
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    owner: Proxy
    protocol_version = "HTTP/1.1"

    def do_any(self) -> None:
        proxy = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        if length > proxy.limit and proxy.reset_over_limit:
            proxy.answered.append((self.command, self.path, 0))
            # Closed with a reset (SO_LINGER 0), the body unread: what a proxy that stops
            # reading (nginx past its lingering_time) leaves the client.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if length > proxy.limit:
            # As nginx: refused on the declared length, at once; then the body read and dropped
            # (its lingering close), so that the client reads the answer, not a reset.
            self._answer(413, "Request Entity Too Large")
            while length > 0 and (chunk := self.rfile.read(min(2**16, length))):
                length -= len(chunk)
            return
        body = self.rfile.read(length)
        proxy.released.wait()
        time.sleep(proxy.delay)
        status = proxy.outage.get(self.command)
        if status is not None:
            self._answer(status, http.client.responses.get(status, ""))
            return
        upstream = http.client.HTTPConnection(*proxy.upstream, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_any

    def _answer(self, status: int, reason: str) -> None:
        self.owner.answered.append((self.command, self.path, status))
        page = f"<html><head><title>{status} {reason}</title></head><body><center><h1>{status} {reason}</h1>"
        page += "</center><hr><center>nginx</center></body></html>\r\n"
        data = page.encode()
        self.send_response(status, reason)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:  # quiet: the test's output is the test's
        pass
