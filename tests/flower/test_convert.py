"""to_arrayrecord / from_arrayrecord: every dtype a checkpoint stores, the split, optimizer
state, no copies, and what is refused."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from ortckpt import CheckpointState, OptimizerGroup
from ortckpt.dtypes import PackedBits
from ortckpt.flower import OPTIMIZER_PREFIX, ArrayRecordError, from_arrayrecord, to_arrayrecord

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "ort-vectors"
NUMPY_TYPES = [
    np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64, np.bool_,
]  # fmt: skip
ML_TYPES = [
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e5m2fnuz,
]  # fmt: skip


def sample(dtype, shape=(3, 4)):
    values = np.random.default_rng(1).standard_normal(shape) * 3
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", NUMPY_TYPES + ML_TYPES, ids=lambda t: np.dtype(t).name)
def test_every_dtype_round_trips_through_an_arrayrecord_and_a_checkpoint_file(dtype, tmp_path):
    trainable = {"layer/w": sample(dtype), "scalar": sample(dtype, ())}
    frozen = {"frozen.b": sample(dtype, (5,)), "empty": sample(dtype, (0, 2))}
    state = CheckpointState.from_arrays(trainable, frozen, {"epoch": 3})
    record = to_arrayrecord(state)
    assert list(record.keys()) == ["layer/w", "scalar", "frozen.b", "empty"]
    assert record["layer/w"].dtype == np.dtype(dtype).name and record["layer/w"].shape == (3, 4)
    back = from_arrayrecord(record, like=state)
    assert {e.name: e.requires_grad for e in back.tensor_records()} == {
        "layer/w": True,
        "scalar": True,
        "frozen.b": False,
        "empty": False,
    }
    assert back.properties["epoch"] == 3
    CheckpointState.save_checkpoint(back, tmp_path / "c.ckpt")
    loaded = CheckpointState.load_checkpoint(tmp_path / "c.ckpt")
    for name, value in {**trainable, **frozen}.items():
        got = loaded.parameters[name].data
        assert got.dtype == np.dtype(dtype) and got.shape == value.shape
        assert got.tobytes() == value.tobytes(), name


@pytest.mark.parametrize("dtype", [*NUMPY_TYPES, ml_dtypes.bfloat16], ids=lambda t: np.dtype(t).name)
def test_the_bytes_are_what_flowers_own_array_writes_and_flowers_arrays_are_read(dtype):
    value = sample(dtype, (2, 3, 2))
    mine = to_arrayrecord(CheckpointState.from_arrays({"x": value}))["x"]
    flowers = Array(value)
    assert (mine.dtype, mine.shape, mine.stype, mine.data) == (
        flowers.dtype,
        flowers.shape,
        flowers.stype,
        flowers.data,
    )
    back = from_arrayrecord(ArrayRecord({"x": flowers})).parameters["x"].data
    assert back.dtype == np.dtype(dtype) and back.tobytes() == value.tobytes()


def test_from_arrayrecord_views_the_arrays_bytes_without_copying_them():
    value = sample(np.float32, (100, 10))
    record = ArrayRecord({"w": Array(value)})
    state = from_arrayrecord(record)
    view = state.parameters["w"].data
    data = np.frombuffer(record["w"].data, np.uint8)
    assert np.shares_memory(view, data)
    assert [e.requires_grad for e in state.tensor_records()] == [True]  # without like: trainable


def test_a_fortran_ordered_or_byte_swapped_npy_is_converted():
    value = np.asfortranarray(sample(np.float32, (3, 5)))
    assert from_arrayrecord(ArrayRecord({"f": Array(value)})).parameters["f"].data.tolist() == value.tolist()
    swapped = sample(np.float64, (4,)).astype(">f8")
    got = from_arrayrecord(ArrayRecord({"s": Array(swapped)})).parameters["s"].data
    assert got.dtype == np.dtype("<f8") and got.tolist() == swapped.tolist()


def test_trainable_only_leaves_the_frozen_out_and_like_puts_them_back():
    state = CheckpointState.from_arrays({"w": sample(np.float32)}, {"f": sample(np.int32)})
    record = to_arrayrecord(state, trainable_only=True)
    assert list(record.keys()) == ["w"]
    back = from_arrayrecord(record, like=state)
    assert back.parameters["f"].data.tolist() == state.parameters["f"].data.tolist()
    assert not back.parameters["f"].requires_grad


def test_optimizer_state_round_trips_under_keys_that_no_parameter_can_take():
    state = CheckpointState.from_arrays({"w": sample(np.float32), "a/b": sample(np.float32, (2,))})
    state.optimizer_groups = {
        "group0": OptimizerGroup(
            7,
            0.001,
            {
                "w": {"momentum0": sample(np.float32) + 1, "momentum1": sample(np.float32) + 2},
                "a/b": {"momentum0": sample(np.float32, (2,))},
            },
        )
    }
    record = to_arrayrecord(state, include_optimizer_state=True)
    assert sum(k.startswith(OPTIMIZER_PREFIX) for k in record) == 5
    assert list(to_arrayrecord(state).keys()) == ["w", "a/b"]
    back = from_arrayrecord(record)
    group = back.optimizer_groups["group0"]
    assert (group.step, group.initial_learning_rate) == (7, 0.001)
    assert group.momentums["w"]["momentum1"].tobytes() == (sample(np.float32) + 2).tobytes()
    assert group.momentums["a/b"]["momentum0"].shape == (2,)
    assert sorted(n for n, _ in back.parameters) == ["a/b", "w"]
    assert OPTIMIZER_PREFIX + "group0/a%2Fb/momentum0" in record
    bad = CheckpointState.from_arrays({OPTIMIZER_PREFIX + "g/step": np.zeros(1, np.int64)})
    with pytest.raises(ArrayRecordError, match="may not start with"):
        to_arrayrecord(bad)


def test_nominal_string_and_sub_byte_tensors_are_refused_naming_them():
    with pytest.raises(ArrayRecordError, match="nominal"):
        to_arrayrecord(CheckpointState.load_checkpoint(GOLDEN / "protos_nominal.ckpt"))
    strings = CheckpointState.from_arrays({"vocab": np.array(["a", "bc"], dtype=object)})
    with pytest.raises(ArrayRecordError, match="vocab: a string tensor"):
        to_arrayrecord(strings)
    packed = CheckpointState.from_arrays({"q": PackedBits.pack(np.array([1, -2, 3], ml_dtypes.int4))})
    with pytest.raises(ArrayRecordError, match="q: a sub-byte tensor"):
        to_arrayrecord(packed)


def bad_arrays():
    good = Array(sample(np.float32, (2, 2)))
    return {
        "shape": Array(good.dtype, (4,), good.stype, good.data),
        "dtype": Array("int32", good.shape, good.stype, good.data),
        "stype": Array(good.dtype, good.shape, "torch.tensor", good.data),
        "truncated": Array(good.dtype, good.shape, good.stype, good.data[:-1]),
        "not npy": Array(good.dtype, good.shape, good.stype, b"x" * 80),
        "object dtype": Array("object", good.shape, good.stype, good.data),
    }


@pytest.mark.parametrize("case", list(bad_arrays()))
def test_an_array_whose_metadata_and_bytes_disagree_is_refused_naming_it(case):
    with pytest.raises(ArrayRecordError) as caught:
        from_arrayrecord(ArrayRecord({"t": bad_arrays()[case]}))
    assert caught.value.tensor == "t" and str(caught.value).startswith("t: ")


def test_like_refuses_an_unknown_parameter_or_another_type():
    like = CheckpointState.from_arrays({"w": sample(np.float32)})
    with pytest.raises(ArrayRecordError, match="not a parameter"):
        from_arrayrecord(ArrayRecord({"v": Array(sample(np.float32))}), like=like)
    with pytest.raises(ArrayRecordError, match="w: float64"):
        from_arrayrecord(ArrayRecord({"w": Array(sample(np.float64))}), like=like)


def test_a_nominal_like_gives_the_split_to_the_arrays_a_server_sends():
    """ONNX Runtime's on-device flow: a device holds a nominal checkpoint, the values come from Flower."""
    nominal = CheckpointState.load_checkpoint(GOLDEN / "protos_nominal.ckpt")
    values = {
        r.name: np.arange(6).astype(np.dtype({1: np.float32, 11: np.float64, 7: np.int64, 9: np.bool_}[r.code]))
        for r in nominal.tensor_records()
    }
    state = from_arrayrecord(ArrayRecord({k: Array(v) for k, v in values.items()}), like=nominal)
    assert not state.is_nominal
    assert {r.name: r.requires_grad for r in state.tensor_records()} == {
        r.name: r.requires_grad for r in nominal.tensor_records()
    }
    assert state.parameters["scale"].data.tolist() == values["scale"].tolist()
    with pytest.raises(ArrayRecordError, match="scale: float32"):
        from_arrayrecord(ArrayRecord({"scale": Array(np.zeros(2, np.float32))}), like=nominal)
    with pytest.raises(ArrayRecordError, match="nominal"):  # (a parameter the record lacks has no values)
        from_arrayrecord(ArrayRecord({"scale": Array(values["scale"])}), like=nominal)


def test_without_flwr_the_import_says_what_to_install():
    import subprocess
    import sys

    code = "import sys; sys.modules['flwr'] = None; import ortckpt.flower"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert "ImportError: ortckpt.flower needs flwr: pip install 'ortckpt[flower]'" in done.stderr


@pytest.mark.parametrize("dtype", ML_TYPES, ids=lambda t: np.dtype(t).name)
def test_flowers_own_arrays_of_the_ml_dtypes_types_are_read(dtype):
    """np.save writes "<V2", "<V1" or "<f1" (float8_e5m2's, which NumPy cannot read back)."""
    value = sample(dtype, (3, 2))
    back = from_arrayrecord(ArrayRecord({"x": Array(value)})).parameters["x"].data
    assert back.dtype == np.dtype(dtype) and back.tobytes() == value.tobytes()
