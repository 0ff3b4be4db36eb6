"""Issue 16 without ONNX Runtime: checkpoints in memory and file objects, format versions and
the newer ONNX type codes (its arithmetic: compute/test_arithmetic_rules.py; its export errors:
convert/test_export_errors.py)."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np
import ortckpt.arithmetic
import pytest
from ortckpt import CheckpointState, PackedBits, PackedInt4
from ortckpt.compare import compare
from ortckpt.errors import CheckpointFormatError, CheckpointStateError, UnsupportedDataTypeError

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "ort-vectors"


# -- in memory and file objects ---------------------------------------------------------------


def test_to_bytes_is_the_file_save_writes_and_from_bytes_reads_it_back(tmp_path):
    state = CheckpointState.load_checkpoint(GOLDEN / "trained_with_optimizer.ckpt")
    data = state.to_bytes(include_optimizer_state=True)
    CheckpointState.save_checkpoint(state, tmp_path / "file.ckpt", include_optimizer_state=True)
    assert data == (tmp_path / "file.ckpt").read_bytes()
    for buffer in (data, bytearray(data), memoryview(data)):
        again = CheckpointState.from_bytes(buffer)
        assert compare(again, state).identical
        assert again.optimizer_groups["group0"].step == state.optimizer_groups["group0"].step
    assert CheckpointState.from_bytes(state.to_bytes()).optimizer_groups == {}


def test_from_bytes_is_zero_copy_and_keeps_the_buffer_alive(tmp_path):
    state = CheckpointState.from_arrays({"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    buffer = bytearray(state.to_bytes())
    loaded = CheckpointState.from_bytes(buffer)
    view = loaded.parameters["w"].data
    assert np.shares_memory(view, np.frombuffer(buffer, np.uint8))
    view[0, 0] = 42  # writable, since a bytearray is: it writes the caller's buffer
    assert CheckpointState.from_bytes(bytes(buffer)).parameters["w"].data[0, 0] == 42
    with pytest.raises(BufferError):  # the state holds an export: the buffer cannot move under it
        buffer.extend(b"x")
    del buffer
    assert view[2, 3] == 11  # still alive through the state's reference

    path = tmp_path / "m.ckpt"
    CheckpointState.save_checkpoint(state, path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        from_map = CheckpointState.from_bytes(mapped)
        assert np.array_equal(from_map.parameters["w"].data, state.parameters["w"].data)
        assert not from_map.parameters["w"].data.flags.writeable
        del from_map
        gc.collect()  # a state and its views form cycles: collected, they release the map
    # a buffer of another item size is read as its bytes
    words = np.frombuffer(state.to_bytes(), np.uint8).copy().view(np.uint32)
    assert compare(CheckpointState.from_bytes(memoryview(words)), state).identical


def test_bad_bytes_get_the_errors_files_get(tmp_path):
    good = CheckpointState.from_arrays({"w": np.ones(4, np.float32)}).to_bytes()
    with pytest.raises(CheckpointFormatError, match="not an ONNX Runtime training checkpoint"):
        CheckpointState.from_bytes(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(CheckpointFormatError):
        CheckpointState.from_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointStateError, match="contiguous"):
        CheckpointState.from_bytes(memoryview(bytearray(good) * 2)[::2])
    # a checkpoint with external data is two files: one buffer cannot hold it
    CheckpointState.save_checkpoint(
        CheckpointState.from_arrays({"w": np.ones(64, np.float32)}), tmp_path / "x.ckpt", external_data_threshold=0
    )
    with pytest.raises(CheckpointStateError, match=r"external data file .* no place in a single buffer"):
        CheckpointState.from_bytes((tmp_path / "x.ckpt").read_bytes())


def test_to_bytes_refuses_more_than_one_buffer_holds_before_touching_the_values():
    huge = np.zeros(2**31, np.uint8)  # calloc'd: never touched, so this costs no memory
    with pytest.raises(
        CheckpointStateError, match=r"one buffer holds at most 2147483647 .* save larger checkpoints to a path"
    ):
        CheckpointState.from_arrays({"w": huge}).to_bytes()


def test_file_objects(tmp_path):
    state = CheckpointState.load_checkpoint(GOLDEN / "trained_with_optimizer.ckpt")
    sink = io.BytesIO()
    ortckpt.save_checkpoint(state, sink, include_optimizer_state=True)
    sink.seek(0)
    again = ortckpt.load_checkpoint(sink)
    assert compare(again, state).identical and again.optimizer_groups["group0"].momentums
    with open(tmp_path / "f.ckpt", "wb") as f:
        CheckpointState.save_checkpoint(state, f, include_optimizer_state=True)
    with open(tmp_path / "f.ckpt", "rb") as f:
        assert compare(CheckpointState.load_checkpoint(f), state).identical


# -- format versions and type codes ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["ort_format", "custom_ops"])
def test_version_1_reads_as_its_version_2_twin(tmp_path, name):
    v1 = CheckpointState.load_checkpoint(GOLDEN / "v1" / f"{name}_v1.ckpt")
    v2 = CheckpointState.load_checkpoint(GOLDEN / "v1" / f"{name}_v2.ckpt")
    assert (v1.format_version, v2.format_version) == (1, 2)
    assert compare(v1, v2).identical
    expected = json.loads((GOLDEN / "v1" / f"{name}_v2.ckpt.json").read_text())
    for p in expected["parameters"]:
        assert hashlib.sha256(v1.parameters[p["name"]].data.tobytes()).hexdigest() == p["sha256"]
    assert ortckpt.upgrade(GOLDEN / "v1" / f"{name}_v1.ckpt", tmp_path / "up.ckpt") == 1
    up = CheckpointState.load_checkpoint(tmp_path / "up.ckpt")
    assert up.format_version == 2 and compare(up, v2).identical
    assert ortckpt.upgrade(tmp_path / "up.ckpt", tmp_path / "again.ckpt") == 2


def test_the_pre_1_16_directory_layout_is_named(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "paramtrain_tensors.pbseq").write_bytes(b"\x00")
    (tmp_path / "ckpt" / "custom_properties.pbseq").write_bytes(b"\x00")
    with pytest.raises(CheckpointFormatError, match=r"protobuf sequence files .* before version 1.16"):
        CheckpointState.load_checkpoint(tmp_path / "ckpt")
    (tmp_path / "plain").mkdir()
    with pytest.raises(IsADirectoryError):
        CheckpointState.load_checkpoint(tmp_path / "plain")


NEW_TYPES = {
    "FLOAT4E2M1": np.array([[0.5, -6.0, 1.5], [0.0, 3.0, -0.5]], ml_dtypes.float4_e2m1fn),
    "FLOAT8E8M0": np.array([1.0, 2.0, 0.5, 2.0**-100], ml_dtypes.float8_e8m0fnu),
    "UINT2": np.array([0, 1, 2, 3, 3], ml_dtypes.uint2),
    "INT2": np.array([[1, -2, 0], [1, -1, -2]], ml_dtypes.int2),
}


@pytest.mark.parametrize("name", sorted(NEW_TYPES))
def test_onnx_type_codes_after_onnx_runtime_1_19(tmp_path, name):
    values = NEW_TYPES[name]
    state = CheckpointState.from_arrays({"t": values})
    CheckpointState.save_checkpoint(state, tmp_path / "t.ckpt")
    loaded = CheckpointState.load_checkpoint(tmp_path / "t.ckpt").parameters["t"]
    assert loaded.data_type == name and loaded.shape == values.shape
    data = loaded.data.unpack() if isinstance(loaded.data, PackedBits) else loaded.data
    assert data.dtype == values.dtype
    assert np.array_equal(data.view(np.uint8) & 0x0F, values.view(np.uint8) & 0x0F)


def test_sub_byte_packing_is_onnxs_low_bits_first():
    assert PackedBits.pack(NEW_TYPES["UINT2"]).packed.tolist() == [0b11100100, 0b11]
    assert PackedBits.pack(NEW_TYPES["INT2"]).packed.tolist() == [0b01001001, 0b1011]  # 1,-2,0,1 | -1,-2
    assert PackedBits.pack(NEW_TYPES["FLOAT4E2M1"]).packed.tolist() == [0xF1, 0x03, 0x95]  # 0.5,-6 | 1.5,0 | 3,-0.5
    four = PackedBits.pack(np.array([1, -2, 3], ml_dtypes.int4))
    assert isinstance(four, PackedInt4) and four.signed and four.packed.tolist() == [0xE1, 0x03]
    with pytest.raises(UnsupportedDataTypeError, match="int4/uint4"):
        PackedInt4.pack(NEW_TYPES["UINT2"])


# -- arithmetic -------------------------------------------------------------------------------


# -- export errors ----------------------------------------------------------------------------
