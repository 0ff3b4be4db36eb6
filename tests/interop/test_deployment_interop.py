"""Issue 16 against ONNX Runtime 1.19.2 itself: inference export from the eval model (what
Module.export_model_for_inferencing writes), federated averaging that ONNX Runtime trains on
from, and version-1 checkpoints upgraded to what ONNX Runtime's own version-2 files hold.
The exported models also run in the current onnxruntime inference package, in this venv."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import ortckpt
import pytest
from ortckpt import CheckpointState
from ortckpt.cli import run as cli

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "ort-vectors"
ARTIFACTS = GOLDEN / "artifacts"


def io_signature(path: Path) -> dict:
    """Graph inputs and outputs: names, element types and shapes (symbolic dims by name)."""
    graph = onnx.load(str(path)).graph

    def of(values):
        return [
            (v.name, v.type.tensor_type.elem_type, [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim])
            for v in values
        ]

    return {"inputs": of(graph.input), "outputs": of(graph.output)}


def random_inputs(path: Path, rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    graph = onnx.load(str(path)).graph
    return {
        i.name: rng.standard_normal([d.dim_value or rows for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in graph.input
    }


def run_here(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Runs a model in the current onnxruntime inference package (this venv, NumPy 2)."""
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def run_in_ort(ort, path: Path, inputs: dict[str, np.ndarray], tmp: Path) -> dict[str, np.ndarray]:
    np.savez(tmp / "in.npz", **inputs)
    ort("infer_all", path, tmp / "in.npz", tmp / "out.npz")
    return dict(np.load(tmp / "out.npz"))


def trained_artifacts(ort, tmp_path: Path, which: str) -> tuple[Path, Path]:
    """(a checkpoint ONNX Runtime trained, its artifacts directory)."""
    if which == "golden":
        ort("train_steps", ARTIFACTS / "checkpoint", ARTIFACTS, tmp_path / "trained.ckpt", 7, 2)
        return tmp_path / "trained.ckpt", ARTIFACTS
    directory = tmp_path / "frozen"
    directory.mkdir()
    ort("frozen_artifacts", directory)
    return directory / "trained.ckpt", directory


@pytest.mark.parametrize("which", ["golden", "frozen"])
def test_export_equals_onnx_runtimes_export_for_inferencing(ort, tmp_path, which):
    checkpoint, artifacts = trained_artifacts(ort, tmp_path, which)
    eval_model = artifacts / "eval_model.onnx"
    ort("export", checkpoint, artifacts, tmp_path / "theirs.onnx", "y")
    ortckpt.export_model(checkpoint, eval_model, tmp_path / "ours.onnx", output_names=["y"])

    assert io_signature(tmp_path / "ours.onnx") == io_signature(tmp_path / "theirs.onnx")
    assert [i.name for i in onnx.load(str(tmp_path / "ours.onnx")).graph.input] == ["x"]  # parameters bound
    ours = onnx.load(str(tmp_path / "ours.onnx")).graph
    assert "ReduceMean" not in {n.op_type for n in ours.node}  # the loss is gone
    state = CheckpointState.load_checkpoint(checkpoint)
    assert {i.name for i in ours.initializer} == set(state.parameters.names())
    for init in ours.initializer:  # the checkpoint's values, frozen ones included
        assert np.array_equal(onnx.numpy_helper.to_array(init), state.parameters[init.name].data)

    inputs = random_inputs(tmp_path / "ours.onnx", rows=9, seed=5)
    theirs_out = run_in_ort(ort, tmp_path / "theirs.onnx", inputs, tmp_path)
    assert set(theirs_out) == {"y"}
    ours_in_ort = run_in_ort(ort, tmp_path / "ours.onnx", inputs, tmp_path)
    assert np.array_equal(ours_in_ort["y"], theirs_out["y"])  # identical, in ONNX Runtime 1.19.2
    here = run_here(tmp_path / "ours.onnx", inputs)  # and it runs without the training package
    assert onnxruntime.__version__ != "1.19.2"
    np.testing.assert_allclose(here["y"], theirs_out["y"], rtol=1e-6, atol=1e-6)

    # the command line writes the same model
    assert cli(["export", str(checkpoint), str(eval_model), str(tmp_path / "cli.onnx"), "--output", "y"]) == 0
    assert onnx.load(str(tmp_path / "cli.onnx")) == onnx.load(str(tmp_path / "ours.onnx"))
    assert (
        cli(["convert", str(checkpoint), str(tmp_path / "conv.onnx"), "--model", str(eval_model), "--output", "y"]) == 0
    )
    assert onnx.load(str(tmp_path / "conv.onnx")) == onnx.load(str(tmp_path / "ours.onnx"))


def test_without_output_names_the_eval_models_outputs_stay(ort, tmp_path):
    checkpoint = GOLDEN / "trained_no_optimizer.ckpt"
    ortckpt.export_model(checkpoint, ARTIFACTS / "eval_model.onnx", tmp_path / "loss.onnx")
    signature = io_signature(tmp_path / "loss.onnx")
    assert [i[0] for i in signature["inputs"]] == ["x", "target"]
    assert [o[0] for o in signature["outputs"]] == ["onnx::reducemean_output::6"]
    inputs = random_inputs(tmp_path / "loss.onnx", rows=3, seed=1)
    loss = run_here(tmp_path / "loss.onnx", inputs)["onnx::reducemean_output::6"]
    assert np.isfinite(loss) and loss > 0


def test_federated_averaging_that_onnx_runtime_trains_on(ort, tmp_path):
    """Three devices train from one checkpoint on their own data; the server averages their
    checkpoints with ortckpt; ONNX Runtime trains on from the average."""
    devices = []
    for seed in (1, 2, 3):
        path = tmp_path / f"device{seed}.ckpt"
        ort("train_steps", ARTIFACTS / "checkpoint", ARTIFACTS, path, seed, 3)
        devices.append(path)
    weights = [120.0, 45.0, 300.0]  # e.g. samples per device
    average = ortckpt.average(devices, weights, out=tmp_path / "average.ckpt")
    states = [CheckpointState.load_checkpoint(p) for p in devices]
    for name in average.parameters.names():
        values = [s.parameters[name].data for s in states]
        if not average.parameters[name].requires_grad:  # frozen: equal everywhere, copied
            assert all(np.array_equal(v, values[0]) for v in values)
            assert np.array_equal(average.parameters[name].data, values[0])
            continue
        expected = np.average(np.stack(values).astype(np.float64), axis=0, weights=weights).astype(np.float32)
        assert np.array_equal(average.parameters[name].data.view(np.uint32), expected.view(np.uint32)), name
        assert not np.array_equal(values[0], values[1])  # the devices did diverge
    assert ort("describe", tmp_path / "average.ckpt")["parameter_names"] == average.parameters.names()
    losses = ort("train_steps", tmp_path / "average.ckpt", ARTIFACTS, tmp_path / "round2.ckpt", 9, 2)["losses"]
    assert all(np.isfinite(losses))

    # with the optimizer state: momentums averaged too, the step the largest, and ONNX Runtime resumes from it
    with_state = ortckpt.average(devices, weights, include_optimizer_state=True, out=tmp_path / "avg_opt.ckpt")
    group = with_state.optimizer_groups["group0"]
    assert group.step == max(s.optimizer_groups["group0"].step for s in states)
    m = [s.optimizer_groups["group0"].momentums["0.weight"]["momentum0"] for s in states]
    expected = np.average(np.stack(m).astype(np.float64), axis=0, weights=weights).astype(np.float32)
    assert np.array_equal(group.momentums["0.weight"]["momentum0"], expected)
    losses = ort("train_steps", tmp_path / "avg_opt.ckpt", ARTIFACTS, tmp_path / "round2b.ckpt", 9, 2)["losses"]
    assert all(np.isfinite(losses))

    # the command line writes the same average
    assert cli(["average", *map(str, devices), "-o", str(tmp_path / "cli.ckpt"), "--weights", "120,45,300"]) == 0
    from ortckpt.compare import compare

    assert compare(CheckpointState.load_checkpoint(tmp_path / "cli.ckpt"), average).identical


@pytest.mark.parametrize("name", ["ort_format", "custom_ops"])
def test_version_1_upgrades_to_what_onnx_runtime_wrote_as_version_2(ort, tmp_path, name):
    v1, v2 = GOLDEN / "v1" / f"{name}_v1.ckpt", GOLDEN / "v1" / f"{name}_v2.ckpt"
    # ONNX Runtime 1.19.2 refuses version 1: the reason upgrade exists
    with pytest.raises(AssertionError, match="version 1 is not supported"):
        ort("describe", v1)
    state = CheckpointState.load_checkpoint(v1)
    assert state.format_version == 1
    assert cli(["upgrade", str(v1), str(tmp_path / "up.ckpt")]) == 0
    assert CheckpointState.load_checkpoint(tmp_path / "up.ckpt").format_version == 2
    ours, theirs = ort("describe", tmp_path / "up.ckpt"), ort("describe", v2)
    assert ours == theirs
    expected = json.loads((GOLDEN / "v1" / f"{name}_v2.ckpt.json").read_text())
    import hashlib

    for p in expected["parameters"]:
        parameter = state.parameters[p["name"]]
        assert parameter.requires_grad == p["requires_grad"]
        assert hashlib.sha256(parameter.data.tobytes()).hexdigest() == p["sha256"]


def test_exported_model_reads_a_copy_not_the_eval_model():
    """The eval model passed in (a ModelProto) is not changed by the export."""
    model = onnx.load(str(ARTIFACTS / "eval_model.onnx"))
    before = model.SerializeToString()
    ortckpt.inference_model(GOLDEN / "trained_no_optimizer.ckpt", model, output_names=["y"])
    assert model.SerializeToString() == before
