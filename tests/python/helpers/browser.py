"""Headless Chromium driven over its DevTools protocol, for tests of the HTML report.

No dependency but Chromium itself (Debian's ``chromium``; ``make chromium`` installs it): the
browser is started with ``--remote-debugging-pipe`` and reads commands on its fd 3, writes
answers and events on its fd 4, each a JSON message ended by a NUL byte. Every wait has a
deadline; the browser is killed and its profile removed when the block ends.

Run as a script it saves a screenshot: ``python tests/python/helpers/browser.py page.html shot.png``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEADLINE = 60.0  # seconds for any one answer or event: a page of the report loads in well under one


class BrowserError(AssertionError):
    pass


def find_chromium() -> str:
    """The browser to run: $ORTCKPT_CHROMIUM, else ``chromium`` (or ``chromium-browser``) on PATH."""
    given = os.environ.get("ORTCKPT_CHROMIUM")
    if given:
        if not os.access(given, os.X_OK):
            raise BrowserError(f"ORTCKPT_CHROMIUM={given} is not an executable")
        return given
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise BrowserError(
        "no chromium on PATH (nor ORTCKPT_CHROMIUM): the report's browser test needs it; "
        "`make chromium` installs Debian's package (apt-get install -y --no-install-recommends chromium)"
    )


def _high(fd: int) -> int:
    """``fd`` moved to a number of 10 or more, so that placing the child's 3 and 4 clobbers nothing."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    """One headless Chromium with one page, offline. Use as a context manager."""

    def __init__(self, width: int = 1300, height: int = 1500) -> None:
        self.width, self.height = width, height
        self.events: list[dict[str, Any]] = []
        self._next_id = 0
        self._buffer = b""

    def __enter__(self) -> Browser:
        self._profile = tempfile.mkdtemp(prefix="ortckpt-chromium-")
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        child_in, child_out = _high(to_child_r), _high(from_child_w)

        # The child's fds 3 and 4 placed by the shell that execs it (no preexec_fn: unsafe with threads).
        place = f'exec "$@" 3<&{child_in} 4>&{child_out} {child_in}<&- {child_out}>&-'
        self._process = subprocess.Popen(
            [
                "bash",  # (dash redirects fds 0 to 9 only)
                "-c",
                place,
                "bash",
                find_chromium(),
                "--headless",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile}",
                "--no-sandbox",  # (tests run as root in containers, where Chromium's sandbox cannot start)
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--proxy-server=127.0.0.1:9",  # anything the page tried to fetch would fail, not leave the machine
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(child_in, child_out),
            start_new_session=True,  # its own process group: the renderers are killed with it
        )
        os.close(child_in)
        os.close(child_out)
        self._write, self._read = to_child_w, from_child_r
        try:
            target = self.send("Target.createTarget", url="about:blank")["targetId"]
            self._session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.send(f"{domain}.enable", session=True)
            self.send(
                "Network.emulateNetworkConditions",
                session=True,
                offline=True,
                latency=0,
                downloadThroughput=-1,
                uploadThroughput=-1,
            )
            self.send(
                "Emulation.setDeviceMetricsOverride",
                session=True,
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        try:
            self._process.wait(timeout=DEADLINE)
        finally:
            for fd in (self._write, self._read):
                os.close(fd)
            shutil.rmtree(self._profile, ignore_errors=True)

    def send(self, method: str, *, session: bool = False, **params: Any) -> dict[str, Any]:
        """Sends a command and returns its result (events that come meanwhile are kept)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._write, data) :]
        while True:
            answer = self._receive(f"the answer to {method}")
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                return dict(answer.get("result", {}))
            self.events.append(answer)

    def wait_for(self, method: str) -> dict[str, Any]:
        """The next event ``method`` of the page (one that already came is taken first)."""
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return dict(self.events.pop(i))
        while True:
            event = self._receive(f"the event {method}")
            if event.get("method") == method:
                return event
            self.events.append(event)

    def _receive(self, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + DEADLINE
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise BrowserError(f"Chromium sent nothing for {DEADLINE:g} s, waiting for {what}")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium exited (code {self._process.poll()}) while waiting for {what}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return dict(json.loads(message))

    def open(self, page: Path) -> None:
        """Loads a file and waits for its load event."""
        self.send("Page.navigate", session=True, url=page.resolve().as_uri())
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (thrown errors raised)."""
        result = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def problems(self) -> list[str]:
        """Script errors and console or log errors and warnings the page caused so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"exception: {params['exceptionDetails']}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
                found.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Log.entryAdded" and params["entry"].get("level") in ("error", "warning"):
                found.append(f"log {params['entry']['level']}: {params['entry'].get('text')}")
            elif method == "Network.requestWillBeSent" and not params["request"]["url"].startswith(("file:", "data:")):
                found.append(f"a request: {params['request']['url']}")
        return found

    def screenshot(self, path: Path, *, full_page: bool = False) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            height = int(self.evaluate("document.documentElement.scrollHeight"))
            params.update(
                captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": self.width, "height": height, "scale": 1}
            )
        data = self.send("Page.captureScreenshot", session=True, **params)["data"]
        path.write_bytes(base64.b64decode(data))


if __name__ == "__main__":
    with Browser() as browser:
        browser.open(Path(sys.argv[1]))
        browser.screenshot(Path(sys.argv[2]))
        print("\n".join(browser.problems()) or "no problems")
