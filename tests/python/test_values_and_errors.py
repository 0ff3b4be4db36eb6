"""Silent wrong values and unclear errors (issue 15, findings 9 and 10): values the format cannot
hold are refused with a typed error at save() (never saved as something else, never only in a
background thread); non-finite metrics round-trip and rank; the command reports every failure in
one line with its documented exit code; a failed async save is never silently lost."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys

import numpy as np
import onnx
import ortckpt
import pytest
from onnx import TensorProto, helper
from ortckpt import (
    CheckpointFormatError,
    CheckpointManager,
    CheckpointState,
    CheckpointStateError,
    UnsupportedDataTypeError,
)
from ortckpt.cli import FAILED, USAGE, run

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python

# --- finding 9: values --------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[1.5, None, {"k": 1}], [b"ok", 3], ["a", 1.5]])
def test_an_object_array_of_non_strings_is_refused_naming_the_tensor(values):
    array = np.empty(len(values), dtype=object)
    array[:] = values
    with pytest.raises(UnsupportedDataTypeError, match="vocab"):
        CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"vocab": array})


def test_an_object_array_changed_to_non_strings_after_intake_is_refused_at_save(tmp_path):
    vocab = np.array(["a", "b"], dtype=object)
    state = CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"vocab": vocab})
    vocab[1] = 7
    with pytest.raises(UnsupportedDataTypeError, match="vocab"):
        CheckpointState.save_checkpoint(state, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_non_utf8_bytes_are_a_typed_error_at_save(tmp_path, async_save):
    with pytest.raises(CheckpointStateError, match=r"raw.*UTF-8"):
        CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"raw": np.array([b"ok", b"\xff\xfe"])})
    raw = np.array([b"ok", b"ab"])
    state = CheckpointState.from_arrays({"w": np.ones(2, np.float32)}, {"raw": raw})
    raw[1] = b"\xff\xfe"  # changed after intake: refused at save
    with pytest.raises(CheckpointStateError, match=r"raw.*UTF-8"):
        CheckpointState.save_checkpoint(state, tmp_path / "ck")
    with CheckpointManager(tmp_path / "run", async_save=async_save) as manager:
        with pytest.raises(CheckpointStateError, match=r"raw.*UTF-8"):
            manager.save(state, 1)  # in the caller's thread, not at wait()
        manager.wait()
        assert manager.all_steps() == []


def test_utf8_bytes_and_str_still_save_as_strings(tmp_path):
    state = CheckpointState.from_arrays(
        {"w": np.ones(2, np.float32)}, {"raw": np.array(["é".encode(), b"x"]), "words": np.array(["a", "b"])}
    )
    CheckpointState.save_checkpoint(state, tmp_path / "ck")
    loaded = CheckpointState.load_checkpoint(tmp_path / "ck")
    assert loaded.parameters["raw"].data.tolist() == ["é", "x"]
    assert loaded.parameters["words"].data.tolist() == ["a", "b"]


@pytest.mark.parametrize(("mode", "value"), [("max", float("inf")), ("min", float("-inf"))])
def test_non_finite_metrics_round_trip_and_rank_after_a_restart(tmp_path, mode, value):
    with CheckpointManager(tmp_path, keep_best=("score", mode, 1), max_to_keep=1) as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 1, metrics={"score": value})
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 2, metrics={"score": 0.0})
    restarted = CheckpointManager(tmp_path, keep_best=("score", mode, 1), max_to_keep=1)
    assert restarted.latest().metrics["score"] == 0.0
    assert restarted.all()[0].metrics["score"] == value
    restarted.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 3, metrics={"score": 1.0})
    assert restarted.all_steps() == [1, 3], "keep_best deleted the best checkpoint after a restart"
    assert restarted.best().step == 1
    restarted.close()
    text = (tmp_path / "step_00000001" / "metadata.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in metadata.json"))  # strict JSON still


def test_nan_metrics_round_trip_unranked(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 1, metrics={"loss": float("nan")})
    restarted = CheckpointManager(tmp_path, read_only=True)
    assert np.isnan(restarted.latest().metrics["loss"])
    assert restarted.best("loss", "min") is None


@pytest.mark.parametrize("step", [np.int64(5), np.int32(5), np.uint8(5)])
def test_integral_numpy_steps_are_accepted(tmp_path, step):
    with CheckpointManager(tmp_path) as manager:
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), step, epoch=np.int64(1))
        assert manager.all_steps() == [5] and type(manager.all_steps()[0]) is int
        assert manager.restore(np.int64(5)).properties["step"] == 5
    meta = json.loads((tmp_path / "step_00000005" / "metadata.json").read_text())
    assert meta["step"] == 5 and meta["epoch"] == 1


@pytest.mark.parametrize("step", [True, np.bool_(True), 5.0, np.float64(5), -1, "5"])
def test_other_steps_are_refused(tmp_path, step):
    with CheckpointManager(tmp_path) as manager, pytest.raises((TypeError, ValueError)):
        manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), step)


def test_non_str_parameter_names_are_refused_by_from_arrays():
    with pytest.raises(TypeError, match="names are str"):
        CheckpointState.from_arrays({1: np.ones(2, np.float32)})
    with pytest.raises(TypeError, match="names are str"):
        CheckpointState.from_arrays({}, {("a",): np.ones(2, np.float32)})


# --- finding 10: errors ---------------------------------------------------------------------------------


def one_line_failure(capsys, argv: list[str], code: int, *must_name: object) -> str:
    assert run([str(a) for a in argv]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for thing in must_name:
        assert str(thing) in err, (thing, err)
    return err


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["diff", "X"], ["convert", "OUT"], ["nominal", "OUT"]])
def test_a_missing_input_is_exit_3_naming_the_file(tmp_path, capsys, command):
    missing = tmp_path / "missing.ckpt"
    args = [str(missing) if a == "X" else str(tmp_path / "out") if a == "OUT" else a for a in command[1:]]
    one_line_failure(capsys, [command[0], missing, *args], FAILED, missing)


def test_a_directory_as_input_is_exit_3(tmp_path, capsys):
    one_line_failure(capsys, ["inspect", tmp_path], FAILED, tmp_path)


def test_bad_usage_is_still_exit_2(capsys):
    assert run(["inspect"]) == USAGE
    assert run(["no-such-command"]) == USAGE
    capsys.readouterr()


def test_an_onnx_model_whose_external_data_onnx_refuses_is_one_line(tmp_path, capsys):
    weight = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    weight.data_location = TensorProto.EXTERNAL
    del weight.float_data[:]
    weight.external_data.add(key="location", value="../../etc/passwd")
    weight.external_data.add(key="length", value="8")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [weight],
    )
    path = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(graph), path)
    one_line_failure(capsys, ["inspect", path], FAILED, path)
    one_line_failure(capsys, ["convert", path, tmp_path / "out.ckpt"], FAILED, path)


def test_verify_of_a_text_file_names_it_once(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(ortckpt.CheckpointIntegrityError) as e:
        ortckpt.verify(text)
    assert len(e.value.problems) == 1 and e.value.problems[0].count(str(text)) == 1, e.value.problems
    assert run(["verify", str(text)]) == 1
    err = capsys.readouterr().err
    assert err.count(str(text)) == 2, err  # the FAILED line and the problem


def test_a_full_disk_while_writing_metadata_names_the_file(tmp_path, monkeypatch):
    from ortckpt import safe_io

    real_write = safe_io.os.write

    def full(fd, data):
        if b'"run_id"' in bytes(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(safe_io.os, "write", full)
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(OSError) as e:
            manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 1)
        assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("metadata.json"), e.value
        monkeypatch.undo()
        assert manager.all_steps() == []
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ortckpt")) == []


FORGOTTEN_ASYNC_SAVE = """
import sys
import numpy as np
from ortckpt import CheckpointManager, CheckpointState, targets
manager = CheckpointManager(sys.argv[1], async_save=True)
def disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")
targets.LocalFile.save = disk_full
manager.save(CheckpointState.from_arrays({"w": np.ones(2, np.float32)}), 1)
{ending}
"""


@pytest.mark.parametrize("ending", ["pass", "del manager", "import gc; manager = None; gc.collect()"])
def test_a_failed_async_save_never_waited_for_is_reported(tmp_path, ending):
    script = FORGOTTEN_ASYNC_SAVE.replace("{ending}", ending)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True, timeout=60, check=False
    )
    assert "step 1" in done.stderr and "No space left on device" in done.stderr, done.stderr
    assert "never" in done.stderr or "lost" in done.stderr, done.stderr


def test_a_failed_async_save_that_was_waited_for_is_not_reported_twice(tmp_path):
    script = FORGOTTEN_ASYNC_SAVE.replace("{ending}", "try:\n    manager.close()\nexcept OSError:\n    print('caught')")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "caught" and "No space" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: {**s, "numpy_global": {"ndarray": [1], "dtype": "S2000000000"}},
        lambda s: {**s, "python": [3, "x", None]},
        lambda s: {k: v for k, v in s.items() if k != "generators"},
        lambda s: {**s, "generators": [{"kind": "os.system", "state": 1}]},
        lambda s: {**s, "torch": "!!not base64!!"},
        lambda s: [],
    ],
    ids=["huge-dtype", "python-state", "no-generators", "unknown-kind", "torch-base64", "not-a-dict"],
)
def test_a_damaged_rng_state_is_refused_before_any_generator_changes(damage):
    import random

    from ortckpt import capture_rng_state, restore_rng_state

    gen = np.random.default_rng(1)
    state = capture_rng_state(gen)
    before = (random.getstate(), gen.bit_generator.state)
    with pytest.raises(ValueError, match="capture_rng_state"):
        restore_rng_state(damage(state), gen)
    assert (random.getstate(), gen.bit_generator.state) == before


@pytest.mark.parametrize(
    ("missing", "call", "install"),
    [
        (("obstore", "obstore.store"), lambda d: ortckpt.load_checkpoint("s3://bucket/key"), "ortckpt[s3]"),
        (("zstandard",), lambda d: ortckpt.CheckpointManager(d / "run", compress_kept=True), "ortckpt[compress]"),
        (("tqdm", "tqdm.auto"), lambda d: ortckpt.CheckpointManager(d / "run", progress=True), "ortckpt[progress]"),
    ],
)
def test_a_missing_optional_package_names_what_to_install_at_once(monkeypatch, tmp_path, missing, call, install):
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # (an import of it fails as if it were not installed)
    with pytest.raises(ImportError, match=rf"needs {missing[0]}: pip install '{re.escape(install)}'"):
        call(tmp_path)
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_a_file_that_is_no_checkpoint_is_named_for_what_it_seems_to_be(tmp_path):
    import ortckpt.compression
    from goldens import EVAL_MODEL
    from safetensors.numpy import save_file

    state = CheckpointState.from_arrays({"w": np.ones(1000, np.float32)})
    CheckpointState.save_checkpoint(state, tmp_path / "whole.ckpt")
    whole = (tmp_path / "whole.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])
    ortckpt.compression.compress(tmp_path / "whole.ckpt", tmp_path / "compressed.zst")
    save_file({"w": np.ones(4, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "zeros.ckpt").write_bytes(bytes(8192))
    for name, says in (
        (EVAL_MODEL, "it looks like an ONNX model"),
        (tmp_path / "compressed.zst", "it is a compressed checkpoint (a manager's compress_kept)"),
        (tmp_path / "model.safetensors", "it looks like a safetensors file"),
        (tmp_path / "zeros.ckpt", "its first bytes are all zero"),
        (tmp_path / "truncated.ckpt", f"the file ends at byte {len(whole) // 2}, before the end of what it records"),
    ):
        with pytest.raises(CheckpointFormatError, match=re.escape(says)) as e:
            CheckpointState.load_checkpoint(name)
        assert str(e.value).startswith(str(name)), e.value
