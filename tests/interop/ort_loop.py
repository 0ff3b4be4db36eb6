"""ortckpt inside ONNX Runtime's training loop: runs in the ONNX Runtime virtualenv with ortckpt
installed (ORTCKPT_ORT_LOOP_PYTHON, the torch stand-in on PYTHONPATH), called by test_ort_loop.py.
Each command prints one JSON object on its last line of stdout.

  manager_run ARTIFACTS DIRECTORY STEPS CLASS ASYNC  a training run with a CheckpointManager in
      DIRECTORY, saving every step (CLASS: "ortckpt" or "onnxruntime", whose CheckpointState
      the run trains); resumes from the manager's latest step if there is one; at the end
      saves DIRECTORY/final.ckpt with ONNX Runtime's own saver
  own_state ARTIFACTS OUT  ONNX Runtime's own CheckpointState trained two steps, then saved by
      ortckpt's save_checkpoint, by a manager (sync and async) and by ONNX Runtime, same moment
  live_api ARTIFACTS OUT  what ortckpt's state shows and takes while a Module trains it
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
import ortckpt  # noqa: E402
from onnxruntime.capi import _pybind_state as C  # noqa: E402
from onnxruntime.training import api as ort_api  # noqa: E402


def _batch(step: int) -> list[np.ndarray]:
    """The data of a step, the same whatever ran before it (so a resumed run sees what an
    uninterrupted one saw)."""
    rng = np.random.default_rng(1000 + step)
    return [rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)]


def _session(artifacts: str, state: object) -> tuple[ort_api.Module, ort_api.Optimizer]:
    model = ort_api.Module(
        os.path.join(artifacts, "training_model.onnx"), state, os.path.join(artifacts, "eval_model.onnx")
    )
    return model, ort_api.Optimizer(os.path.join(artifacts, "optimizer_model.onnx"), model)


def _train_step(model: ort_api.Module, optimizer: ort_api.Optimizer, step: int) -> float:
    loss = float(model(*_batch(step)))
    optimizer.step()
    model.lazy_reset_grad()
    return loss


def manager_run(artifacts: str, directory: str, steps: str, cls: str, async_save: str) -> dict:
    manager = ortckpt.CheckpointManager(
        os.path.join(directory, "run"), max_to_keep=3, async_save=async_save == "1", durable=False
    )
    latest = manager.latest_step()
    state_class = ortckpt.CheckpointState if cls == "ortckpt" else ort_api.CheckpointState
    if latest is None:
        state = state_class.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    elif cls == "ortckpt":
        state = manager.restore()
    else:  # (ONNX Runtime's class loads the step's checkpoint file)
        state = state_class.load_checkpoint(os.fspath(manager.latest().path))
    start = latest or 0
    model, optimizer = _session(artifacts, state)
    for step in range(start, int(steps)):
        _train_step(model, optimizer, step)
        state.properties["last_loss_step"] = step
        manager.save(state, step + 1)
        print(f"saved {step + 1}", file=sys.stderr, flush=True)
    manager.close()
    C.save_checkpoint(state._state, os.path.join(directory, "final.ckpt"), True)
    return {"resumed_from": latest, "steps": manager.all_steps()}


def own_state(artifacts: str, out: str) -> dict:
    state = ort_api.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    model, optimizer = _session(artifacts, state)
    for step in range(2):
        _train_step(model, optimizer, step)
    state.properties["note"] = "own"
    ortckpt.CheckpointState.save_checkpoint(state, os.path.join(out, "ortckpt.ckpt"), include_optimizer_state=True)
    ortckpt.save_checkpoint(state, os.path.join(out, "ortckpt_params.ckpt"))
    ortckpt.CheckpointState.save_checkpoint(state._state, os.path.join(out, "ortckpt_inner.ckpt"), True)
    ort_api.CheckpointState.save_checkpoint(state, os.path.join(out, "ort.ckpt"), include_optimizer_state=True)
    ort_api.CheckpointState.save_checkpoint(state, os.path.join(out, "ort_params.ckpt"))
    with ortckpt.CheckpointManager(os.path.join(out, "sync")) as manager:
        manager.save(state, 2)
    with ortckpt.CheckpointManager(os.path.join(out, "async"), async_save=True) as manager:
        manager.save(state, 2)
        # Trained on while the save writes: the step holds the state of the moment save() was called.
        _train_step(model, optimizer, 2)
    return {"saved": out}


def _sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def live_api(artifacts: str, out: str) -> dict:
    report: dict = {}
    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    before = state.parameters["0.weight"].data  # a view of ortckpt's own (before ONNX Runtime has it)
    report["repr_before"] = repr(state)
    report["grad_before"] = state.parameters["0.weight"].grad is None
    model, optimizer = _session(artifacts, state)
    inner = state._state
    report["same_inner"] = inner is state._state and isinstance(inner, C.CheckpointState)
    report["repr_live"] = repr(state)
    weight = state.parameters["0.weight"]
    _train_step(model, optimizer, 0)
    report["view_is_ort"] = _sha(weight.data) == _sha(inner.get_parameter("0.weight").data.numpy())
    report["trained"] = _sha(weight.data) != _sha(before)
    # A view taken before: stays ortckpt's (ONNX Runtime copied it when the Module took the state).
    report["old_view_kept"] = _sha(before) == _sha(
        ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint")).parameters["0.weight"].data
    )
    model(*_batch(1))  # a gradient, not yet applied
    report["grads"] = {name: p.grad is not None for name, p in state.parameters}
    report["grad_is_ort"] = _sha(state.parameters["0.weight"].grad) == _sha(
        inner.get_parameter("0.weight").grad.numpy()
    )
    optimizer.step()
    model.lazy_reset_grad()
    # Setting values: through ortckpt's state, into what ONNX Runtime trains.
    ones = np.ones((16, 8), np.float32)
    state.parameters["0.weight"] = ones
    report["set_item_reaches_ort"] = bool((inner.get_parameter("0.weight").data.numpy() == 1).all())
    state.parameters["0.weight"].data = ones * 2
    report["set_data_reaches_ort"] = bool((inner.get_parameter("0.weight").data.numpy() == 2).all())
    try:
        state.parameters["0.weight"] = np.ones((8, 16), np.float32)
        report["wrong_shape"] = "accepted"
    except ortckpt.CheckpointStateError as e:
        report["wrong_shape"] = str(e)
    # Properties both ways.
    state.properties["epoch"] = 5
    state.properties["ratio"] = 0.1
    inner.add_property("from_ort", "yes")
    report["properties_in_ort"] = {n: inner.get_property(n) for n in inner.property_names()}
    report["properties"] = dict(state.properties)
    report["has_from_ort"] = "from_ort" in state.properties and len(state.properties) == len(inner.property_names())
    # The optimizer state: a copy of ONNX Runtime's, as it saves it.
    groups = state.optimizer_groups
    C.save_checkpoint(inner, os.path.join(out, "ort.ckpt"), True)
    saved = ortckpt.CheckpointState.load_checkpoint(os.path.join(out, "ort.ckpt")).optimizer_groups
    report["groups_equal_ort"] = {
        g: {
            "step": groups[g].step == saved[g].step,
            "lr": groups[g].initial_learning_rate == saved[g].initial_learning_rate,
            "moments": all(
                _sha(m) == _sha(saved[g].momentums[p][k])
                for p, ms in groups[g].momentums.items()
                for k, m in ms.items()
            ),
        }
        for g in saved
    }
    report["step"] = groups["group0"].step
    try:
        state.optimizer_groups = {}
        report["set_groups"] = "accepted"
    except ortckpt.CheckpointStateError as e:
        report["set_groups"] = str(e)
    report["records"] = [list(r) for r in state.tensor_records()]
    # A state bound with its values in an external data file (as one past 1800 MiB is): ONNX Runtime
    # reads `<checkpoint>.data` from memory too.
    ortckpt.live.EXTERNAL_DATA_THRESHOLD = 0
    second = ortckpt.CheckpointState.load_checkpoint(os.path.join(out, "ort.ckpt"))
    second_inner = second._state
    report["external_bound"] = all(
        _sha(second_inner.get_parameter(name).data.numpy()) == _sha(p.data) for name, p in state.parameters
    ) and all(
        _sha(m) == _sha(saved[g].momentums[p][k])
        for g, group in second.optimizer_groups.items()
        for p, ms in group.momentums.items()
        for k, m in ms.items()
    )
    report["to_bytes_loads"] = sorted(
        name for name, _ in ortckpt.CheckpointState.from_bytes(state.to_bytes(True)).parameters
    )
    return report


def main(argv: list[str]) -> None:
    command, *args = argv
    result = {"manager_run": manager_run, "own_state": own_state, "live_api": live_api}[command](*args)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
