"""validate=Forward(...): a forward pass of each new checkpoint in ONNX Runtime (the inference
package) before the manager commits it, on the golden artifacts ONNX Runtime generated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import ortckpt
import pytest
from goldens import ARTIFACTS, EVAL_MODEL, INPUTS, LOSS
from ortckpt import CheckpointIntegrityError, CheckpointManager, CheckpointState, Forward
from ortckpt.convert.onnx_model import inference_model
from ortckpt.manager.validation import dummy_inputs


def trained() -> CheckpointState:
    return CheckpointState.load_checkpoint(ARTIFACTS / "checkpoint")


def loss_of(state: CheckpointState) -> float:
    model = inference_model(state, EVAL_MODEL)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return float(session.run([LOSS], INPUTS)[0])


def poisoned() -> CheckpointState:
    state = trained()
    state.parameters["0.weight"].data[3, 5] = np.nan  # what a diverged step leaves
    return state


def loss_below_ten(outputs: dict[str, np.ndarray]) -> bool:  # module-level: it pickles
    return bool(outputs[LOSS] < 10)


def committed(manager: CheckpointManager) -> list[int]:
    return [c.step for c in manager.all()]


@pytest.mark.parametrize("process", [False, True])
def test_a_good_checkpoint_commits_and_a_nan_one_is_refused(tmp_path: Path, process: bool) -> None:
    with CheckpointManager(tmp_path, validate=Forward(EVAL_MODEL, process=process)) as manager:
        manager.save(trained(), 1)
        with pytest.raises(CheckpointIntegrityError, match=r"output onnx::reducemean_output::6 is not finite") as e:
            manager.save(poisoned(), 2)
        assert e.value.filename.endswith("checkpoint") and ".step_00000002.tmp-" in e.value.filename
        assert committed(manager) == [1] and manager.latest().step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # nothing of step 2 is left
    assert committed(CheckpointManager(tmp_path, read_only=True)) == [1]


def test_the_logged_metric_must_be_the_checkpoints(tmp_path: Path) -> None:
    state = trained()
    loss = loss_of(state)
    forward = Forward(EVAL_MODEL, inputs=INPUTS, metric=(LOSS, "loss"), tolerance=1e-5)
    with CheckpointManager(tmp_path, validate=forward) as manager:
        manager.save(state, 1, metrics={"loss": loss})
        with pytest.raises(CheckpointIntegrityError, match=rf"output {LOSS} is .* but metric loss is 0\.5"):
            manager.save(state, 2, metrics={"loss": 0.5})  # a metric of some other weights
        with pytest.raises(CheckpointIntegrityError, match="metric loss was not given to save"):
            manager.save(state, 3)
        assert committed(manager) == [1]


def test_check_decides(tmp_path: Path) -> None:
    state = trained()
    with CheckpointManager(tmp_path, validate=Forward(EVAL_MODEL, inputs=INPUTS, check=loss_below_ten)) as manager:
        manager.save(state, 1)
    state.parameters["2.bias"].data[:] = 1e3  # finite, but far off
    assert loss_of(state) > 10
    refuse = Forward(EVAL_MODEL, inputs=INPUTS, check=loss_below_ten, process=True)
    with CheckpointManager(tmp_path, validate=refuse) as manager:
        with pytest.raises(CheckpointIntegrityError, match=r"check\(outputs\) returned False, not True"):
            manager.save(state, 2)
        assert committed(manager) == [1]


def test_a_model_that_does_not_fit_the_checkpoint_is_a_failed_forward_pass(tmp_path: Path) -> None:
    other = CheckpointState.from_arrays({"0.weight": np.ones((3, 3), np.float32)})  # the wrong shape
    with CheckpointManager(tmp_path, validate=Forward(EVAL_MODEL)) as manager:
        with pytest.raises(CheckpointIntegrityError, match="the forward pass failed"):
            manager.save(other, 1)
        assert committed(manager) == []


def test_dummy_inputs_follow_the_models_types_and_shapes() -> None:
    model = inference_model(trained(), EVAL_MODEL)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = dummy_inputs(session)
    assert {n: (a.shape, a.dtype) for n, a in feeds.items()} == {
        "x": ((1, 8), np.float32),  # the symbolic batch dimension as 1
        "target": ((1, 4), np.float32),
    }
    assert np.array_equal(feeds["x"], dummy_inputs(session)["x"])  # the same every time


def test_what_cannot_work_is_refused_when_configured(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="does not pickle"):
        Forward(EVAL_MODEL, check=lambda outputs: True, process=True)
    with pytest.raises(TypeError, match="metric is"):
        Forward(EVAL_MODEL, metric="loss")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="validate takes"):
        CheckpointManager(tmp_path, validate=EVAL_MODEL)  # type: ignore[arg-type]
    assert ortckpt.Forward is Forward
