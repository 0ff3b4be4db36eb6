"""What ONNX Runtime's own training-API tests (orttraining_test_ort_apis_py_bindings.py,
orttraining_test_ort_apis_onnxblock.py, checkpoint_test.cc) showed to differ, each checked
against ONNX Runtime 1.19.2 itself: matched where ortckpt matches, and pinned where README's
"Differences from ONNX Runtime" says how and why it differs (so the README stays true)."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import onnx
import ortckpt
import pytest
from onnx import numpy_helper
from onnx.external_data_helper import uses_external_data
from ortckpt import CheckpointState
from ortckpt.cli import run as cli
from ortckpt.onnxblock import save_checkpoint

ARTIFACTS = Path(__file__).resolve().parents[1] / "data" / "ort-vectors" / "artifacts"


def typed(properties) -> dict:
    """{name: [type name, value]}, as ort_helper reports ONNX Runtime's get_property."""
    return {name: [type(value).__name__, value] for name, value in properties}


# --- properties -------------------------------------------------------------------------------

# The values of ONNX Runtime's test_add_get_property, and a bool, a wide int and text beyond ASCII.
PROPERTY_VALUES = [-1, 0, 1, 1234567890, -1.0, -0.1, 0.1, 1.0, 1234.0, "hello", "world", "onnxruntime"]
PROPERTY_VALUES += [True, 2**62, "ünïcødé"]


@pytest.mark.parametrize("value", PROPERTY_VALUES)
def test_properties_read_back_as_the_python_values_onnx_runtime_gives(ort, tmp_path, value):
    theirs = ort("properties", json.dumps([["property", value]]), tmp_path / "theirs.ckpt")
    state = CheckpointState()
    state.properties["property"] = value
    # In memory: the same Python type and value (a float as float32 widened back to a Python float).
    assert typed(state.properties) == theirs["in_memory"] == theirs["reloaded"]
    if isinstance(value, float):
        assert theirs["in_memory"]["property"] == ["float", float(np.float32(value))]
    # After a save, each side reads the other's file as its own.
    CheckpointState.save_checkpoint(state, tmp_path / "ours.ckpt")
    assert typed(CheckpointState.load_checkpoint(tmp_path / "ours.ckpt").properties) == theirs["reloaded"]
    assert ort("read_properties", tmp_path / "ours.ckpt") == theirs["reloaded"]
    assert typed(CheckpointState.load_checkpoint(tmp_path / "theirs.ckpt").properties) == theirs["reloaded"]


def test_numpy_float_properties_keep_their_value_where_onnx_runtime_truncates_them(ort, tmp_path):
    # Documented difference: ONNX Runtime 1.19.2's binding takes a NumPy float32/float16 as an int.
    pairs = [["f32", 0.75, "float32"], ["f16", 2.5, "float16"], ["f64", 0.75, "float64"], ["i64", 7, "int64"]]
    theirs = ort("properties", json.dumps(pairs), tmp_path / "theirs.ckpt")
    assert theirs["in_memory"] == {"f16": ["int", 2], "f32": ["int", 0], "f64": ["float", 0.75], "i64": ["int", 7]}
    state = CheckpointState()
    for name, value, numpy_type in pairs:
        state.properties[name] = getattr(np, numpy_type)(value)
    assert typed(state.properties) == {
        "f16": ["float", 2.5],
        "f32": ["float", 0.75],
        "f64": ["float", 0.75],
        "i64": ["int", 7],
    }


# --- argument types --------------------------------------------------------------------------

FLAGS = {
    "True": True,
    "None": None,
    "1": 1,
    "0.5": 0.5,
    "2j": 2j,
    "np.bool_": np.bool_(False),
    "np.int64": np.int64(1),
    "np.float32": np.float32(0),
    "str": "False",
    "bytes": b"",
    "list": [],
    "dict": {},
    "object": object(),
}


def test_include_optimizer_state_takes_what_onnx_runtime_takes(ort, tmp_path):
    # ONNX Runtime's binding takes a number's truth (None is False) and refuses the rest with TypeError.
    theirs = ort("flags", tmp_path / "theirs.ckpt")
    state = CheckpointState.from_arrays({"w": np.zeros(2, np.float32)})
    ours = {}
    for label, value in FLAGS.items():
        try:
            CheckpointState.save_checkpoint(state, tmp_path / "ours.ckpt", value)
            ours[label] = True
        except ortckpt.InvalidArgumentTypeError as e:
            assert isinstance(e, TypeError) and e.argument == "include_optimizer_state"
            ours[label] = False
    assert ours == theirs
    assert [label for label, taken in theirs.items() if not taken] == ["str", "bytes", "list", "dict", "object"]


# --- an empty state ---------------------------------------------------------------------------


def test_an_empty_state_is_36_bytes_in_onnx_runtime_and_loads_both_ways(ort, tmp_path):
    theirs = ort("properties", "[]", tmp_path / "theirs.ckpt")
    assert theirs["size"] == 36  # version and an empty optimizer_groups vector, nothing else
    loaded = CheckpointState.load_checkpoint(tmp_path / "theirs.ckpt")
    assert len(loaded.parameters) == 0 and len(loaded.properties) == 0 and loaded.optimizer_groups == {}

    CheckpointState.save_checkpoint(CheckpointState(), tmp_path / "ours.ckpt", include_optimizer_state=True)
    # Documented difference: the same tables, then the checksum block and the pair trailer.
    data = (tmp_path / "ours.ckpt").read_bytes()
    assert data[4:8] == b"ODTC" and data.endswith(ortckpt.targets.PAIR_MAGIC + data[-16:])
    assert len(data) == 192  # README's figure
    assert ortckpt.verify(tmp_path / "ours.ckpt").checksums
    assert ort("describe", tmp_path / "ours.ckpt") == {"parameter_names": [], "parameters": [], "properties": {}}
    # ONNX Runtime's resave of it is its own 36 bytes again.
    ort("resave", tmp_path / "ours.ckpt", tmp_path / "resaved.ckpt")
    assert (tmp_path / "resaved.ckpt").read_bytes() == (tmp_path / "theirs.ckpt").read_bytes()


# --- external data -----------------------------------------------------------------------------

# The 9 initializers of the model ONNX Runtime's checkpoint_test.cc saves with external data
# (testdata/transform/computation_reduction/gathernd/e2e.onnx): names, types, shapes; 7 trainable.
E2E_TRAINABLE = {
    "bert.encoder.layer.2.output.LayerNorm.weight": (128,),
    "bert.encoder.layer.2.output.LayerNorm.bias": (128,),
    "add1_initializerr": (128,),
    "cls.predictions.transform.LayerNorm.weight": (128,),
    "cls.predictions.transform.LayerNorm.bias": (128,),
    "bert.embeddings.word_embeddings.weight_transposed": (128, 256),
    "cls.predictions.bias": (256,),
}


def test_an_external_data_checkpoint_of_small_tensors_carries_its_checksums(ort, tmp_path):
    """ONNX Runtime's test asserts its checkpoint file is under 1,000 bytes here; ortckpt's is
    1,152 (README): the checksum block (8 bytes a tensor and 40) and the pair trailer (32) on
    tables and an inline int64 scalar at 64-byte-aligned offsets. It loads in ONNX Runtime."""
    rng = np.random.default_rng(5)
    trainable = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in E2E_TRAINABLE.items()}
    frozen = {"matmul1_initializer": rng.standard_normal((128, 128)).astype(np.float32)}
    frozen["gather_indice_initializer"] = np.array(3, np.int64)  # 8 bytes: stays inline, as in ONNX Runtime
    state = CheckpointState.from_arrays(trainable, frozen)
    CheckpointState.save_checkpoint(state, tmp_path / "e2e_ckpt_save_cpu", external_data_threshold=0)
    assert (tmp_path / "e2e_ckpt_save_cpu").stat().st_size == 1152
    assert (tmp_path / "e2e_ckpt_save_cpu.data").stat().st_size > 200000  # as ONNX Runtime's test asserts
    seen = {p["name"]: p["sha256"] for p in ort("describe", tmp_path / "e2e_ckpt_save_cpu")["parameters"]}
    expected = trainable | frozen
    assert seen == {name: hashlib.sha256(value.tobytes()).hexdigest() for name, value in expected.items()}


# --- nominal checkpoints ------------------------------------------------------------------------


def _protos() -> tuple[list, list]:
    rng = np.random.default_rng(3)
    trainable = [numpy_helper.from_array(rng.standard_normal((5, 4)).astype(np.float32), "fc1.weight")]
    trainable.append(numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "fc1.bias"))
    frozen = [numpy_helper.from_array(rng.integers(0, 9, (2, 5)).astype(np.int64), "fc2.weight")]
    frozen.append(numpy_helper.from_array(rng.integers(0, 9, 2).astype(np.int64), "fc2.bias"))
    return trainable, frozen


def test_a_nominal_checkpoint_is_smaller_than_the_complete_one_and_loads_as_onnx_runtimes(ort, tmp_path):
    # ONNX Runtime's test_save_nominal_checkpoint: the complete checkpoint is larger than its nominal twin.
    trainable, frozen = _protos()
    with open(tmp_path / "protos.pkl", "wb") as f:
        pickle.dump(([t.SerializeToString() for t in trainable], [t.SerializeToString() for t in frozen]), f)
    ort("save_protos", tmp_path / "protos.pkl", tmp_path / "theirs_nominal", "--nominal")
    save_checkpoint((trainable, frozen), tmp_path / "checkpoint")
    save_checkpoint((trainable, frozen), tmp_path / "nominal_checkpoint", nominal_checkpoint=True)
    assert cli(["nominal", str(tmp_path / "checkpoint"), str(tmp_path / "twin")]) == 0  # the same, from the file
    assert (tmp_path / "checkpoint").stat().st_size > (tmp_path / "nominal_checkpoint").stat().st_size
    # README's figures (the checksum block and the pair trailer, after aligned tables)
    assert (tmp_path / "nominal_checkpoint").stat().st_size == 448
    assert (tmp_path / "theirs_nominal").stat().st_size == 268

    theirs = CheckpointState.load_checkpoint(tmp_path / "theirs_nominal")
    seen_by_ort = ort("describe", tmp_path / "theirs_nominal")
    for name in ("nominal_checkpoint", "twin"):
        ours = CheckpointState.load_checkpoint(tmp_path / name)
        assert ours.is_nominal and theirs.is_nominal
        assert ours.tensor_records() == theirs.tensor_records()  # names, roles, types, empty dims, order
        assert ort("describe", tmp_path / name) == seen_by_ort  # ONNX Runtime: the same names, no values
        for parameter in seen_by_ort["parameters"]:
            assert "Please load the parameter states first" in parameter["error"]
        with pytest.raises(ortckpt.CheckpointError, match="Please load the parameter states first"):
            ours.parameters["fc1.weight"]
        with pytest.raises(ortckpt.CheckpointError, match="Please load all the parameter states first"):
            ours.parameters["fc1.weight"] = np.ones((5, 4), np.float32)


# --- export_model_for_inferencing ------------------------------------------------------------


def _trained(ort, tmp_path: Path) -> Path:
    ort("train_steps", ARTIFACTS / "checkpoint", ARTIFACTS, tmp_path / "trained.ckpt", 7, 2)
    return tmp_path / "trained.ckpt"


def _external_entries(path: Path) -> dict:
    model = onnx.load(str(path), load_external_data=False)
    return {
        init.name: {e.key: e.value for e in init.external_data} if uses_external_data(init) else init.raw_data
        for init in model.graph.initializer
    }


def test_export_writes_external_data_where_onnx_runtime_does(ort, tmp_path):
    """A checkpoint with external data exports with external data (ONNX Runtime's rule), the
    same initializers out (64 bytes or more) at the same offsets, the data files byte-identical."""
    state = CheckpointState.load_checkpoint(_trained(ort, tmp_path))
    CheckpointState.save_checkpoint(state, tmp_path / "ext.ckpt", True, external_data_threshold=0)
    ort("export", tmp_path / "ext.ckpt", ARTIFACTS, tmp_path / "theirs.onnx", "y")
    ortckpt.export_model(
        tmp_path / "ext.ckpt", ARTIFACTS / "eval_model.onnx", tmp_path / "ours.onnx", output_names=["y"]
    )

    theirs, ours = _external_entries(tmp_path / "theirs.onnx"), _external_entries(tmp_path / "ours.onnx")
    for entries, name in ((theirs, "theirs.onnx.data"), (ours, "ours.onnx.data")):
        for entry in entries.values():
            if isinstance(entry, dict):
                assert entry.pop("location") == name  # beside the model, by its relative name
    assert ours == theirs
    assert sorted(n for n, e in ours.items() if isinstance(e, dict)) == ["0.bias", "0.weight", "2.weight"]
    assert (tmp_path / "ours.onnx.data").read_bytes() == (tmp_path / "theirs.onnx.data").read_bytes()

    inputs = {"x": np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **inputs)
    for name in ("ours", "theirs"):
        ort("infer_all", tmp_path / f"{name}.onnx", tmp_path / "in.npz", tmp_path / f"{name}.npz")
    assert np.array_equal(np.load(tmp_path / "ours.npz")["y"], np.load(tmp_path / "theirs.npz")["y"])

    # The command line follows the same rule, and --no-external-data overrides it.
    assert (
        cli(["export", str(tmp_path / "ext.ckpt"), str(ARTIFACTS / "eval_model.onnx"), str(tmp_path / "cli.onnx")]) == 0
    )
    assert (tmp_path / "cli.onnx.data").exists()
    out = tmp_path / "one.onnx"
    assert (
        cli(["export", str(tmp_path / "ext.ckpt"), str(ARTIFACTS / "eval_model.onnx"), str(out), "--no-external-data"])
        == 0
    )
    assert not Path(f"{out}.data").exists()


def test_export_of_an_inline_checkpoint_is_one_file_as_in_onnx_runtime(ort, tmp_path):
    trained = _trained(ort, tmp_path)
    ort("export", trained, ARTIFACTS, tmp_path / "theirs.onnx", "y")
    ortckpt.export_model(trained, ARTIFACTS / "eval_model.onnx", tmp_path / "ours.onnx", output_names=["y"])
    assert sorted(p.name for p in tmp_path.glob("*.onnx*")) == ["ours.onnx", "theirs.onnx"]
    assert not any(isinstance(e, dict) for e in _external_entries(tmp_path / "ours.onnx").values())


def test_export_declares_only_what_the_eval_model_declares(ort, tmp_path):
    """Pins the documented difference: ONNX Runtime's export adds the opset import of every
    domain it registers, the type info of the values it pruned (the loss) and the default values
    of attributes; ortckpt's keeps the eval model's declarations, and the graphs compute alike."""
    trained = _trained(ort, tmp_path)
    ort("export", trained, ARTIFACTS, tmp_path / "theirs.onnx", "y")
    ortckpt.export_model(trained, ARTIFACTS / "eval_model.onnx", tmp_path / "ours.onnx", output_names=["y"])
    eval_model = onnx.load(str(ARTIFACTS / "eval_model.onnx"))
    theirs, ours = onnx.load(str(tmp_path / "theirs.onnx")), onnx.load(str(tmp_path / "ours.onnx"))

    def opsets(model):
        return {o.domain: o.version for o in model.opset_import}

    assert opsets(ours) == opsets(eval_model) == {"": 20}
    assert opsets(theirs).items() > opsets(ours).items() and len(opsets(theirs)) == 8

    computed = {out for node in ours.graph.node for out in node.output}
    assert {v.name for v in ours.graph.value_info} <= computed
    assert {v.name for v in ours.graph.value_info} < {v.name for v in theirs.graph.value_info}
    assert eval_model.graph.output[0].name in {v.name for v in theirs.graph.value_info} - computed  # the loss

    def attributes(node):
        """(the attributes written, the attributes with the schema's defaults for those not written)."""
        schema = onnx.defs.get_schema(node.op_type, opsets(ours)[node.domain], node.domain)
        written = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        defaults = {
            name: onnx.helper.get_attribute_value(a.default_value)
            for name, a in schema.attributes.items()
            if a.default_value.name
        }
        return written, defaults | written

    assert len(ours.graph.node) == len(theirs.graph.node)
    added = set()
    for mine, their in zip(ours.graph.node, theirs.graph.node, strict=True):
        assert (mine.op_type, list(mine.input), list(mine.output)) == (
            their.op_type,
            list(their.input),
            list(their.output),
        )
        (written, effective), (their_written, their_effective) = attributes(mine), attributes(their)
        assert effective == their_effective  # the same computation
        assert written.items() <= their_written.items()
        added |= {(mine.op_type, name) for name in their_written.keys() - written.keys()}
    assert added == {("Gemm", "transA")}  # ONNX Runtime writes out the default transA=0


def test_export_moves_initializers_as_onnx_runtimes_writer_does(ort, tmp_path):
    """Typed-field initializers (float_data, int64_data) of 64 bytes or more go out as their raw
    bytes, smaller ones stay; checked against ONNX Runtime's own writer. A string initializer
    stays in the model (ONNX Runtime's writer fails on one: "Unsupported type: 8")."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(4)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    initializers = [
        numpy_helper.from_array(w, "w"),  # the parameter, from the checkpoint (raw_data)
        helper.make_tensor("typed", TensorProto.FLOAT, [5], np.arange(5, dtype=np.float32).tolist()),  # 20 bytes
        helper.make_tensor("wide", TensorProto.FLOAT, [5, 4], np.arange(20, dtype=np.float32).tolist()),  # 80
        helper.make_tensor("shape", TensorProto.INT64, [8], [1] * 8),  # 64 bytes of int64_data
        helper.make_tensor("i32", TensorProto.INT32, [16], list(range(16))),  # int32_data
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "typed"], ["a"]),
        helper.make_node("MatMul", ["a", "wide"], ["m"]),
        helper.make_node("Identity", ["shape"], ["s"]),
        helper.make_node("Identity", ["i32"], ["i"]),
    ]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in (("m", 1), ("s", 7), ("i", 6))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2, 4])], outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "model.onnx")
    ort("save_optimized", tmp_path / "model.onnx", tmp_path / "theirs.onnx")

    state = CheckpointState.from_arrays({"w": w})
    CheckpointState.save_checkpoint(state, tmp_path / "ext.ckpt", external_data_threshold=0)
    ortckpt.export_model(tmp_path / "ext.ckpt", tmp_path / "model.onnx", tmp_path / "ours.onnx")

    theirs, ours = _external_entries(tmp_path / "theirs.onnx"), _external_entries(tmp_path / "ours.onnx")
    for entries, name in ((theirs, "theirs.onnx.data"), (ours, "ours.onnx.data")):
        for entry in entries.values():
            if isinstance(entry, dict):
                assert entry.pop("location") == name
    assert sorted(n for n, e in ours.items() if isinstance(e, dict)) == ["i32", "shape", "w", "wide"]
    assert ours == theirs
    assert (tmp_path / "ours.onnx.data").read_bytes() == (tmp_path / "theirs.onnx.data").read_bytes()
    kept = {i.name: i for i in onnx.load(str(tmp_path / "ours.onnx"), load_external_data=False).graph.initializer}
    assert list(kept["typed"].float_data) == list(range(5))

    model.graph.initializer.append(helper.make_tensor("tag", TensorProto.STRING, [1], [b"x" * 100]))
    model.graph.node.append(helper.make_node("Identity", ["tag"], ["t"]))
    model.graph.output.append(helper.make_tensor_value_info("t", TensorProto.STRING, None))
    ortckpt.export_model(tmp_path / "ext.ckpt", model, tmp_path / "tagged.onnx")
    loaded = onnx.load(str(tmp_path / "tagged.onnx"))
    assert not uses_external_data(loaded.graph.initializer[-1])
    for init, original in zip(loaded.graph.initializer, model.graph.initializer, strict=True):  # every value kept
        assert np.array_equal(numpy_helper.to_array(init), numpy_helper.to_array(original))
