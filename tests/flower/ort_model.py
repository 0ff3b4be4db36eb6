"""ONNX Runtime training artifacts for the Flower tests (generate_artifacts, run here in the flower
venv, which holds onnxruntime-training-cpu 1.19.2) and each client's deterministic data."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import numpy as np

TRAINABLE, FROZEN = ["w1", "b1", "w2"], ["b2"]
STEPS = 3  # train steps per client and round


def training_api():
    """onnxruntime.training without its torch import (the README's trap workaround), and the bindings."""
    import onnxruntime

    if "onnxruntime.training" not in sys.modules:
        package = types.ModuleType("onnxruntime.training")
        package.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
        sys.modules["onnxruntime.training"] = package
    from onnxruntime.capi import _pybind_state as C
    from onnxruntime.training import artifacts

    return artifacts, C


def make_artifacts(directory: Path) -> Path:
    """An MLP's artifacts (AdamW, MSE): w1, b1, w2 trainable, b2 frozen; a nominal checkpoint too."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    artifacts, _ = training_api()
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(11)
    weights = {
        "w1": rng.standard_normal((6, 5)).astype(np.float32),
        "b1": rng.standard_normal(5).astype(np.float32),
        "w2": rng.standard_normal((5, 3)).astype(np.float32),
        "b2": rng.standard_normal(3).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    artifacts.generate_artifacts(
        model,
        requires_grad=TRAINABLE,
        frozen_params=FROZEN,
        loss=artifacts.LossType.MSELoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=str(directory),
        nominal_checkpoint=True,
    )
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        # (the onnx beside ONNX Runtime 1.19.2 stamps a newer IR version than it reads)
        generated = onnx.load(str(directory / name))
        generated.ir_version = min(generated.ir_version, 10)
        onnx.save(generated, str(directory / name))
    return directory


def batches(partition: int, server_round: int, steps: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    """A client's training data for a round: the same in every run."""
    rng = np.random.default_rng(1000 * partition + server_round)
    return [
        (rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32))
        for _ in range(steps)
    ]
