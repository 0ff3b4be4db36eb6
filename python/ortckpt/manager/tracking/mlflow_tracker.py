"""The built-in tracker: :class:`MlflowTracker` (``track="mlflow"``), with what it needs of
MLflow's limits (params, tags, batches) and of its runs (found again by the run id's key)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from ... import arguments, extras, safe_io, steps
from ..._boundary import VERSION
from .base import (
    DEFAULT_TIMEOUT,
    REPORT_NAME,
    TAG_CHECKPOINT,
    TAG_DIRECTORY,
    TAG_RUN_ID,
    TAG_RUN_KEY,
    TAG_SHA256,
    TAG_STEP,
    TAG_VERSION,
    CommittedCheckpoint,
    Lane,
    TrackedRun,
    Unreported,
    refused,
    warn_of_work,
)

# Searching every experiment for a run: 100 experiments a request (search_runs takes at most that
# many ids), at most 100 requests.
_EXPERIMENTS_A_PAGE, _MAX_EXPERIMENT_PAGES = 100, 100

# MLflow's own limits (mlflow.utils.validation): a longer param or tag is refused by the server,
# a larger batch too.
_MAX_PARAM_LENGTH = 6000
_MAX_TAG_LENGTH = 8000
_MAX_PARAMS_PER_BATCH = 100
# And a proxy's: nginx refuses request bodies over 1 MiB by default. 100 params of 6000
# characters, each escaped in JSON as \uXXXX, would be 3.6 MB.
_MAX_BATCH_BYTES = 256 * 1024
# How often a step's upload may fail for a reason that may pass, the server answering the rest,
# before its files are given up.
_UPLOAD_TRIES = 3


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
        timeout: How long, in seconds, the manager waits for this tracker when it starts, at
            each save and at close (default :data:`DEFAULT_TIMEOUT`, 5 s). A server that is down
            or does not answer costs a save this much, once per outage (see :class:`Tracker`).
            With ``log_artifacts``, give it the time an upload takes if each save should wait
            for its upload (a step that retention deletes before its upload began is reported
            without its files).
        report: Upload each step's HTML report (:func:`ortckpt.write_report`: statistics,
            NaN/Inf, histograms, and what changed since the step reported before it, when that
            one is still there) as ``checkpoints/step_N/report.html``. Reports are made on a
            thread of their own once the step's metrics are logged: one takes about the time of
            reading the checkpoint, and no save waits for it (close waits while they get on). A
            report that cannot be made or uploaded is a warning, and not tried again.

    The MLflow run: the active run of ``mlflow.start_run()`` when there is one on this tracker's
    server (``tracking_uri`` None or the fluent API's); else the run
    tagged with the manager's run id (a resumed training run continues its MLflow run); else a
    new one, so tagged. Each save logs the step's metrics at that step, the tags ``ortckpt.step``,
    ``ortckpt.checkpoint`` and ``ortckpt.sha256`` (the newest step), and, once, the config as
    params (nested keys joined by dots: :func:`flatten`).

    What the server refuses (HTTP 4xx but 408 and 429: it would refuse it again) is given up
    with a warning naming it, and only that: a metric or param name MLflow does not take drops
    that metric or param; an upload refused (a proxy's 413 Request Entity Too Large) drops that
    step's files, its metrics and tags are logged. Anything else (the server down, 5xx, a
    timeout, a connection reset) is tried again, in order: no later step is reported before it;
    an upload that fails so 3 times while the server answers the rest is given up too.

    MLflow's client retries a server that does not answer (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
    default 7, about 4 minutes of backoff; ``MLFLOW_HTTP_REQUEST_TIMEOUT``, default 120 s per
    request). That happens on the tracker's thread, past the deadline, and says how soon the
    reports resume once the server is back; this tracker leaves those variables as they are.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
        log_artifacts: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        report: bool = False,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.log_artifacts = log_artifacts
        self.report = report
        self.timeout = arguments.seconds("timeout", timeout)
        self.mlflow_run_id: str | None = None  # known once started
        self._active_run_id: str | None = None  # the fluent API's active run, when the manager started
        self._run: TrackedRun | None = None
        self._client: Any = None
        self._unreported: dict[int, Unreported] = {}  # committed, not yet reported
        # HTML reports: made and uploaded in order on a lane of their own, each against the step before.
        self._reports = Lane("ortckpt-mlflow-reports")
        self._pending_reports: list[Future[Any]] = []
        self._previous: CommittedCheckpoint | None = None
        # Requests the server has answered: one call (a start logging a config of thousands of
        # params, 100 a request) makes many, and close waits while they come (Tracker.answered).
        self.answered = 0
        # MLflow is imported now, in the caller's thread: its import takes seconds, which are not
        # the server's to be timed by the deadline (and a missing MLflow is said at once).
        self._client_class = extras.require("mlflow", "track='mlflow'").MlflowClient

    @property
    def client(self) -> Any:
        """The ``mlflow.MlflowClient``, made on first use."""
        if self._client is None:
            self._client = self._client_class(self.tracking_uri)
        return self._client

    def start(self, run: TrackedRun, committed: Sequence[CommittedCheckpoint]) -> None:
        self._run = run
        self.mlflow_run_id = self._find_or_create_run(run)
        client = self.client
        if run.writer:
            client.update_run(self.mlflow_run_id, status="RUNNING")
            self._log_params(run.config)
            done = self._reported_step()
            # (a start tried again keeps what an earlier try did: files already uploaded are not sent again)
            self._unreported = {
                c.step: self._unreported.get(c.step) or Unreported(c)
                for c in committed
                if done is None or c.step > done
            }
            self._report()

    def log_checkpoint(self, checkpoint: CommittedCheckpoint) -> None:
        self._unreported.setdefault(checkpoint.step, Unreported(checkpoint))
        self._report()

    def close(self) -> None:
        for future in self._pending_reports:  # (each one done counts as answered: the manager waits while they come)
            future.result()
        self._pending_reports = []
        if self._run is not None and self._run.writer and self.mlflow_run_id is not None:
            self.client.set_terminated(self.mlflow_run_id, status="FINISHED")

    def register_model(self, name: str, model: Any, checkpoint: CommittedCheckpoint) -> Any:
        """Logs ``model`` (an ONNX ModelProto) as an MLflow ONNX model in this run, and makes it
        a new version of the registered model ``name`` (created if missing), with the
        checkpoint's metrics and lineage as the version's tags. Returns the ModelVersion."""
        if self.mlflow_run_id is None:
            raise RuntimeError("the tracker is not started")
        mlflow_onnx = extras.require("mlflow.onnx", "registering a model")
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

        client = self.client
        # Unique: a source that a later registration overwrote would change an existing version.
        artifact_path = f"models/step_{checkpoint.step}-{secrets.token_hex(4)}"
        with safe_io.scratch_directory() as scratch:
            local = scratch / "model"
            # Requirements given, not inferred: inference loads the model in a subprocess (tens of s).
            mlflow_onnx.save_model(model, str(local), pip_requirements=mlflow_onnx.get_default_pip_requirements())
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

    def prepare(self, run: TrackedRun) -> None:
        """In the manager's thread: MLflow's active run (``mlflow.start_run()``) is its thread's."""
        import mlflow

        active = mlflow.active_run()
        # The active run lives on the fluent API's server: this tracker's only when it has no
        # URI of its own or the same one (a run id on another server would be unknown here).
        if active is not None and self.tracking_uri in (None, mlflow.get_tracking_uri()):
            self._active_run_id = str(active.info.run_id)

    def _find_or_create_run(self, run: TrackedRun) -> str:
        client = self.client
        if self._active_run_id is not None:
            self._tag_run(self._active_run_id, run)
            return self._active_run_id
        experiment_id = self._experiment_id()
        key = run_key(run.run_id)  # hex: nothing to escape in the search string
        found = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN_KEY}` = '{key}'", max_results=1)
        if not found and self._experiment_name() is None:
            # No experiment named (a shell without MLFLOW_EXPERIMENT_NAME): the run's MLflow run
            # wherever training put it, rather than a second one in the Default experiment.
            found = self._search_every_experiment(f"tags.`{TAG_RUN_KEY}` = '{key}'")
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
        tags += [RunTag(TAG_DIRECTORY, path_text(run.directory.absolute())), RunTag(TAG_VERSION, VERSION)]
        self.client.log_batch(mlflow_run_id, tags=tags)

    def _experiment_name(self) -> str | None:
        return self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")

    def _search_every_experiment(self, filter_string: str) -> list[Any]:
        """The first run matching ``filter_string`` in any experiment (a page of experiments a
        request, a bounded number of pages)."""
        client, token = self.client, None
        for _ in range(_MAX_EXPERIMENT_PAGES):
            page = client.search_experiments(max_results=_EXPERIMENTS_A_PAGE, page_token=token)
            ids = [str(e.experiment_id) for e in page]
            found = client.search_runs(ids, filter_string=filter_string, max_results=1) if ids else []
            token = page.token
            if found or not token:
                return list(found)
        return []

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self._experiment_name()
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
                warn_of_work(
                    f"config {key!r} is not logged as an MLflow param: {len(value)} characters, "
                    f"MLflow takes {_MAX_PARAM_LENGTH} (metadata.json has it)"
                )
            elif key not in logged:
                params.append(Param(key, value))
            elif logged[key] != value:
                warn_of_work(
                    f"config {key!r} is {value!r}, but the MLflow run logged {logged[key]!r} and params "
                    "do not change (metadata.json has the new value)"
                )
        for batch in _batches(params):
            for param, problem in self._each_logged(params=batch):
                warn_of_work(f"config {param.key!r} is not logged as an MLflow param: {problem} (metadata.json has it)")

    def _each_logged(
        self, *, params: Sequence[Any] = (), metrics: Sequence[Any] = (), tags: Sequence[Any] = ()
    ) -> Iterator[tuple[Any, str]]:
        """Logs the params, metrics and tags in one request (all or nothing on the server); when
        the server refuses it, each one alone, in that order, so that one it refuses (a name
        MLflow does not take) drops only itself: yields those, with the server's reason. A
        failure worth trying again (the server down) is raised: logged again later, a metric
        already logged is not logged twice (the server keeps one of identical points)."""
        client, run_id = self.client, self.mlflow_run_id
        problem = refused(lambda: client.log_batch(run_id, metrics=metrics, params=params, tags=tags))
        self.answered += 1
        if problem is None:
            return
        for kind, items in (("params", params), ("metrics", metrics), ("tags", tags)):
            for item in items:
                problem = refused(lambda: client.log_batch(run_id, **{kind: [item]}))  # noqa: B023
                self.answered += 1
                if problem:
                    yield item, problem

    def _reported_step(self) -> int | None:
        assert self.mlflow_run_id is not None
        value = self.client.get_run(self.mlflow_run_id).data.tags.get(TAG_STEP)
        try:
            return int(value) if value is not None else None
        except ValueError:  # not ours to trust: report everything again
            return None

    def _report(self) -> None:
        """Reports every unreported checkpoint, oldest first: its files, then its metrics and
        tags. A failure worth trying again (the server down) is raised and leaves the step and
        those after it for later (files already uploaded are not uploaded again); what the
        server refuses is given up with a warning naming it, and the rest goes on."""
        from mlflow.entities import Metric, RunTag

        assert self.mlflow_run_id is not None
        for step in sorted(self._unreported):
            report = self._unreported[step]
            checkpoint = report.checkpoint
            if not report.uploaded:
                self._upload(report)
                report.uploaded = True
            timestamp = _milliseconds(checkpoint.metadata.get("timestamp"))
            metrics = [
                Metric(key, float(value), timestamp, step)
                for key, value in sorted(checkpoint.metrics.items())
                if ("metric", key) not in report.refused
            ]
            lineage = self._lineage(checkpoint)
            # ortckpt.step last: it says that every step up to it is reported (a resumed run reports those after it).
            names = [key for key in (TAG_CHECKPOINT, TAG_SHA256, TAG_STEP) if ("tag", key) not in report.refused]
            tags = [RunTag(key, lineage[key]) for key in names]
            for item, problem in self._each_logged(metrics=metrics, tags=tags):
                kind = "metric" if isinstance(item, Metric) else "tag"
                report.refused.add((kind, item.key))
                warn_of_work(
                    f"{checkpoint.directory}: step {step}'s {kind} {item.key!r} is not logged "
                    f"(MLflow refused it; not sent again): {problem}"
                )
            del self._unreported[step]
            if self.report:
                self._queue_report(checkpoint)

    def _queue_report(self, checkpoint: CommittedCheckpoint) -> None:
        previous, self._previous = self._previous, checkpoint
        self._pending_reports = [f for f in self._pending_reports if not f.done()]
        self._pending_reports.append(self._reports.submit(lambda: self._upload_report(checkpoint, previous)))

    def _upload_report(self, checkpoint: CommittedCheckpoint, previous: CommittedCheckpoint | None) -> None:
        """Makes the step's report (against ``previous`` if it still loads) and uploads it; any
        failure is a warning: the report is a view of the step, whose files and metrics are
        reported either way."""
        from ...report import write_report

        assert self.mlflow_run_id is not None
        destination = f"checkpoints/{steps.step_directory_name(checkpoint.step)}"
        try:
            state = checkpoint.load()
            against, sides = None, [checkpoint]
            if previous is not None:
                with contextlib.suppress(Exception):  # (deleted by retention meanwhile: a report of this step alone)
                    against, sides = previous.load(), [checkpoint, previous]
            with safe_io.scratch_directory() as scratch:
                write_report(
                    state,
                    scratch / REPORT_NAME,
                    against=against,
                    name=path_text(checkpoint.directory),
                    against_name=None if previous is None else path_text(previous.directory),
                    files=[_files_of(side) for side in sides],
                )
                problem = refused(
                    lambda: self.client.log_artifact(self.mlflow_run_id, str(scratch / REPORT_NAME), destination)
                )
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        finally:
            self.answered += 1
        if problem:
            warn_of_work(f"{checkpoint.directory}: step {checkpoint.step}'s report is not uploaded: {problem}")

    def _upload(self, report: Unreported) -> None:
        """The step's metadata.json (its files too, with log_artifacts). Refused by the server
        (a proxy's 413 for a body over its limit), they are given up with a warning: sent again,
        they would be refused again, and every later step would wait behind them. So are they
        after failing 3 times for a reason that may pass while the server answers the rest (a
        proxy that resets the connection of a body too large for it, an artifact store that is
        down): only a server that is down holds the later steps back for longer."""
        assert self.mlflow_run_id is not None
        checkpoint = report.checkpoint
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
                problem: str | None = str(e)
            else:
                try:
                    problem = refused(lambda: self.client.log_artifacts(self.mlflow_run_id, str(pinned), destination))
                    self.answered += 1
                except Exception as e:
                    report.upload_failures += 1
                    if report.upload_failures < _UPLOAD_TRIES or not self._answers():
                        raise
                    problem = f"{report.upload_failures} tries failed, the server answering otherwise: {e}"
        if problem:
            warn_of_work(
                f"{checkpoint.directory}: step {checkpoint.step}'s files are not uploaded: {problem} "
                "(given up: its metrics are logged)"
            )

    def _answers(self) -> bool:
        """Whether the server answers a request other than an upload."""
        try:
            self.client.get_run(self.mlflow_run_id)
        except Exception:
            return False
        return True

    @staticmethod
    def _lineage(checkpoint: CommittedCheckpoint) -> dict[str, str]:
        files = checkpoint.metadata.get("files", {})
        recorded = {name: entry.get("sha256") for name, entry in files.items()}
        digests = json.dumps(recorded, sort_keys=True)
        # Without digest="sha256" (no file's SHA-256 recorded), or with many shards: metadata.json's
        # own digest, which pins every file's size and xxh3 (or SHA-256).
        if None in recorded.values() or len(digests) > _MAX_TAG_LENGTH:
            try:
                digest: str | None = safe_io.sha256_of(checkpoint.directory / steps.METADATA_NAME)[1]
            except OSError:  # the step deleted (by retention) before its report: a tag without it, not none
                digest = None
            digests = json.dumps({steps.METADATA_NAME: digest})
        return {
            TAG_RUN_ID: str(checkpoint.metadata.get("run_id"))[:_MAX_TAG_LENGTH],
            TAG_STEP: str(checkpoint.step),
            TAG_CHECKPOINT: path_text(checkpoint.directory.absolute())[:_MAX_TAG_LENGTH],
            TAG_SHA256: digests,
            TAG_VERSION: VERSION,
        }


def _files_of(checkpoint: CommittedCheckpoint) -> dict[str, int | None]:
    """A step's files as its metadata.json records them, named inside its directory."""
    files = checkpoint.metadata.get("files", {})
    return {f"{checkpoint.directory}/{name}": entry.get("bytes") for name, entry in sorted(files.items())}


def flatten(config: Mapping[str, Any]) -> dict[str, str]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": "0.1"}``: nested keys joined by dots, the
    values as text (lists and other JSON as JSON). Two keys that join to one name
    (``{"a": {"b": 1}, "a.b": 2}``): the first in the config's order is that param, the other
    is not logged, with a warning naming both (each checkpoint's metadata.json has both)."""
    flat: dict[str, str] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for path, value in _leaves(config, ()):
        name = ".".join(str(key) for key in path)
        text = _text(value)
        if name in flat:
            warn_of_work(
                f"config{_spelled(paths[name])} and config{_spelled(path)} are both the MLflow param {name!r}: "
                f"the first is logged ({flat[name]!r}), the second is not ({text!r}; metadata.json has both)"
            )
            continue
        flat[name] = text
        paths[name] = path
    return flat


def _leaves(config: Mapping[Any, Any], path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):  # keys json cannot sort (1 and "a"), a cycle: as Python shows it
        return repr(value)


def _spelled(path: tuple[Any, ...]) -> str:
    """A config key as the user wrote it: ``['a']['b']``."""
    return "".join(f"[{key!r}]" for key in path)


def _batches(params: Sequence[Any]) -> Iterator[list[Any]]:
    """Params in requests that MLflow takes (100 at most) and a proxy in front of it too."""
    batch: list[Any] = []
    size = 0
    for param in params:
        cost = len(json.dumps(param.key)) + len(json.dumps(param.value))  # as escaped in the request
        if batch and (len(batch) == _MAX_PARAMS_PER_BATCH or size + cost > _MAX_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(param)
        size += cost
    if batch:
        yield batch


def path_text(path: os.PathLike[str] | str) -> str:
    """A path as text any server takes: a name's bytes that are not UTF-8 (which Python holds as
    surrogates, refused by every JSON and protobuf encoder) written out as ``\\xff``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def run_key(run_id: str) -> str:
    return hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()


def _milliseconds(timestamp: Any) -> int:
    """metadata.json's ISO timestamp in ms since the epoch (now, when it is missing or bad)."""
    try:
        value = datetime.datetime.fromisoformat(str(timestamp)).timestamp() * 1000
    except ValueError:
        return int(time.time() * 1000)
    return int(value) if math.isfinite(value) else int(time.time() * 1000)
