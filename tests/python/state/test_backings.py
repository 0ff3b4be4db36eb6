"""A CheckpointState is a shell over one backing: arrays, a mapped file (or buffer), or ONNX Runtime's
live state (tests/interop/test_ort_loop.py holds that one to the same, with ONNX Runtime). Whatever
the backing, the public API shows the same and a save writes the same file."""

from __future__ import annotations

import numpy as np
import pytest
from ortckpt import CheckpointState, OptimizerGroup, TensorKey
from ortckpt.dtypes import PackedBits


def arrays() -> CheckpointState:
    state = CheckpointState.from_arrays(
        {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float64)},
        {"ids": np.arange(4, dtype=np.int64), "words": np.array(["a", "bc"], dtype=object)},
        {"epoch": 2, "lr": 0.5, "tag": "x"},
    )
    state.optimizer_groups["group0"] = OptimizerGroup(
        7, 0.5, {"w": {"momentum0": np.full((2, 3), 0.5, np.float32)}, "b": {"momentum0": np.zeros(3)}}
    )
    return state


def shown(state: CheckpointState) -> dict:
    values = {}
    for key, value in state.tensors():
        values[key] = value.packed.tolist() if isinstance(value, PackedBits) else np.asarray(value).tolist()
    return {
        "parameters": [(n, p.requires_grad, p.data_type, p.shape) for n, p in state.parameters],
        "properties": dict(state.properties),
        "groups": {
            g: (o.step, o.initial_learning_rate, sorted(o.momentums)) for g, o in state.optimizer_groups.items()
        },
        "records": sorted(state.tensor_records()),
        "values": values,
        "nominal": state.is_nominal,
        "external": state.has_external_data,
    }


@pytest.fixture
def three(tmp_path) -> dict[str, CheckpointState]:
    path = tmp_path / "c.ckpt"
    CheckpointState.save_checkpoint(arrays(), path, include_optimizer_state=True)
    return {
        "arrays": arrays(),
        "mapped": CheckpointState.load_checkpoint(path),
        "buffer": CheckpointState.from_bytes(bytearray(path.read_bytes())),
    }


def test_every_backing_shows_the_same_and_saves_the_same_bytes(three, tmp_path):
    reference = shown(three["arrays"])
    assert len(reference["values"]) == 6 and reference["groups"] == {"group0": (7, 0.5, ["b", "w"])}
    files = []
    for name, state in three.items():
        assert shown(state) == reference, name
        path = tmp_path / f"{name}.out"
        CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
        assert shown(CheckpointState.load_checkpoint(path)) == reference, name
        files.append(path.read_bytes())
        assert state.to_bytes(True) == files[-1], name
    assert files[1:] == files[:-1]


def test_every_backing_takes_values_and_properties_alike(three):
    for name, state in three.items():
        state.parameters["w"] = np.full((2, 3), 9, np.float32)
        state.parameters["b"].data = np.full(3, 4.0)
        state.properties["epoch"] = 3
        with pytest.raises(Exception, match="shape mismatch"):
            state.parameters["w"] = np.zeros((3, 2), np.float32)
        assert state.parameters["w"].data.tolist() == [[9.0] * 3] * 2, name
        assert dict(state.tensors())[TensorKey.of_parameter("b")].tolist() == [4.0] * 3, name
        assert state.properties["epoch"] == 3 and state.tensor_value("w")[0, 0] == 9.0, name
        state.optimizer_groups = {}
        assert [k for k, _ in state.tensors()] == [TensorKey.of_parameter(n) for n in ("b", "ids", "w", "words")]


def test_a_snapshot_copies_every_value_by_its_key_and_leaves_the_state_alone(three):
    for name, state in three.items():
        asked = []

        def copy(key, value, asked=asked):
            asked.append(key)
            return np.array(value, copy=True)

        snapshot = state.snapshot(copy_value=copy, include_optimizer_state=True, properties={"step": 5})
        assert sorted(asked) == sorted(k for k, _ in state.tensors() if k.label != "words"), name  # (strings: copied)
        assert "step" not in state.properties and snapshot.properties["step"] == 5
        state.parameters["w"].data[:] = -1
        assert snapshot.parameters["w"].data[0, 0] == 0.0, name
        assert shown(snapshot)["groups"] == shown(state)["groups"]
