"""Every checkpoint ONNX Runtime wrote loads in ortckpt exactly as its JSON describes."""

from __future__ import annotations

import pytest
from goldens import golden_checkpoints, load_json, sha256
from ortckpt import CheckpointState, PackedInt4

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python


def _bytes_of(value):
    return value.packed if isinstance(value, PackedInt4) else value


@pytest.mark.parametrize("path", golden_checkpoints(), ids=lambda p: p.name)
def test_golden_file_matches_its_json(path):
    expected = load_json(path)
    state = CheckpointState.load_checkpoint(path)
    assert state.is_nominal == expected["is_nominal_state"]

    want = {p["name"]: p for p in expected["parameters"]}
    assert state.parameters.names() == sorted(want)
    if state.is_nominal:  # names only: as in ONNX Runtime, the parameters cannot be read
        return
    for name, param in state.parameters:
        w = want[name]
        assert param.name == name
        assert param.requires_grad == w["requires_grad"]
        assert param.data_type == w["dtype"]
        assert list(param.shape) == (w["dims"])
        data = _bytes_of(param.data)
        assert data.nbytes == w["nbytes"]
        assert sha256(data) == w["sha256"]
        if not isinstance(param.data, PackedInt4):
            assert list(param.data.shape) == w["dims"]

    groups = state.optimizer_groups
    assert sorted(groups) == sorted(g["group_name"] for g in expected["optimizer_groups"])
    for g in expected["optimizer_groups"]:
        group = groups[g["group_name"]]
        assert group.step == g["step"]
        assert group.initial_learning_rate == g["initial_learning_rate"]
        assert sorted(group.momentums) == sorted(s["param_name"] for s in g["optimizer_states"])
        for s in g["optimizer_states"]:
            moms = group.momentums[s["param_name"]]
            assert sorted(moms) == [m["name"] for m in s["momentums"]]
            for m in s["momentums"]:
                assert list(moms[m["name"]].shape) == m["dims"]
                assert sha256(moms[m["name"]]) == m["sha256"]

    props = {**expected["properties"]["ints"], **expected["properties"]["floats"], **expected["properties"]["strings"]}
    assert dict(state.properties) == props
