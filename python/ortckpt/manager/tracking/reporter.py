"""The manager's side of a tracker: :func:`tracker_for` (what ``track=`` names), and
:class:`Reporter`, which runs the tracker's calls on a Lane of their own, each waited
for at most the tracker's deadline, its failures turned into warnings."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any

from .base import CommittedCheckpoint, Lane, TrackedRun, Tracker, tracker_timeout, warn_of_work
from .mlflow_tracker import MlflowTracker


def tracker_for(track: str | Tracker) -> Tracker:
    """The tracker ``track=`` names: ``"mlflow"``, or a :class:`Tracker` object as it is."""
    if isinstance(track, str):
        if track == "mlflow":
            return MlflowTracker()
        raise ValueError(f"track is 'mlflow' or a Tracker object, got {track!r}")
    if not isinstance(track, Tracker):
        raise TypeError(f"track is 'mlflow' or a Tracker object, got {type(track).__name__}")
    return track


class Reporter:
    """The manager's side of a tracker: runs its calls on a :class:`Lane`, waits for each at
    most the tracker's deadline, starts it again at the next commit if starting failed, and
    turns its failures into warnings (a save is never failed by its report). Its methods are
    called by one thread at a time (the manager's saves are one after another)."""

    def __init__(self, tracker: Tracker, run: TrackedRun, committed: Callable[[], Sequence[CommittedCheckpoint]]):
        self.tracker = tracker
        self.run = run
        self.timeout = tracker_timeout(tracker)
        self._committed = committed  # the manager's committed checkpoints, oldest first
        self._started = False  # set on the lane
        self._lane = Lane(f"ortckpt-tracker-{type(tracker).__name__}")
        self._late: list[tuple[str, Future[Any]]] = []  # calls that ran past their deadline
        self.start()

    def start(self) -> None:
        prepare = getattr(self.tracker, "prepare", None)
        if callable(prepare):
            try:
                prepare(self.run)
            except Exception as e:  # what it prepares is a nicety: the tracker starts regardless
                self._warn_failed("prepare", e)
        committed = list(self._committed())
        self._call("start", lambda: self._start(committed))

    def committed(self, checkpoint: CommittedCheckpoint) -> None:
        # The committed checkpoints are listed here, in the manager's thread, for a start tried again.
        committed = [] if self._started else list(self._committed())
        what = f"report step {checkpoint.step}" if self._started else "start"
        self._call(what, lambda: self._report(checkpoint, committed))

    def register(self, name: str, model: Any, checkpoint: CommittedCheckpoint) -> Any:
        """Registering is what the caller asked for: waited for, however long; its errors raised."""
        committed = list(self._committed())

        def register() -> Any:
            self._start(committed)
            return self.tracker.register_model(name, model, checkpoint)

        return self._lane.submit(register).result()

    def close(self) -> None:
        """Waits for the tracker's calls and its close while they get on: until one of them
        takes longer than the deadline (a server that is down, a call that stalls). Past it,
        they go on in the background while the process lives; what they have not reported when
        it exits is reported when the run resumes."""
        self._warn_late()
        future = self._lane.submit(self._close)
        self._wait("close", future, while_progressing=True)

    def _close(self) -> None:
        if self._started:
            self.tracker.close()

    def _start(self, committed: Sequence[CommittedCheckpoint]) -> None:
        if not self._started:
            self.tracker.start(self.run, committed)
            self._started = True

    def _report(self, checkpoint: CommittedCheckpoint, committed: Sequence[CommittedCheckpoint]) -> None:
        if self._started:
            self.tracker.log_checkpoint(checkpoint)
        else:
            self._start(committed)  # reports every committed step, this one included

    def _call(self, what: str, call: Callable[[], None]) -> None:
        """Runs ``call`` on the lane and waits for it at most the deadline; while an earlier
        call is past its deadline, not at all (a dead server costs the deadline once, not at
        every save)."""
        behind = self._warn_late()
        future = self._lane.submit(call)
        if behind:
            self._late.append((what, future))
        else:
            self._wait(what, future)

    def _wait(self, what: str, future: Future[Any], while_progressing: bool = False) -> None:
        """Waits for ``future`` at most the deadline (with ``while_progressing``, as long as
        the lane completes a call, or the tracker's server answers a request, within each
        deadline); warns of a failure or of the wait's end."""
        while True:
            progress = self._progress()
            # (threading waits at most TIMEOUT_MAX, some 292 years: a longer deadline is that)
            wait_for([future], timeout=min(self.timeout, threading.TIMEOUT_MAX))
            if future.done() or not while_progressing or self._progress() == progress:
                break
        if not future.done():
            self._late.append((what, future))
            then = (
                "it goes on in the background while the process lives; what it has not reported when the "
                "process exits is reported when the run resumes"
                if what == "close"
                else "it goes on in the background, and what it misses is reported later, or when the run resumes"
            )
            warn_of_work(
                f"{self.run.directory}: the tracker ({type(self.tracker).__name__}) did not {what} within its "
                f"deadline of {self.timeout:g} s (its timeout): {then}",
                stacklevel=4,
            )
        elif (error := future.exception()) is not None:
            self._warn_failed(what, error)

    def _progress(self) -> int:
        """Calls completed on the lane, and requests the tracker's server answered (its count
        ``answered``, if it keeps one)."""
        answered = getattr(self.tracker, "answered", 0)
        return self._lane.completed + (answered if isinstance(answered, int) else 0)

    def _warn_late(self) -> bool:
        """Warns of the late calls that have failed since; whether one is still running."""
        done = [(what, future) for what, future in self._late if future.done()]
        self._late = [(what, future) for what, future in self._late if not future.done()]
        for what, future in done:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                self._warn_failed(what, error)
        return bool(self._late)

    def _warn_failed(self, what: str, error: BaseException) -> None:
        then = ", to be retried at the next save" if what == "start" or what.startswith("report") else ""
        warn_of_work(
            f"{self.run.directory}: the tracker ({type(self.tracker).__name__}) could not {what}{then}: "
            f"{type(error).__name__}: {error}",
            stacklevel=5,
        )
