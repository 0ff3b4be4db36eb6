from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "interop"

# A launcher that ignores SIGINT (a non-interactive shell's background job) passes that on to every
# process the tests start, and a Python started so never raises KeyboardInterrupt: the Ctrl-C tests
# would test the launcher. With Python's own handler here, each child starts with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class WarmOrt:
    """ONNX Runtime's interpreter, started once (tests/interop/ort_server.py): each command runs in a
    child it forks, in the caller's directory and environment, with a deadline. A command that misses
    it is killed with the server, which starts again for the next one."""

    def __init__(self, python: str) -> None:
        self.python = python
        self.process: subprocess.Popen | None = None
        self.pending = b""
        self.lock = threading.Lock()

    def start(self) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's stderr, for its life)
        self.pending = b""
        self.process = subprocess.Popen(
            [self.python, str(HERE / "ort_server.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )

    def server_log(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def reply(self, deadline: float) -> dict:
        assert self.process is not None and self.process.stdout is not None
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"ONNX Runtime's server ended:\n{self.server_log()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None
        self.log.close()

    def run(self, args: tuple, timeout: float = 300) -> tuple[int, str, str]:
        with self.lock, tempfile.TemporaryDirectory(prefix="ortckpt-ort-") as scratch:
            if self.process is None or self.process.poll() is not None:
                self.start()
            assert self.process is not None and self.process.stdin is not None
            stdout, stderr = Path(scratch, "stdout"), Path(scratch, "stderr")
            request = {
                "argv": list(args),
                "cwd": os.getcwd(),
                "env": dict(os.environ),
                "stdout": str(stdout),
                "stderr": str(stderr),
            }
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            try:
                returncode = self.reply(time.monotonic() + timeout)["returncode"]
            except TimeoutError:
                self.stop()
                raise AssertionError(
                    f"ONNX Runtime ran past {timeout} s on {args}:\n{stderr.read_text()[-3000:]}"
                ) from None
            except BaseException:
                self.stop()
                raise
            return returncode, stdout.read_text(), stderr.read_text()

    def close(self) -> None:
        if self.process is None or self.process.stdin is None:
            return
        self.process.stdin.close()  # (the server ends when its stdin does)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        self.stop()


@pytest.fixture(scope="session")
def ort():
    """Runs an ort_helper.py command under ONNX Runtime's own interpreter and returns its JSON."""
    python = os.environ.get("ORTCKPT_ORT_PYTHON")
    if not python or not Path(python).exists():
        pytest.fail(
            "the interop tests need ONNX Runtime's virtualenv: set ORTCKPT_ORT_PYTHON to its python "
            "(`make test` builds .venv-ort and sets it)"
        )
    server = WarmOrt(python)

    def run(*args) -> dict:
        returncode, stdout, stderr = server.run(tuple(map(str, args)))
        if returncode != 0:
            raise AssertionError(f"ONNX Runtime failed on {args}:\n{stderr[-3000:]}")
        return json.loads(stdout.strip().splitlines()[-1])

    yield run
    server.close()


@pytest.fixture(scope="session")
def ort_loop_python() -> str:
    """The interpreter of ONNX Runtime's virtualenv with ortckpt installed in it (ortckpt inside
    ONNX Runtime's training loop: tests/interop/test_ort_loop.py)."""
    python = os.environ.get("ORTCKPT_ORT_LOOP_PYTHON")
    if not python or not Path(python).exists():
        pytest.fail(
            "the tests of ortckpt inside ONNX Runtime's training loop need ONNX Runtime's virtualenv with "
            "ortckpt installed: set ORTCKPT_ORT_LOOP_PYTHON to its python (`make test` builds it and sets it)"
        )
    return python
