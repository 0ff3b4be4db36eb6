"""FedAvg's server checkpoints on the services users keep them on: an s3:// manager against a real
S3 server (SeaweedFS, started here by the main suite's s3_server.py) and MLflow tracking against a
real MLflow server (mlflow_server.py): each round committed and reported, a crashed run resumed
from object storage bit for bit."""

from __future__ import annotations

import secrets
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeGrid, deterministic_client
from flwr.app import Array, ArrayRecord, MetricRecord
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.flower import FedAdam

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "helpers"))
from mlflow_server import MlflowServer
from s3_server import BUCKET, S3Server

ROUNDS = 4
PATIENT = 120  # (a busy machine's MLflow server may take seconds to answer)


@pytest.fixture(scope="module")
def s3_server():
    server = S3Server()
    yield server
    server.stop(keep_data=False)


@pytest.fixture(scope="module")
def mlflow_uri():
    server = MlflowServer()
    try:
        yield server.wait_until_up()
    finally:
        server.stop()


class Crash(Exception):
    pass


def norm(server_round, arrays):
    return MetricRecord({"norm": float(np.linalg.norm(arrays["fc.weight"].numpy()))})


def run(model, manager=None, crash=None):
    # (FedAdam: its server-optimizer state goes through the store and back too)
    strategy = FedAdam(min_available_nodes=3, min_train_nodes=3, min_evaluate_nodes=3, manager=manager)
    grid = FakeGrid([1, 2, 3], deterministic_client, crash)
    record = ArrayRecord({k: Array(v) for k, v in model.items()})
    return strategy.start(grid, record, num_rounds=ROUNDS, evaluate_fn=norm)


def test_an_s3_manager_commits_each_round_and_a_crashed_run_resumes_from_it_bit_identical(model, s3_server):
    url = f"s3://{BUCKET}/flower-{secrets.token_hex(4)}"
    options = s3_server.storage_options()
    uninterrupted = run(model)

    def crash(server_round):
        if server_round == 3:
            raise Crash

    manager = CheckpointManager(url, storage_options=options, max_to_keep=2)
    with pytest.raises(Crash):
        run(model, manager, crash)
    manager.close()
    assert CheckpointManager(url, storage_options=options, read_only=True).all_steps() == [1, 2]
    rounds_run = []
    resumed = run(model, CheckpointManager(url, storage_options=options, max_to_keep=2), rounds_run.append)
    assert sorted(set(rounds_run)) == [3, 4]
    for key, array in uninterrupted.arrays.items():
        assert resumed.arrays[key].data == array.data, key
    stored = CheckpointManager(url, storage_options=options, read_only=True)
    assert stored.all_steps() == [3, 4]  # (max_to_keep on the object store)
    final = stored.latest().load()
    for key, array in uninterrupted.arrays.items():
        assert final.parameters[key].data.tobytes() == array.numpy().tobytes(), key
    assert set(final.optimizer_groups) == {"server"} and final.optimizer_groups["server"].step == ROUNDS
    assert stored.latest().metrics["server.norm"] == uninterrupted.evaluate_metrics_serverapp[ROUNDS]["norm"]


def test_mlflow_tracking_reports_every_rounds_metrics_at_its_round(model, tmp_path, mlflow_uri):
    from mlflow import MlflowClient
    from ortckpt.manager.tracking import TAG_RUN_ID, MlflowTracker

    experiment = f"ortckpt-flower-{uuid.uuid4().hex[:12]}"
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment, run_name="federation")
    with CheckpointManager(tmp_path / "run", track=tracker, config={"rounds": ROUNDS}) as manager:
        result = run(model, manager)
        run_id, final = manager.run_id, manager.latest().path
    client = MlflowClient(mlflow_uri)
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(found) == 1
    mlflow_run = found[0]
    assert mlflow_run.data.tags[TAG_RUN_ID] == run_id
    for key, by_round in [
        ("server.norm", result.evaluate_metrics_serverapp),
        ("train.loss", result.train_metrics_clientapp),
        ("evaluate.accuracy", result.evaluate_metrics_clientapp),
    ]:
        logged = sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, key))
        expected = [(r, by_round[r][key.split(".", 1)[1]]) for r in range(1, ROUNDS + 1)]
        assert logged == expected, key
    assert mlflow_run.data.params["rounds"] == str(ROUNDS)
    for key, array in result.arrays.items():
        assert CheckpointState.load_checkpoint(final).parameters[key].data.tobytes() == array.numpy().tobytes()
