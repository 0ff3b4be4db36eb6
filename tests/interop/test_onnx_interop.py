"""The ONNX paths against ONNX Runtime 1.19.2's own results on the same inputs: onnxblock's
save_checkpoint (TensorProto path) and load_checkpoint_to_model, models exported with the
checkpoint's weights (external data included) running in an InferenceSession."""

from __future__ import annotations

import pickle
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from ortckpt import CheckpointState, _boundary
from ortckpt.compare import compare
from ortckpt.convert.onnx_model import export_model
from ortckpt.onnxblock import load_checkpoint_to_model, save_checkpoint

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "ort-vectors"


def protos() -> tuple[list[TensorProto], list[TensorProto]]:
    """Trainable and frozen tensors of mixed types and shapes, deliberately not in name order."""
    rng = np.random.default_rng(3)
    trainable = [
        numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "zz.weight"),
        numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "aa.bias"),
        numpy_helper.from_array(np.array(0.5), "m.scale"),  # 0-d double
        numpy_helper.from_array(rng.integers(-9, 9, (2, 2)).astype(np.int32), "counts"),
    ]
    frozen = [
        numpy_helper.from_array(np.arange(7, dtype=np.int64), "position_ids"),
        numpy_helper.from_array(np.array([True, False, True]), "mask"),
        numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty"),
    ]
    return trainable, frozen


def decoded(path) -> dict:
    """Everything a checkpoint holds, in file order, bytes included."""
    loaded = _boundary.load(path)
    main, external_data = loaded.mappings
    out = {"nominal": loaded.nominal, "external": external_data is not None}
    for role in ("trainable", "frozen"):
        entries = []
        for name, code, dims, stored in getattr(loaded, role):
            data = None
            if stored is not None:
                offset, nbytes, external = stored
                mapping = external_data if external else main
                data = bytes(memoryview(mapping)[offset : offset + nbytes])
            entries.append((name, code, list(dims), data))
        out[role] = entries
    return out


@pytest.mark.parametrize("nominal", [False, True])
def test_save_checkpoint_writes_what_onnx_runtimes_tensorproto_path_writes(ort, tmp_path, nominal):
    trainable, frozen = protos()
    with open(tmp_path / "protos.pkl", "wb") as f:
        pickle.dump(([p.SerializeToString() for p in trainable], [p.SerializeToString() for p in frozen]), f)
    extra = ["--nominal"] if nominal else []
    assert "saved" in ort("save_protos", tmp_path / "protos.pkl", tmp_path / "ort.ckpt", *extra)
    save_checkpoint((trainable, frozen), tmp_path / "ours.ckpt", nominal_checkpoint=nominal)
    ours, theirs = decoded(tmp_path / "ours.ckpt"), decoded(tmp_path / "ort.ckpt")
    assert ours == theirs
    assert [name for name, *_ in ours["trainable"]] == ["zz.weight", "aa.bias", "m.scale", "counts"]  # order kept
    # and ONNX Runtime reads ours as it reads its own
    assert ort("describe", tmp_path / "ours.ckpt") == ort("describe", tmp_path / "ort.ckpt")


def test_duplicate_names_are_refused_as_onnx_runtime_refuses_them(ort, tmp_path):
    trainable, frozen = protos()
    frozen.append(trainable[1])
    with open(tmp_path / "protos.pkl", "wb") as f:
        pickle.dump(([p.SerializeToString() for p in trainable], [p.SerializeToString() for p in frozen]), f)
    theirs = ort("save_protos", tmp_path / "protos.pkl", tmp_path / "ort.ckpt")["error"]
    with pytest.raises(ValueError) as ours:
        save_checkpoint((trainable, frozen), tmp_path / "ours.ckpt")
    assert "Duplicated tensor proto named aa.bias" in theirs
    assert "Duplicated tensor proto named aa.bias" in str(ours.value)
    assert not (tmp_path / "ours.ckpt").exists()


def test_serialized_protos_and_the_external_data_rule(tmp_path):
    trainable, frozen = protos()
    save_checkpoint(([p.SerializeToString() for p in trainable], frozen), tmp_path / "bytes.ckpt")
    save_checkpoint((trainable, frozen), tmp_path / "protos.ckpt")
    assert decoded(tmp_path / "bytes.ckpt") == decoded(tmp_path / "protos.ckpt")
    # Past the threshold (ONNX Runtime's is 1800 MiB; lowered here) the values go to .data.
    save_checkpoint((trainable, frozen), tmp_path / "ext.ckpt", external_data_threshold=2**20)
    assert decoded(tmp_path / "ext.ckpt")["external"] and (tmp_path / "ext.ckpt.data").exists()
    assert compare(
        CheckpointState.load_checkpoint(tmp_path / "ext.ckpt"),
        CheckpointState.load_checkpoint(tmp_path / "protos.ckpt"),
    ).identical
    save_checkpoint((trainable, frozen), tmp_path / "nominal.ckpt", True, external_data_threshold=2**20)
    assert not decoded(tmp_path / "nominal.ckpt")["external"]


def mlp_model(extra_value: float = 7.0) -> onnx.ModelProto:
    """An inference MLP whose initializers are named like the golden checkpoint's parameters,
    plus one the checkpoint does not hold."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "0.weight"),
        numpy_helper.from_array(np.zeros(16, np.float32), "0.bias"),
        numpy_helper.from_array(rng.standard_normal((4, 16)).astype(np.float32), "2.weight"),
        numpy_helper.from_array(np.zeros(4, np.float32), "2.bias"),
        numpy_helper.from_array(np.full(4, extra_value, np.float32), "offset"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "0.weight", "0.bias"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "2.weight", "2.bias"], ["y0"], transB=1),
        helper.make_node("Add", ["y0", "offset"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_load_checkpoint_to_model_matches_onnx_runtime(ort, tmp_path):
    ckpt = GOLDEN / "trained_with_optimizer.ckpt"
    onnx.save_model(mlp_model(), tmp_path / "model.onnx")
    ort("load_to_model", ckpt, tmp_path / "model.onnx", tmp_path / "ort.onnx")
    ours = mlp_model()
    load_checkpoint_to_model(ckpt, ours)
    theirs = onnx.load(tmp_path / "ort.onnx")
    values = lambda m: {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}  # noqa: E731
    mine, expected = values(ours), values(theirs)
    assert mine.keys() == expected.keys()
    for name in expected:
        assert mine[name].dtype == expected[name].dtype and np.array_equal(mine[name], expected[name]), name
    assert np.array_equal(mine["offset"], np.full(4, 7.0, np.float32))  # not in the checkpoint: untouched
    state = CheckpointState.load_checkpoint(ckpt)
    assert np.array_equal(mine["0.weight"], state.parameters["0.weight"].data)


@pytest.mark.parametrize("external", [False, True])
def test_an_exported_model_runs_in_onnx_runtime_with_the_checkpoints_weights(ort, tmp_path, external):
    ckpt = GOLDEN / "trained_with_optimizer.ckpt"
    onnx.save_model(mlp_model(), tmp_path / "model.onnx")
    ort("load_to_model", ckpt, tmp_path / "model.onnx", tmp_path / "ort.onnx")
    export_model(ckpt, tmp_path / "model.onnx", tmp_path / "exported.onnx", external_data=external, size_threshold=0)
    assert (tmp_path / "exported.onnx.data").exists() == external
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    ort("infer", tmp_path / "ort.onnx", tmp_path / "x.npy", tmp_path / "expected.npy")
    ort("infer", tmp_path / "exported.onnx", tmp_path / "x.npy", tmp_path / "got.npy")
    assert np.array_equal(np.load(tmp_path / "got.npy"), np.load(tmp_path / "expected.npy"))


def test_from_onnx_reads_initializers_inline_and_in_external_data(tmp_path):
    model = mlp_model()
    model.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "unused"))
    bf16 = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    bf16_proto = helper.make_tensor("bf16", TensorProto.BFLOAT16, [2, 3], bf16.view(np.uint16).tobytes(), raw=True)
    model.graph.initializer.append(bf16_proto)
    inline = CheckpointState.from_onnx(model, frozen=["offset"])
    assert not inline.parameters["offset"].requires_grad and inline.parameters["0.weight"].requires_grad
    assert np.array_equal(inline.parameters["bf16"].data, bf16)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # saving with external data moves the copy's bytes out
    onnx.save_model(copy, tmp_path / "ext.onnx", save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    assert onnx.load(tmp_path / "ext.onnx", load_external_data=False).graph.initializer[0].data_location == 1
    external = CheckpointState.from_onnx(tmp_path / "ext.onnx", requires_grad=["0.weight", "2.weight"])
    assert [n for n, p in external.parameters if p.requires_grad] == ["0.weight", "2.weight"]
    assert compare(external, CheckpointState.from_onnx(model, requires_grad=["0.weight", "2.weight"])).identical
    with pytest.raises(ValueError, match="not initializers"):
        CheckpointState.from_onnx(model, frozen=["nope"])
