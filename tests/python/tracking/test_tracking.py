"""track="mlflow": checkpoints reported to a real MLflow tracking server (started for the session
by conftest's mlflow_uri), queried back with MlflowClient; register_best's model-registry
handoff; and the Tracker interface another tracker plugs into."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import ortckpt
import ortckpt.manager.tracking
import pytest
from goldens import ARTIFACTS, EVAL_MODEL, INPUTS, LOSS
from http_proxy import Proxy
from lazy_modules import lazy_module
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.cli import OK, USAGE, run
from ortckpt.errors import InvalidArgumentError
from ortckpt.manager.tracking import (
    DEFAULT_TIMEOUT,
    TAG_CHECKPOINT,
    TAG_DIRECTORY,
    TAG_RUN_ID,
    TAG_SHA256,
    TAG_STEP,
    TAG_VERSION,
    MlflowTracker,
    TrackedRun,
    flatten,
)

mlflow = lazy_module("mlflow")  # (imported at a test's first use: 3 CPU s that collection need not pay)


def scaled(factor: float) -> CheckpointState:
    """ONNX Runtime's trained checkpoint with its weights scaled: a different loss per factor."""
    state = CheckpointState.load_checkpoint(ARTIFACTS / "checkpoint")
    for name in state.parameters.names():
        state.parameters[name].data = state.parameters[name].data * np.float32(factor)
    return state


def loss_of(model_bytes: bytes) -> float:
    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return float(session.run([LOSS], INPUTS)[0])


def state_loss(state: CheckpointState) -> float:
    return loss_of(ortckpt.inference_model(state, EVAL_MODEL).SerializeToString())


# The deadline of the tests about what is reported, not about the deadline: a server on a busy
# machine may take seconds to answer a first request, and no test should depend on it.
PATIENT = 120


@pytest.fixture
def experiment() -> str:
    return f"ortckpt-{uuid.uuid4().hex[:12]}"  # each test its own experiment on the shared server


def the_run(client: mlflow.MlflowClient, experiment: str, run_id: str) -> Any:
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{TAG_RUN_ID}` = '{run_id}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]  # one MLflow run per training run, resumed or not
    return runs[0]


def history(client: mlflow.MlflowClient, mlflow_run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run_id, key))


def small(value: float) -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.full((4, 4), value, np.float32)})


def test_each_save_logs_metrics_at_its_step_config_params_once_and_lineage_tags(tmp_path, mlflow_uri, experiment):
    config = {"lr": 0.1, "optim": {"name": "adamw", "betas": [0.9, 0.99]}, "epochs": 3}
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment, run_name="tiny")
    with CheckpointManager(tmp_path, track=tracker, config=config, max_to_keep=2) as manager:
        for step, loss in [(10, 0.9), (20, 0.5), (30, 0.7)]:
            manager.save(small(step), step, metrics={"loss": loss, "accuracy": 1 - loss})
        latest = manager.latest()
    client = mlflow.MlflowClient(mlflow_uri)
    found = the_run(client, experiment, manager.run_id)
    assert found.info.run_id == tracker.mlflow_run_id and found.info.run_name == "tiny"
    assert found.info.status == "FINISHED"  # the manager was closed
    assert history(client, found.info.run_id, "loss") == [(10, 0.9), (20, 0.5), (30, 0.7)]
    accuracy = history(client, found.info.run_id, "accuracy")
    assert [step for step, _ in accuracy] == [10, 20, 30]
    assert [value for _, value in accuracy] == pytest.approx([0.1, 0.5, 0.3])
    assert found.data.params == {"lr": "0.1", "optim.name": "adamw", "optim.betas": "[0.9, 0.99]", "epochs": "3"}
    tags = found.data.tags
    assert tags[TAG_DIRECTORY] == str(tmp_path.absolute()) and tags[TAG_VERSION] == ortckpt.__version__
    assert tags[TAG_STEP] == "30" and tags[TAG_CHECKPOINT] == str(latest.directory.absolute())
    # No file's SHA-256 recorded (digest=None): metadata.json's, which pins each file's size and xxh3.
    metadata_digest = hashlib.sha256((latest.directory / "metadata.json").read_bytes()).hexdigest()
    assert json.loads(tags[TAG_SHA256]) == {"metadata.json": metadata_digest}
    # Every step's metadata.json (metrics, SHA-256s) is the run's lineage, retention or not.
    for step in (10, 20, 30):
        [entry] = client.list_artifacts(found.info.run_id, f"checkpoints/step_{step:08d}")
        assert entry.path.endswith("metadata.json")  # the checkpoints themselves only with log_artifacts
    logged = client.download_artifacts(found.info.run_id, "checkpoints/step_00000030/metadata.json", str(tmp_path))
    assert Path(logged).read_bytes() == (latest.directory / "metadata.json").read_bytes()


def test_a_resumed_run_continues_its_mlflow_run(tmp_path, mlflow_uri, experiment):
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with CheckpointManager(tmp_path, track=tracker, config={"lr": 0.1}) as manager:
        manager.save(small(1), 1, metrics={"loss": 1.0})
        manager.save(small(2), 2, metrics={"loss": 0.8})
    first = tracker.mlflow_run_id
    resumed = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with pytest.warns(RuntimeWarning, match=r"config 'lr' is '0.2', but the MLflow run logged '0.1'"):
        manager = CheckpointManager(tmp_path, track=resumed, config={"lr": 0.2, "warmup": 5})
    client = mlflow.MlflowClient(mlflow_uri)
    assert resumed.mlflow_run_id == first and client.get_run(first).info.status == "RUNNING"
    manager.save(small(3), 3, metrics={"loss": 0.6})
    manager.close()
    found = the_run(client, experiment, manager.run_id)
    assert history(client, first, "loss") == [(1, 1.0), (2, 0.8), (3, 0.6)]  # no step logged twice
    assert found.data.params == {"lr": "0.1", "warmup": "5"}  # MLflow's params never change


def test_log_artifacts_uploads_each_checkpoints_files(tmp_path, mlflow_uri, experiment):
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment, log_artifacts=True)
    with CheckpointManager(tmp_path / "run", track=tracker, external_data_threshold=16) as manager:
        manager.save(small(7), 7, metrics={"loss": 0.1})
        step = manager.latest()
    assert sorted(step.metadata["files"]) == ["checkpoint", "checkpoint.data"]
    client = mlflow.MlflowClient(mlflow_uri)
    downloaded = Path(client.download_artifacts(tracker.mlflow_run_id, "checkpoints/step_00000007", str(tmp_path)))
    assert sorted(p.name for p in downloaded.iterdir()) == ["checkpoint", "checkpoint.data", "metadata.json"]
    for name in ("checkpoint", "checkpoint.data", "metadata.json"):
        assert (downloaded / name).read_bytes() == (step.directory / name).read_bytes()
    assert (CheckpointState.load_checkpoint(downloaded / "checkpoint").parameters["w"].data == 7).all()


@contextmanager
def dead_server(kind: str) -> Iterator[str]:
    """The URL of a server that refuses connections (a port where nothing listens) or of one
    that accepts them and never answers (a socket that listens and never reads)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        if kind == "never answers":
            s.listen(64)  # the kernel accepts the connections; nothing reads the requests
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def timed(call: Any) -> float:
    began = time.monotonic()
    call()
    return time.monotonic() - began


def mlflow_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("MLFLOW_")}


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("kind", ["refuses connections", "never answers"])
def test_a_server_that_is_down_costs_seconds_at_start_save_and_close_and_what_it_missed_is_reported_later(
    tmp_path, mlflow_uri, experiment, monkeypatch, kind, async_save
):
    # MLflow's own retries as they come: before, 249 s to start and 246 s per save.
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    environment = mlflow_environment()
    with dead_server(kind) as url:
        tracker = MlflowTracker(url, experiment=experiment, timeout=1)
        manager: Any = None

        def start() -> None:
            nonlocal manager
            manager = CheckpointManager(tmp_path, track=tracker, async_save=async_save, config={"lr": 0.1})

        with pytest.warns(RuntimeWarning, match=r"did not start within its deadline of 1 s \(its timeout\)"):
            starting = timed(start)
        saves = [timed(lambda s=step: manager.save(small(s), s, metrics={"loss": 1 / s})) for step in (1, 2, 3)]
        with pytest.warns(RuntimeWarning, match=r"did not close within its deadline of 1 s.*when the run resumes"):
            closing = timed(manager.close)
    assert starting < 15 and max(saves) < 15 and closing < 15, (starting, saves, closing)
    assert manager.all_steps() == [1, 2, 3]  # committed regardless
    assert mlflow_environment() == environment  # MLflow's configuration is the user's: left as it was
    # The same run, the server reachable: the steps it missed are reported when it starts.
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        CheckpointManager(tmp_path, track=tracker).close()
    assert history(mlflow.MlflowClient(mlflow_uri), tracker.mlflow_run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3)]


@pytest.fixture
def proxy(mlflow_uri: str) -> Iterator[Proxy]:
    """The test server behind a proxy that refuses bodies over 1 MiB (nginx's default)."""
    proxy = Proxy(mlflow_uri)
    yield proxy
    proxy.close()


def test_a_report_past_its_deadline_reaches_the_server_once_it_answers(tmp_path, mlflow_uri, proxy, experiment):
    tracker = MlflowTracker(proxy.url, experiment=experiment, timeout=1)
    client = mlflow.MlflowClient(mlflow_uri)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a busy machine's first calls may take longer than 1 s)
        manager = CheckpointManager(tmp_path, track=tracker)
        manager.save(small(0), 0)
    until(lambda: tracker.mlflow_run_id and client.get_run(tracker.mlflow_run_id).data.tags.get(TAG_STEP) == "0")
    time.sleep(0.5)  # (the report's answer on its way back)
    proxy.hold()  # the server accepts and does not answer
    with pytest.warns(RuntimeWarning, match=r"did not report step 1 within its deadline of 1 s"):
        manager.save(small(1), 1, metrics={"loss": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the deadline is spent once, not at every save
        manager.save(small(2), 2, metrics={"loss": 0.5})
    assert history(client, tracker.mlflow_run_id, "loss") == []
    proxy.release()  # it answers: what waited is sent, in order, without another save
    until(lambda: history(client, tracker.mlflow_run_id, "loss") == [(1, 1.0), (2, 0.5)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        manager.save(small(3), 3, metrics={"loss": 0.25})
        manager.close()
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 0.25)]
    assert client.get_run(tracker.mlflow_run_id).info.status == "FINISHED"


def test_close_waits_for_a_large_config_while_the_server_answers_its_requests(tmp_path, mlflow_uri, proxy, experiment):
    """A config of thousands of keys is one start of many requests (100 params each): a server
    that answers each in time is waited for at close, though the whole takes longer than the
    deadline. It used to be left behind (the lane completes no call meanwhile), and a script
    that then exited reported no metric at all, its run never FINISHED."""
    config = {f"layer{i}": {"width": i, "act": "gelu"} for i in range(1500)}  # 3000 params: 30 requests
    proxy.delay = 0.2  # each request a fifth of a second: the start takes 6 s at least
    tracker = MlflowTracker(proxy.url, experiment=experiment, timeout=3)
    with pytest.warns(RuntimeWarning, match=r"did not start within its deadline of 3 s"):
        manager = CheckpointManager(tmp_path, track=tracker, config=config)
    manager.save(small(1), 1, metrics={"loss": 1.0})  # behind the start: not waited for
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "did not close within its deadline"
        manager.close()
    client = mlflow.MlflowClient(mlflow_uri)
    run = client.get_run(tracker.mlflow_run_id)
    assert len(run.data.params) == 3000
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 1.0)]
    assert run.info.status == "FINISHED"


def test_a_report_that_fails_midway_is_sent_again_at_the_next_save(tmp_path, mlflow_uri, experiment, monkeypatch):
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with CheckpointManager(tmp_path, track=tracker) as manager:
        manager.save(small(1), 1, metrics={"loss": 0.9})
        # One report fails (the server briefly gone): the next save reports both.
        real = tracker.client.log_batch
        failures = iter([ConnectionError("server gone")])

        def flaky(*args: Any, **kwargs: Any) -> Any:
            for error in failures:
                raise error
            return real(*args, **kwargs)

        monkeypatch.setattr(tracker.client, "log_batch", flaky)
        with pytest.warns(
            RuntimeWarning, match=r"could not report step 2, to be retried.*ConnectionError: server gone"
        ):
            manager.save(small(2), 2, metrics={"loss": 0.7})
        client = mlflow.MlflowClient(mlflow_uri)
        assert history(client, tracker.mlflow_run_id, "loss") == [(1, 0.9)]
        manager.save(small(3), 3, metrics={"loss": 0.5})
        assert history(client, tracker.mlflow_run_id, "loss") == [(1, 0.9), (2, 0.7), (3, 0.5)]
        assert client.get_run(tracker.mlflow_run_id).data.tags[TAG_STEP] == "3"


def big(value: float) -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.full((640, 640), value, np.float32)})  # 1.6 MB: over 1 MiB


def test_an_upload_the_proxy_refuses_is_given_up_its_metrics_logged_and_later_steps_flow(
    tmp_path, mlflow_uri, proxy, experiment
):
    tracker = MlflowTracker(proxy.url, timeout=PATIENT, experiment=experiment, log_artifacts=True)
    with CheckpointManager(tmp_path, track=tracker) as manager:
        manager.save(small(1), 1, metrics={"loss": 1.0})
        expected = (
            r"step_00000002: step 2's files are not uploaded: the server answered HTTP 413 Request Entity Too "
            r"Large .*client_max_body_size.* to PUT http.*\(given up: its metrics are logged\)"
        )
        with pytest.warns(RuntimeWarning, match=expected):
            manager.save(big(2), 2, metrics={"loss": 0.5})
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # given up: not tried again, nothing held back
            manager.save(small(3), 3, metrics={"loss": 0.25})
            manager.save(small(4), 4, metrics={"loss": 0.125})
    client = mlflow.MlflowClient(mlflow_uri)
    run_id = tracker.mlflow_run_id
    assert history(client, run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 0.25), (4, 0.125)]
    assert client.get_run(run_id).data.tags[TAG_STEP] == "4"
    for step in (1, 3, 4):
        uploaded = sorted(Path(e.path).name for e in client.list_artifacts(run_id, f"checkpoints/step_{step:08d}"))
        assert uploaded == ["checkpoint", "metadata.json"]
    assert "checkpoint" not in [Path(e.path).name for e in client.list_artifacts(run_id, "checkpoints/step_00000002")]
    [(method, path, status)] = proxy.answered  # refused once: given up, not sent again
    assert (method, status) == ("PUT", 413) and "step_00000002/checkpoint" in path


def test_an_upload_that_fails_for_now_is_sent_again_and_holds_back_the_steps_after_it(
    tmp_path, mlflow_uri, proxy, experiment, monkeypatch
):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries of a 503: minutes
    tracker = MlflowTracker(proxy.url, timeout=PATIENT, experiment=experiment, log_artifacts=True)
    with CheckpointManager(tmp_path, track=tracker) as manager:
        proxy.outage["PUT"] = 503  # the artifact store unavailable, the rest answering
        with pytest.warns(RuntimeWarning, match=r"could not report step 1, to be retried at the next save: .*503"):
            manager.save(small(1), 1, metrics={"loss": 1.0})
        # (step 2's report fails on step 1's upload: it goes first)
        with pytest.warns(RuntimeWarning, match=r"could not report step 2, to be retried.*step_00000001.*503"):
            manager.save(small(2), 2, metrics={"loss": 0.5})
        client = mlflow.MlflowClient(mlflow_uri)
        assert history(client, tracker.mlflow_run_id, "loss") == []  # in order: step 2 waits behind step 1
        del proxy.outage["PUT"]
        manager.save(small(3), 3, metrics={"loss": 0.25})
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 0.25)]
    for step in (1, 2, 3):
        uploaded = client.list_artifacts(tracker.mlflow_run_id, f"checkpoints/step_{step:08d}")
        assert sorted(Path(e.path).name for e in uploaded) == ["checkpoint", "metadata.json"]


def test_an_upload_whose_connection_is_reset_is_given_up_after_3_tries_while_the_server_answers(
    tmp_path, mlflow_uri, proxy, experiment, monkeypatch
):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries of a reset: minutes
    proxy.reset_over_limit = True  # no answer to tell it from an outage: it may pass, so it is tried again
    tracker = MlflowTracker(proxy.url, timeout=PATIENT, experiment=experiment, log_artifacts=True)
    with CheckpointManager(tmp_path, track=tracker) as manager:
        with pytest.warns(RuntimeWarning, match=r"could not report step 1, to be retried at the next save"):
            manager.save(big(1), 1, metrics={"loss": 1.0})
        with pytest.warns(RuntimeWarning, match=r"could not report step 2, to be retried at the next save"):
            manager.save(small(2), 2, metrics={"loss": 0.5})
        client = mlflow.MlflowClient(mlflow_uri)
        assert history(client, tracker.mlflow_run_id, "loss") == []  # in order: step 2 waits behind step 1
        expected = r"step 1's files are not uploaded: 3 tries failed, the server answering otherwise.*\(given up"
        with pytest.warns(RuntimeWarning, match=expected):
            manager.save(small(3), 3, metrics={"loss": 0.25})
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 0.25)]
    assert [status for _, path, status in proxy.answered if "step_00000001/checkpoint" in path] == [0, 0, 0]
    for step in (2, 3):
        uploaded = client.list_artifacts(tracker.mlflow_run_id, f"checkpoints/step_{step:08d}")
        assert sorted(Path(e.path).name for e in uploaded) == ["checkpoint", "metadata.json"]


def test_a_name_mlflow_refuses_drops_only_that_item(tmp_path, mlflow_uri, experiment):
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with pytest.warns(RuntimeWarning, match=r"config 'bad key %' is not logged as an MLflow param: INVALID_PARAM"):
        manager = CheckpointManager(tmp_path, track=tracker, config={"bad key %": 1, "lr": 0.1})
    with manager:
        with pytest.warns(RuntimeWarning) as warned:
            manager.save(small(1), 1, metrics={"val/../loss": 1.0, "loss": 0.9, "loss%": 2.0, "accuracy": 0.5})
        named = [re.search(r"step 1's metric '(.*)' is not logged \(MLflow refused it", str(w.message)) for w in warned]
        assert sorted(m.group(1) for m in named if m) == ["loss%", "val/../loss"] and len(warned) == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            manager.save(small(2), 2, metrics={"loss": 0.5})
    client = mlflow.MlflowClient(mlflow_uri)
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 0.9), (2, 0.5)]
    assert history(client, tracker.mlflow_run_id, "accuracy") == [(1, 0.5)]
    assert client.get_run(tracker.mlflow_run_id).data.tags[TAG_STEP] == "2"
    assert client.get_run(tracker.mlflow_run_id).data.params == {"lr": "0.1"}  # the good ones logged


def test_a_step_sent_again_after_a_refused_item_logs_each_metric_once(tmp_path, mlflow_uri, experiment, monkeypatch):
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with CheckpointManager(tmp_path, track=tracker) as manager:
        real = tracker.client.log_batch
        failures = iter([ConnectionError("server gone")])

        def flaky(run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> Any:
            if tags and not metrics:  # the step's tags alone, after its metrics one by one
                for error in failures:
                    raise error
            return real(run_id, metrics=metrics, params=params, tags=tags)

        monkeypatch.setattr(tracker.client, "log_batch", flaky)
        with pytest.warns(RuntimeWarning) as warned:
            manager.save(small(1), 1, metrics={"loss": 0.9, "loss%": 1.0})
        messages = sorted(str(w.message) for w in warned)
        assert len(messages) == 2 and "step 1's metric 'loss%' is not logged" in messages[0]
        assert "could not report step 1, to be retried at the next save: ConnectionError" in messages[1]
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # what was refused is not sent again
            manager.save(small(2), 2, metrics={"loss": 0.5})
    client = mlflow.MlflowClient(mlflow_uri)
    # Step 1's loss was logged alone, then again with its batch: the server keeps one of identical points.
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 0.9), (2, 0.5)]
    assert client.get_run(tracker.mlflow_run_id).data.tags[TAG_STEP] == "2"


def test_a_large_config_reaches_the_server_through_a_proxy_that_refuses_bodies_over_1_mib(
    tmp_path, mlflow_uri, proxy, experiment
):
    config = {f"p{i:03}": "\u00e9" * 5000 for i in range(100)}  # 3 MB of JSON: each é escaped as \u00e9
    tracker = MlflowTracker(proxy.url, timeout=PATIENT, experiment=experiment)
    # Its metadata.json holds the config: that upload is refused, the params are sent in parts.
    expected = r"step 1's files are not uploaded: .*HTTP 413.*\(given up: its metrics are logged\)"
    with CheckpointManager(tmp_path, track=tracker, config=config) as manager, pytest.warns(match=expected):
        manager.save(small(1), 1, metrics={"loss": 0.5})
    client = mlflow.MlflowClient(mlflow_uri)
    assert client.get_run(tracker.mlflow_run_id).data.params == config
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 0.5)]
    [(method, path, status)] = proxy.answered
    assert (method, status) == ("PUT", 413) and path.endswith("step_00000001/metadata.json")


@dataclass
class Gone:
    """A committed checkpoint of many shards whose step retention deleted before its report."""

    step: int
    directory: Path
    metadata: dict[str, Any]

    @property
    def metrics(self) -> dict[str, Any]:
        return self.metadata["metrics"]

    def load(self) -> Any:
        raise FileNotFoundError(self.directory)


def test_a_step_deleted_before_its_report_is_reported_without_its_files(tmp_path, mlflow_uri, experiment):
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    tracker.start(TrackedRun("deleted", tmp_path, {}, writer=True), [])
    files = {f"shard_{i:04}": {"sha256": "0" * 64} for i in range(200)}  # their digests: more than a tag holds
    with pytest.warns(RuntimeWarning, match=r"step 1's files are not uploaded: .*No such file or directory"):
        tracker.log_checkpoint(Gone(1, tmp_path / "step_00000001", {"metrics": {"loss": 1.0}, "files": files}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with CheckpointManager(tmp_path / "next") as manager:  # the next step, whole, flows
            manager.save(small(2), 2, metrics={"loss": 0.5})
            tracker.log_checkpoint(manager.latest())
    client = mlflow.MlflowClient(mlflow_uri)
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 1.0), (2, 0.5)]
    assert client.get_run(tracker.mlflow_run_id).data.tags[TAG_STEP] == "2"


@pytest.mark.parametrize(
    ("config", "name", "kept", "dropped"),
    [
        ({"a": {"b": 1}, "a.b": 2}, "a.b", ("['a']['b']", "1"), ("['a.b']", "2")),
        ({"a.b": 2, "a": {"b": 1}}, "a.b", ("['a.b']", "2"), ("['a']['b']", "1")),
        ({1: "x", "1": "y"}, "1", ("[1]", "x"), ("['1']", "y")),
    ],
)
def test_two_config_keys_that_flatten_to_one_param_are_reported(config, name, kept, dropped):
    expected = (
        f"config{kept[0]} and config{dropped[0]} are both the MLflow param {name!r}: the first is logged "
        f"('{kept[1]}'), the second is not ('{dropped[1]}'; metadata.json has both)"
    )
    with pytest.warns(RuntimeWarning, match=re.escape(expected)):
        assert flatten(config) == {name: kept[1]}


def test_a_flattening_collision_logs_the_first_key_as_the_param(tmp_path, mlflow_uri, experiment):
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with pytest.warns(RuntimeWarning, match=re.escape("config['a']['b'] and config['a.b'] are both the MLflow param")):
        CheckpointManager(tmp_path, track=tracker, config={"a": {"b": 1}, "a.b": 2, "c": 3}).close()
    assert mlflow.MlflowClient(mlflow_uri).get_run(tracker.mlflow_run_id).data.params == {"a.b": "1", "c": "3"}


def test_any_run_id_finds_its_mlflow_run_again(tmp_path, mlflow_uri, experiment):
    run_id = "it's a \\ 'run' \" OR 1=1 --"
    for step in (1, 2):
        tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
        with CheckpointManager(tmp_path, track=tracker, run_id=run_id) as manager:
            manager.save(small(step), step, metrics={"loss": 1.0 / step})
    client = mlflow.MlflowClient(mlflow_uri)
    [found] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert found.data.tags[TAG_RUN_ID] == run_id
    assert history(client, found.info.run_id, "loss") == [(1, 1.0), (2, 0.5)]


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_file_planted_in_a_step_is_not_uploaded_and_its_metrics_still_are(tmp_path, mlflow_uri, experiment, plant):
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for the tracker")
    with CheckpointManager(tmp_path / "run") as manager:  # trained untracked; tracked from the restart
        manager.save(small(1), 1, metrics={"loss": 0.25})
        step = manager.latest().directory
    (step / "checkpoint").unlink()
    if plant == "symlink":
        (step / "checkpoint").symlink_to(secret)
    else:
        os.mkfifo(step / "checkpoint")  # an upload that opened it would wait forever
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment, log_artifacts=True)
    expected = r"step 1's files are not uploaded: .*(Too many levels of symbolic links|a FIFO, not a regular file)"
    with pytest.warns(RuntimeWarning, match=expected):
        CheckpointManager(tmp_path / "run", track=tracker).close()
    client = mlflow.MlflowClient(mlflow_uri)
    assert history(client, tracker.mlflow_run_id, "loss") == [(1, 0.25)]
    assert client.list_artifacts(tracker.mlflow_run_id, "checkpoints/step_00000001") == []


def test_an_active_mlflow_run_is_the_one_reported_to(tmp_path, mlflow_uri, experiment, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)  # track="mlflow": MLflow's own configuration
    client = mlflow.MlflowClient(mlflow_uri)
    experiment_id = client.create_experiment(experiment)
    with mlflow.start_run(experiment_id=experiment_id) as active:
        mlflow.log_param("model", "tiny")
        with CheckpointManager(tmp_path, track="mlflow") as manager:
            manager.save(small(1), 1, metrics={"loss": 0.3})
    assert history(client, active.info.run_id, "loss") == [(1, 0.3)]
    assert client.get_run(active.info.run_id).data.tags[TAG_RUN_ID] == manager.run_id


def test_an_active_run_on_another_server_is_left_alone(tmp_path, mlflow_uri, experiment, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # the fluent API's: a local store
    with mlflow.start_run() as elsewhere:
        tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # before: the unknown run id failed every report
            with CheckpointManager(tmp_path / "run", track=tracker) as manager:
                manager.save(small(1), 1, metrics={"loss": 0.3})
    assert tracker.mlflow_run_id != elsewhere.info.run_id
    assert history(mlflow.MlflowClient(mlflow_uri), tracker.mlflow_run_id, "loss") == [(1, 0.3)]


def trained_run(directory: Path, tracker: Any) -> tuple[CheckpointManager, dict[int, float]]:
    """Three checkpoints of ONNX Runtime's artifacts, each with the loss its weights really have."""
    manager = CheckpointManager(directory, keep_best=("loss", "min", 2), track=tracker)
    losses = {}
    for step, factor in [(1, 1.0), (2, 0.5), (3, 1.5)]:
        state = scaled(factor)
        losses[step] = state_loss(state)
        manager.save(state, step, metrics={"loss": losses[step]})
    return manager, losses


def test_register_best_hands_the_best_checkpoint_to_the_model_registry(tmp_path, mlflow_uri, experiment, monkeypatch):
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    manager, losses = trained_run(tmp_path / "run", tracker)
    best_step = min(losses, key=losses.__getitem__)
    name = f"{experiment}-model"
    version = manager.register_best(name, EVAL_MODEL, output_names=[LOSS])
    manager.close()
    client = mlflow.MlflowClient(mlflow_uri)
    registered = client.get_model_version(name, version.version)
    assert registered.version == "1" and registered.run_id == tracker.mlflow_run_id
    assert registered.source.startswith(client.get_run(tracker.mlflow_run_id).info.artifact_uri + "/models/")
    best = {c.step: c for c in manager.all()}[best_step]
    assert registered.tags[TAG_STEP] == str(best_step) and registered.tags[TAG_RUN_ID] == manager.run_id
    metadata_digest = hashlib.sha256((best.directory / "metadata.json").read_bytes()).hexdigest()
    assert json.loads(registered.tags[TAG_SHA256]) == {"metadata.json": metadata_digest}
    assert float(registered.tags["metric.loss"]) == losses[best_step]
    assert f"step {best_step} of ortckpt run {manager.run_id}" in registered.description
    # The registered model is an MLflow ONNX model with the best step's weights.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)  # where models:/ URIs resolve
    model = importlib.import_module("mlflow.onnx").load_model(f"models:/{name}/1")
    assert loss_of(model.SerializeToString()) == pytest.approx(losses[best_step], rel=1e-6)
    # Registering again is a new version with its own source, the first one unchanged.
    again = CheckpointManager(
        tmp_path / "run", read_only=True, track=MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    )
    second = again.register_best(name, EVAL_MODEL, metric="loss", mode="max")
    assert second.version == "2" and second.source != registered.source and second.tags[TAG_STEP] == str(max(losses))
    assert client.get_model_version(name, "1").source == registered.source


def test_two_processes_registering_one_new_name_at_once_both_get_a_version(tmp_path, mlflow_uri, experiment):
    manager, _ = trained_run(tmp_path / "run", MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment))
    manager.close()
    name = f"{experiment}-raced"
    args = ["-m", "ortckpt", "register-best", str(tmp_path / "run"), name, str(EVAL_MODEL), "--output", LOSS]
    args += ["--tracking-uri", mlflow_uri, "--experiment", experiment, "--json"]
    racers = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [json.loads(racer.communicate(timeout=300)[0]) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0]
    assert sorted(out["version"] for out in outs) == ["1", "2"]  # the name created once, by one of them
    assert len(mlflow.MlflowClient(mlflow_uri).search_model_versions(f"name = '{name}'")) == 2


def test_the_register_best_command(tmp_path, mlflow_uri, experiment, capsys):
    manager, losses = trained_run(tmp_path / "run", None)  # training not tracked: the command makes the run
    manager.close()
    name = f"{experiment}-cli"
    args = ["register-best", str(tmp_path / "run"), name, str(EVAL_MODEL), "--output", LOSS]
    args += ["--tracking-uri", mlflow_uri, "--experiment", experiment, "--json"]
    assert run(args) == OK
    out = json.loads(capsys.readouterr().out)
    best_step = min(losses, key=losses.__getitem__)
    assert out["step"] == best_step and out["version"] == "1" and out["metric"] == "loss"
    client = mlflow.MlflowClient(mlflow_uri)
    assert the_run(client, experiment, manager.run_id).info.run_id == out["mlflow_run_id"]
    assert client.get_model_version(name, "1").tags[TAG_STEP] == str(best_step)
    assert run(["register-best", str(tmp_path / "empty"), name, str(EVAL_MODEL), "--tracking-uri", mlflow_uri]) == 3
    assert "no checkpoint" in capsys.readouterr().err


def test_register_best_from_a_shell_without_the_runs_experiment_uses_the_runs_mlflow_run(
    tmp_path, mlflow_uri, experiment, capsys, monkeypatch
):
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    manager, _ = trained_run(tmp_path / "run", tracker)
    manager.close()
    name = f"{experiment}-shell"
    args = ["register-best", str(tmp_path / "run"), name, str(EVAL_MODEL), "--output", LOSS, "--json"]
    # No server named: refused with the hint, nothing made in the working directory.
    monkeypatch.chdir(tmp_path)
    assert run(args) == USAGE
    assert "--tracking-uri URL or MLFLOW_TRACKING_URI" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # The server named, no experiment: the run's own MLflow run (in its experiment), twice over.
    for _ in range(2):
        assert run([*args, "--tracking-uri", mlflow_uri]) == OK
        assert json.loads(capsys.readouterr().out)["mlflow_run_id"] == tracker.mlflow_run_id
    client = mlflow.MlflowClient(mlflow_uri)
    default = client.search_runs(["0"], filter_string=f"tags.`{TAG_RUN_ID}` = '{manager.run_id}'")
    assert default == []  # no second MLflow run in the Default experiment


class Recording:
    """Another tracker: the manager calls it through the same four methods."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def start(self, run: TrackedRun, committed: Any) -> None:
        self.calls.append(("start", run.run_id, run.writer, [c.step for c in committed]))

    def log_checkpoint(self, checkpoint: Any) -> None:
        self.calls.append(("log", checkpoint.step, dict(checkpoint.metrics)))

    def register_model(self, name: str, model: Any, checkpoint: Any) -> Any:
        self.calls.append(("register", name, checkpoint.step, type(model).__name__))
        return "v1"

    def close(self) -> None:
        self.calls.append(("close",))


@pytest.mark.parametrize("async_save", [False, True])
def test_another_tracker_plugs_in_through_the_interface(tmp_path, async_save):
    tracker = Recording()
    manager = CheckpointManager(tmp_path, track=tracker, async_save=async_save, keep_best=("loss", "min", 1))
    manager.save(scaled(1.0), 5, metrics={"loss": 2.0})
    manager.save(scaled(0.5), 6, metrics={"loss": 1.0})
    manager.wait()
    assert manager.register_best("m", EVAL_MODEL) == "v1"
    manager.close()
    manager.close()  # closed once
    assert tracker.calls == [
        ("start", manager.run_id, True, []),
        ("log", 5, {"loss": 2.0}),
        ("log", 6, {"loss": 1.0}),
        ("register", "m", 6, "ModelProto"),
        ("close",),
    ]
    resumed = Recording()
    CheckpointManager(tmp_path, track=resumed).close()
    assert resumed.calls[0] == ("start", manager.run_id, True, [6])  # the committed steps, for it to catch up


def test_in_a_sharded_run_rank_0_alone_reports(tmp_path):
    from distributed_model import on_ranks, rank_state

    trackers = [Recording(), Recording()]

    def work(comm: Any) -> Any:
        with CheckpointManager(tmp_path, comm=comm, durable=False, track=trackers[comm.rank]) as manager:
            for step in (10, 20):
                state, slices = rank_state(step, comm.rank, 2)
                manager.save(state, step, metrics={"loss": 1.0 / step}, slices=slices)
            return manager.run_id

    run_id, _ = on_ranks(2, work)
    assert trackers[0].calls == [
        ("start", run_id, True, []),
        ("log", 10, {"loss": 0.1}),
        ("log", 20, {"loss": 0.05}),
        ("close",),
    ]
    assert trackers[1].calls == []


def test_a_failing_tracker_is_a_warning_and_the_step_is_committed(tmp_path):
    class Broken(Recording):
        def log_checkpoint(self, checkpoint: Any) -> None:
            raise RuntimeError("tracker exploded")

    with CheckpointManager(tmp_path, track=Broken()) as manager:
        with pytest.warns(
            RuntimeWarning,
            match=r"could not report step 1, to be retried at the next save: RuntimeError: tracker exploded",
        ):
            manager.save(small(1), 1)
        assert manager.all_steps() == [1]


def until(condition: Any, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


class Stalling(Recording):
    """A tracker whose every call waits until released: a server that never answers, as any
    tracker may meet one."""

    timeout = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def start(self, run: TrackedRun, committed: Any) -> None:
        self.released.wait()
        super().start(run, committed)

    def log_checkpoint(self, checkpoint: Any) -> None:
        self.released.wait()
        super().log_checkpoint(checkpoint)

    def close(self) -> None:
        self.released.wait()
        super().close()


def test_a_tracker_of_ones_own_that_stalls_costs_at_most_its_deadline_and_reports_in_order_later(tmp_path):
    tracker = Stalling()
    with pytest.warns(RuntimeWarning, match=r"the tracker \(Stalling\) did not start within its deadline of 0.5 s"):
        manager = CheckpointManager(tmp_path, track=tracker)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        saves = [timed(lambda s=step: manager.save(small(s), s, metrics={"loss": float(s)})) for step in (1, 2)]
    assert max(saves) < 15
    tracker.released.set()  # it answers: the calls that waited run, in order, without another save
    until(lambda: len(tracker.calls) == 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        manager.save(small(3), 3, metrics={"loss": 3.0})
        manager.close()
    assert tracker.calls[0] == ("start", manager.run_id, True, [])
    assert tracker.calls[1:] == [
        ("log", 1, {"loss": 1.0}),
        ("log", 2, {"loss": 2.0}),
        ("log", 3, {"loss": 3.0}),
        ("close",),
    ]


def test_a_tracker_that_stalls_at_close_costs_its_deadline_and_goes_on_in_the_background(tmp_path):
    tracker = Stalling()
    tracker.released.set()
    manager = CheckpointManager(tmp_path, track=tracker)
    manager.save(small(1), 1)
    tracker.released.clear()
    with pytest.warns(RuntimeWarning, match=r"did not report step 2 within its deadline"):
        manager.save(small(2), 2)
    manager.save(small(3), 3)  # behind: waits its turn
    expected = r"did not close within its deadline of 0.5 s \(its timeout\): it goes on in the background"
    with pytest.warns(RuntimeWarning, match=expected):
        assert timed(manager.close) < 15
    resumed = Recording()  # meanwhile, another process resumes the run: it reports what it lacks
    CheckpointManager(tmp_path, track=resumed).close()
    assert resumed.calls[0] == ("start", manager.run_id, True, [1, 2, 3])
    tracker.released.set()  # this process lives on: what waited is reported
    until(lambda: len(tracker.calls) == 5)
    assert tracker.calls[1:] == [("log", 1, {}), ("log", 2, {}), ("log", 3, {}), ("close",)]


class Slow(Recording):
    """A tracker each of whose reports takes most of its deadline: a slow server that answers."""

    timeout = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def log_checkpoint(self, checkpoint: Any) -> None:
        self.released.wait()
        time.sleep(0.4)
        super().log_checkpoint(checkpoint)


def test_close_waits_for_the_reports_while_they_get_on(tmp_path):
    tracker = Slow()
    manager = CheckpointManager(tmp_path, track=tracker)
    with pytest.warns(RuntimeWarning, match=r"did not report step 1 within its deadline of 1 s"):
        manager.save(small(1), 1)
    for step in (2, 3, 4, 5):
        manager.save(small(step), step)  # behind: each waits its turn
    tracker.released.set()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # 2 s of reports, each within its 1 s: all waited for
        manager.close()
    assert tracker.calls[1:] == [("log", step, {}) for step in (1, 2, 3, 4, 5)] + [("close",)]


def test_a_tracker_that_fails_at_start_or_close_is_a_warning(tmp_path):
    class Failing(Recording):
        def __init__(self) -> None:
            super().__init__()
            self.starts = 0

        def start(self, run: TrackedRun, committed: Any) -> None:
            self.starts += 1
            if self.starts == 1:
                raise RuntimeError("no server")
            super().start(run, committed)

        def close(self) -> None:
            raise RuntimeError("gone at close")

    tracker = Failing()
    with pytest.warns(
        RuntimeWarning, match=r"could not start, to be retried at the next save: RuntimeError: no server"
    ):
        manager = CheckpointManager(tmp_path, track=tracker)
    manager.save(small(1), 1)
    with pytest.warns(RuntimeWarning, match=r"the tracker \(Failing\) could not close: RuntimeError: gone at close"):
        manager.close()
    assert tracker.calls == [("start", manager.run_id, True, [1])]  # started again at the save: it reported step 1


def test_a_trackers_timeout_is_checked(tmp_path):
    assert MlflowTracker("http://127.0.0.1:1").timeout == DEFAULT_TIMEOUT == 5.0
    with pytest.raises(ValueError, match=r"timeout is a number of seconds above 0, got 0"):
        MlflowTracker("http://127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match=r"got inf"):
        MlflowTracker("http://127.0.0.1:1", timeout=float("inf"))
    with pytest.raises(TypeError, match=r"timeout is a number of seconds, got str"):
        MlflowTracker("http://127.0.0.1:1", timeout="5")  # type: ignore[arg-type]

    class Negative(Recording):
        timeout = -1

    with pytest.raises(InvalidArgumentError, match=r"Negative.timeout is a number of seconds above 0, got -1") as e:
        CheckpointManager(tmp_path / "run", track=Negative())
    assert e.value.argument == "track" and not (tmp_path / "run").exists()  # refused before anything is made


@pytest.mark.parametrize("timeout", [1e10, 1e300])
def test_a_trackers_deadline_past_what_threading_can_wait_is_waited_not_an_overflow(tmp_path, timeout):
    """A patient tracker (a deadline of centuries, past threading.TIMEOUT_MAX) used to fail the
    manager's start with OverflowError: timestamp out of range."""

    class Patient(Recording):
        pass

    Patient.timeout = timeout  # type: ignore[attr-defined]
    tracker = Patient()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with CheckpointManager(tmp_path, track=tracker, async_save=True) as manager:
            manager.save(small(1), 1)
    assert tracker.calls == [("start", manager.run_id, True, []), ("log", 1, {}), ("close",)]
    assert MlflowTracker("http://127.0.0.1:1", timeout=timeout).timeout == timeout


def test_a_trackers_timeout_may_be_a_numpy_number_and_an_int_past_a_float_is_refused_by_type():
    # NumPy's numbers were refused (TypeError: got int64) and 10**400 was a bare OverflowError.
    assert MlflowTracker("http://127.0.0.1:1", timeout=np.int64(7)).timeout == 7.0
    assert MlflowTracker("http://127.0.0.1:1", timeout=np.float32(2.5)).timeout == 2.5
    with pytest.raises(InvalidArgumentError, match=r"timeout must be a finite number of seconds, got 1000") as e:
        MlflowTracker("http://127.0.0.1:1", timeout=10**400)
    assert e.value.argument == "timeout"
    with pytest.raises(InvalidArgumentError, match=r"got nan"):
        MlflowTracker("http://127.0.0.1:1", timeout=float("nan"))


def test_track_is_mlflow_or_a_tracker_and_register_best_needs_one(tmp_path):
    with pytest.raises(ValueError, match=r"track is 'mlflow' or a Tracker object, got 'wandb'"):
        CheckpointManager(tmp_path / "a", track="wandb")
    with pytest.raises(TypeError, match=r"got object"):
        CheckpointManager(tmp_path / "b", track=object())
    with CheckpointManager(tmp_path / "c", keep_best=("loss", "min", 1)) as manager:
        manager.save(small(1), 1, metrics={"loss": 1.0})
        with pytest.raises(ValueError, match=r"register_best needs a tracker"):
            manager.register_best("m", EVAL_MODEL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report, nothing warned
        with CheckpointManager(tmp_path / "d", track=Recording(), keep_best=("loss", "min", 1)) as manager:
            manager.save(small(1), 1)  # no metric
            with pytest.raises(FileNotFoundError, match=r"no checkpoint has the metric"):
                manager.register_best("m", EVAL_MODEL)


def test_warnings_made_errors_do_not_fail_the_trackers_work(tmp_path, mlflow_uri, experiment, caplog):
    """Under a warning filter of "error", what the tracker warns of while it works (a flattening
    collision here) is logged instead: its start is not failed for it, so the params, the
    metrics and the step's tags reach MLflow."""
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CheckpointManager(tmp_path, track=tracker, config={"a": {"b": 1}, "a.b": 2}) as manager:
            manager.save(scaled(1.0), 1, metrics={"loss": 0.5})
    assert "are both the MLflow param 'a.b'" in caplog.text
    run = mlflow.MlflowClient(mlflow_uri).get_run(tracker.mlflow_run_id)
    assert run.data.params == {"a.b": "1"}
    assert run.data.metrics == {"loss": 0.5}
    assert run.data.tags[TAG_STEP] == "1"


def test_warnings_made_errors_do_not_fail_a_save(tmp_path, caplog):
    """A tracker that fails, under a warning filter of "error": the save commits and returns,
    the failure is logged (a report never fails a save)."""

    class Failing(Recording):
        def log_checkpoint(self, checkpoint):
            raise ConnectionError("the tracker's server is down")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CheckpointManager(tmp_path, track=Failing()) as manager:
            manager.save(scaled(1.0), 1)
    assert "could not report step 1" in caplog.text and "server is down" in caplog.text
    assert CheckpointManager(tmp_path, read_only=True).latest_step() == 1


def test_config_flattens_to_params():
    assert flatten({"a": 1, "b": {"c": "x", "d": {"e": [1, 2]}}, "f": {}, "g": None}) == {
        "a": "1",
        "b.c": "x",
        "b.d.e": "[1, 2]",
        "f": "{}",
        "g": "null",
    }
    assert ortckpt.manager.tracking.tracker_for("mlflow").__class__ is MlflowTracker


def test_a_run_directory_whose_name_is_not_utf8_is_tracked(tmp_path, mlflow_uri, experiment):
    # A name of bytes that are not UTF-8 (os.fsdecode gives surrogates, which no JSON encoder takes):
    # tags carry it written out (\xff), and nothing stops tracking.
    directory = Path(os.fsdecode(bytes(tmp_path) + b"/run-\xff\xfe"))
    tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "could not start" is a warning: none may come
        with CheckpointManager(directory, track=tracker) as manager:
            manager.save(small(1), 1, metrics={"loss": 1.0})
            manager.save(small(2), 2, metrics={"loss": 0.5})
    found = the_run(mlflow.MlflowClient(mlflow_uri), experiment, manager.run_id)
    assert history(mlflow.MlflowClient(mlflow_uri), found.info.run_id, "loss") == [(1, 1.0), (2, 0.5)]
    assert found.data.tags[TAG_DIRECTORY] == str(tmp_path.absolute()) + "/run-\\xff\\xfe"
    assert found.data.tags[TAG_CHECKPOINT].startswith(str(tmp_path.absolute()) + "/run-\\xff\\xfe/")


def test_the_sha256_tag_holds_no_null(tmp_path, mlflow_uri, experiment):
    # With digest="sha256" each file's recorded digest; without, metadata.json's (never {"checkpoint": null}).
    for digest, directory in (("sha256", tmp_path / "digests"), (None, tmp_path / "plain")):
        tracker = MlflowTracker(mlflow_uri, timeout=PATIENT, experiment=experiment)
        with CheckpointManager(directory, track=tracker, digest=digest) as manager:
            manager.save(small(1), 1)
            latest = manager.latest()
        tags = mlflow.MlflowClient(mlflow_uri).get_run(tracker.mlflow_run_id).data.tags
        files = latest.metadata["files"]
        expected = (
            {name: entry["sha256"] for name, entry in files.items()}
            if digest
            else {"metadata.json": hashlib.sha256((latest.directory / "metadata.json").read_bytes()).hexdigest()}
        )
        assert json.loads(tags[TAG_SHA256]) == expected
        assert None not in expected.values()


PREEMPTED_LOOP = """
import sys, numpy as np, ortckpt
from ortckpt.manager.tracking import MlflowTracker
directory, uri, experiment = sys.argv[1:4]
tracker = MlflowTracker(uri, timeout=120, experiment=experiment)
with ortckpt.CheckpointManager(directory, save_every=25, async_save=True, track=tracker, preemption=True,
                               preemption_grace=60) as manager:
    state = ortckpt.CheckpointState.from_arrays({"w": np.zeros(1 << 14, np.float32)})
    print("ready", flush=True)
    for step in range(1, 1_000_000):
        state.parameters["w"].data[:] += 1
        sum(range(20000))
        if manager.should_save(step):
            manager.save(state, step, metrics={"loss": 1.0 / step})
            if manager.preempted:
                break
print("result", step, manager.latest_step(), flush=True)
"""


def test_preemption_with_tracking_reports_the_preempted_step(tmp_path, mlflow_uri, experiment):
    """SIGTERM to a run with async saves and MLflow tracking: it exits 0 with the step it was at
    committed, and that step's metrics are in the MLflow run (the report flushed), which is closed."""
    script = tmp_path / "loop.py"
    script.write_text(PREEMPTED_LOOP)
    process = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run"), mlflow_uri, experiment],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=PATIENT)
    assert process.returncode == 0, err
    _, step, latest = [line for line in out.splitlines() if line.startswith("result")][-1].split()
    assert step == latest
    manager = CheckpointManager(tmp_path / "run", read_only=True)
    client = mlflow.MlflowClient(mlflow_uri)
    found = the_run(client, experiment, manager.run_id)
    assert found.info.status == "FINISHED"
    assert history(client, found.info.run_id, "loss")[-1] == (int(step), pytest.approx(1.0 / int(step)))
