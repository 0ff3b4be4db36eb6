"""Issue 16 without ONNX Runtime: checkpoints in memory and file objects, format versions and
the newer ONNX type codes, checkpoint arithmetic (rules, streaming, memory), export errors."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import mmap
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import ortckpt.arithmetic
import pytest
from ortckpt import CheckpointState, PackedBits, PackedInt4
from ortckpt.cli import run as cli
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


def device(tmp_path: Path, i: int, *, samples: int | None = None, **changes) -> Path:
    rng = np.random.default_rng(i)
    trainable = {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "h": rng.standard_normal(70).astype(ml_dtypes.bfloat16),
        "count": np.arange(3),
    }
    frozen = {"emb": np.linspace(0, 1, 10, dtype=np.float32)}
    for key, value in changes.items():
        (frozen if key in frozen else trainable)[key] = value
    properties = {"round": 3} if samples is None else {"round": 3, "num_samples": samples}
    path = tmp_path / f"d{i}.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(trainable, frozen, properties), path)
    return path


def test_average_is_numpys_weighted_mean_streamed_or_not(tmp_path, monkeypatch):
    paths = [device(tmp_path, i, samples=n) for i, n in enumerate((10, 30, 60))]
    xs = [CheckpointState.load_checkpoint(p) for p in paths]
    monkeypatch.setattr(ortckpt.arithmetic, "CHUNK", 1000)  # several chunks per tensor
    in_memory = ortckpt.average(paths)  # weights: num_samples
    streamed = ortckpt.average(paths, out=tmp_path / "avg.ckpt")
    assert compare(in_memory, streamed).identical
    w = [10, 30, 60]
    expected = np.average(np.stack([x.parameters["w"].data for x in xs]).astype(np.float64), axis=0, weights=w)
    assert np.array_equal(streamed.parameters["w"].data, expected.astype(np.float32))
    # bfloat16 accumulates in float32, rounded once
    h = [x.parameters["h"].data.astype(np.float32) for x in xs]
    mean = h[0] * np.float32(10) + h[1] * np.float32(30)
    mean += h[2] * np.float32(60)
    assert np.array_equal(streamed.parameters["h"].data, (mean / np.float32(100)).astype(ml_dtypes.bfloat16))
    assert np.array_equal(streamed.parameters["count"].data, [0, 1, 2])  # integers copied, never averaged
    assert dict(streamed.properties) == {"round": 3, "num_samples": 100}
    equal = ortckpt.average(paths, [1, 1, 1])
    assert np.allclose(equal.parameters["w"].data, np.mean([x.parameters["w"].data for x in xs], axis=0))
    # external data and a state given in memory work the same
    ext = ortckpt.average([xs[0], *paths[1:]], out=tmp_path / "ext.ckpt", external_data_threshold=0)
    assert (tmp_path / "ext.ckpt.data").exists() and compare(ext, streamed).identical


def test_what_average_refuses(tmp_path):
    a = device(tmp_path, 1)
    with pytest.raises(CheckpointStateError, match=r"count differs .* INT64 tensor is never combined"):
        ortckpt.average([a, device(tmp_path, 2, count=np.arange(1, 4))])
    frozen_b = device(tmp_path, 3, emb=np.zeros(10, np.float32))
    with pytest.raises(CheckpointStateError, match=r"emb differs .*frozen='first'"):
        ortckpt.average([a, frozen_b])
    taken = ortckpt.average([a, frozen_b], frozen="first")
    assert np.array_equal(taken.parameters["emb"].data, CheckpointState.load_checkpoint(a).parameters["emb"].data)
    with pytest.raises(CheckpointStateError, match=r"tensor w is FLOAT \[64, 33\] in checkpoint #0 .* FLOAT \[2\]"):
        ortckpt.average([a, device(tmp_path, 4, w=np.ones(2, np.float32))])
    with pytest.raises(CheckpointStateError, match="does not hold the same tensors"):
        ortckpt.average([a, device(tmp_path, 5, extra=np.ones(2, np.float32))])
    for weights in ([1.0], [1.0, -1.0], [0.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(CheckpointStateError, match="weights"):
            ortckpt.average([a, device(tmp_path, 6)], weights)
    before = tmp_path / "kept.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"w": np.ones(1, np.float32)}), before)
    with pytest.raises(CheckpointStateError):
        ortckpt.average([a, device(tmp_path, 2, count=np.arange(1, 4))], out=before)
    assert CheckpointState.load_checkpoint(before).parameters.names() == ["w"]  # a refused result writes nothing
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]


def test_delta_apply_interpolate_and_their_commands(tmp_path):
    a, b = device(tmp_path, 1), device(tmp_path, 2)
    sa, sb = CheckpointState.load_checkpoint(a), CheckpointState.load_checkpoint(b)
    d = ortckpt.delta(b, a)
    assert np.array_equal(
        d.parameters["w"].data,
        (sb.parameters["w"].data.astype(np.float64) - sa.parameters["w"].data).astype(np.float32),
    )
    back = ortckpt.apply(a, d)
    np.testing.assert_allclose(back.parameters["w"].data, sb.parameters["w"].data, atol=1e-6)
    assert np.array_equal(ortckpt.interpolate(a, b, 0.0).parameters["w"].data, sa.parameters["w"].data)
    assert np.array_equal(ortckpt.interpolate(a, b, 1.0).parameters["w"].data, sb.parameters["w"].data)
    half = ortckpt.interpolate(a, b, 0.5).parameters["w"].data
    assert np.array_equal(half, ortckpt.average([a, b]).parameters["w"].data)

    assert cli(["delta", str(b), str(a), str(tmp_path / "d.ckpt")]) == 0
    assert cli(["apply", str(a), str(tmp_path / "d.ckpt"), str(tmp_path / "b2.ckpt"), "--scale", "0.5"]) == 0
    half_step = CheckpointState.load_checkpoint(tmp_path / "b2.ckpt").parameters["w"].data
    assert np.array_equal(half_step, ortckpt.apply(a, d, 0.5).parameters["w"].data)
    assert cli(["average", str(a), str(b), "-o", str(tmp_path / "avg.ckpt"), "--weights", "1,x"]) == 2
    assert cli(["average", str(a), str(b), "-o", str(tmp_path / "avg.ckpt"), "--weights", "1,3"]) == 0
    assert compare(CheckpointState.load_checkpoint(tmp_path / "avg.ckpt"), ortckpt.average([a, b], [1, 3])).identical


STREAMING_RSS = textwrap.dedent(
    """
    import sys
    import ortckpt
    def peak():  # VmHWM: unlike ru_maxrss, it does not carry the parent's peak across exec
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    paths, out = sys.argv[1:-1], sys.argv[-1]
    before = peak()
    ortckpt.average(paths, out=out)
    print(peak() - before)
    """
)


def test_streaming_average_uses_a_few_chunks_of_memory_not_the_checkpoints(tmp_path):
    """Four checkpoints of 96 MiB: averaging them with out= grows the peak RSS by a few chunks
    (the sources' pages are dropped once used), not by the 384 MiB they hold."""
    paths = []
    for i in range(4):
        w = np.full((3, 8 << 20), i + 0.5, np.float32)  # 3 tensors of 32 MiB
        state = CheckpointState.from_arrays({f"w{j}": w[j] for j in range(3)})
        CheckpointState.save_checkpoint(state, tmp_path / f"s{i}.ckpt")
        paths.append(str(tmp_path / f"s{i}.ckpt"))
        del w, state
    done = subprocess.run(
        [sys.executable, "-c", STREAMING_RSS, *paths, str(tmp_path / "avg.ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    grown = int(done.stdout.split()[-1])
    assert grown < 96 << 20, f"peak RSS grew by {grown >> 20} MiB"  # less than one source holds
    result = CheckpointState.load_checkpoint(tmp_path / "avg.ckpt")
    assert np.all(result.parameters["w1"].data == np.float32(2.0))


# -- export errors ----------------------------------------------------------------------------


def test_export_errors_name_what_is_wrong(tmp_path):
    eval_model = GOLDEN / "artifacts" / "eval_model.onnx"
    trained = GOLDEN / "trained_no_optimizer.ckpt"
    with pytest.raises(CheckpointStateError, match="no node of the model computes nope") as e:
        ortckpt.export_model(trained, eval_model, tmp_path / "m.onnx", output_names=["nope"])
    # The model's own outputs are offered first, before the values inside it.
    declared = [o.name for o in onnx.load(eval_model).graph.output]
    assert f"(the model's outputs: {', '.join(declared)}; other values its nodes compute: " in str(e.value)
    with pytest.raises(CheckpointStateError, match="output_names is empty"):
        ortckpt.export_model(trained, eval_model, tmp_path / "m.onnx", output_names=[])
    with pytest.raises(CheckpointStateError, match="nominal"):
        ortckpt.export_model(GOLDEN / "protos_nominal.ckpt", eval_model, tmp_path / "m.onnx")
    wrong = CheckpointState.load_checkpoint(trained)
    shapes = {n: p.data for n, p in wrong.parameters}
    shapes["0.bias"] = np.zeros(3, np.float32)
    bad = CheckpointState.from_arrays(shapes)
    with pytest.raises(CheckpointStateError, match=r"tensor 0.bias: the model's input has shape \[16\]"):
        ortckpt.export_model(bad, eval_model, tmp_path / "m.onnx", output_names=["y"])
    other = CheckpointState.from_arrays({"unrelated": np.ones(2, np.float32)})
    with pytest.raises(
        CheckpointStateError, match=r"no graph input or initializer .* named like a checkpoint parameter"
    ):
        ortckpt.export_model(other, eval_model, tmp_path / "m.onnx", output_names=["y"])
    assert not (tmp_path / "m.onnx").exists()


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    import ortckpt
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
    try:
        ortckpt.average(sys.argv[1:-1], out=sys.argv[-1])
    except OSError as e:
        print("refused", e.errno)
    """
)


def test_a_full_disk_mid_average_leaves_the_previous_result_and_no_staging(tmp_path):
    paths = []
    for i in range(2):
        state = CheckpointState.from_arrays({"w": np.full(1 << 20, i, np.float32)})  # 4 MiB
        CheckpointState.save_checkpoint(state, tmp_path / f"s{i}.ckpt")
        paths.append(str(tmp_path / f"s{i}.ckpt"))
    previous = tmp_path / "avg.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"old": np.ones(3, np.float32)}), previous)
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, *paths, str(previous)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout.startswith("refused 27"), done.stdout + done.stderr  # EFBIG
    assert CheckpointState.load_checkpoint(previous).parameters.names() == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["avg.ckpt", "s0.ckpt", "s1.ckpt"]
