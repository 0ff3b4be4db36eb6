"""Experiment tracking: a manager's checkpoints reported to the tracker people already use.

The manager knows one small interface, :class:`Tracker`; :class:`MlflowTracker` is the one
built in (``CheckpointManager(..., track="mlflow")``). Another tracker is a class with the same
four methods, passed as ``track=``: the manager does not change.

A tracker is told of a checkpoint once it is committed. Reporting is never part of the save: a
tracker that fails (the server down) is a warning, the checkpoint stays saved, and what was not
reported is reported later: at the next save, or when the run is resumed (the tracker compares
the committed steps with the last one it recorded).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import secrets
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .. import __version__, safe_io, steps


class CommittedCheckpoint(Protocol):
    """What a tracker sees of a committed checkpoint: the manager's ``CheckpointInfo``."""

    @property
    def step(self) -> int: ...

    @property
    def directory(self) -> Path: ...

    @property
    def metadata(self) -> dict[str, Any]: ...  # metadata.json: metrics, config, files and SHA-256s

    @property
    def metrics(self) -> dict[str, Any]: ...

    def load(self) -> Any: ...


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told about the manager's run when it starts."""

    run_id: str  # the manager's run id: it survives restarts, so a resumed run finds its own
    directory: Path
    config: Mapping[str, Any]
    writer: bool  # False for a read-only manager: it registers models, it reports no saves


@runtime_checkable
class Tracker(Protocol):
    """What the manager calls. ``start`` comes first, with the checkpoints already committed
    (a tracker reports those it has not recorded yet); ``log_checkpoint`` after each commit;
    ``register_model`` from :meth:`CheckpointManager.register_best`; ``close`` from the
    manager's ``close``. Errors are the tracker's to raise: the manager turns them into
    warnings (a failed report never fails a save)."""

    def start(self, run: TrackedRun, committed: Sequence[CommittedCheckpoint]) -> None: ...

    def log_checkpoint(self, checkpoint: CommittedCheckpoint) -> None: ...

    def register_model(self, name: str, model: Any, checkpoint: CommittedCheckpoint) -> Any: ...

    def close(self) -> None: ...


def tracker_for(track: str | Tracker) -> Tracker:
    """The tracker ``track=`` names: ``"mlflow"``, or a :class:`Tracker` object as it is."""
    if isinstance(track, str):
        if track == "mlflow":
            return MlflowTracker()
        raise ValueError(f"track is 'mlflow' or a Tracker object, got {track!r}")
    if not isinstance(track, Tracker):
        raise TypeError(f"track is 'mlflow' or a Tracker object, got {type(track).__name__}")
    return track


# Tag names, one place: tests and users query them.
TAG_RUN_ID = "ortckpt.run_id"
TAG_RUN_KEY = "ortckpt.run_key"  # the run id's SHA-256: what a resumed run searches by (any id, safely quoted)
TAG_DIRECTORY = "ortckpt.directory"
TAG_VERSION = "ortckpt.version"
TAG_STEP = "ortckpt.step"  # the newest step reported
TAG_CHECKPOINT = "ortckpt.checkpoint"  # its step directory
TAG_SHA256 = "ortckpt.sha256"  # its files' SHA-256s, a JSON object {file name: hex digest}

# MLflow's own limits (mlflow.utils.validation): a longer param or tag is refused by the server,
# a larger batch too.
_MAX_PARAM_LENGTH = 6000
_MAX_TAG_LENGTH = 8000
_MAX_PARAMS_PER_BATCH = 100


class MlflowTracker:
    """Reports checkpoints to an MLflow tracking server (``pip install ortckpt[mlflow]``).

    Args:
        tracking_uri: The server; default: MLflow's own (``MLFLOW_TRACKING_URI``, else ./mlruns).
        experiment: The experiment's name, created if missing; default: ``MLFLOW_EXPERIMENT_NAME``,
            else MLflow's Default experiment.
        run_name: The MLflow run's name when it is created.
        log_artifacts: Upload each checkpoint's files as artifacts under ``checkpoints/step_N``
            (off by default: checkpoints are large). ``metadata.json`` (metrics, config,
            SHA-256s) is uploaded there either way: the lineage of every step.

    The MLflow run: the active run of ``mlflow.start_run()`` when there is one on this tracker's
    server (``tracking_uri`` None or the fluent API's); else the run
    tagged with the manager's run id (a resumed training run continues its MLflow run); else a
    new one, so tagged. Each save logs the step's metrics at that step, the tags ``ortckpt.step``,
    ``ortckpt.checkpoint`` and ``ortckpt.sha256`` (the newest step), and, once, the config as
    params (nested keys joined by dots). MLflow's client retries a server that does not answer
    (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_TIMEOUT``): with a synchronous
    manager the save waits for it, with ``async_save`` its thread does.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
        log_artifacts: bool = False,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.log_artifacts = log_artifacts
        self.mlflow_run_id: str | None = None  # known once started
        self._run: TrackedRun | None = None
        self._client: Any = None
        self._unreported: dict[int, CommittedCheckpoint] = {}  # committed, not yet reported

    @property
    def client(self) -> Any:
        """The ``mlflow.MlflowClient`` (mlflow is imported here, on first use)."""
        if self._client is None:
            try:
                from mlflow import MlflowClient
            except ImportError as e:
                raise ImportError("track='mlflow' needs MLflow: pip install 'ortckpt[mlflow]'") from e
            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def start(self, run: TrackedRun, committed: Sequence[CommittedCheckpoint]) -> None:
        self._run = run
        self.mlflow_run_id = self._find_or_create_run(run)
        client = self.client
        if run.writer:
            client.update_run(self.mlflow_run_id, status="RUNNING")
            self._log_params(run.config)
            done = self._reported_step()
            self._unreported = {c.step: c for c in committed if done is None or c.step > done}
            self._report()

    def log_checkpoint(self, checkpoint: CommittedCheckpoint) -> None:
        self._unreported[checkpoint.step] = checkpoint
        self._report()

    def close(self) -> None:
        if self._run is not None and self._run.writer and self.mlflow_run_id is not None:
            self.client.set_terminated(self.mlflow_run_id, status="FINISHED")

    def register_model(self, name: str, model: Any, checkpoint: CommittedCheckpoint) -> Any:
        """Logs ``model`` (an ONNX ModelProto) as an MLflow ONNX model in this run, and makes it
        a new version of the registered model ``name`` (created if missing), with the
        checkpoint's metrics and lineage as the version's tags. Returns the ModelVersion."""
        if self.mlflow_run_id is None:
            raise RuntimeError("the tracker is not started")
        try:
            import mlflow.onnx
        except ImportError as e:
            raise ImportError("registering a model needs MLflow: pip install 'ortckpt[mlflow]'") from e
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

        client = self.client
        # Unique: a source that a later registration overwrote would change an existing version.
        artifact_path = f"models/step_{checkpoint.step}-{secrets.token_hex(4)}"
        with safe_io.scratch_directory() as scratch:
            local = scratch / "model"
            # Requirements given, not inferred: inference loads the model in a subprocess (tens of s).
            mlflow.onnx.save_model(model, str(local), pip_requirements=mlflow.onnx.get_default_pip_requirements())
            client.log_artifacts(self.mlflow_run_id, str(local), artifact_path)
        source = f"{client.get_run(self.mlflow_run_id).info.artifact_uri}/{artifact_path}"
        try:
            client.create_registered_model(name)
        except MlflowException as e:  # a second process registering the same name first
            if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
        metrics = checkpoint.metrics
        tags = {
            **self._lineage(checkpoint),
            **{f"metric.{key}": repr(float(value)) for key, value in metrics.items()},
        }
        description = f"step {checkpoint.step} of ortckpt run {checkpoint.metadata.get('run_id')}" + "".join(
            f", {key}={float(value):g}" for key, value in sorted(metrics.items())
        )
        return client.create_model_version(
            name, source=source, run_id=self.mlflow_run_id, tags=tags, description=description
        )

    def _find_or_create_run(self, run: TrackedRun) -> str:
        import mlflow

        client = self.client
        active = mlflow.active_run()
        # The active run lives on the fluent API's server: this tracker's only when it has no
        # URI of its own or the same one (a run id on another server would be unknown here).
        if active is not None and self.tracking_uri in (None, mlflow.get_tracking_uri()):
            self._tag_run(active.info.run_id, run)
            return str(active.info.run_id)
        experiment_id = self._experiment_id()
        key = run_key(run.run_id)  # hex: nothing to escape in the search string
        found = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN_KEY}` = '{key}'", max_results=1)
        if found:
            mlflow_run_id = str(found[0].info.run_id)
        else:
            created = client.create_run(experiment_id, run_name=self.run_name, tags={TAG_RUN_KEY: key})
            mlflow_run_id = str(created.info.run_id)
        self._tag_run(mlflow_run_id, run)
        return mlflow_run_id

    def _tag_run(self, mlflow_run_id: str, run: TrackedRun) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(TAG_RUN_KEY, run_key(run.run_id)), RunTag(TAG_RUN_ID, run.run_id[:_MAX_TAG_LENGTH])]
        tags += [RunTag(TAG_DIRECTORY, str(run.directory.absolute())), RunTag(TAG_VERSION, __version__)]
        self.client.log_batch(mlflow_run_id, tags=tags)

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        client = self.client
        if name is None:
            return "0"  # MLflow's Default experiment
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(client.create_experiment(name))
        except MlflowException:  # created meanwhile by another process
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    def _log_params(self, config: Mapping[str, Any]) -> None:
        """The config as params, once: MLflow's params never change, so a resumed run with a
        changed config logs the keys it lacks and warns about the others (each checkpoint's
        metadata.json holds its own config)."""
        from mlflow.entities import Param

        assert self.mlflow_run_id is not None
        logged = self.client.get_run(self.mlflow_run_id).data.params
        params: list[Any] = []
        for key, value in flatten(config).items():
            if len(value) > _MAX_PARAM_LENGTH:
                warnings.warn(
                    f"config {key!r} is not logged as an MLflow param: {len(value)} characters, "
                    f"MLflow takes {_MAX_PARAM_LENGTH} (metadata.json has it)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            elif key not in logged:
                params.append(Param(key, value))
            elif logged[key] != value:
                warnings.warn(
                    f"config {key!r} is {value!r}, but the MLflow run logged {logged[key]!r} and params "
                    "do not change (metadata.json has the new value)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            batch = params[i : i + _MAX_PARAMS_PER_BATCH]
            if not refused(lambda: self.client.log_batch(self.mlflow_run_id, params=batch)):  # noqa: B023 - called now
                continue
            for param in batch:  # one refused (a key MLflow does not take): the others one by one
                problem = refused(lambda: self.client.log_batch(self.mlflow_run_id, params=[param]))  # noqa: B023
                if problem:
                    warnings.warn(
                        f"config {param.key!r} is not logged as an MLflow param: {problem} (metadata.json has it)",
                        RuntimeWarning,
                        stacklevel=2,
                    )

    def _reported_step(self) -> int | None:
        assert self.mlflow_run_id is not None
        value = self.client.get_run(self.mlflow_run_id).data.tags.get(TAG_STEP)
        try:
            return int(value) if value is not None else None
        except ValueError:  # not ours to trust: report everything again
            return None

    def _report(self) -> None:
        """Reports every unreported checkpoint, oldest first; each one's metrics and tags in one
        request (all or nothing on the server), so a failure midway leaves the rest for later.
        A report the server refuses as invalid (a metric name MLflow does not take) is dropped
        with a warning: sent again, it would be refused again, and hold back every later step."""
        from mlflow.entities import Metric, RunTag

        assert self.mlflow_run_id is not None
        for step in sorted(self._unreported):
            checkpoint = self._unreported[step]
            timestamp = _milliseconds(checkpoint.metadata.get("timestamp"))
            metrics = [Metric(key, float(value), timestamp, step) for key, value in sorted(checkpoint.metrics.items())]
            lineage = self._lineage(checkpoint)
            tags = [RunTag(TAG_STEP, lineage[TAG_STEP]), RunTag(TAG_CHECKPOINT, lineage[TAG_CHECKPOINT])]
            tags.append(RunTag(TAG_SHA256, lineage[TAG_SHA256]))
            self._upload(checkpoint)
            problem = refused(lambda: self.client.log_batch(self.mlflow_run_id, metrics=metrics, tags=tags))  # noqa: B023
            if problem:
                warnings.warn(
                    f"{checkpoint.directory}: MLflow refused the report of step {step} (not sent again): {problem}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            del self._unreported[step]

    def _upload(self, checkpoint: CommittedCheckpoint) -> None:
        assert self.mlflow_run_id is not None
        destination = f"checkpoints/{steps.step_directory_name(checkpoint.step)}"
        names = [steps.METADATA_NAME]
        if self.log_artifacts:
            names += list(checkpoint.metadata.get("files", {}))
        # Opened here, not by name in the uploader: a symlink planted in the step directory is
        # refused (ELOOP), not followed out of it, and a FIFO is refused, not waited on. Such a
        # step's files are not uploaded (its metrics still are): trying again would not help.
        with contextlib.ExitStack() as stack:
            try:
                pinned = stack.enter_context(safe_io.pinned_files(checkpoint.directory, names))
            except OSError as e:
                warnings.warn(
                    f"{checkpoint.directory}: step {checkpoint.step}'s files are not uploaded: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
            self.client.log_artifacts(self.mlflow_run_id, str(pinned), destination)

    @staticmethod
    def _lineage(checkpoint: CommittedCheckpoint) -> dict[str, str]:
        files = checkpoint.metadata.get("files", {})
        digests = json.dumps({name: entry.get("sha256") for name, entry in files.items()}, sort_keys=True)
        if len(digests) > _MAX_TAG_LENGTH:  # many shards: metadata.json's own digest, which lists theirs
            digests = json.dumps(
                {steps.METADATA_NAME: safe_io.sha256_of(checkpoint.directory / steps.METADATA_NAME)[1]}
            )
        return {
            TAG_RUN_ID: str(checkpoint.metadata.get("run_id"))[:_MAX_TAG_LENGTH],
            TAG_STEP: str(checkpoint.step),
            TAG_CHECKPOINT: str(checkpoint.directory.absolute())[:_MAX_TAG_LENGTH],
            TAG_SHA256: digests,
            TAG_VERSION: __version__,
        }


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": "0.1"}``: nested keys joined by dots, the
    values as text (lists and other JSON as JSON)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, sort_keys=True, default=str)
    return flat


def run_key(run_id: str) -> str:
    return hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()


def refused(call: Any) -> str | None:
    """Runs an MLflow call; returns the server's reason when it refuses the request as invalid
    (HTTP 4xx), raises anything else (the server down: worth trying again later)."""
    from mlflow.exceptions import MlflowException

    try:
        call()
    except MlflowException as e:
        if 400 <= e.get_http_status_code() < 500:
            return f"{e.error_code}: {e.message}"
        raise
    return None


def _milliseconds(timestamp: Any) -> int:
    """metadata.json's ISO timestamp in ms since the epoch (now, when it is missing or bad)."""
    try:
        value = datetime.datetime.fromisoformat(str(timestamp)).timestamp() * 1000
    except ValueError:
        return int(time.time() * 1000)
    return int(value) if math.isfinite(value) else int(time.time() * 1000)


class Reporter:
    """The manager's side of a tracker: starts it (again at the next commit, if starting failed)
    and turns its failures into warnings; a save is never failed by its report."""

    def __init__(self, tracker: Tracker, run: TrackedRun, committed: Any) -> None:
        self.tracker = tracker
        self.run = run
        self._committed = committed  # () -> the manager's committed checkpoints, oldest first
        self._started = False
        self.start()

    def start(self) -> bool:
        if not self._started:
            self._started = self._quietly("start", lambda: self.tracker.start(self.run, self._committed()))
        return self._started

    def committed(self, checkpoint: CommittedCheckpoint) -> None:
        if self._started:
            self._quietly(f"report step {checkpoint.step}", lambda: self.tracker.log_checkpoint(checkpoint))
        else:
            self.start()  # reports every committed step, this one included

    def register(self, name: str, model: Any, checkpoint: CommittedCheckpoint) -> Any:
        """Registering is what the caller asked for: its errors are raised, not warned."""
        if not self._started:
            self.tracker.start(self.run, self._committed())
            self._started = True
        return self.tracker.register_model(name, model, checkpoint)

    def close(self) -> None:
        if self._started:
            self._quietly("close", self.tracker.close)

    def _quietly(self, what: str, call: Any) -> bool:
        try:
            call()
        except Exception as e:  # any tracker failure: the checkpoint is saved regardless
            warnings.warn(
                f"{self.run.directory}: the tracker ({type(self.tracker).__name__}) could not {what}, "
                f"to be retried at the next save: {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        return True
