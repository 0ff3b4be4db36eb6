"""Values and names at their edges, as a user gives them (issue 29, adversarial review): the
command line names a file or URL exactly as it was typed (``./x``, ``x/``, ``a//b``, an s3 URL
with a trailing slash), never the form pathlib or the object store make of it; a manager's
directory given as an empty string is refused, not taken for the working directory."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.cli import FAILED
from test_cli_arguments import ortckpt  # the command in a process of its own


def error_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def state() -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.arange(4, dtype=np.float32)})


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("inspect", "./missing"), "./missing"),
        (("inspect", "missing/"), "missing/"),
        (("inspect", "./run/step_00000009/"), "./run/step_00000009/"),
        (("verify", "./run//step_00000009"), "./run//step_00000009"),
        (("inspect", "./notes.txt"), "./notes.txt"),
        (("inspect", "./sub/..//notes.txt"), "./sub/..//notes.txt"),
        (("convert", "./notes.txt", "out.ckpt"), "./notes.txt"),
        (("upgrade", "./missing", "out.ckpt"), "./missing"),
        (("nominal", "./missing", "out.ckpt"), "./missing"),
        (("average", "run/step_00000001", "-o", "./nodir//mean.ckpt"), "./nodir//mean.ckpt"),
        (("delta", "run/step_00000001", "./missing", "out.ckpt"), "./missing"),
        (("convert", "run/step_00000001", "sub"), "sub"),
    ],
)
def test_an_error_names_the_file_as_the_user_typed_it(tmp_path, args, named):
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(state(), 1)
    (tmp_path / "notes.txt").write_text("a note\n")
    (tmp_path / "sub").mkdir()
    done = ortckpt(*args, cwd=tmp_path)
    assert done.returncode == FAILED, done.stderr
    assert error_line(done).startswith(f"ortckpt: error: {named}:"), done.stderr


def test_verify_names_the_file_as_typed_in_its_problems(tmp_path):
    (tmp_path / "notes.txt").write_text("a note\n")
    done = ortckpt("verify", "./notes.txt", cwd=tmp_path)
    assert done.returncode == 1 and "\n  ./notes.txt: " in done.stderr, done.stderr
    done = ortckpt("verify", "--json", "./notes.txt", cwd=tmp_path)
    assert json.loads(done.stdout)["problems"][0].startswith("./notes.txt: "), done.stdout


def test_an_s3_url_with_a_trailing_slash_is_named_as_typed(s3_url, aws_environment):
    with CheckpointManager(f"{s3_url}/run") as manager:
        manager.save(state(), 3)
    assert ortckpt("inspect", f"{s3_url}/run/step_00000003/").returncode == 0
    for command in ("inspect", "verify"):
        for url in (f"{s3_url}/run/step_00000009/", f"{s3_url}/missing/"):
            done = ortckpt(command, url)
            assert done.returncode == FAILED, done.stderr
            assert error_line(done).startswith(f"ortckpt: error: {url}:"), done.stderr


def test_register_best_of_a_metric_that_is_nan_everywhere_says_so(tmp_path):
    with CheckpointManager(tmp_path / "run") as manager:
        for step in (1, 2):
            manager.save(state(), step, metrics={"loss": float("nan")})
    (tmp_path / "eval.onnx").write_text("not used: refused before\n")
    done = ortckpt(
        "register-best", tmp_path / "run", "name", tmp_path / "eval.onnx", "--tracking-uri", "http://127.0.0.1:9"
    )
    assert done.returncode == 2 and "NaN" in done.stderr and "no checkpoint" not in done.stderr, done.stderr


def test_the_command_line_calls_an_output_ending_with_a_slash_bad_usage(tmp_path):
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"w": np.ones(4, np.float32)}), tmp_path / "src")
    average = ["average", "src", "src", "-o", "newdir/"]
    for args in (average, ["convert", "src", "newdir/"], ["compress", "src", "newdir/"]):
        done = subprocess.run(
            [sys.executable, "-m", "ortckpt", *args], cwd=tmp_path, capture_output=True, text=True, check=False
        )
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.strip().splitlines() == [
            "ortckpt: error: newdir/: names a directory (it ends with '/'); a checkpoint or model is written as a "
            "file: give its file name"
        ], args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
