"""safetensors both ways: exact round trips (bfloat16, float8, optimizer state, typed
properties), files checked by the real safetensors package, foreign files read, and
malformed ones refused with errors that name the file and tensor."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from ortckpt import CheckpointFormatError, CheckpointState, OptimizerGroup, UnsupportedDataTypeError
from ortckpt.compare import compare
from ortckpt.convert import convert, load_safetensors, save_safetensors


def rich_state() -> CheckpointState:
    rng = np.random.default_rng(5)
    state = CheckpointState.from_arrays(
        {
            "w": rng.standard_normal((8, 4)).astype(np.float32),
            "w_bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
            "e4m3": rng.standard_normal(16).astype(ml_dtypes.float8_e4m3fn),
            "e5m2": rng.standard_normal(16).astype(ml_dtypes.float8_e5m2),
            "half": rng.standard_normal(7).astype(np.float16),
            "scalar": np.array(2.5),
            "empty": np.zeros((0, 3), np.float32),
        },
        {"ids": np.arange(5, dtype=np.int64), "mask": np.array([True, False]), "u16": np.arange(4, dtype=np.uint16)},
        {"epoch": 4, "best": 0.75, "run": "demo", "note": "12"},
    )
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=9,
        initial_learning_rate=1e-3,
        momentums={
            "w": {"momentum0": np.ones((8, 4), np.float32), "momentum1": np.full((8, 4), 2, np.float32)},
            "w_bf16": {"momentum0": np.zeros((3, 5), ml_dtypes.bfloat16)},
        },
    )
    return state


def test_a_state_round_trips_exactly_and_so_does_a_checkpoint_file(tmp_path):
    state = rich_state()
    save_safetensors(state, tmp_path / "s.safetensors")
    back = load_safetensors(tmp_path / "s.safetensors")
    CheckpointState.save_checkpoint(state, tmp_path / "ckpt", include_optimizer_state=True)
    from_file = CheckpointState.load_checkpoint(tmp_path / "ckpt")
    assert compare(back, from_file).identical
    assert back.properties["note"] == "12" and back.properties["epoch"] == 4  # types kept
    assert [n for n, p in back.parameters if not p.requires_grad] == ["ids", "mask", "u16"]
    assert back.parameters["scalar"].shape == ()
    # checkpoint -> safetensors -> checkpoint through the converter
    convert(tmp_path / "ckpt", tmp_path / "c.safetensors")
    convert(tmp_path / "c.safetensors", tmp_path / "again.ckpt")
    assert compare(CheckpointState.load_checkpoint(tmp_path / "again.ckpt"), from_file).identical


def test_the_safetensors_package_reads_our_files_bytes_and_metadata(tmp_path):
    state = rich_state()
    save_safetensors(state, tmp_path / "s.safetensors")
    raw = dict(safetensors.deserialize((tmp_path / "s.safetensors").read_bytes()))
    assert raw["w_bf16"]["dtype"] == "BF16" and raw["e4m3"]["dtype"] == "F8_E4M3" and raw["e5m2"]["dtype"] == "F8_E5M2"
    for name, param in state.parameters:
        assert bytes(raw[name]["data"]) == np.ascontiguousarray(param.data).tobytes(), name
        assert list(raw[name]["shape"]) == list(param.shape), name
    assert bytes(raw["optimizer.group0.momentum1.w"]["data"]) == np.full((8, 4), 2, np.float32).tobytes()
    with safetensors.safe_open(tmp_path / "s.safetensors", framework="numpy") as f:
        metadata = f.metadata()
    assert metadata["run"] == "demo" and metadata["epoch"] == "4"
    plain = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.int64)}
    save_safetensors(CheckpointState.from_arrays(plain), tmp_path / "plain.safetensors")
    loaded = safetensors.numpy.load_file(tmp_path / "plain.safetensors")
    assert all(np.array_equal(loaded[k], v) for k, v in plain.items())


def test_files_the_safetensors_package_writes_load_with_metadata_as_properties(tmp_path):
    arrays = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.arange(3, dtype=np.int32)}
    safetensors.numpy.save_file(arrays, tmp_path / "np.safetensors", metadata={"format": "np", "epoch": "3"})
    state = load_safetensors(tmp_path / "np.safetensors", frozen=["n"])
    assert state.parameters["x"].requires_grad and not state.parameters["n"].requires_grad
    assert np.array_equal(state.parameters["x"].data, arrays["x"])
    assert dict(state.properties) == {"format": "np", "epoch": "3"}  # strings: no type record in foreign files
    bf16 = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    e4m3 = np.linspace(-2, 2, 8).astype(ml_dtypes.float8_e4m3fn)

    # The package's dtype names, as its torch API passes them (its NumPy API has no bfloat16).
    def spec(dtype, shape, a):
        return safetensors.TensorSpec(dtype=dtype, shape=shape, data_ptr=a.ctypes.data, data_len=a.nbytes)

    tensors = {"bf": spec("bfloat16", [8], bf16), "f8": spec("float8_e4m3fn", [2, 4], e4m3)}
    safetensors.serialize_file(tensors, str(tmp_path / "raw.safetensors"))
    state = load_safetensors(tmp_path / "raw.safetensors")
    assert np.array_equal(state.parameters["bf"].data, bf16)
    assert state.parameters["f8"].data.dtype == ml_dtypes.float8_e4m3fn
    assert np.array_equal(state.parameters["f8"].data.view(np.uint8), e4m3.view(np.uint8).reshape(2, 4))


def test_types_safetensors_lacks_are_refused_naming_the_tensor_and_the_old_file_stays(tmp_path):
    path = tmp_path / "s.safetensors"
    save_safetensors(CheckpointState.from_arrays({"ok": np.ones(2, np.float32)}), path)
    before = path.read_bytes()
    for bad in (
        {"words": np.array(["a", "b"], dtype=object)},
        {"nibbles": np.arange(4).astype(ml_dtypes.int4)},
        {"fnuz": np.ones(2, ml_dtypes.float8_e4m3fnuz)},
    ):
        with pytest.raises(UnsupportedDataTypeError, match=next(iter(bad))):
            save_safetensors(CheckpointState.from_arrays(bad), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def write_raw(path, header: dict | bytes, data: bytes = b"") -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    "header, data, expected",
    [
        (b"", b"", "not JSON"),
        (b"[1, 2]", b"", "the header is \\[1, 2\\], expected an object"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "tensor t: bytes 0..8 of 4"),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "tensor t"),
        ({"t": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "tensor t"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "tensor t"),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__ is not a map of strings"),
    ],
)
def test_malformed_files_are_refused_naming_the_file_and_tensor(tmp_path, header, data, expected):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data)
    with pytest.raises(CheckpointFormatError, match=expected) as e:
        load_safetensors(path)
    assert str(path) in str(e.value)


def test_a_header_length_past_the_end_is_refused(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointFormatError, match="header of 1000000000000 bytes"):
        load_safetensors(path)
    path.write_bytes(b"\1\0")
    with pytest.raises(CheckpointFormatError, match="shorter than the header length"):
        load_safetensors(path)
