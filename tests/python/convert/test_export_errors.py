"""Exporting a checkpoint into an ONNX model (issue 16): its errors name what is wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import ortckpt.arithmetic
import pytest
from ortckpt import CheckpointState
from ortckpt.errors import CheckpointStateError

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "ort-vectors"


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
