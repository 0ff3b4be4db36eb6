"""The ortckpt command: every subcommand's output, JSON and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import ortckpt
import pytest
from ortckpt import CheckpointManager, CheckpointState, OptimizerGroup, _boundary, texts
from ortckpt.cli import DIFFERENT, FAILED, OK, USAGE, run

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "ort-vectors"


def cli(capsys, *args) -> tuple[int, str, str]:
    code = run([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ckpt(tmp_path) -> Path:
    state = CheckpointState.from_arrays(
        {"layer.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "layer.bias": np.ones(4, np.float32)},
        {"table": np.arange(1000, dtype=np.int64)},
        {"epoch": 2, "run": "cli"},
    )
    state.optimizer_groups["group0"] = OptimizerGroup(7, 0.01, {"layer.bias": {"momentum0": np.zeros(4, np.float32)}})
    path = tmp_path / "model.ckpt"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True, external_data_threshold=100)
    return path


def test_inspect_lists_tensors_with_role_dtype_shape_size_and_location(capsys, ckpt):
    code, out, _ = cli(capsys, "inspect", ckpt)
    assert code == OK
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("layer", "table"))}
    assert lines["table"][:5] == ["table", "frozen", "INT64", "1000", "7.8"]
    assert "external" in lines["table"]
    assert lines["layer.bias/momentum0"][1:3] == ["momentum", "FLOAT"]
    assert "group0: step 7, initial learning rate 0.01" in out
    assert "epoch = 2" in out and "run = 'cli'" in out
    assert "total: 4 tensors" in out and "external data" in out.splitlines()[0]


def test_inspect_json_is_complete_and_limit_only_shortens_the_table(capsys, ckpt):
    code, out, _ = cli(capsys, "inspect", "--json", ckpt)
    info = json.loads(out)
    assert code == OK and info["format"] == "ortckpt" and info["external_data"]
    assert info["totals"] == {
        "tensors": 4,
        "bytes": 48 + 16 + 8000 + 16,
        "trainable": 2,
        "frozen": 1,
        "momentum": 1,
        "parameter_bytes": 48 + 16 + 8000,
        "optimizer_bytes": 16,
    }
    assert {t["name"]: t["shape"] for t in info["tensors"]}["layer.weight"] == [3, 4]
    assert info["properties"] == {"epoch": 2, "run": "cli"}
    _, out, _ = cli(capsys, "inspect", "--limit", "1", ckpt)
    assert "... 3 more (--limit 0 lists all)" in out


def test_inspect_reads_onnx_runtimes_own_files(capsys):
    code, out, _ = cli(capsys, "inspect", "--json", GOLDEN / "trained_with_optimizer.ckpt")
    info = json.loads(out)
    assert code == OK and info["totals"]["momentum"] == 6 and info["properties"]["run"] == "mlp-demo"


def test_verify_passes_whole_checkpoints_and_fails_damaged_ones_with_exit_code_1(capsys, ckpt, tmp_path):
    assert cli(capsys, "verify", ckpt)[0] == OK
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(CheckpointState.load_checkpoint(ckpt), step=3)
    step = tmp_path / "run" / "step_00000003"
    code, out, _ = cli(capsys, "verify", "--json", step)
    assert code == OK and json.loads(out)["ok"] and json.loads(out)["step"] == 3
    data = step / "checkpoint"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    code, _, err = cli(capsys, "verify", step)
    assert code == DIFFERENT and "FAILED" in err and "checksum block or the trailer after it is damaged" in err
    code, out, _ = cli(capsys, "verify", "--json", step)
    assert code == DIFFERENT and not json.loads(out)["ok"]


def test_diff_reports_every_kind_of_difference_and_honours_tolerances(capsys, ckpt, tmp_path):
    assert cli(capsys, "diff", ckpt, ckpt)[0] == OK
    state = CheckpointState.load_checkpoint(ckpt)
    state.parameters["layer.weight"] = state.parameters["layer.weight"].data + np.float32(1e-3)
    state.properties["epoch"] = 3
    state.optimizer_groups["group0"].step = 8
    CheckpointState.save_checkpoint(state, tmp_path / "other.ckpt", include_optimizer_state=True)
    code, out, _ = cli(capsys, "diff", ckpt, tmp_path / "other.ckpt")
    assert code == DIFFERENT
    assert "layer.weight: values: 12 of 12 elements differ" in out
    assert "epoch: 2 vs 3" in out and "group0.step: 7 vs 8" in out
    code, out, _ = cli(capsys, "diff", "--json", "--atol", "0.01", ckpt, tmp_path / "other.ckpt")
    report = json.loads(out)
    assert code == DIFFERENT and report["tensors"] == []  # values within tolerance; step and property still differ
    assert report["properties"] == {"epoch": [2, 3]}
    only = CheckpointState.from_arrays({"layer.weight": np.zeros((3, 5), np.float32)})
    CheckpointState.save_checkpoint(only, tmp_path / "shape.ckpt")
    code, out, _ = cli(capsys, "diff", ckpt, tmp_path / "shape.ckpt")
    assert "layer.weight: shape: [3, 4] vs [3, 5]" in out and f"only in {ckpt}: table" in out


def test_convert_between_formats_and_back_is_lossless(capsys, ckpt, tmp_path):
    code, out, _ = cli(capsys, "convert", ckpt, tmp_path / "m.safetensors")
    assert code == OK and "(ortckpt) ->" in out and "(safetensors)" in out
    code, out, _ = cli(capsys, "convert", "--json", tmp_path / "m.safetensors", tmp_path / "back")
    assert code == OK and json.loads(out)["to"] == "ortckpt"
    assert cli(capsys, "diff", ckpt, tmp_path / "back")[0] == OK
    code, _, err = cli(capsys, "convert", ckpt, tmp_path / "model.onnx")
    assert code == USAGE and "--model" in err  # bad usage: exit 2, before any work


def test_nominal_keeps_names_roles_and_types_without_values(capsys, ckpt, tmp_path):
    code, out, _ = cli(capsys, "nominal", ckpt, tmp_path / "nominal.ckpt")
    assert code == OK and "3 parameters" in out
    assert CheckpointState.load_checkpoint(tmp_path / "nominal.ckpt").is_nominal
    info = json.loads(cli(capsys, "inspect", "--json", tmp_path / "nominal.ckpt")[1])
    assert info["nominal"] and info["properties"] == {"epoch": 2, "run": "cli"}
    assert [(t["name"], t["role"], t["dtype"], t["shape"], t["bytes"]) for t in info["tensors"]] == [
        ("layer.bias", "trainable", "FLOAT", [], 0),
        ("layer.weight", "trainable", "FLOAT", [], 0),
        ("table", "frozen", "INT64", [], 0),
    ]
    # a nominal checkpoint's nominal twin is itself
    assert cli(capsys, "nominal", tmp_path / "nominal.ckpt", tmp_path / "twice.ckpt")[0] == OK
    assert (tmp_path / "twice.ckpt").read_bytes() == (tmp_path / "nominal.ckpt").read_bytes()
    assert (tmp_path / "nominal.ckpt").stat().st_size < 1024


def test_errors_have_exit_codes_and_name_the_file(capsys, tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint at all")
    code, _, err = cli(capsys, "inspect", bad)
    assert code == FAILED and str(bad) in err and "ODTC" in err
    assert cli(capsys, "inspect", tmp_path / "missing")[0] == FAILED  # an input that cannot be read
    assert cli(capsys, "frobnicate")[0] == USAGE
    assert cli(capsys, "diff", "--rtol", "x", bad, bad)[0] == USAGE


def test_the_console_script_and_python_m_run_with_help_and_version():
    env = {**os.environ, "COLUMNS": "100"}
    for command in ([sys.executable, "-m", "ortckpt"], [str(Path(sys.executable).parent / "ortckpt")]):
        done = subprocess.run([*command, "--help"], capture_output=True, text=True, env=env, check=True)
        for sub in ("inspect", "verify", "diff", "convert", "nominal", "Exit codes"):
            assert sub in done.stdout, (command, sub)
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, check=True).stdout
        assert version.startswith("ortckpt ")


def test_nominal_of_onnx_runtimes_checkpoint_holds_what_its_own_nominal_twin_holds(capsys, tmp_path):
    assert cli(capsys, "nominal", GOLDEN / "protos.ckpt", tmp_path / "nominal.ckpt")[0] == OK
    ours, theirs = (_boundary.load(p) for p in (tmp_path / "nominal.ckpt", GOLDEN / "protos_nominal.ckpt"))
    for key in ("trainable", "frozen", "nominal", "optimizer_groups", "properties"):
        assert getattr(ours, key) == getattr(theirs, key), key  # names in the same order, types, empty dims, no values


def test_progress_bars_on_every_long_command(capfd, ckpt, tmp_path, monkeypatch):
    from ortckpt import progress

    monkeypatch.setattr(progress, "DELAY_SECONDS", 0)  # show at once, even for a small file
    for args, label in (
        (["verify", "--progress", ckpt], "verifying model.ckpt"),
        (["diff", "--progress", ckpt, ckpt], "comparing"),
        (["inspect", "--stats", "--progress", ckpt], "statistics"),
        (["convert", "--progress", ckpt, tmp_path / "copy.ckpt"], "saving copy.ckpt"),
        (["compress", "--progress", ckpt, tmp_path / "c.zst"], "compressing model.ckpt"),
        (["decompress", "--progress", tmp_path / "c.zst", tmp_path / "back"], "decompressing c.zst"),
        (["average", "--progress", ckpt, ckpt, "-o", tmp_path / "mean"], "average"),
        (["delta", "--progress", ckpt, ckpt, tmp_path / "zero"], "delta"),
        (["apply", "--progress", ckpt, tmp_path / "zero", tmp_path / "same"], "apply"),
    ):
        code, _, err = cli(capfd, *args)
        assert code == OK and label in err, (args, err)
    assert cli(capfd, "verify", "--no-progress", ckpt)[2] == ""


def test_convert_from_and_to_onnx_models(capsys, tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.arange(32, dtype=np.float32).reshape(4, 8)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.ones(3, np.int64), "frozen_ids")],
    )
    onnx.save_model(helper.make_model(graph), tmp_path / "model.onnx")
    code, out, _ = cli(capsys, "convert", tmp_path / "model.onnx", tmp_path / "ckpt", "--frozen", "frozen_ids")
    assert code == OK and "(onnx) ->" in out
    state = CheckpointState.load_checkpoint(tmp_path / "ckpt")
    assert state.parameters["w"].requires_grad and not state.parameters["frozen_ids"].requires_grad
    state.parameters["w"] = weight * 2
    CheckpointState.save_checkpoint(state, tmp_path / "trained")
    code, _, _ = cli(capsys, "convert", tmp_path / "trained", tmp_path / "out.onnx", "--model", tmp_path / "model.onnx")
    assert code == OK
    exported = {i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "out.onnx").graph.initializer}
    assert np.array_equal(exported["w"], weight * 2) and np.array_equal(exported["frozen_ids"], np.ones(3, np.int64))
    assert cli(capsys, "diff", tmp_path / "out.onnx", tmp_path / "trained")[0] == DIFFERENT  # roles differ
    assert cli(capsys, "diff", tmp_path / "trained", tmp_path / "trained")[0] == OK


def test_ctrl_c_exits_130_not_the_code_that_says_differ(ckpt, tmp_path):
    # A real SIGINT, delivered while the command works (its inputs being opened), in the program
    # as installed (`ortckpt` is cli.console) and as `python -m ortckpt`.
    interrupt = (
        "import os, signal, sys\n"
        "from ortckpt.cli import commands\n"
        "def interrupted(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    signal.pause()\n"
        "commands.resolve.checkpoints = interrupted\n"
    )
    out = tmp_path / "out.ckpt"
    for launch in ("from ortckpt.cli import console; console()", "import runpy; runpy.run_module('ortckpt')"):
        argv = ["ortckpt", "apply", str(ckpt), str(ckpt), str(out)]
        script = interrupt + f"sys.argv = {argv!r}\n" + launch
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 130, done.stderr
        assert "ortckpt: interrupted" in done.stderr and "Traceback" not in done.stderr
        assert not out.exists()


def test_average_names_its_output_by_option_and_never_overwrites_a_source(ckpt, tmp_path, capsys):
    before = ckpt.read_bytes()
    other = tmp_path / "other.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.load_checkpoint(ckpt), other)
    before_other = other.read_bytes()
    # The order of delta/apply/convert (output last), or a source named as the output: refused, nothing written.
    assert run(["average", str(ckpt), str(other), str(tmp_path / "mean.ckpt")]) == USAGE
    assert run(["average", str(ckpt), str(other), "-o", f"{tmp_path}/./other.ckpt"]) == USAGE
    assert "is also a source" in capsys.readouterr().err
    assert ckpt.read_bytes() == before and other.read_bytes() == before_other
    assert not (tmp_path / "mean.ckpt").exists()
    assert run(["average", str(ckpt), str(other), "-o", str(tmp_path / "mean.ckpt"), "--json"]) == OK
    assert json.loads(capsys.readouterr().out)["weights"] == [1.0, 1.0]  # the weights used, never null
    assert run(["average", str(ckpt), str(other), "-o", str(tmp_path / "w.ckpt"), "--weights", "1,3", "--json"]) == OK
    assert json.loads(capsys.readouterr().out)["weights"] == [1.0, 3.0]


def test_averaging_different_frozen_parameters_names_the_commands_option(ckpt, tmp_path, capsys):
    state = CheckpointState.load_checkpoint(ckpt)
    changed = CheckpointState.from_arrays(
        {n: p.data for n, p in state.parameters if p.requires_grad},
        {"table": np.zeros(1000, dtype=np.int64)},
    )
    CheckpointState.save_checkpoint(changed, tmp_path / "changed.ckpt")
    assert run(["average", str(ckpt), str(tmp_path / "changed.ckpt"), "-o", str(tmp_path / "m.ckpt")]) == FAILED
    err = capsys.readouterr().err
    assert "--frozen-from-first" in err and "frozen='first'" not in err
    assert (
        run(
            [
                "average",
                str(ckpt),
                str(tmp_path / "changed.ckpt"),
                "-o",
                str(tmp_path / "m.ckpt"),
                "--frozen-from-first",
            ]
        )
        == OK
    )


@pytest.mark.parametrize("kind", ["dangling symlink", "directory", "FIFO"])
def test_a_step_whose_metadata_is_not_a_regular_file_is_refused_in_one_line(capsys, tmp_path, kind):
    """A step folder whose metadata.json is a dangling symlink, a directory or a FIFO: every
    command says so, naming the file, with the documented exit code (3: an input that cannot be
    read; 1 for verify: the step fails verification), never an AssertionError (nor, under
    ``python -O``, an AttributeError)."""
    with CheckpointManager(tmp_path / "run") as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(4, np.float32)}), 1)
    step = tmp_path / "run" / "step_00000001"
    metadata = step / "metadata.json"
    os.unlink(metadata)
    if kind == "dangling symlink":
        metadata.symlink_to(tmp_path / "nowhere")
    elif kind == "directory":
        metadata.mkdir()
    else:
        os.mkfifo(metadata)
    what = kind.split()[-1]
    expected = f"{metadata}: a {what}, not a regular file"
    for command, code in (("inspect", FAILED), ("verify", DIFFERENT), ("diff", FAILED)):
        args = [command, step, step] if command == "diff" else [command, step]
        got, _, err = cli(capsys, *args)
        assert got == code and expected in err, (command, err)
        assert "Error" not in err and err.count("\n") <= 3, err
    done = subprocess.run(
        [sys.executable, "-O", "-m", "ortckpt", "inspect", str(step)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == FAILED and expected in done.stderr and "Error" not in done.stderr, done.stderr


def test_a_nominal_checkpoint_is_inspected_and_compared_for_what_it_holds(capsys, tmp_path):
    # ONNX Runtime's nominal checkpoint: names and types, no values. Never a KeyError, never "only in".
    nominal, valued = GOLDEN / "protos_nominal.ckpt", GOLDEN / "protos.ckpt"
    assert run(["inspect", "--stats", str(nominal)]) == OK
    assert "no statistics: a nominal checkpoint has names and types, no values" in capsys.readouterr().out
    assert run(["diff", str(nominal), str(valued)]) == DIFFERENT
    out = capsys.readouterr().out
    assert "only in" not in out and out.splitlines()[-1] == (
        "5 tensors compared: differ in values (A is nominal: names and types, no values)"
    )
    assert run(["diff", str(nominal), str(nominal)]) == OK
    assert "values not compared" in capsys.readouterr().out
    assert run(["diff", "--json", str(valued), str(nominal)]) == DIFFERENT
    found = json.loads(capsys.readouterr().out)
    assert found["nominal"] == ["b"] and found["only_in_a"] == [] and not found["identical"]
    with pytest.raises(ortckpt.CheckpointStateError, match="a is a nominal checkpoint"):
        ortckpt.tensor_changes(nominal, valued)


def test_diff_says_what_differs_when_only_properties_do(capsys, tmp_path):
    arrays = {"w": np.arange(4, dtype=np.float32)}
    for name, epoch in (("a", 1), ("b", 2)):
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays, None, {"epoch": epoch}), tmp_path / name)
    for extra in ([], ["--atol", "0.1"]):
        assert run(["diff", str(tmp_path / "a"), str(tmp_path / "b"), *extra]) == DIFFERENT
        last = capsys.readouterr().out.splitlines()[-1]
        assert last.startswith("1 tensors compared: differ in properties"), last


def test_inspect_writes_out_unprintable_names_and_aligns_wide_ones(capsys, tmp_path):
    # A right-to-left override in a name would turn the rest of the line around; a CJK name takes two
    # columns a character: the columns after it stay aligned.
    state = CheckpointState.from_arrays(
        {"evil\u202eyxz": np.ones(2, np.float32), "重み": np.ones(3, np.float32), "w": np.ones(4, np.float32)},
        None,
        {"note\u200b": "x"},
    )
    CheckpointState.save_checkpoint(state, tmp_path / "c")
    assert run(["inspect", str(tmp_path / "c")]) == OK
    out = capsys.readouterr().out
    assert "\u202e" not in out and "\u200b" not in out
    assert "evil\\u202eyxz" in out and "note\\u200b = 'x'" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("evil", "重み", "w "))}
    role_column = {texts.width(line[: line.index("trainable")]) for line in rows.values()}
    assert len(rows) == 3 and len(role_column) == 1, out
