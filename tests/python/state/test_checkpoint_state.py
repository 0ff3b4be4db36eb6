"""The CheckpointState API behaves as onnxruntime.training.api.CheckpointState does,
plus what ortckpt adds (from_arrays, optimizer_groups, zero-copy views)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import ortckpt
import pytest
from goldens import GOLDEN
from ortckpt import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointState,
    CheckpointStateError,
    NotACheckpointStateError,
    OptimizerGroup,
    PackedInt4,
    Parameter,
    UnsupportedDataTypeError,
    _boundary,
    _core,
)

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python


@pytest.fixture
def state_path(tmp_path, trained_path):
    path = tmp_path / "checkpoint"
    shutil.copy(trained_path, path)
    return path


# --- loading, parameters -------------------------------------------------------


def test_parameters_behave_like_onnx_runtimes(state_path):
    state = CheckpointState.load_checkpoint(state_path)
    params = state.parameters
    assert len(params) == 4
    assert "0.weight" in params and "nope" not in params
    names = [name for name, _ in params]
    assert names == ["0.bias", "0.weight", "2.bias", "2.weight"]  # sorted, as parameter_names()
    assert all(isinstance(p, Parameter) for _, p in params)
    weight = params["0.weight"]
    assert weight.name == "0.weight"
    assert weight.requires_grad is True and params["2.bias"].requires_grad is False
    assert weight.grad is None
    assert weight.data.dtype == np.float32 and weight.data.shape == (16, 8)
    assert repr(weight) == "Parameter(name=0.weight, requires_grad=True)"
    with pytest.raises(KeyError, match=r"Parameter nope not found."):
        params["nope"]
    with pytest.raises(KeyError, match=r"Parameter nope not found."):
        params["nope"] = np.zeros(3, np.float32)


def test_data_is_a_view_of_the_mapped_file_and_writes_change_the_state_not_the_file(state_path, tmp_path):
    before = state_path.read_bytes()
    state = CheckpointState.load_checkpoint(state_path)
    data = state.parameters["0.weight"].data
    assert not data.flags.owndata and data.flags.writeable
    base = data
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base.obj, _core.MappedFile)  # a view over the mapping, not a copy
    # The same memory every time: a view, not a copy per access.
    assert np.shares_memory(data, state.parameters["0.weight"].data)
    data[0, 0] = 123.0
    assert state.parameters["0.weight"].data[0, 0] == 123.0
    assert state_path.read_bytes() == before  # copy-on-write: the file is untouched
    out = tmp_path / "edited"
    CheckpointState.save_checkpoint(state, out)
    assert CheckpointState.load_checkpoint(out).parameters["0.weight"].data[0, 0] == 123.0


def test_views_over_files_ortckpt_wrote_are_aligned(tmp_path):
    state = CheckpointState.from_arrays({"a": np.arange(3, dtype=np.int8), "b": np.ones((5, 7), np.float64)})
    CheckpointState.save_checkpoint(state, tmp_path / "c")
    for _, p in CheckpointState.load_checkpoint(tmp_path / "c").parameters:
        assert p.data.ctypes.data % _core.PAYLOAD_ALIGNMENT == 0


def test_views_keep_the_mapping_alive_after_the_state_is_gone(state_path):
    data = CheckpointState.load_checkpoint(state_path).parameters["0.bias"].data
    expected = data.copy()
    import gc

    gc.collect()
    np.testing.assert_array_equal(data, expected)


def test_setting_data_copies_values_in_with_shape_and_dtype_checked(state_path):
    state = CheckpointState.load_checkpoint(state_path)
    view = state.parameters["0.weight"].data
    state.parameters["0.weight"].data = np.full((16, 8), 2.0, np.float32)
    assert (view == 2.0).all()  # copied into the existing tensor, as ONNX Runtime's copy_from
    state.parameters["0.bias"] = np.full(16, 3.0, np.float32)
    assert (state.parameters["0.bias"].data == 3.0).all()
    with pytest.raises(
        CheckpointStateError, match=r"Parameter 0.weight: shape mismatch: expected \(16, 8\), got \(3, 3\)"
    ):
        state.parameters["0.weight"].data = np.zeros((3, 3), np.float32)
    with pytest.raises(CheckpointStateError, match="data type mismatch: expected FLOAT, got DOUBLE"):
        state.parameters["0.weight"] = np.zeros((16, 8), np.float64)
    # A failed assignment is a RuntimeError, as in ONNX Runtime, and a ValueError.
    with pytest.raises(RuntimeError):
        state.parameters["0.weight"] = np.zeros((1,), np.float32)
    with pytest.raises(ValueError):
        state.parameters["0.weight"] = np.zeros((1,), np.float32)


# --- properties -----------------------------------------------------------------


def test_properties_behave_like_onnx_runtimes(state_path):
    state = CheckpointState.load_checkpoint(state_path)
    props = state.properties
    assert len(props) == 3
    assert list(props) == [("best_accuracy", pytest.approx(0.95)), ("epoch", 10), ("run", "mlp-demo")]
    assert props["epoch"] == 10 and isinstance(props["epoch"], int)
    assert props["best_accuracy"] == np.float32(0.95)  # float32 in the file
    assert "run" in props and "nope" not in props
    with pytest.raises(KeyError, match=r"Property nope not found."):
        props["nope"]
    props["epoch"] = 11
    props["flag"] = True  # stored as int 1, as ONNX Runtime does
    props["lr"] = 0.1  # read back as float32, as ONNX Runtime does
    props["note"] = "ünïcødé"
    props["np_int"] = np.int64(5)
    assert props["flag"] == 1 and type(props["flag"]) is int
    assert props["lr"] == float(np.float32(0.1))
    assert props["np_int"] == 5 and type(props["np_int"]) is int
    with pytest.raises(TypeError, match="int, float or str"):
        props["bad"] = [1]
    with pytest.raises(OverflowError):
        props["big"] = 2**70
    assert "bad" not in props and "big" not in props


def test_property_kinds_survive_a_save(tmp_path):
    state = CheckpointState.from_arrays({"w": np.zeros(2, np.float32)}, properties={"i": -(2**63), "f": 1.5, "s": ""})
    CheckpointState.save_checkpoint(state, tmp_path / "c")
    loaded = CheckpointState.load_checkpoint(tmp_path / "c")
    assert dict(loaded.properties) == {"i": -(2**63), "f": 1.5, "s": ""}


def test_numpy_scalar_properties_read_back_as_python_values():
    # ONNX Runtime gives back Python int, float and str (tests/interop/test_ort_differences.py).
    props = CheckpointState().properties
    values = {"f32": np.float32(0.5), "f64": np.float64(0.25), "i32": np.int32(-3), "b": np.bool_(True)}
    for name, value in values.items():
        props[name] = value
    props[np.str_("s")] = np.str_("text")
    got = dict(props)
    assert got == {"f32": 0.5, "f64": 0.25, "i32": -3, "b": 1, "s": "text"}
    assert {name: type(v) for name, v in got.items()} == {"f32": float, "f64": float, "i32": int, "b": int, "s": str}
    assert [type(name) for name, _ in props] == [str] * 5


# --- saving ----------------------------------------------------------------------


def test_include_optimizer_state(state_path, tmp_path):
    state = CheckpointState.load_checkpoint(state_path)
    CheckpointState.save_checkpoint(state, tmp_path / "without")
    CheckpointState.save_checkpoint(state, tmp_path / "with", include_optimizer_state=True)
    assert CheckpointState.load_checkpoint(tmp_path / "without").optimizer_groups == {}
    groups = CheckpointState.load_checkpoint(tmp_path / "with").optimizer_groups
    original = state.optimizer_groups["group0"]
    assert groups["group0"].step == original.step == 3
    assert groups["group0"].initial_learning_rate == original.initial_learning_rate
    for param, moms in original.momentums.items():
        for name, value in moms.items():
            np.testing.assert_array_equal(groups["group0"].momentums[param][name], value)


def test_paths_may_be_str_or_pathlike(state_path, tmp_path):
    state = CheckpointState.load_checkpoint(str(state_path))
    CheckpointState.save_checkpoint(state, pathlib.PurePath(tmp_path / "a").__fspath__())
    CheckpointState.save_checkpoint(state, tmp_path / "b")
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_saving_a_loaded_state_over_its_own_file(state_path):
    state = CheckpointState.load_checkpoint(state_path)
    bias = state.parameters["0.bias"].data
    expected = bias.copy()
    state.properties["epoch"] = 12
    CheckpointState.save_checkpoint(state, state_path, include_optimizer_state=True)
    np.testing.assert_array_equal(bias, expected)  # the live view still reads the old mapping
    again = CheckpointState.load_checkpoint(state_path)
    np.testing.assert_array_equal(again.parameters["0.bias"].data, expected)
    assert again.properties["epoch"] == 12 and again.optimizer_groups["group0"].step == 3
    assert sorted(os.listdir(state_path.parent)) == ["checkpoint"]  # no temporary files left


def test_a_failed_save_leaves_the_previous_file_intact(state_path):
    before = state_path.read_bytes()
    # Bytes that disagree with dims are refused by the Rust core before anything is written.
    with pytest.raises(CheckpointStateError, match="tensor 'w': 3 bytes given but dims \\[2\\] of FLOAT need 8") as e:
        _boundary.save(state_path, _boundary.CoreState([("w", 1, (2,), b"abc")], [], [], {}))
    assert e.value.filename == str(state_path) and e.value.tensor == "w"
    with pytest.raises(IsADirectoryError):
        CheckpointState.save_checkpoint(CheckpointState.load_checkpoint(state_path), state_path.parent)
    assert state_path.read_bytes() == before
    assert sorted(os.listdir(state_path.parent)) == ["checkpoint"]


def test_save_into_a_missing_directory_is_file_not_found(state_path, tmp_path):
    state = CheckpointState.load_checkpoint(state_path)
    with pytest.raises(FileNotFoundError) as e:
        CheckpointState.save_checkpoint(state, tmp_path / "no" / "such" / "dir" / "c")
    assert e.value.filename == str(tmp_path / "no" / "such" / "dir" / "c")


@pytest.mark.parametrize("caught", [TypeError, AttributeError, NotACheckpointStateError])
@pytest.mark.parametrize("other", [object(), None, "state", {"w": np.zeros(2, np.float32)}])
def test_save_checkpoint_rejects_other_objects(tmp_path, caught, other):
    # ONNX Runtime raises AttributeError there (reading other._state); ortckpt's error is both.
    with pytest.raises(caught, match="Invalid argument for CheckpointState") as e:
        CheckpointState.save_checkpoint(other, tmp_path / "c")
    assert type(e.value) is NotACheckpointStateError and e.value.argument == "state"
    assert not (tmp_path / "c").exists()


# --- building states from Python --------------------------------------------------


def test_from_arrays_and_an_adamw_state_built_in_python(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.zeros(3, np.float32)
    mask = np.array([True, False])
    state = CheckpointState.from_arrays({"w": w, "b": b}, frozen={"mask": mask}, properties={"epoch": 1})
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=3,
        initial_learning_rate=1e-3,
        momentums={n: {"momentum0": np.ones_like(a), "momentum1": np.full_like(a, 2)} for n, a in (("w", w), ("b", b))},
    )
    CheckpointState.save_checkpoint(state, tmp_path / "c", include_optimizer_state=True)
    loaded = CheckpointState.load_checkpoint(tmp_path / "c")
    np.testing.assert_array_equal(loaded.parameters["w"].data, w)
    assert loaded.parameters["mask"].requires_grad is False
    group = loaded.optimizer_groups["group0"]
    assert (group.step, group.initial_learning_rate) == (3, np.float32(1e-3))
    np.testing.assert_array_equal(group.momentums["w"]["momentum1"], np.full_like(w, 2))
    # Editing a loaded group and saving again.
    group.step = 4
    group.momentums["b"]["momentum0"][:] = 7
    CheckpointState.save_checkpoint(loaded, tmp_path / "d", include_optimizer_state=True)
    again = CheckpointState.load_checkpoint(tmp_path / "d").optimizer_groups["group0"]
    assert again.step == 4 and (again.momentums["b"]["momentum0"] == 7).all()


def test_from_arrays_refuses_a_name_given_twice():
    with pytest.raises(CheckpointStateError, match="Parameter x is given as both trainable and frozen"):
        CheckpointState.from_arrays({"x": np.zeros(1)}, frozen={"x": np.zeros(1)})


def test_from_arrays_refuses_dtypes_without_an_onnx_type():
    with pytest.raises(UnsupportedDataTypeError, match="tensor when: NumPy dtype datetime64"):
        CheckpointState.from_arrays({"when": np.array(["2020-01-01"], dtype="datetime64[D]")})


# --- data types ------------------------------------------------------------------------

EVERY_DTYPE = [
    np.float32,
    np.float64,
    np.float16,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    np.complex64,
    np.complex128,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e5m2fnuz,
]


@pytest.mark.parametrize("dtype", EVERY_DTYPE, ids=lambda d: np.dtype(d).name)
def test_every_dtype_round_trips(dtype, tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "matrix": rng.integers(0, 2, (3, 5)).astype(dtype),
        "scalar": np.array(1, dtype=dtype),
        "empty": np.zeros((0, 4), dtype=dtype),
    }
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), tmp_path / "c")
    loaded = CheckpointState.load_checkpoint(tmp_path / "c")
    for name, array in arrays.items():
        got = loaded.parameters[name].data
        assert got.dtype == np.dtype(dtype) and got.shape == array.shape
        assert got.tobytes() == array.tobytes()


def test_big_endian_arrays_are_stored_little_endian(tmp_path):
    big = np.arange(6, dtype=">f4").reshape(2, 3)
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"w": big}), tmp_path / "c")
    got = CheckpointState.load_checkpoint(tmp_path / "c").parameters["w"].data
    assert got.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(got, big)


def test_non_contiguous_arrays_are_saved_by_value(tmp_path):
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"t": base.T, "s": base[:, ::2]}), tmp_path / "c")
    loaded = CheckpointState.load_checkpoint(tmp_path / "c")
    np.testing.assert_array_equal(loaded.parameters["t"].data, base.T)
    np.testing.assert_array_equal(loaded.parameters["s"].data, base[:, ::2])


def test_strings(tmp_path):
    vocab = np.array([["a", "ünï"], ["", "🚀 long " * 20]], dtype=object)
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({}, frozen={"vocab": vocab}), tmp_path / "c")
    got = CheckpointState.load_checkpoint(tmp_path / "c").parameters["vocab"]
    assert got.data_type == "STRING" and got.data.shape == (2, 2)
    assert got.data.tolist() == vocab.tolist()


@pytest.mark.parametrize("signed", [True, False])
def test_int4_and_uint4_are_packed_with_their_logical_shape(signed, tmp_path):
    dtype = ml_dtypes.int4 if signed else ml_dtypes.uint4
    values = np.array([[-8, -1, 0], [1, 5, 7]] if signed else [[0, 1, 2], [13, 14, 15]], dtype=dtype)
    packed = PackedInt4.pack(values)
    assert packed.packed.dtype == np.uint8 and packed.packed.shape == (3,) and packed.shape == (2, 3)
    np.testing.assert_array_equal(packed.unpack(), values)
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"q": values, "p": packed}), tmp_path / "c")
    loaded = CheckpointState.load_checkpoint(tmp_path / "c")
    for name in ("q", "p"):
        param = loaded.parameters[name]
        assert param.data_type == ("INT4" if signed else "UINT4") and param.shape == (2, 3)
        assert isinstance(param.data, PackedInt4) and param.data.packed.tobytes() == packed.packed.tobytes()
        np.testing.assert_array_equal(param.data.unpack(), values)


def test_golden_int4_file_unpacks(tmp_path):
    param = CheckpointState.load_checkpoint(GOLDEN / "dtypes" / "int4.ckpt").parameters["INT4"]
    assert param.shape == (2, 3) and param.data.unpack().shape == (2, 3)


# --- nominal checkpoints ---------------------------------------------------------------------


def test_nominal_checkpoints_behave_like_onnx_runtimes(tmp_path):
    state = CheckpointState.load_checkpoint(GOLDEN / "protos_nominal.ckpt")
    assert state.is_nominal
    assert len(state.parameters) == 5 and "scale" in state.parameters
    assert state.parameters.names() == ["encoder.bias", "encoder.weight", "mask", "position_ids", "scale"]
    with pytest.raises(CheckpointError, match="Please load the parameter states first"):
        state.parameters["scale"]
    with pytest.raises(CheckpointError, match="Please load the parameter states first"):
        list(state.parameters)
    with pytest.raises(CheckpointError, match="Please load all the parameter states first"):
        state.parameters["scale"] = np.ones((10, 10), np.float64)
    with pytest.raises(KeyError, match=r"Parameter nope not found."):
        state.parameters["nope"]
    # Saved as it is: still nominal, names and types kept; properties can be added.
    state.properties["epoch"] = 1
    CheckpointState.save_checkpoint(state, tmp_path / "nominal")
    again = CheckpointState.load_checkpoint(tmp_path / "nominal")
    assert again.is_nominal and again.parameters.names() == state.parameters.names()
    assert again.properties["epoch"] == 1
    assert (tmp_path / "nominal").stat().st_size < 1024  # no values written


# --- ONNX Runtime's own checkpoint tests, behaviour by behaviour ---------------------------------


@pytest.mark.parametrize("value", [-1, 0, 1, 1234567890, -1.0, -0.1, 0.1, 1.0, 1234.0, "hello", "world", "onnxruntime"])
def test_add_get_property_and_save_over_the_same_file(value, tmp_path):
    path = tmp_path / "checkpoint"
    shutil.copy(GOLDEN / "artifacts" / "checkpoint", path)
    state = CheckpointState.load_checkpoint(path)
    if isinstance(value, float):
        value = float(np.float32(value))  # properties hold float32
    assert len(state.properties) == 0
    state.properties["property"] = value
    assert "property" in state.properties and state.properties["property"] == value
    assert len(state.properties) == 1
    CheckpointState.save_checkpoint(state, path)
    new_state = CheckpointState.load_checkpoint(path)
    assert "property" in new_state.properties and new_state.properties["property"] == value
    assert len(new_state.properties) == 1


def test_get_and_set_parameter_values():
    state = CheckpointState.load_checkpoint(GOLDEN / "artifacts" / "checkpoint")
    expected = {"0.weight": True, "0.bias": True, "2.weight": True, "2.bias": False}
    assert len(state.parameters) == len(expected)
    for name, param in state.parameters:
        assert name in expected and param.name == name
        assert param.requires_grad is expected[name]
        assert param.grad is None
    original = state.parameters["2.bias"].data
    saved = original.copy()
    state.parameters["2.bias"].data = np.ones_like(original, dtype=np.float32)
    assert np.allclose(state.parameters["2.bias"].data, 1.0)
    state.parameters["2.bias"] = saved
    assert np.allclose(state.parameters["2.bias"].data, saved)


# --- errors on bad files ------------------------------------------------------------------------


def test_missing_file_is_file_not_found_with_the_filename(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        CheckpointState.load_checkpoint(tmp_path / "missing.ckpt")
    assert e.value.filename == str(tmp_path / "missing.ckpt")


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda b: b[:5], "file is too short to be a checkpoint"),
        (lambda b: b[:4] + b"ORTM" + b[8:], "not an ONNX Runtime training checkpoint"),
        (lambda b: b[: len(b) // 2], "checkpoint verification failed"),
        (lambda b: b"", "file is too short"),
    ],
    ids=["short", "identifier", "truncated", "empty"],
)
def test_malformed_files_raise_a_typed_error_naming_the_file(mangle, message, trained_path, tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(mangle(trained_path.read_bytes()))
    with pytest.raises(CheckpointFormatError, match=message) as e:
        CheckpointState.load_checkpoint(bad)
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)
    assert e.value.filename == str(bad) and str(bad) in str(e.value)


def test_wrong_version_and_bad_dims(trained_path, tmp_path):
    data = bytearray(trained_path.read_bytes())
    # The root table's version field: find the int32 2 that the root's vtable points at.
    root = int.from_bytes(data[0:4], "little")
    vtable = root - int.from_bytes(data[root : root + 4], "little", signed=True)
    version_at = root + int.from_bytes(data[vtable + 4 : vtable + 6], "little")
    assert int.from_bytes(data[version_at : version_at + 4], "little") == 2
    data[version_at : version_at + 4] = (3).to_bytes(4, "little")
    bad = tmp_path / "v3.ckpt"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match="checkpoint version 3 is not supported"):
        CheckpointState.load_checkpoint(bad)


def _patch_dims_of_0_bias(trained_path, tmp_path, new_dims: int) -> pathlib.Path:
    """Rewrites the first dims vector [16] in the file: 0.bias or one of its momentums."""
    data = trained_path.read_bytes()
    pattern = (1).to_bytes(4, "little") + (16).to_bytes(8, "little")
    at = data.index(pattern)
    bad = tmp_path / "bad_dims.ckpt"
    bad.write_bytes(
        data[:at] + (1).to_bytes(4, "little") + new_dims.to_bytes(8, "little", signed=True) + data[at + 12 :]
    )
    return bad


@pytest.mark.parametrize(
    "dims, message",
    [
        (17, r"raw_data holds 64 bytes but dims \[17\] of FLOAT need 68"),
        (-16, r"negative dimension -16"),
        (2**62, r"overflow the byte length"),
    ],
)
def test_dims_that_disagree_with_the_data(dims, message, trained_path, tmp_path):
    bad = _patch_dims_of_0_bias(trained_path, tmp_path, dims)
    with pytest.raises(CheckpointFormatError, match=message) as e:
        CheckpointState.load_checkpoint(bad)
    assert e.value.tensor in ("0.bias", "group0/0.bias/momentum0", "group0/0.bias/momentum1")
    assert e.value.filename == str(bad)
    assert f"{bad}: tensor '{e.value.tensor}': " in str(e.value)


def test_unknown_data_type_codes_are_refused_on_save(tmp_path):
    with pytest.raises(UnsupportedDataTypeError, match="tensor 'w': unsupported tensor data type 99") as e:
        _boundary.save(tmp_path / "c", _boundary.CoreState([("w", 99, (2,), b"\0" * 8)], [], [], {}))
    assert e.value.tensor == "w" and not (tmp_path / "c").exists()


# --- the GIL -----------------------------------------------------------------------------------


def test_another_thread_runs_while_a_large_checkpoint_saves(tmp_path):
    big = np.ones(64 * 2**20 // 4, np.float32)  # 64 MiB per tensor, 4 tensors
    state = CheckpointState.from_arrays({f"w{i}": big for i in range(4)})
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            stop.wait(0.0005)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        before = len(ticks)
        CheckpointState.save_checkpoint(state, tmp_path / "big")
        during = len(ticks) - before
    finally:
        stop.set()
        thread.join()
    # With the GIL held for the whole write the ticker could not run at all.
    assert during >= 3, during
    assert CheckpointState.load_checkpoint(tmp_path / "big").parameters["w3"].data[-1] == 1.0


def test_version_is_the_crates_from_the_compiled_core():
    cargo = (Path(__file__).resolve().parents[3] / "Cargo.toml").read_text()
    crate = re.search(r'^version = "([^"]+)"', cargo, re.MULTILINE)
    assert crate is not None
    assert ortckpt.__version__ == _core.__version__ == crate.group(1)


def test_durable_saves_write_the_same_checkpoint(state_path, tmp_path):
    state = CheckpointState.load_checkpoint(state_path)
    CheckpointState.save_checkpoint(state, tmp_path / "fast", include_optimizer_state=True)
    CheckpointState.save_checkpoint(state, tmp_path / "durable", include_optimizer_state=True, durable=True)
    assert (tmp_path / "fast").read_bytes() == (tmp_path / "durable").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "durable", "fast"]


def _fuzz_regression(name: str, path: pathlib.Path) -> pathlib.Path:
    """Writes a fuzz input of tests/fuzz/regressions (u32 length, checkpoint, data file) to path."""
    data = (pathlib.Path(__file__).resolve().parents[2] / "fuzz" / "regressions" / name).read_bytes()
    n = int.from_bytes(data[:4], "little")
    path.write_bytes(data[4 : 4 + n])
    pathlib.Path(f"{path}.data").write_bytes(data[4 + n :])
    return path


def test_a_nominal_checkpoints_momentums_have_no_values(tmp_path):
    """Found by the atheris fuzzer (tests/fuzz/regressions/atheris-nominal-momentums-huge-dims):
    momentums of a nominal file were materialised as zeros of their dims, which a
    hostile file can make exabytes large."""
    path = _fuzz_regression("atheris-nominal-momentums-huge-dims", tmp_path / "nominal.ckpt")
    state = CheckpointState.load_checkpoint(path)
    assert state.is_nominal
    momentums = state.optimizer_groups["group0"].momentums["layer.weight"]
    assert momentums == {"momentum0": None, "momentum1": None}
    with pytest.raises(CheckpointStateError, match="nominal"):
        CheckpointState.save_checkpoint(state, tmp_path / "again.ckpt", include_optimizer_state=True)
    CheckpointState.save_checkpoint(state, tmp_path / "again.ckpt")
    assert CheckpointState.load_checkpoint(tmp_path / "again.ckpt").is_nominal


def test_an_empty_tensor_whose_other_dims_overflow_is_a_format_error(tmp_path):
    """Found by the atheris fuzzer (tests/fuzz/regressions/atheris-empty-tensor-huge-dims):
    a momentum with dims like (0, 2**62, 2**62) passed as empty, then NumPy refused the
    shape with a ValueError that was not one of ortckpt's errors."""
    path = _fuzz_regression("atheris-empty-tensor-huge-dims", tmp_path / "c.ckpt")
    with pytest.raises(CheckpointFormatError, match="overflow") as caught:
        CheckpointState.load_checkpoint(path)
    assert caught.value.filename == str(path)


def test_handing_a_state_to_onnx_runtime_without_its_training_api_says_what_is_missing() -> None:
    # This venv has onnxruntime, the inference package (no Module, no load_checkpoint).
    state = CheckpointState.from_arrays({"w": np.ones(3, np.float32)})
    with pytest.raises(ImportError, match="need onnxruntime-training"):
        state._state  # what ONNX Runtime's Module takes  # noqa: B018
    assert state.parameters["w"].data.tolist() == [1.0, 1.0, 1.0]  # and the state is as it was
