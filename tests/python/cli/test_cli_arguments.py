"""The ortckpt command as a user runs it (a subprocess: exit codes, stdout, stderr): every
checkpoint argument takes a manager's step folder (local or s3://, plain, compressed or
sharded) as well as a checkpoint; bad usage is exit 2 before any work; every error is one line
naming the user's file or URL; every command takes --json. The walks of every command over each
kind of step folder run the command in this process (``cli.run``, what the console script calls):
what they test is what each command reads, and a process per command cost them two minutes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ortckpt import CheckpointManager, CheckpointState, OptimizerGroup, object_store, targets
from ortckpt.cli import FAILED, OK, USAGE, run
from ortckpt.distributed import SingleProcess, save_sharded
from warm_python import warm

# Subprocesses, each a `python -m ortckpt` run whose behaviour is the package's, not the interpreter's
# (test_cli.py runs the command on every interpreter): on the first interpreter only.
pytestmark = pytest.mark.once

# (what the commands import at their first use: paid once)
CLI_PRELOAD = ("ortckpt", "ortckpt.cli", "ortckpt.cli.commands", "onnx", "obstore", "zstandard")

WEIGHT = np.arange(12, dtype=np.float32).reshape(3, 4)


def ortckpt(*args, cwd=None) -> subprocess.CompletedProcess:
    """``python -m ortckpt ARGS`` in a process of its own, with the test's environment (its AWS_*
    variables): a child of a warm interpreter that imported ortckpt once (helpers/warm_python.py;
    test_cli.py starts the command's own interpreter, on every interpreter)."""
    return warm(sys.executable, CLI_PRELOAD).run(["-m", "ortckpt", *map(str, args)], cwd=cwd, timeout=300)


def in_process(*args) -> subprocess.CompletedProcess:
    """The command run by ``cli.run`` in this process, its exit code and output captured as
    :func:`ortckpt`'s are (AWS_* from this process's environment)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_line_naming(done: subprocess.CompletedProcess, name: object) -> str:
    """The error's single line (no traceback, no temporary file), which names ``name``."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(name) in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert "ortckpt-tmp" not in lines[0] and "ortckpt-scratch" not in lines[0], lines[0]
    return lines[0]


def state() -> CheckpointState:
    made = CheckpointState.from_arrays(
        {"layer.weight": WEIGHT, "layer.bias": np.ones(4, np.float32)}, {"ids": np.arange(5, dtype=np.int64)}
    )
    made.optimizer_groups["group0"] = OptimizerGroup(7, 0.01, {"layer.bias": {"momentum0": np.zeros(4, np.float32)}})
    return made


def eval_model(path: Path) -> Path:
    """A model whose input ``layer.weight`` the checkpoint binds: y = x @ layer.weight."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "layer.weight"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3]),
            helper.make_tensor_value_info("layer.weight", TensorProto.FLOAT, [3, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
    )
    onnx.save_model(helper.make_model(graph), path)
    return path


def step_folder(run: str, kind: str = "plain") -> str:
    """A step folder of ``kind`` in the run ``run`` (a directory or an s3:// prefix): a
    manager's plain step (step 1000, metric loss), its sharded step (comm=), a sharded step
    saved without a manager, or (directories only) a step compressed by compress_kept."""
    if kind == "plain":
        with CheckpointManager(run, external_data_threshold=64) as manager:
            manager.save(state(), step=1000, metrics={"loss": 0.5})
        number = 1000
    elif kind == "sharded":
        with CheckpointManager(run, comm=SingleProcess()) as manager:
            manager.save(state(), step=20)
        number = 20
    elif kind == "bare sharded":
        save_sharded(state(), run, step=30)
        number = 30
    else:
        assert kind == "compressed"
        with CheckpointManager(run, max_to_keep=1, keep_every=1, compress_kept=True) as manager:
            manager.save(state(), step=1)
            manager.save(state(), step=2)
        assert sorted(os.listdir(f"{run}/step_00000001")) == ["checkpoint.zst", "metadata.json"]
        number = 1
    return f"{run}/step_{number:08d}"


def every_command_reads(step: str, tmp: Path) -> None:
    """Runs every command that reads a checkpoint on ``step`` and checks what it read."""
    original = tmp / "original.ckpt"
    CheckpointState.save_checkpoint(state(), original, include_optimizer_state=True)
    model = eval_model(tmp / "eval.onnx")

    def ok(*args):
        done = in_process(*args)
        assert done.returncode == OK, (args, done.stderr)
        return done

    info = json.loads(ok("inspect", "--json", step).stdout)
    assert info["path"] == step and info["step"] > 0
    assert {t["name"]: t["shape"] for t in info["tensors"]} == {
        "layer.weight": [3, 4],
        "layer.bias": [4],
        "ids": [5],
        "layer.bias/momentum0": [4],
    }
    assert all(step in name for name in info["files"]), info["files"]  # the step's files, not a copy
    assert step in ok("inspect", step).stdout.splitlines()[0]
    assert json.loads(ok("verify", "--json", step).stdout)["ok"]
    compared = json.loads(in_process("diff", "--json", step, original).stdout)
    assert (compared["tensors"], compared["only_in_a"], compared["only_in_b"]) == ([], [], [])
    assert sorted(c["name"] for c in compared["changes"]) == [
        "group0/layer.bias/momentum0",
        "ids",
        "layer.bias",
        "layer.weight",
    ]
    assert not any(c["changed"] for c in compared["changes"])
    figures = {t["name"]: t["stats"] for t in json.loads(ok("inspect", "--stats", "--json", step).stdout)["tensors"]}
    assert (figures["layer.weight"]["max"], figures["layer.weight"]["mean"], figures["ids"]["l2"]) == (
        11.0,
        5.5,
        30**0.5,
    )
    assert figures["layer.bias/momentum0"]["name"] == "group0/layer.bias/momentum0"
    assert "no NaN or Inf in any tensor" in ok("inspect", "--stats", step).stdout
    ok("convert", step, tmp / "out.safetensors")
    from ortckpt.convert import load_safetensors

    assert np.array_equal(load_safetensors(tmp / "out.safetensors").parameters["layer.weight"].data, WEIGHT)
    ok("nominal", step, tmp / "nominal.ckpt")
    assert CheckpointState.load_checkpoint(tmp / "nominal.ckpt").is_nominal
    ok("export", step, model, tmp / "inference.onnx")
    import onnx
    from onnx import numpy_helper

    exported = {i.name: numpy_helper.to_array(i) for i in onnx.load(tmp / "inference.onnx").graph.initializer}
    assert np.array_equal(exported["layer.weight"], WEIGHT)
    ok("upgrade", step, tmp / "upgraded.ckpt")
    ok("compress", step, tmp / "kept.zst")
    ok("decompress", tmp / "kept.zst", tmp / "back.ckpt")
    for written in ("upgraded.ckpt", "back.ckpt"):
        assert in_process("diff", "--json", tmp / written, step).returncode == OK, written
    ok("report", step, "--against", original, "-o", tmp / "report.html")
    page = (tmp / "report.html").read_text()
    assert f"<h1>{step}</h1>" in page and "<p>No tensor changed (4 compared).</p>" in page
    listed = re.findall(r"<li><code>([^<]*)</code>", page)  # (the summary's files: no other list here)
    assert listed and all(name.startswith(f"{step}/") for name in listed), listed  # the step's files, not a copy
    ok("average", step, original, "-o", tmp / "mean.ckpt", "--weights", "1,3")
    ok("delta", step, original, tmp / "delta.ckpt")
    ok("apply", original, step, tmp / "applied.ckpt", "--scale", "0.5")
    for written, expected in (("mean.ckpt", WEIGHT), ("delta.ckpt", WEIGHT * 0), ("applied.ckpt", WEIGHT * 1.5)):
        loaded = CheckpointState.load_checkpoint(tmp / written)
        assert np.array_equal(loaded.parameters["layer.weight"].data, expected), written


@pytest.mark.parametrize("kind", ["plain", "compressed", "sharded", "bare sharded"])
def test_every_command_takes_a_local_step_folder(tmp_path, kind):
    step = step_folder(str(tmp_path / "run"), kind)
    every_command_reads(step, tmp_path)


@pytest.mark.parametrize("kind", ["plain", "sharded", "bare sharded"])
def test_every_command_takes_a_step_folder_on_s3(s3_url, tmp_path, aws_environment, kind):
    """On s3 the checkpoint is in the folder of the attempt that committed the step: found
    through the step's document, never by the URL alone."""
    step = step_folder(f"{s3_url}/run", kind)
    every_command_reads(step, tmp_path)


def test_a_compressed_step_decompresses_and_odd_paths_work(tmp_path):
    folders = {kind: step_folder(str(tmp_path / "runs ünï" / kind), kind) for kind in ("plain", "compressed")}
    done = ortckpt("decompress", folders["compressed"], tmp_path / "back")
    assert done.returncode == OK, done.stderr
    assert ortckpt("diff", tmp_path / "back", folders["plain"]).returncode == 1  # the step property differs only
    (tmp_path / "a link").symlink_to(folders["plain"])
    done = ortckpt("inspect", "--json", tmp_path / "a link")
    assert done.returncode == OK and json.loads(done.stdout)["step"] == 1000
    done = ortckpt("decompress", folders["plain"], tmp_path / "x")
    assert done.returncode == FAILED and "not compressed" in one_line_naming(done, folders["plain"])


def test_what_is_no_checkpoint_is_refused_in_one_line_naming_it(tmp_path):
    run_dir = tmp_path / "plain"
    folders = {"plain": step_folder(str(run_dir))}
    for command in ("inspect", "verify"):
        done = ortckpt(command, run_dir)
        line = one_line_naming(done, run_dir)
        assert done.returncode == FAILED and f"{run_dir}/step_00001000" in line  # the latest step, to name instead
    (tmp_path / "empty dir").mkdir()
    (tmp_path / "step_00000009").mkdir()  # named like a step, holding nothing
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    for path in (tmp_path / "empty dir", tmp_path / "step_00000009", empty, tmp_path / "missing"):
        for command in ("inspect", "verify", "convert"):
            done = ortckpt(command, path, *([tmp_path / "out.ckpt"] if command == "convert" else []))
            if (command, path) == ("verify", empty):  # a file that does not decode fails verification
                assert done.returncode == 1 and f"{empty}: file is too short" in done.stderr
                continue
            assert done.returncode == FAILED, (command, path, done.stderr)
            one_line_naming(done, path)
    (Path(folders["plain"]) / "checkpoint").unlink()
    done = ortckpt("inspect", folders["plain"])
    assert done.returncode == FAILED and "holds no checkpoint" in one_line_naming(done, folders["plain"])
    assert ortckpt("verify", folders["plain"]).returncode == 1  # verify: a damaged step fails verification


def test_an_output_in_a_missing_folder_names_the_users_path(tmp_path):
    source = tmp_path / "model.ckpt"
    CheckpointState.save_checkpoint(state(), source, include_optimizer_state=True, external_data_threshold=16)
    model = eval_model(tmp_path / "eval.onnx")
    archive = tmp_path / "kept.zst"
    assert ortckpt("compress", source, archive).returncode == OK
    missing = tmp_path / "no dir"
    for args, out in (
        (("convert", source), missing / "x.safetensors"),
        (("convert", source), missing / "x.ckpt"),
        (("convert", source, "--model", model), missing / "x.onnx"),
        (("average", source, source, "-o", "OUT"), missing / "mean.ckpt"),
        (("delta", source, source), missing / "delta.ckpt"),
        (("apply", source, source), missing / "applied.ckpt"),
        (("compress", source), missing / "kept.zst"),
        (("decompress", archive), missing / "back.ckpt"),
        (("export", source, model), missing / "inference.onnx"),
        (("nominal", source), missing / "nominal.ckpt"),
        (("upgrade", source), missing / "upgraded.ckpt"),
        (("report", source, "-o"), missing / "report.html"),
    ):
        argv = [out if a == "OUT" else a for a in args] + ([] if "OUT" in args else [out])
        done = ortckpt(*argv)
        assert done.returncode == FAILED, (argv, done.stderr)
        one_line_naming(done, out)
    assert not missing.exists()


def test_an_eval_model_that_is_no_onnx_model_is_named(tmp_path):
    source = tmp_path / "model.ckpt"
    CheckpointState.save_checkpoint(state(), source)
    notes, empty = tmp_path / "notes.txt", tmp_path / "empty.onnx"
    notes.write_text("not a model\n")
    empty.write_bytes(b"")
    for model in (notes, empty, source):
        done = ortckpt("export", source, model, tmp_path / "out.onnx")
        assert done.returncode == FAILED and "not an ONNX model" in one_line_naming(done, model)
        done = ortckpt("convert", source, tmp_path / "out.onnx", "--model", model)
        assert done.returncode == FAILED and "not an ONNX model" in one_line_naming(done, model)


def test_object_storage_errors_name_the_url(s3_url, tmp_path, aws_environment):
    bucket = s3_url.rsplit("/", 1)[0]
    notes = f"{s3_url}/notes.txt"
    object_store.put(targets.object_location(notes), b"a note, not a checkpoint\n")
    checkpoint = f"{s3_url}/ck"
    CheckpointState.save_checkpoint(state(), checkpoint, include_optimizer_state=True)
    for command in ("inspect", "verify"):
        done = ortckpt(command, notes)
        assert done.returncode in (1, FAILED)
        assert notes in done.stderr and "ortckpt-scratch" not in done.stderr and "Traceback" not in done.stderr
        done = ortckpt(command, bucket)  # a bucket: its listing is no checkpoint
        assert done.returncode == FAILED and "a bucket" in one_line_naming(done, bucket)
        done = ortckpt(command, f"{s3_url}/missing")
        assert done.returncode == FAILED and "no such object" in one_line_naming(done, f"{s3_url}/missing")
    done = ortckpt("compress", checkpoint, tmp_path / "kept.zst")  # an object compresses (a local copy)
    assert done.returncode == OK, done.stderr
    assert ortckpt("decompress", tmp_path / "kept.zst", tmp_path / "back.ckpt").returncode == OK
    assert ortckpt("diff", checkpoint, tmp_path / "back.ckpt").returncode == OK
    step_folder(f"{s3_url}/runs/plain")
    done = ortckpt("inspect", f"{s3_url}/runs/plain")  # a run, not a step: its latest step named
    assert done.returncode == FAILED and f"{s3_url}/runs/plain/step_00001000" in one_line_naming(done, s3_url)
    for args in (("nominal", checkpoint), ("compress", checkpoint), ("export", checkpoint, tmp_path / "eval.onnx")):
        done = ortckpt(*args, f"{s3_url}/out")  # outputs these commands write on this machine only
        assert done.returncode == USAGE and f"{s3_url}/out" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("average", "A", "B", "-o", "OUT", "--weights", "1,2,3"),
        ("average", "A", "B", "-o", "OUT", "--weights", "1,-1"),
        ("average", "A", "B", "-o", "OUT", "--weights", "0,0"),
        ("average", "A", "B", "-o", "OUT", "--weights", "1,nan"),
        ("average", "A", "B", "-o", "OUT", "--weights", "inf,1"),
        ("average", "A", "B", "-o", "OUT", "--weights", "1e999,1"),
        ("average", "A", "B", "-o", "OUT", "--weights", "1,x"),
        ("apply", "A", "B", "OUT", "--scale", "inf"),
        ("apply", "A", "B", "OUT", "--scale", "-inf"),
        ("apply", "A", "B", "OUT", "--scale", "nan"),
        ("diff", "A", "B", "--atol", "-1"),
        ("diff", "A", "B", "--rtol", "-0.5"),
        ("diff", "A", "B", "--atol", "nan"),
        ("diff", "A", "B", "--rtol", "inf"),
        ("inspect", "A", "--limit", "-3"),
        ("compress", "A", "OUT", "--level", "0"),
        ("compress", "A", "OUT", "--level", "23"),
    ],
)
def test_bad_numbers_are_usage_errors_before_any_work(tmp_path, args):
    """Exit 2, the option named, before any input is read (the inputs here do not exist) and
    without any output written."""
    argv = [tmp_path / a if a in ("OUT", "A", "B") else a for a in args]
    done = ortckpt(*argv)
    assert done.returncode == USAGE, done.stderr
    assert args[-2] in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_empty_name_is_bad_usage(tmp_path):
    """Not the current directory, as Path("") would have it."""
    average = ["average", "", tmp_path / "b", "-o", tmp_path / "m"]
    for argv in (["inspect", ""], ["convert", tmp_path / "a", ""], average):
        done = ortckpt(*argv)
        assert done.returncode == USAGE and "an empty name" in done.stderr, (argv, done.stderr)


def test_usage_errors_found_in_the_inputs_exit_2(tmp_path):
    source = step_folder(str(tmp_path / "plain"))
    model = eval_model(tmp_path / "eval.onnx")
    run_dir = str(Path(source).parent)
    safetensors = tmp_path / "model.safetensors"
    assert ortckpt("convert", source, safetensors).returncode == OK
    for args, named in (
        (("average", source, source, "-o", tmp_path / "m.ckpt", "--weights", "1,2,3"), "--weights"),
        (("register-best", run_dir, "name", model, "--metric", "accuracy"), "accuracy"),
        (("register-best", source, "name", model), "name the run's directory"),
        (("convert", source, tmp_path / "x.safetensors", "--frozen", "layer.bias"), "--frozen"),
        (("convert", source, tmp_path / "x.onnx"), "--model"),
        (("convert", safetensors, tmp_path / "x.ckpt", "--frozen", "layer.bias", "--frozen", "nope"), "nope"),
        (("convert", source, tmp_path / "x.ckpt", "--to", "safetensors", "--model", "s3://b/m.onnx"), "--model"),
    ):
        done = ortckpt(*args)
        assert done.returncode == USAGE and named in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    assert not any((tmp_path / name).exists() for name in ("m.ckpt", "x.onnx", "x.ckpt", "x.safetensors"))
    with CheckpointManager(tmp_path / "two metrics") as manager:
        manager.save(state(), step=1, metrics={"loss": 1.0, "accuracy": 0.5})
    done = ortckpt("register-best", tmp_path / "two metrics", "name", model)  # which metric? say it
    assert done.returncode == USAGE and "--metric" in done.stderr and "accuracy, loss" in done.stderr


def test_every_command_takes_json_and_prints_json(tmp_path, mlflow_uri):
    """Walks every subcommand of the click group: each accepts --json, and on success prints
    JSON alone on stdout."""
    from ortckpt.cli.commands import main

    step = step_folder(str(tmp_path / "plain"))
    model = eval_model(tmp_path / "eval.onnx")
    safetensors = tmp_path / "m.safetensors"
    archive = tmp_path / "kept.zst"
    delta = tmp_path / "delta.ckpt"
    runs = {
        "inspect": [step],
        "verify": [step],
        "diff": [step, step],
        "convert": [step, safetensors],
        "nominal": [step, tmp_path / "nominal.ckpt"],
        "export": [step, model, tmp_path / "inference.onnx"],
        "upgrade": [step, tmp_path / "upgraded.ckpt"],
        "compress": [step, archive],
        "decompress": [archive, tmp_path / "back.ckpt"],
        "register-best": [
            str(Path(step).parent),
            f"json-walk-{os.getpid()}",
            model,
            "--tracking-uri",
            mlflow_uri,
            "--experiment",
            f"json-walk-{os.getpid()}",
        ],
        "average": [step, step, "-o", tmp_path / "mean.ckpt"],
        "delta": [step, step, delta],
        "apply": [step, delta, tmp_path / "applied.ckpt"],
        "report": [step, "--against", step, "-o", tmp_path / "report.html"],
    }
    assert sorted(runs) == sorted(main.commands), "a command without a run here: add one"
    for name, args in runs.items():  # (in this order: decompress reads what compress wrote)
        assert any("--json" in p.opts for p in main.commands[name].params), name
        done = ortckpt(name, *args, "--json")
        assert done.returncode == OK, (name, done.stderr)
        assert isinstance(json.loads(done.stdout), dict), (name, done.stdout)
