"""External data: tensor values in ``<checkpoint>.data`` (ONNX Runtime's layout beyond 2 GiB)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from ortckpt import CheckpointFormatError, CheckpointState, OptimizerGroup, _core


def _base(array: np.ndarray):
    while isinstance(array, np.ndarray):
        array = array.base
    return array.obj


@pytest.fixture
def state() -> CheckpointState:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    tiny = np.arange(3, dtype=np.int64)  # 24 bytes: stays inline
    s = CheckpointState.from_arrays({"w": w, "tiny": tiny}, frozen={"vocab": np.array(["a", "b"])})
    s.optimizer_groups["group0"] = OptimizerGroup(
        step=5, initial_learning_rate=0.01, momentums={"w": {"momentum0": w * 0.1, "momentum1": w * w}}
    )
    return s


def test_threshold_zero_moves_values_out_and_everything_reads_back(state, tmp_path):
    path = tmp_path / "c"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True, external_data_threshold=0)
    data = tmp_path / "c.data"
    assert data.exists()
    assert data.stat().st_size >= 3 * 64 * 32 * 4  # w and both momentums
    assert path.stat().st_size < 2048  # metadata, the tiny tensor and the strings
    loaded = CheckpointState.load_checkpoint(path)
    w = loaded.parameters["w"].data
    np.testing.assert_array_equal(w, state.parameters["w"].data)
    assert _base(w) is loaded._backing.mappings[1]  # a view over the data file
    assert w.ctypes.data % _core.PAYLOAD_ALIGNMENT == 0
    assert _base(loaded.parameters["tiny"].data) is loaded._backing.mappings[0]  # inline
    assert loaded.parameters["vocab"].data.tolist() == ["a", "b"]
    moms = loaded.optimizer_groups["group0"].momentums["w"]
    assert _base(moms["momentum1"]) is loaded._backing.mappings[1]  # momentums go external too
    np.testing.assert_array_equal(moms["momentum1"], state.optimizer_groups["group0"].momentums["w"]["momentum1"])


def test_below_the_default_threshold_nothing_moves(state, tmp_path):
    CheckpointState.save_checkpoint(state, tmp_path / "c", include_optimizer_state=True)
    assert not (tmp_path / "c.data").exists()
    assert not CheckpointState.load_checkpoint(tmp_path / "c").has_external_data


def test_writes_into_external_views_change_the_state_not_the_file(state, tmp_path):
    path = tmp_path / "c"
    CheckpointState.save_checkpoint(state, path, external_data_threshold=0)
    before = (tmp_path / "c.data").read_bytes()
    loaded = CheckpointState.load_checkpoint(path)
    loaded.parameters["w"].data[0, 0] = 42.0
    assert (tmp_path / "c.data").read_bytes() == before
    CheckpointState.save_checkpoint(loaded, path, external_data_threshold=0, durable=True)  # over its own files
    assert CheckpointState.load_checkpoint(path).parameters["w"].data[0, 0] == 42.0
    assert loaded.parameters["w"].data[0, 0] == 42.0  # the live view is intact
    assert sorted(os.listdir(tmp_path)) == ["c", "c.data"]


def test_a_missing_data_file_is_file_not_found(state, tmp_path):
    CheckpointState.save_checkpoint(state, tmp_path / "c", external_data_threshold=0)
    (tmp_path / "c.data").unlink()
    with pytest.raises(FileNotFoundError) as e:
        CheckpointState.load_checkpoint(tmp_path / "c")
    assert e.value.filename == str(tmp_path / "c.data")


def test_a_short_data_file_is_refused_before_any_view_exists(state, tmp_path):
    CheckpointState.save_checkpoint(state, tmp_path / "c", external_data_threshold=0)
    data = tmp_path / "c.data"
    data.write_bytes(data.read_bytes()[:100])
    # (w is first in the data file, so it is the tensor named; momentums are named group/param/momentum)
    with pytest.raises(CheckpointFormatError, match="lies beyond the end of the data file \\(100 bytes\\)") as e:
        CheckpointState.load_checkpoint(tmp_path / "c")
    assert e.value.filename == str(data)
    assert e.value.tensor in ("w", "group0/w/momentum0", "group0/w/momentum1")
