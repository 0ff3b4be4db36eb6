"""What a tracker and the manager share: the :class:`Tracker` interface, what a tracker sees of
a run and a checkpoint, the tags, the deadline, the warnings, and the :class:`Lane` each
tracker's calls run on."""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ... import arguments


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


# How long the manager waits for a tracker's call (start, each report, close) unless the tracker
# says otherwise (its ``timeout``): a report to a server nearby takes a tenth of a second.
DEFAULT_TIMEOUT = 5.0


@runtime_checkable
class Tracker(Protocol):
    """What the manager calls. ``start`` comes first, with the checkpoints already committed
    (a tracker reports those it has not recorded yet); ``log_checkpoint`` after each commit;
    ``register_model`` from :meth:`CheckpointManager.register_best`; ``close`` from the
    manager's ``close``. Errors are the tracker's to raise: the manager turns them into
    warnings (a failed report never fails a save).

    The calls run in order on a thread of the manager's own, one at a time. The manager waits
    for ``start``, each ``log_checkpoint`` and ``close`` at most the tracker's ``timeout``
    attribute in seconds, when it has one (:data:`DEFAULT_TIMEOUT` otherwise): past it, a
    warning, and the call goes on in the background while training goes on (the calls after it
    wait their turn; the manager does not wait for them again until it has caught up).
    ``close`` waits for the calls before it and its own while each ends within the deadline
    (or, for a tracker with a count ``answered`` of the requests its server has answered, while
    that count grows within each deadline: one call may make many requests);
    past it, they go on while the process lives (a tracker reports what it missed when the run
    resumes). ``register_model`` is waited for, however long.
    A tracker with a method ``prepare(run)`` has it called first, in the manager's thread, for
    what is that thread's (MLflow's active run)."""

    def start(self, run: TrackedRun, committed: Sequence[CommittedCheckpoint]) -> None: ...

    def log_checkpoint(self, checkpoint: CommittedCheckpoint) -> None: ...

    def register_model(self, name: str, model: Any, checkpoint: CommittedCheckpoint) -> Any: ...

    def close(self) -> None: ...


def tracker_timeout(tracker: Any) -> float:
    """A tracker's deadline: its ``timeout`` attribute, checked, else :data:`DEFAULT_TIMEOUT`."""
    return arguments.seconds(f"{type(tracker).__name__}.timeout", getattr(tracker, "timeout", DEFAULT_TIMEOUT), "track")


# Tag names, one place: tests and users query them.
TAG_RUN_ID = "ortckpt.run_id"
TAG_RUN_KEY = "ortckpt.run_key"  # the run id's SHA-256: what a resumed run searches by (any id, safely quoted)
TAG_DIRECTORY = "ortckpt.directory"
TAG_VERSION = "ortckpt.version"
TAG_STEP = "ortckpt.step"  # the newest step reported
TAG_CHECKPOINT = "ortckpt.checkpoint"  # its step directory
TAG_SHA256 = "ortckpt.sha256"  # its files' SHA-256s, a JSON object {file name: hex digest}

REPORT_NAME = "report.html"  # a step's HTML report, beside its metadata.json in the run's artifacts


def warn_of_work(message: str, stacklevel: int = 2) -> None:
    """A warning about reporting (a param or metric refused, an upload given up, a tracker late
    or failing). Under a warning filter of "error" it is logged instead: a report is never a
    reason to fail a save, nor one to fail the report it belongs to (which would then be tried
    again, and warned of again, at every save)."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    except Warning:
        logging.getLogger("ortckpt.manager.tracking").warning(message)  # (the package's name)


def refused(call: Callable[[], Any]) -> str | None:
    """Runs a call to the server; returns why when the server refused the request for good
    (:func:`refusal`), raises anything else: worth trying again later."""
    try:
        call()
    except Exception as e:
        problem = refusal(e)
        if problem is None:
            raise
        return problem
    return None


# Request Timeout and Too Many Requests: about the server's state, not the request: may pass later.
_TRANSIENT_CLIENT_ERRORS = frozenset({408, 429})


def refusal(error: BaseException) -> str | None:
    """Why the server refused a request for good: an HTTP 4xx but 408 and 429 (the request
    itself is wrong or too large: sent again, it is refused again); None for anything else
    (the server down, a timeout, 5xx: may pass later). MLflow raises an ``MlflowException``
    for its REST calls and a ``requests.HTTPError`` for an artifact upload."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):  # requests.HTTPError: the HTTP answer itself (a proxy's, perhaps)
        reason = f"HTTP {status} {getattr(response, 'reason', '')}".rstrip()
        request = getattr(response, "request", None)
        where = f" to {request.method} {request.url}" if request is not None else ""
        if status == 413:
            reason += " (a proxy in front of MLflow limits request bodies: nginx's client_max_body_size)"
        cause = f"the server answered {reason}{where}"
    elif callable(http_status := getattr(error, "get_http_status_code", None)):  # MlflowException
        status = http_status()
        code, message = str(getattr(error, "error_code", "")), str(getattr(error, "message", error))
        cause = message if message.startswith(code) else f"{code}: {message}"  # (a RestException's has it)
    else:
        return None
    if 400 <= status < 500 and status not in _TRANSIENT_CLIENT_ERRORS:
        return cause
    return None


@dataclass
class Unreported:
    """A committed checkpoint not reported yet, and what is done of it."""

    checkpoint: CommittedCheckpoint
    uploaded: bool = False
    upload_failures: int = 0  # for reasons that may pass
    refused: set[tuple[str, str]] = field(default_factory=set)  # ("metric" or "tag", key): given up


class Lane:
    """One thread that runs calls in order, for callers that wait for them only so long: a
    call past its caller's deadline goes on here while the caller moves on. The thread is
    a daemon, started when a call comes and gone when none is left: a call stuck on a server
    that does not answer holds neither the caller nor the interpreter's exit (the threads of a
    ThreadPoolExecutor are joined at exit)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._running = False
        self.completed = 0  # calls run to their end, for a caller to see whether they get on

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._calls.append((call, future))
            if not self._running:
                threading.Thread(target=self._run, name=self.name, daemon=True).start()
                self._running = True
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    self._running = False
                    return
                call, future = self._calls.popleft()
            try:
                result = call()
            except BaseException as e:  # the caller's to see, through its future
                future.set_exception(e)
            else:
                future.set_result(result)
            finally:
                self.completed += 1
