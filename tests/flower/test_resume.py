"""FedAvg(manager=...): a commit per round (an ONNX Runtime checkpoint, the round, its metrics),
and a start() after a crash (an exception, a SIGKILL) that resumes at the next round and ends
bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeGrid, deterministic_client
from flwr.app import Array, ArrayRecord, MetricRecord
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.flower import FedAvg

ROUNDS = 5


def initial(model):
    return ArrayRecord({k: Array(v) for k, v in model.items()})


def evaluate_fn(server_round, arrays):
    return MetricRecord({"norm": float(np.linalg.norm(arrays["fc.weight"].numpy()))})


def run(model, manager=None, crash=None, rounds=ROUNDS, like=None):
    strategy = FedAvg(min_available_nodes=3, min_train_nodes=3, min_evaluate_nodes=3, manager=manager, like=like)
    grid = FakeGrid([1, 2, 3], deterministic_client, crash)
    return strategy.start(grid, initial(model), num_rounds=rounds, evaluate_fn=evaluate_fn)


def as_bytes(record):
    return {k: (v.dtype, v.shape, v.data) for k, v in record.items()}


def test_each_round_commits_the_global_model_its_round_and_metrics(model, tmp_path):
    like = CheckpointState.from_arrays(
        {k: v for k, v in model.items() if k != "steps"}, {"steps": model["steps"]}, {"run": "fl"}
    )
    manager = CheckpointManager(tmp_path / "run", keep_best=("server.norm", "min", 2))
    result = run(model, manager, like=like)
    assert manager.latest_step() == ROUNDS
    info = manager.latest()
    assert set(info.metrics) == {"train.loss", "evaluate.accuracy", "server.norm"}
    assert info.metrics["server.norm"] == result.evaluate_metrics_serverapp[ROUNDS]["norm"]
    state = CheckpointState.load_checkpoint(info.path)  # an ONNX Runtime checkpoint file
    for key, array in result.arrays.items():
        assert state.parameters[key].data.tobytes() == array.numpy().tobytes()
    assert not state.parameters["steps"].requires_grad and state.parameters["fc.weight"].requires_grad
    assert state.properties["run"] == "fl" and state.properties["step"] == ROUNDS
    history = info.metadata["user"]["flower"]["history"]
    assert sorted(history["train"], key=int) == [str(r) for r in range(1, ROUNDS + 1)]


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash_at", [1, 3, ROUNDS])
def test_a_run_that_crashes_resumes_at_the_next_round_and_ends_bit_identical(model, tmp_path, crash_at):
    uninterrupted = run(model)

    def crash(server_round):
        if server_round == crash_at:
            raise Crash

    manager = CheckpointManager(tmp_path / "run")
    with pytest.raises(Crash):
        run(model, manager, crash)
    manager.close()  # (what the crashed process's exit does)
    assert manager.latest_step() == (crash_at - 1 or None)
    rounds_run = []
    resumed = run(model, CheckpointManager(tmp_path / "run"), rounds_run.append)
    assert sorted(set(rounds_run)) == list(range(crash_at, ROUNDS + 1))  # no round run twice, none lost
    assert as_bytes(resumed.arrays) == as_bytes(uninterrupted.arrays)
    assert list(resumed.arrays.keys()) == list(model)
    assert sorted(resumed.train_metrics_clientapp) == list(range(1, ROUNDS + 1))
    for r in range(1, ROUNDS + 1):
        assert dict(resumed.evaluate_metrics_serverapp[r]) == dict(uninterrupted.evaluate_metrics_serverapp[r])


def test_a_finished_run_started_again_runs_no_round(model, tmp_path):
    first = run(model, CheckpointManager(tmp_path / "run"))
    rounds_run = []
    again = run(model, CheckpointManager(tmp_path / "run"), rounds_run.append)
    assert rounds_run == [] and as_bytes(again.arrays) == as_bytes(first.arrays)


SERVER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from conftest import FakeGrid, deterministic_client
    from test_resume import run
    from ortckpt import CheckpointManager

    model = dict(np.load({model!r}))
    def crash(server_round):
        if server_round == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
    run(model, CheckpointManager({directory!r}), crash)
    """
)


def test_a_server_killed_by_sigkill_resumes_bit_identical(model, tmp_path):
    np.savez(tmp_path / "model.npz", **model)
    kill_at = 4
    code = SERVER.format(
        tests=str(Path(__file__).parent),
        model=str(tmp_path / "model.npz"),
        kill_at=kill_at,
        directory=str(tmp_path / "run"),
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    manager = CheckpointManager(tmp_path / "run")
    assert manager.latest_step() == kill_at - 1
    resumed = run(model, manager)
    assert as_bytes(resumed.arrays) == as_bytes(run(model).arrays)


def test_an_async_manager_commits_every_round_and_resumes_bit_identical(model, tmp_path):
    uninterrupted = run(model)

    def crash(server_round):
        if server_round == 4:
            raise Crash

    manager = CheckpointManager(tmp_path / "run", async_save=True, max_to_keep=2)
    with pytest.raises(Crash):
        run(model, manager, crash)
    manager.close()  # (waits for the save in flight)
    assert CheckpointManager(tmp_path / "run", read_only=True).all_steps() == [2, 3]
    resumed = run(model, CheckpointManager(tmp_path / "run", async_save=True))
    assert as_bytes(resumed.arrays) == as_bytes(uninterrupted.arrays)
