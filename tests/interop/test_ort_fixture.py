"""The `ort` fixture's warm ONNX Runtime interpreter (helpers/warm_python.py) answers as a fresh
one would: a command that fails fails the test with ONNX Runtime's own message, and each command
runs in the caller's working directory (tests/python/design/test_warm_python.py tests the rest)."""

from __future__ import annotations

import pytest


def test_a_failing_command_fails_with_onnx_runtimes_message(ort, tmp_path):
    with pytest.raises(AssertionError, match=r"ONNX Runtime failed on.*describe") as failed:
        ort("describe", tmp_path / "missing.ckpt")
    assert "load_checkpoint" in str(failed.value)  # (the child's traceback, from ONNX Runtime's call)
    with pytest.raises(AssertionError, match="unknown command nope"):
        ort("nope")
    assert ort("properties", "[]", tmp_path / "after.ckpt")["size"] == 36  # the server goes on


def test_a_command_runs_in_the_callers_directory(ort, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ort("properties", "[]", "relative.ckpt")["size"] == 36
    assert (tmp_path / "relative.ckpt").stat().st_size == 36
