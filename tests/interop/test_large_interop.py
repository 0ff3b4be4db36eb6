"""Past ONNX Runtime's 1800 MiB threshold, both ways (`make test-large`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from ortckpt import CheckpointState, OptimizerGroup, _boundary

pytestmark = pytest.mark.large


def sha256(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def test_ortckpt_checkpoint_over_the_default_threshold_loads_in_onnx_runtime(ort, tmp_path):
    big = np.full(1900 * 2**20 // 4, 0.25, np.float32)
    big[::9973] = np.arange(big[::9973].size, dtype=np.float32)
    small = {f"fc{i}.weight": np.random.default_rng(i).standard_normal((256, 64)).astype(np.float32) for i in range(3)}
    state = CheckpointState.from_arrays({"embed": big, **small}, properties={"epoch": 9})
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=7,
        initial_learning_rate=1e-4,
        momentums={n: {"momentum0": a * 0.5, "momentum1": a * a} for n, a in small.items()},
    )
    ours = tmp_path / "ours.ckpt"
    CheckpointState.save_checkpoint(state, ours, include_optimizer_state=True)  # default threshold
    assert (tmp_path / "ours.ckpt.data").stat().st_size > 1800 * 2**20
    assert ours.stat().st_size < 2**20

    seen = ort("describe", ours)
    want = {n: sha256(p.data) for n, p in state.parameters}
    assert {p["name"]: p["sha256"] for p in seen["parameters"]} == want
    assert seen["properties"] == {"epoch": 9}

    # ONNX Runtime re-saves it (external, momentums inline): every byte, momentums included, comes back.
    theirs = tmp_path / "theirs.ckpt"
    ort("resave", ours, theirs)
    back = CheckpointState.load_checkpoint(theirs)
    assert {n: sha256(p.data) for n, p in back.parameters} == want
    group = back.optimizer_groups["group0"]
    assert group.step == 7
    for name, moms in state.optimizer_groups["group0"].momentums.items():
        for m, value in moms.items():
            assert sha256(group.momentums[name][m]) == sha256(value)


def test_onnx_runtime_tensorproto_checkpoint_over_the_threshold_loads_in_ortckpt(ort, tmp_path):
    path = tmp_path / "protos.ckpt"
    written = ort("write_protos", path, 1900)
    assert Path(f"{path}.data").exists()
    state = CheckpointState.load_checkpoint(path)
    assert {n: sha256(p.data) for n, p in state.parameters} == written["sha256"]
    assert state.parameters["small"].requires_grad is False and state.parameters["layer1.weight"].requires_grad


@pytest.mark.parametrize("mib", [1700, 1900])
def test_onnxblock_save_checkpoint_goes_external_where_onnx_runtimes_tensorproto_path_does(ort, tmp_path, mib):
    from onnx import numpy_helper
    from ortckpt.onnxblock import save_checkpoint

    theirs, ours = tmp_path / "theirs.ckpt", tmp_path / "ours.ckpt"
    written = ort("write_protos", theirs, mib)
    # The same protos as ort_helper.write_protos builds (eight float32 tensors, then "small").
    count, per = 8, mib * 2**20 // 4 // 8
    trainable, frozen = [], []
    for i in range(count):
        array = np.full(per, i + 0.5, np.float32)
        array[::4097] = i
        (trainable if i % 4 else frozen).append(numpy_helper.from_array(array, f"layer{i}.weight"))
        del array
    frozen.append(numpy_helper.from_array(np.arange(10, dtype=np.int64), "small"))
    save_checkpoint((trainable, frozen), ours)
    del trainable, frozen
    assert Path(f"{ours}.data").exists() == Path(f"{theirs}.data").exists() == (mib > 1800)
    a, b = CheckpointState.load_checkpoint(ours), CheckpointState.load_checkpoint(theirs)
    loaded = [_boundary.load(p) for p in (ours, theirs)]
    order = [[[t[0] for t in getattr(one, role)] for role in ("trainable", "frozen")] for one in loaded]
    assert order[0] == order[1]  # the protos' order, not sorted
    assert {n: sha256(p.data) for n, p in a.parameters} == written["sha256"]
    assert [p.requires_grad for _, p in a.parameters] == [p.requires_grad for _, p in b.parameters]


def test_a_model_past_two_gib_is_exported_with_external_data_and_runs_in_onnx_runtime(ort, tmp_path):
    from onnx import TensorProto, helper, numpy_helper
    from ortckpt.onnxblock import export_model

    rows = (2100 * 2**20) // (256 * 4)  # a 2100 MiB embedding table
    table = np.zeros((rows, 256), np.float32)
    table[:, 0] = np.arange(rows, dtype=np.float32)
    table[-1, :] = 7.0
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"table": table}), tmp_path / "ckpt")
    # The model holds a placeholder; the export puts the checkpoint's 2100 MiB in its place.
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"])],
        "lookup",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [None, 256])],
        [numpy_helper.from_array(np.zeros((1, 256), np.float32), "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    del table
    export_model(tmp_path / "ckpt", model, tmp_path / "lookup.onnx")
    assert (tmp_path / "lookup.onnx").stat().st_size < 2**20
    assert Path(f"{tmp_path / 'lookup.onnx'}.data").stat().st_size == rows * 256 * 4
    ids = np.array([0, 5, rows - 1], np.int64)
    np.save(tmp_path / "ids.npy", ids)
    ort("infer", tmp_path / "lookup.onnx", tmp_path / "ids.npy", tmp_path / "rows.npy")
    got = np.load(tmp_path / "rows.npy")
    assert got[0, 0] == 0 and got[1, 0] == 5 and (got[2] == 7).all() and not got[:2, 1:].any()
