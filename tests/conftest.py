from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "interop"
# The suite's helper modules (servers, golden files, workers) live in python/helpers/ and are imported
# by their plain names, by every folder of tests/.
sys.path.insert(0, str(Path(__file__).resolve().parent / "python" / "helpers"))

from warm_python import close_all, warm  # noqa: E402

# A launcher that ignores SIGINT (a non-interactive shell's background job) passes that on to every
# process the tests start, and a Python started so never raises KeyboardInterrupt: the Ctrl-C tests
# would test the launcher. With Python's own handler here, each child starts with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def ort():
    """Runs an ort_helper.py command under ONNX Runtime's own interpreter and returns its JSON."""
    python = os.environ.get("ORTCKPT_ORT_PYTHON")
    if not python or not Path(python).exists():
        pytest.fail(
            "the interop tests need ONNX Runtime's virtualenv: set ORTCKPT_ORT_PYTHON to its python "
            "(`make test` builds .venv-ort and sets it)"
        )
    # (imported once, in a warm interpreter: each command a child of it; helpers/warm_python.py)
    server = warm(python, ("numpy", "onnxruntime.capi._pybind_state", "onnx"))

    def run(*args) -> dict:
        done = server.run([str(HERE / "ort_helper.py"), *map(str, args)])
        if done.returncode != 0:
            raise AssertionError(f"ONNX Runtime failed on {args}:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session", autouse=True)
def _warm_interpreters_ended():
    """The warm interpreters (helpers/warm_python.py) the session started end with it."""
    yield
    close_all()


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
