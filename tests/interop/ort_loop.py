"""ortckpt inside ONNX Runtime's training loop: runs in the ONNX Runtime virtualenv with ortckpt
installed (ORTCKPT_ORT_LOOP_PYTHON, the torch stand-in on PYTHONPATH), called by test_ort_loop.py.
Each command prints one JSON object on its last line of stdout.

  manager_run ARTIFACTS DIRECTORY STEPS CLASS ASYNC [PACED]  a training run with a CheckpointManager
      in DIRECTORY, saving every step (CLASS: "ortckpt" or "onnxruntime", whose CheckpointState
      the run trains); resumes from the manager's latest step if there is one; at the end
      saves DIRECTORY/final.ckpt with ONNX Runtime's own saver (PACED "1": after each save's
      "saved N" line, waits for a line on stdin before the next step)
  own_state ARTIFACTS OUT  ONNX Runtime's own CheckpointState trained two steps, then saved by
      ortckpt's save_checkpoint, by a manager (sync and async) and by ONNX Runtime, same moment
  live_api ARTIFACTS OUT  what ortckpt's state shows and takes while a Module trains it
  nominal ARTIFACTS OUT CLASS  ONNX Runtime's on-device flow: a nominal checkpoint, a Module, its
      parameters copied in from a buffer (copy_buffer_to_parameters), saved, trained, saved
  refused_types  handing a Module a state of a type ONNX Runtime's loader refuses
  off_cpu ARTIFACTS  setting a parameter whose ONNX Runtime buffer is not on the CPU
  bind_forever  binds states (and saves them in full) until killed; prints "ready" first
  bind_once  binds a state once; what the temporary directory holds of ortckpt's then
  leaks ARTIFACTS OUT  file descriptors and temporary entries after many bindings and saves
  async_while_training ARTIFACTS OUT  async manager saves (with and without the optimizer state),
      training on at once after each; ONNX Runtime's own save at each save() beside them
  hostile_tmpdir OUT  a bind and a full save while someone else who may write TMPDIR swaps the
      memory checkpoint directories
  graphs_run ARTIFACTS DIRECTORY STEPS STOP  a run whose manager records the graphs
      (artifacts=ARTIFACTS) in DIRECTORY/run, saving every step; stops after step STOP (the
      machine gone); at STEPS, ONNX Runtime's saver writes DIRECTORY/final.ckpt
  graphs_resume DIRECTORY STEPS ARTIFACTS  in DIRECTORY (a step folder copied there alone, nothing
      else; ARTIFACTS, the run's folder, gone): restore_training, then train on to STEPS, saving
      every step, and DIRECTORY/final.ckpt
  preempt_run ARTIFACTS DIRECTORY STEPS ASYNC GRACE  a training run with preemption=True (SIGTERM
      and SIGINT), async saves every 4 steps (ASYNC "fork": forked ones), resumed from the latest
      step; stops at the step a signal came (saved there); at the end saves DIRECTORY/final.ckpt
      with ONNX Runtime's saver
  through_ort ARTIFACTS OUT  full saves written by ONNX Runtime's saver into the staged files
      (ortckpt's state and ONNX Runtime's own, each with and without external data), ONNX
      Runtime's own save of the same moment beside each; then saves that fail (ONNX Runtime's
      saver raising, writing a torn file, an interrupt after it returns) over a saved file
  forked_saves ARTIFACTS OUT  async_save="fork" manager saves, training on at once after each;
      at each save() ONNX Runtime's own save and ortckpt's synchronous one beside them; then one
      of ONNX Runtime's own state object (OUT/own), its synchronous save beside it
  forked_failures ARTIFACTS OUT  forked saves whose child is SIGKILLed mid-save, hangs past its
      deadline, raises, or is sent SIGTERM and SIGINT; after each, what the run holds and a save
  forked_orphan ARTIFACTS OUT  a forked save whose child hangs: prints the child's pid, then sleeps
  in_place OUT  full saves of a 12 MiB AdamW state (4 x MatMul 512x512, artifacts generated in
      OUT), ortckpt's state and ONNX Runtime's own: by a forked child whose buffer grows in
      place, by one whose buffer grows as ONNX Runtime's does, and in this process (no fork to be
      had); ONNX Runtime's own save of the same moment beside them
  forked_save_signalled ARTIFACTS OUT  synchronous forked full saves whose SIGTERM handler raises
      SystemExit as the fork's signals are unblocked, and while the replaced file's cache is
      dropped; one with a Ctrl-C (SIGINT) while the child saves
  forked_snapshots ARTIFACTS OUT  manager saves with the optimizer state (async, training on at
      once, and synchronous) whose snapshot a forked child takes into memory, ONNX Runtime's own
      save of each save() beside them; snapshots whose child hangs, raises or cannot be forked;
      saves under a SIGCHLD handler that reaps every child; what the process holds before and after
  backings_alike ARTIFACTS OUT  one checkpoint through each backing (arrays, the mapped file, ONNX
      Runtime's live state bound and adopted): what the public API shows of each, and of its save
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import hashlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

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


def manager_run(artifacts: str, directory: str, steps: str, cls: str, async_save: str, paced: str = "0") -> dict:
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
        if paced == "1":  # (the caller's go-ahead: its kill lands where it chose, however busy the machine)
            sys.stdin.readline()
    manager.close()
    C.save_checkpoint(state._state, os.path.join(directory, "final.ckpt"), True)
    return {"resumed_from": latest, "steps": manager.all_steps()}


def graphs_run(artifacts: str, directory: str, steps: str, stop: str) -> dict:
    manager = ortckpt.CheckpointManager(
        os.path.join(directory, "run"), artifacts=artifacts, max_to_keep=2, durable=False
    )
    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    model, optimizer = _session(artifacts, state)
    for step in range(int(stop)):
        _train_step(model, optimizer, step)
        state.properties["last_loss_step"] = step
        manager.save(state, step + 1)
    manager.close()
    if stop == steps:
        C.save_checkpoint(state._state, os.path.join(directory, "final.ckpt"), True)
    return {"steps": manager.all_steps(), "lr": optimizer.get_learning_rate()}


def graphs_resume(directory: str, steps: str, artifacts: str) -> dict:
    # (the same arguments as the run that made the step: its artifacts folder is not on this machine)
    manager = ortckpt.CheckpointManager(directory, artifacts=artifacts, max_to_keep=2, durable=False)
    start = manager.latest_step()
    state, model, optimizer = manager.restore_training()
    for step in range(start, int(steps)):
        _train_step(model, optimizer, step)
        state.properties["last_loss_step"] = step
        manager.save(state, step + 1)
    manager.close()
    C.save_checkpoint(state._state, os.path.join(directory, "final.ckpt"), True)
    return {
        "resumed_from": start,
        "steps": manager.all_steps(),
        "lr": optimizer.get_learning_rate(),
        "classes": [type(model).__name__, type(optimizer).__name__, type(state).__module__],
        "device": manager.all()[0].metadata["execution_provider"],
        "recorded": sorted(manager.latest().artifacts),
    }


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


def nominal(artifacts: str, out: str, cls: str) -> dict:
    from ortckpt.convert.files import to_nominal

    to_nominal(os.path.join(artifacts, "checkpoint"), os.path.join(out, "nominal"))
    full = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    buffer = _session(artifacts, full)[0].get_contiguous_parameters(False)  # (the values, as an app holds them)
    state_class = ortckpt.CheckpointState if cls == "ortckpt" else ort_api.CheckpointState
    state = state_class.load_checkpoint(os.path.join(out, "nominal"))
    report: dict = {}
    model, optimizer = _session(artifacts, state)
    if cls == "ortckpt":
        report["nominal_in_module"] = state.is_nominal
        try:
            state.parameters["0.weight"]
            report["read_nominal"] = "accepted"
        except ortckpt.CheckpointError as e:
            report["read_nominal"] = str(e)
    model.copy_buffer_to_parameters(buffer, False)
    if cls == "ortckpt":
        report["nominal_after_copy"] = state.is_nominal
        report["records"] = [list(r) for r in state.tensor_records()]
    report["weight_equal"] = _sha(state.parameters["0.weight"].data) == _sha(full.parameters["0.weight"].data)
    ortckpt.CheckpointState.save_checkpoint(state, os.path.join(out, "copied_params.ckpt"))
    with ortckpt.CheckpointManager(os.path.join(out, "run")) as manager:
        manager.save(state, 1, include_optimizer_state=False)
    _train_step(model, optimizer, 0)
    ortckpt.CheckpointState.save_checkpoint(state, os.path.join(out, "trained.ckpt"), include_optimizer_state=True)
    ortckpt.CheckpointState.save_checkpoint(state, os.path.join(out, "trained_params.ckpt"))
    return report


def refused_types() -> dict:
    import ml_dtypes

    report = {}
    for name, values in (
        ("float16", np.ones((2, 2), np.float16)),
        ("bfloat16", np.ones((2, 2), ml_dtypes.bfloat16)),
        ("int4", np.ones((2, 2), ml_dtypes.int4)),
        ("string", np.array(["a", "b"], dtype=object)),
    ):
        state = ortckpt.CheckpointState.from_arrays({"fine": np.ones(2, np.float32)}, {f"{name}_weight": values})
        try:
            assert state._state is not None  # (ONNX Runtime loads it)
            report[name] = "bound"
        except Exception as e:  # (any: the test checks which)
            report[name] = [type(e).__name__, str(e), state.is_nominal, repr(state)]
    return report


class _OffCpuData:
    """An ORT state's parameter as a GPU build shows it: numpy() a writable copy."""

    def __init__(self, data: object) -> None:
        self._data = data

    def device_name(self) -> str:
        return "Cuda"

    def numpy(self) -> np.ndarray:
        return self._data.numpy().copy()


class _OffCpuParameter:
    def __init__(self, parameter: object) -> None:
        self.data = _OffCpuData(parameter.data)
        self.requires_grad = parameter.requires_grad


class _OffCpuState:
    def __init__(self, ort_state: object) -> None:
        self._ort_state = ort_state

    def get_parameter(self, name: str) -> _OffCpuParameter:
        return _OffCpuParameter(self._ort_state.get_parameter(name))

    def __getattr__(self, name: str) -> object:
        return getattr(self._ort_state, name)


def off_cpu(artifacts: str) -> dict:
    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    _model = _session(artifacts, state)  # (ONNX Runtime's copy_parameter_from needs a Module's: else it crashes)
    inner = state._state
    tensor = ortckpt.live.LiveTensor(_OffCpuState(inner), "0.weight", 1, (16, 8))
    tensor.assign(np.full((16, 8), 3, np.float32))
    return {"reached_ort": bool((inner.get_parameter("0.weight").data.numpy() == 3).all())}


def _ortckpt_temporaries() -> list[str]:
    import tempfile

    return sorted(e for e in os.listdir(tempfile.gettempdir()) if e.startswith("ortckpt-"))


def bind_forever() -> dict:
    values = {f"w{i}": np.full((512, 1024), i, np.float32) for i in range(16)}
    print("ready", flush=True)
    while True:
        state = ortckpt.CheckpointState.from_arrays(values)
        assert state._state is not None
        state.to_bytes(include_optimizer_state=True)  # (ONNX Runtime saves into memory)


def bind_once() -> dict:
    assert ortckpt.CheckpointState.from_arrays({"w": np.ones((2, 2), np.float32)})._state is not None
    return {"temporaries": _ortckpt_temporaries()}


def leaks(artifacts: str, out: str) -> dict:
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def cycle() -> None:
        state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
        model, optimizer = _session(artifacts, state)
        _train_step(model, optimizer, 0)
        ortckpt.CheckpointState.save_checkpoint(state, os.path.join(out, "a.ckpt"), include_optimizer_state=True)
        ort_api.CheckpointState.save_checkpoint(state, os.path.join(out, "b.ckpt"), include_optimizer_state=True)
        assert state.optimizer_groups
        with ortckpt.CheckpointManager(os.path.join(out, "run"), async_save=True, max_to_keep=1) as manager:
            manager.save(state, (manager.latest_step() or 0) + 1)
        ortckpt.save_checkpoint(ortckpt.checkpoint_state.adopt(state._state), os.path.join(out, "c.ckpt"))

    cycle()  # (what stays open for good: ONNX Runtime's and the manager's first use)
    before = fds()
    for _ in range(20):
        cycle()
    return {"fds_before": before, "fds_after": fds(), "temporaries": _ortckpt_temporaries()}


def async_while_training(artifacts: str, out: str) -> dict:
    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    model, optimizer = _session(artifacts, state)
    for include in (True, False):
        name = "full" if include else "params"
        with ortckpt.CheckpointManager(os.path.join(out, name), async_save=True) as manager:
            for step in range(1, 4):
                _train_step(model, optimizer, step)
                C.save_checkpoint(state._state, os.path.join(out, f"{name}_ort_{step}.ckpt"), include)
                manager.save(state, step, include_optimizer_state=include)
                _train_step(model, optimizer, 100 + step)  # (while the save writes)
    return {"saved": out}


def forked_saves(artifacts: str, out: str) -> dict:
    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    model, optimizer = _session(artifacts, state)
    fds_before = len(os.listdir("/proc/self/fd"))
    with ortckpt.CheckpointManager(os.path.join(out, "run"), async_save="fork", durable=False) as manager:
        for step in range(1, 4):
            _train_step(model, optimizer, step)
            manager.save(state, step)  # (sets the step property, then forks)
            C.save_checkpoint(state._state, os.path.join(out, f"ort_{step}.ckpt"), True)
            ortckpt.CheckpointState.save_checkpoint(state, os.path.join(out, f"sync_{step}.ckpt"), True)
            for later in range(3):  # (while the child writes: its file holds the state of save())
                _train_step(model, optimizer, 100 * step + later)
    steps = manager.all_steps()
    own = ort_api.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))  # ONNX Runtime's class
    own_model, own_optimizer = _session(artifacts, own)
    _train_step(own_model, own_optimizer, 7)
    with ortckpt.CheckpointManager(os.path.join(out, "own"), async_save="fork", durable=False) as manager:
        manager.save(own, 1)
        ortckpt.CheckpointState.save_checkpoint(own, os.path.join(out, "own_sync_1.ckpt"), True)
        _train_step(own_model, own_optimizer, 8)
    reloaded = C.load_checkpoint(os.path.join(out, "run", "step_00000003", "checkpoint"))
    C.save_checkpoint(reloaded, os.path.join(out, "reloaded_3.ckpt"), True)
    fds_after = len(os.listdir("/proc/self/fd"))
    return {"steps": steps, "left": sorted(os.listdir(os.path.join(out, "run"))), "fds": [fds_before, fds_after]}


def _wrapped_saver(pid_file: str, before: object = None, after: object = None) -> object:
    """ortckpt.live.write_staged, as the forked child runs it, writing the child's pid to
    ``pid_file`` first and running ``before()`` and ``after()`` around the real one."""
    from ortckpt import live

    real = live.write_staged

    def saver(ort_state: object, staging: object, *directory: object) -> None:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        if callable(before):
            before()
        real(ort_state, staging, *directory)
        if callable(after):
            after()

    return saver


def _child_pid(pid_file: str) -> int:
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    with open(pid_file) as f:
        pid = int(f.read())
    os.unlink(pid_file)
    return pid


def forked_failures(artifacts: str, out: str) -> dict:
    from ortckpt import forked_save, live

    real = live.write_staged
    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    model, optimizer = _session(artifacts, state)
    run = os.path.join(out, "run")
    pid_file = os.path.join(out, "child.pid")
    report: dict = {}
    manager = ortckpt.CheckpointManager(run, async_save="fork", durable=False, preemption=True)
    step = 1
    _train_step(model, optimizer, step)
    manager.save(state, step)
    manager.wait()

    def attempt(kind: str, saver: object, act: object = None) -> None:
        nonlocal step
        step += 1
        _train_step(model, optimizer, step)
        live.write_staged = saver
        if os.path.exists(pid_file):  # (a child that was not acted on wrote it)
            os.unlink(pid_file)
        try:
            started = time.monotonic()
            manager.save(state, step)
            if callable(act):
                act(_child_pid(pid_file))
            try:
                manager.wait()
                outcome = {"error": None}
            except Exception as e:
                outcome = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
        finally:
            live.write_staged = real
        outcome["steps"] = manager.all_steps()
        outcome["left"] = sorted(os.listdir(run))
        outcome["preempted"] = manager.preempted
        report[kind] = outcome

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def interrupt(pid: int) -> None:  # (a Ctrl-C, or a preemption notice, sent to the process group)
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)

    attempt("killed", _wrapped_saver(pid_file, after=lambda: time.sleep(60)), kill)
    forked_save.TIMEOUT = 2.0
    attempt("hung", _wrapped_saver(pid_file, before=lambda: time.sleep(3600)))
    forked_save.TIMEOUT = None

    def boom() -> None:
        raise RuntimeError("the saver failed")

    attempt("raised", _wrapped_saver(pid_file, before=boom))
    attempt("signalled", _wrapped_saver(pid_file, before=lambda: time.sleep(1)), interrupt)

    # A child reaped by someone else (a program's SIGCHLD handler that waits for every child) before
    # the save looks: its report over the pipe still says it saved.
    direct = os.path.join(out, "direct.ckpt")
    child = forked_save.start(state._state, Path(direct), checkpoint_bytes=0)
    reaped = os.waitpid(child.pid, 0)[0] == child.pid
    child.finish(durable=False)
    report["reaped"] = {"by_another": reaped, "saved": os.path.exists(direct)}
    attempt("after", real)
    manager.close()
    report["latest"] = os.path.join(run, f"step_{step:08d}", "checkpoint")
    C.save_checkpoint(state._state, os.path.join(out, "now.ckpt"), True)
    return report


def forked_orphan(artifacts: str, out: str) -> dict:
    """A forked save whose child hangs; prints the child's pid, then waits to be killed."""
    from ortckpt import live

    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    model, optimizer = _session(artifacts, state)
    _train_step(model, optimizer, 1)
    pid_file = os.path.join(out, "child.pid")
    live.write_staged = _wrapped_saver(pid_file, before=lambda: time.sleep(3600))
    manager = ortckpt.CheckpointManager(os.path.join(out, "run"), async_save="fork", durable=False)
    manager.save(state, 1)
    print(_child_pid(pid_file), flush=True)
    time.sleep(3600)
    return {}


def hostile_tmpdir(out: str) -> dict:
    """Someone else who may write TMPDIR (no sticky bit) renames each memory checkpoint directory
    away just before ONNX Runtime uses it and puts one of theirs in its place, whose ``checkpoint``
    is a symlink to a file of ours (which ONNX Runtime's save would overwrite) or to a checkpoint
    of theirs (which its load would hand the Module)."""
    import tempfile

    victim = os.path.join(out, "victim.txt")
    with open(victim, "w") as f:
        f.write("precious\n")
    theirs = os.path.join(out, "theirs.ckpt")
    ortckpt.save_checkpoint(ortckpt.CheckpointState.from_arrays({"w": np.full((2, 2), 666, np.float32)}), theirs)
    api = ortckpt.live._training_api()
    planted: set[str] = set()

    def swap(target: str) -> None:
        root = tempfile.gettempdir()
        [name] = [e for e in os.listdir(root) if e.startswith("ortckpt-scratch-") and e not in planted]
        os.rename(os.path.join(root, name), os.path.join(out, "moved-" + name))
        os.mkdir(os.path.join(root, name))
        os.symlink(target, os.path.join(root, name, "checkpoint"))
        planted.add(name)

    class Attacker:
        def __getattr__(self, name: str) -> object:
            return getattr(api, name)

        def load_checkpoint(self, path: str) -> object:
            swap(theirs)
            return api.load_checkpoint(path)

        def save_checkpoint(self, state: object, path: str, include: bool) -> None:
            swap(victim)
            api.save_checkpoint(state, path, include)

    ortckpt.live._training_api = Attacker
    state = ortckpt.CheckpointState.from_arrays({"w": np.ones((2, 2), np.float32)})
    inner = state._state
    ortckpt.save_checkpoint(state, os.path.join(out, "saved.ckpt"), include_optimizer_state=True)
    with open(victim, "rb") as f:
        victim_text = f.read().decode("utf-8", "replace")
    return {
        "swaps": len([e for e in os.listdir(out) if e.startswith("moved-")]),  # (the save's in its forked child)
        "bound": inner.get_parameter("w").data.numpy().tolist(),
        "saved": ortckpt.load_checkpoint(os.path.join(out, "saved.ckpt")).parameters["w"].data.tolist(),
        "victim": victim_text,
    }


def preempt_run(artifacts: str, directory: str, steps: str, async_save: str, grace: str) -> dict:
    manager = ortckpt.CheckpointManager(
        os.path.join(directory, "run"),
        save_every=4,
        max_to_keep=2,
        async_save="fork" if async_save == "fork" else async_save == "1",
        durable=False,
        preemption=True,
        preemption_grace=float(grace),
    )
    latest = manager.latest_step()
    state = manager.restore() if latest is not None else ortckpt.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    model, optimizer = _session(artifacts, state)
    print("ready", file=sys.stderr, flush=True)
    done = latest or 0
    for step in range(done, int(steps)):
        _train_step(model, optimizer, step)
        done = step + 1
        if manager.should_save(done) or done == int(steps):
            manager.save(state, done)
            if manager.preempted:
                break
    if done == int(steps):  # (ONNX Runtime's own saver: the properties are the state's own)
        C.save_checkpoint(state._state, os.path.join(directory, "final.ckpt"), True)
    print("trained", file=sys.stderr, flush=True)
    manager.close()  # (puts SIGTERM's default action back: a signal from now on ends the process)
    return {"resumed_from": latest, "trained_to": done, "latest": manager.latest_step(), "preempted": manager.preempted}


def through_ort(artifacts: str, out: str) -> dict:
    external = os.path.join(out, "external-source.ckpt")  # the artifacts' checkpoint, all external
    ortckpt.CheckpointState.save_checkpoint(
        ortckpt.load_checkpoint(os.path.join(artifacts, "checkpoint")), external, external_data_threshold=0
    )
    files = {}
    for kind in ("ortckpt", "ortckpt_external", "onnxruntime", "onnxruntime_external"):
        source = external if kind.endswith("_external") else os.path.join(artifacts, "checkpoint")
        if kind.startswith("ortckpt"):
            # A bound state's memory checkpoint has external data past this threshold (as files do).
            ortckpt.live.EXTERNAL_DATA_THRESHOLD = 0 if kind.endswith("_external") else 2**40
            state = ortckpt.CheckpointState.load_checkpoint(source)
        else:
            state = ort_api.CheckpointState.load_checkpoint(source)
        model, optimizer = _session(artifacts, state)
        for step in range(2):
            _train_step(model, optimizer, step)
        state.properties["kind"] = kind
        saved = os.path.join(out, f"{kind}.ckpt")
        open(saved, "wb").close()  # (an earlier file in its place)
        ortckpt.CheckpointState.save_checkpoint(state, saved, include_optimizer_state=True)
        ort_api.CheckpointState.save_checkpoint(state, os.path.join(out, f"{kind}_ort.ckpt"), True)
        # ONNX Runtime loads what was saved, and saves it again as it was.
        C.save_checkpoint(C.load_checkpoint(saved), os.path.join(out, f"{kind}_reloaded.ckpt"), True)
        files[kind] = sorted(e for e in os.listdir(out) if e.startswith(kind + "."))
    ortckpt.live.EXTERNAL_DATA_THRESHOLD = 2**40

    # Saves that fail, over the last file saved: each leaves it (and nothing else) behind.
    api = ortckpt.live._training_api()
    failures = {}

    def torn(state: object, path: str, include: bool) -> None:
        api.save_checkpoint(state, path, include)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    def refused(state: object, path: str, include: bool) -> None:
        raise RuntimeError("no space left on device (simulated)")

    def interrupted(state: object, path: str, include: bool) -> None:
        api.save_checkpoint(state, path, include)
        raise KeyboardInterrupt  # (as a Ctrl-C delivered once the saver returns the GIL)

    target = os.path.join(out, "onnxruntime_external.ckpt")
    before = {name: _file_sha(os.path.join(out, name)) for name in files["onnxruntime_external"]}
    model(*_batch(9))
    optimizer.step()  # (the state differs from the saved one now)
    for name, saver in (("torn", torn), ("refused", refused), ("interrupted", interrupted)):

        class Failing:
            def __getattr__(self, attribute: str) -> object:
                return getattr(api, attribute)

            save_checkpoint = staticmethod(saver)

        ortckpt.live._training_api = Failing
        try:
            ortckpt.CheckpointState.save_checkpoint(state, target, include_optimizer_state=True)
        except BaseException as e:
            failures[name] = type(e).__name__
        after = {
            n: _file_sha(os.path.join(out, n))
            for n in sorted(os.listdir(out))
            if n.startswith(os.path.basename(target))
        }
        assert after == before, (name, after, before)
    return {"files": files, "failures": failures, "left": sorted(os.listdir(out))}


def in_place(out: str) -> dict:
    import errno

    from ortckpt import forked_save

    # The benchmark's model (benches/ort_loop_bench.py), small: arrays of 1 MiB and more to grow.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
    from ort_loop_bench import artifacts_for

    artifacts = os.path.join(out, "artifacts")
    os.mkdir(artifacts)
    artifacts_for(Path(artifacts), 4, 512)
    children: list = []
    start = forked_save.start

    def watched_start(*args: object, **kwargs: object) -> object:
        children.append(start(*args, **kwargs))
        return children[-1]

    def no_fork() -> int:
        raise OSError(errno.EAGAIN, "no process to be had (simulated)")

    forked_save.start = watched_start
    result: dict = {}
    for kind in ("ortckpt", "onnxruntime"):
        cls = ortckpt.CheckpointState if kind == "ortckpt" else ort_api.CheckpointState
        state = cls.load_checkpoint(os.path.join(artifacts, "checkpoint"))
        model = ort_api.Module(
            os.path.join(artifacts, "training_model.onnx"), state, os.path.join(artifacts, "eval_model.onnx")
        )
        optimizer = ort_api.Optimizer(os.path.join(artifacts, "optimizer_model.onnx"), model)
        rng = np.random.default_rng(3)
        for _ in range(2):
            model(*(rng.standard_normal((2, 512)).astype(np.float32) for _ in range(2)))
            optimizer.step()
            model.lazy_reset_grad()
        reference = os.path.join(out, f"{kind}_ort.ckpt")
        ort_api.CheckpointState.save_checkpoint(state, reference, True)
        with open(reference, "rb") as f:
            ort_bytes = f.read()
        saves = {}
        for how in ("in_place", "grown_as_onnx_runtime", "in_process", "told_not_to_fork"):
            children.clear()
            forked_save.GROW_IN_PLACE = how != "grown_as_onnx_runtime"
            fork = os.fork
            if how == "in_process":
                os.fork = no_fork
            if how == "told_not_to_fork":
                os.environ["ORTCKPT_NO_FORK"] = "1"
            try:
                saved = os.path.join(out, f"{kind}_{how}.ckpt")
                ortckpt.CheckpointState.save_checkpoint(state, saved, include_optimizer_state=True)
            finally:
                os.fork = fork
                forked_save.GROW_IN_PLACE = True
                os.environ.pop("ORTCKPT_NO_FORK", None)
            with open(saved, "rb") as f:
                saved_bytes = f.read()
            saves[how] = {
                "forked": bool(children),
                "placed": children[0].placed if children else None,
                "onnx_runtimes_bytes_then_the_seal": saved_bytes.startswith(ort_bytes)
                and len(saved_bytes) > len(ort_bytes),
                "verified": bool(ortckpt.verify(saved).checksums),
            }
        result[kind] = {"saves": saves, "checkpoint_bytes": len(ort_bytes)}
    return result


def _children_of_this_process() -> list[str]:
    """The pids of this process's children, running or exited and not yet reaped."""
    me, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            found.append(pid)
    return found


def forked_save_signalled(artifacts: str, out: str) -> dict:
    """Synchronous forked full saves whose trainer's SIGTERM handler raises SystemExit as the
    fork's signals are unblocked, and while the parent drops the replaced file's cache; one
    with a Ctrl-C while the child saves."""
    import contextlib

    from ortckpt import _boundary, forked_save

    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    model, optimizer = _session(artifacts, state)
    target = os.path.join(out, "state.ckpt")
    _train_step(model, optimizer, 1)
    ortckpt.CheckpointState.save_checkpoint(state, target, include_optimizer_state=True)
    with open(target, "rb") as f:
        old = f.read()

    def exit_on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(143)

    def sigterm() -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.contextmanager
    def sigterm_while_blocked() -> object:  # (runs last inside the fork's blocked signals: delivered as they end)
        yield
        sigterm()

    silenced, release = forked_save._fork_warning_silenced, _boundary.release_clean_cache
    patches = {
        "as_the_fork_unblocks_signals": (forked_save, "_fork_warning_silenced", sigterm_while_blocked),
        "while_the_cache_is_dropped": (_boundary, "release_clean_cache", lambda path: sigterm()),
        # (a Ctrl-C while the child saves: held until just before the commit, then raised)
        "ctrl_c_while_the_child_saves": (
            _boundary,
            "release_clean_cache",
            lambda path: os.kill(os.getpid(), signal.SIGINT),
        ),
    }
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    descriptors = len(os.listdir("/proc/self/fd"))
    report: dict = {}
    try:
        for step, (kind, (module, name, patch)) in enumerate(patches.items(), start=2):
            _train_step(model, optimizer, step)
            setattr(module, name, patch)
            try:
                ortckpt.CheckpointState.save_checkpoint(state, target, include_optimizer_state=True)
                raised = None
            except SystemExit as e:
                raised = f"SystemExit({e.code})"
            except KeyboardInterrupt:
                raised = "KeyboardInterrupt"
            finally:
                forked_save._fork_warning_silenced, _boundary.release_clean_cache = silenced, release
            with open(target, "rb") as f:
                intact = f.read() == old
            report[kind] = {
                "raised": raised,
                "children": _children_of_this_process(),
                "old_file_intact": intact,
                "left": sorted(os.listdir(out)),
                "descriptors_added": len(os.listdir("/proc/self/fd")) - descriptors,
            }
    finally:
        signal.signal(signal.SIGTERM, previous)
    reference = os.path.join(out, "reference")
    os.mkdir(reference)
    ort_api.CheckpointState.save_checkpoint(state, os.path.join(reference, "ort.ckpt"), True)
    ortckpt.CheckpointState.save_checkpoint(state, target, include_optimizer_state=True)
    with open(target, "rb") as f, open(os.path.join(reference, "ort.ckpt"), "rb") as g:
        report["next_save_is_onnx_runtimes_then_the_seal"] = f.read().startswith(g.read())
    return report


def _memfds() -> int:
    """This process's descriptors of memfds (ortckpt's memory checkpoints)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    return found


def forked_snapshots(artifacts: str, out: str) -> dict:
    """Manager saves of a state ONNX Runtime trains with its optimizer state (async, training on at
    once, and synchronous), whose snapshot a forked child takes into memfds: ONNX Runtime's own save
    of each save() beside it (OUT/ort_NAME_STEP.ckpt for OUT/NAME/step_STEP); then snapshots whose
    child hangs past its deadline, raises or cannot be forked, and saves under a SIGCHLD handler
    that reaps every child; what the process holds before and after."""
    from ortckpt import forked_save, live

    state = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    own = ort_api.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))  # ONNX Runtime's class
    sessions = {id(state): _session(artifacts, state), id(own): _session(artifacts, own)}
    report: dict = {}

    def held() -> dict:
        return {
            "fds": len(os.listdir("/proc/self/fd")),
            "memfds": _memfds(),
            "children": _children_of_this_process(),
            "temporaries": _ortckpt_temporaries(),
            "threads": threading.active_count(),
            "mapped": sum("/memfd:" in line for line in open("/proc/self/maps")),  # (snapshots still mapped)
        }

    def run(name: str, trained: object, steps: int, **options: object) -> None:
        model, optimizer = sessions[id(trained)]
        bound = getattr(trained, "_state", trained)
        with ortckpt.CheckpointManager(os.path.join(out, name), durable=False, **options) as manager:  # type: ignore[arg-type]
            for step in range(1, steps + 1):
                _train_step(model, optimizer, step)
                C.save_checkpoint(bound, os.path.join(out, f"ort_{name}_{step}.ckpt"), True)
                manager.save(trained, step)
                for later in range(2):  # (at once: the pending async save holds the state of save())
                    _train_step(model, optimizer, 1000 * step + later)
        report[name] = manager.all_steps()

    gc.disable()  # (a snapshot freed only by the collector stays mapped: a whole checkpoint)
    run("warm", state, 1, async_save=True)  # (what stays open for good: ONNX Runtime's and the manager's first use,
    run("warm_sync", state, 1)  # a synchronous save's page watch)
    before = held()
    run("async", state, 12, async_save=True, max_to_keep=3)
    run("async_whole", state, 4, async_save=True, share_unchanged=False)
    run("sync", state, 3)
    run("own", own, 3, async_save=True)
    report["held"] = [before, held()]

    real = live.write_into
    failures: dict = {}

    def sleeper(*_args: object) -> None:
        time.sleep(3600)

    def boom(*_args: object) -> None:
        raise RuntimeError("the saver failed")

    def no_fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    for kind in ("hung", "raised", "forkless"):
        forked_save.TIMEOUT = 1.0 if kind == "hung" else None
        live.write_into = sleeper if kind == "hung" else boom if kind == "raised" else real
        fork, os.fork = os.fork, no_fork if kind == "forkless" else os.fork  # type: ignore[assignment]
        started = time.monotonic()
        try:
            run(kind, state, 2, async_save=True)
        finally:
            live.write_into, os.fork, forked_save.TIMEOUT = real, fork, None
        failures[kind] = time.monotonic() - started < 30  # (fell back: never waited for a hung child)
    report["fell_back"] = failures

    reaped: list[int] = []

    def reap_all(_signum: int, _frame: object) -> None:  # (a program's own reaper of every child)
        with contextlib.suppress(ChildProcessError):
            while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
                reaped.append(pid)

    previous = signal.signal(signal.SIGCHLD, reap_all)
    try:
        run("reaped", state, 3, async_save=True)
        run("reaped_sync", state, 2)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    report["reaped_by_handler"] = len(reaped)
    report["held_at_end"] = held()
    gc.enable()
    return report


def _file_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _shown(state: ortckpt.CheckpointState) -> dict:
    """What the public API shows of a state: parameters, properties, optimizer groups, records and
    the keyed tensors, values by digest."""
    return {
        "parameters": [[n, p.requires_grad, p.data_type, list(p.shape), _sha(p.data)] for n, p in state.parameters],
        "properties": dict(state.properties),
        "groups": {
            g: [
                group.step,
                group.initial_learning_rate,
                {p: {m: _sha(v) for m, v in ms.items()} for p, ms in group.momentums.items()},
            ]
            for g, group in state.optimizer_groups.items()
        },
        "records": sorted([list(r) for r in state.tensor_records()]),
        "tensors": [[key.role, key.label, _sha(value)] for key, value in state.tensors()],
        "nominal": state.is_nominal,
    }


def backings_alike(artifacts: str, out: str) -> dict:
    base = ortckpt.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    momentums = {
        n: {"momentum0": np.full(p.shape, 0.5, np.float32), "momentum1": np.full(p.shape, 0.25, np.float32)}
        for n, p in base.parameters
        if p.requires_grad
    }
    base.optimizer_groups = {"group0": ortckpt.OptimizerGroup(3, 0.01, momentums)}
    base.properties["epoch"] = 2
    base.properties["note"] = "alike"
    path = os.path.join(out, "base.ckpt")
    ortckpt.save_checkpoint(base, path, include_optimizer_state=True)

    mapped = ortckpt.CheckpointState.load_checkpoint(path)
    arrays = ortckpt.CheckpointState.from_arrays(
        {n: p.data.copy() for n, p in mapped.parameters if p.requires_grad},
        {n: p.data.copy() for n, p in mapped.parameters if not p.requires_grad},
        dict(mapped.properties),
    )
    arrays.optimizer_groups = {
        g: ortckpt.OptimizerGroup(group.step, group.initial_learning_rate, group.momentums)
        for g, group in mapped.optimizer_groups.items()
    }
    bound = ortckpt.CheckpointState.load_checkpoint(path)
    bound._state  # noqa: B018 (handed to ONNX Runtime: live from now on)
    adopted = ortckpt.checkpoint_state.adopt(C.load_checkpoint(path))
    report: dict = {}
    # Four threads handing one state to ONNX Runtime at once: one binding, one ORT state for all.
    raced = ortckpt.CheckpointState.load_checkpoint(path)
    start, inners = threading.Barrier(4), []

    def take() -> None:
        start.wait()
        inners.append(raced._state)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report["one_binding"] = len(inners) == 4 and all(inner is inners[0] for inner in inners)
    for name, state in {"arrays": arrays, "mapped": mapped, "bound": bound, "adopted": adopted, "raced": raced}.items():
        saved = os.path.join(out, f"{name}.ckpt")
        ortckpt.save_checkpoint(state, saved, include_optimizer_state=True)
        report[name] = {
            "live": repr(state).endswith("onnxruntime)"),
            "shown": _shown(state),
            "saved": _shown(ortckpt.CheckpointState.load_checkpoint(saved)),
        }
    return report


# A run still going after this long is stuck: it prints every thread's stack and exits 1, so a
# test that waits for it fails with where it hung, instead of waiting forever (SIGABRT, sent by a
# test that gave up on it, prints the same).
DEADLINE = float(os.environ.get("ORTCKPT_LOOP_DEADLINE", "290"))


def main(argv: list[str]) -> None:
    faulthandler.enable()
    faulthandler.dump_traceback_later(DEADLINE, exit=True)
    command, *args = argv
    commands = {
        "manager_run": manager_run,
        "own_state": own_state,
        "live_api": live_api,
        "nominal": nominal,
        "refused_types": refused_types,
        "off_cpu": off_cpu,
        "bind_forever": bind_forever,
        "bind_once": bind_once,
        "leaks": leaks,
        "async_while_training": async_while_training,
        "hostile_tmpdir": hostile_tmpdir,
        "forked_saves": forked_saves,
        "forked_failures": forked_failures,
        "forked_orphan": forked_orphan,
        "graphs_run": graphs_run,
        "graphs_resume": graphs_resume,
        "preempt_run": preempt_run,
        "through_ort": through_ort,
        "backings_alike": backings_alike,
        "in_place": in_place,
        "forked_save_signalled": forked_save_signalled,
        "forked_snapshots": forked_snapshots,
    }
    result = commands[command](*args)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
