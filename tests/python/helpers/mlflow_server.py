"""A real MLflow tracking server for the tests: ``mlflow server`` with a SQLite backend and a
local artifact store (served over HTTP), on 127.0.0.1, one per test session, stopped at its
end. ``make`` installs MLflow in its own venv and names its executable in ``ORTCKPT_MLFLOW``.

Starting it takes about half a minute of CPU (MLflow imports, the database's migrations): the
session starts it as soon as it knows a test will use it, and only those tests wait for it."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

STARTUP_SECONDS = 240  # on a busy machine; it is about 30 s on an idle one
STARTS = 3  # a port taken by someone else while MLflow was starting costs one more start


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768-60999): a port the kernel handed out
    would be handed out again to the next outgoing connection, and MLflow takes half a minute to
    bind (CI lost a run that way). Another suite can still take it: the servers retry."""
    for _ in range(1000):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767 on 127.0.0.1")


def stop_process_group(process: subprocess.Popen[bytes], *, politely: bool = True) -> None:
    """A server started with ``start_new_session`` and every process it started: politely, then not
    (or at once, when nothing it would write on its way out is wanted)."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if politely else (signal.SIGKILL,):
        try:
            os.killpg(process.pid, sig)
            process.wait(15)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


class MlflowServer:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ortckpt-mlflow-"))
        executable = os.environ.get("ORTCKPT_MLFLOW")
        if not executable:
            raise RuntimeError("ORTCKPT_MLFLOW names the mlflow executable (make sets it: make .venv-mlflow/.ok)")
        self.executable = executable
        self.starts = 0
        self._start()

    def _start(self) -> None:
        root = self.root
        executable = self.executable
        self.starts += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "mlflow-server.log"
        command = [executable, "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
        command += ["--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--workers", "1"]
        # Its background job runner (a dozen huey processes, each importing MLflow) serves GenAI
        # features these tests do not use; on two cores it doubled the time to start.
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.deadline = time.monotonic() + STARTUP_SECONDS
        self._up = False

    def wait_until_up(self) -> str:
        while not self._up:
            if self.process.poll() is not None:
                if "address already in use" in self._tail() and self.starts < STARTS:
                    self._start()
                    continue
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}:\n{self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    self._up = response.status == 200
            except OSError:
                if time.monotonic() > self.deadline:
                    raise RuntimeError(f"mlflow server not up in {STARTUP_SECONDS} s:\n{self._tail()}") from None
                time.sleep(0.25)
        return self.url

    def stop(self) -> None:
        """The server and its worker."""
        stop_process_group(self.process)
        shutil.rmtree(self.root, ignore_errors=True)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]
