"""What every part of :class:`~ortckpt.CheckpointManager` stands on: the state a manager holds, its
steps as listed, and its end. :mod:`.saving` writes and keeps steps over it; :mod:`.checkpoint_manager`
opens the run and restores."""

from __future__ import annotations

import datetime
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self

from .. import steps
from ..stepstore import StepStore
from .common import Staging, UnwaitedSave, as_step
from .info import CheckpointInfo
from .preemption import Preemption
from .retention import RetentionPolicy
from .tracking import Reporter
from .validation import Forward

if TYPE_CHECKING:
    from ..distributed import Communicator


class ManagerBase:
    """A run opened by :class:`~ortckpt.CheckpointManager`: what a manager holds (set by its
    constructor), what is there (listing, best, what is due), and its end (wait, close)."""

    # --- what a manager holds (set by CheckpointManager.__init__) -----------------------------
    policy: RetentionPolicy
    save_every: int | datetime.timedelta | None
    async_save: bool
    _fork_save: bool  # async_save="fork"
    read_only: bool
    durable: bool
    verify_after_save: bool | Literal["process"]
    digest: Literal["sha256"] | None
    verify_timeout: float | None
    config: dict[str, Any] | None
    external_data_threshold: int
    validate: Forward | None
    compress_kept: bool
    progress: bool
    storage_options: dict[str, Any]
    artifacts: dict[str, Path]  # role -> the ONNX file recorded with every step
    device: str | None
    comm: Communicator | None
    store: StepStore
    directory: Path | str  # the run: its directory, or its prefix's URL
    share_unchanged: bool
    url: str
    run_id: str
    _where: str  # the run, in messages
    _lock: threading.Lock  # guards _checkpoints: the background thread commits into it
    _checkpoints: dict[int, CheckpointInfo]
    _executor: ThreadPoolExecutor | None
    _pending: Future[None] | None
    _unwaited: UnwaitedSave
    _report_lost: weakref.finalize[Any, Any]
    _staging: Staging
    _last_save: float
    _closed: bool
    _reporter: Reporter | None
    _preemption: Preemption
    _preemption_saved: bool

    @property
    def _is_root(self) -> bool:
        """Whether this process commits and deletes checkpoints (rank 0, or the only one)."""
        return self.comm is None or self.comm.rank == 0

    # --- what is there -----------------------------------------------------------------

    def reload(self) -> None:
        """Reads the steps again: what ``all()``, ``latest()`` and ``restore()`` see. A
        read-only manager does this on every query; a writer knows what it wrote. A step whose
        metadata.json is damaged is skipped with a warning (and kept, for a person to look at);
        one without any is not this manager's (e.g. a save_sharded step) and is ignored."""
        scan = self.store.scan(steps.METADATA_NAME)
        for number, problem in sorted(scan.damaged.items()):
            warnings.warn(
                f"{self._where}: step {number} skipped, its metadata is damaged: {problem}",
                RuntimeWarning,
                stacklevel=3,
            )
        found = {number: CheckpointInfo.of(self.store, step) for number, step in scan.steps.items()}
        with self._lock:
            self._checkpoints = found

    def _refresh(self) -> None:
        if self.read_only:
            self.reload()

    def all(self) -> list[CheckpointInfo]:
        """Every complete checkpoint, oldest step first."""
        self._refresh()
        with self._lock:
            return [self._checkpoints[s] for s in sorted(self._checkpoints)]

    def all_steps(self) -> list[int]:
        return [c.step for c in self.all()]

    def latest(self) -> CheckpointInfo | None:
        """The complete checkpoint with the highest step, or None."""
        self._refresh()
        with self._lock:
            return self._checkpoints[max(self._checkpoints)] if self._checkpoints else None

    def latest_step(self) -> int | None:
        latest = self.latest()
        return latest.step if latest else None

    def best(self, metric: str | None = None, mode: Literal["min", "max"] | None = None) -> CheckpointInfo | None:
        """The checkpoint with the best ``metric`` (default: ``keep_best``'s); ties go to the
        newer step; checkpoints without the metric, or with NaN, are not ranked."""
        if metric is None:
            if self.policy.keep_best is None:
                raise ValueError("best() needs a metric name and mode, or keep_best set on the manager")
            metric, mode = self.policy.keep_best[0], self.policy.keep_best[1]
        if mode not in ("min", "max"):
            raise ValueError(f"mode is 'min' or 'max', got {mode!r}")
        checkpoints = self.all()
        ranked = RetentionPolicy(keep_best=(metric, mode, 1)).ranked([(c.step, c.metrics) for c in checkpoints])
        return {c.step: c for c in checkpoints}[ranked[0]] if ranked else None

    # --- saving --------------------------------------------------------------------------

    @property
    def preempted(self) -> bool:
        """Whether a preemption signal (``preemption=``) came, or :meth:`preempt` was called:
        the loop should stop once :meth:`should_save`'s save is done. Ask it right after that
        save (inside the ``if``): a signal can land between a false ``should_save`` and the
        question, and the step the loop stops at would then not be saved."""
        return self._preemption.noticed

    def preempt(self) -> None:
        """Marks the run preempted, as a signal would (from any thread: a poller of the
        cloud's preemption notices, say); starts ``preemption_grace``'s watchdog."""
        self._preemption.notice()

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a checkpoint by ``save_every`` (and newer than the
        latest); once preempted, True until the preemption save is made."""
        step = as_step(step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            return False
        if self.preempted and not self._preemption_saved:
            return True
        if self.save_every is None:
            return True
        if isinstance(self.save_every, datetime.timedelta):
            return time.monotonic() - self._last_save >= self.save_every.total_seconds()
        return step % self.save_every == 0

    def _read_step(self, step: int) -> CheckpointInfo:
        found = self.store.read(step, steps.METADATA_NAME)
        if found is None:
            raise FileNotFoundError(f"{self._where}: no checkpoint of step {step}")
        return CheckpointInfo.of(self.store, found)

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ValueError(f"{self._where}: this manager is read-only (read_only=True): it cannot {what}")
        if self._closed:
            raise ValueError(f"{self._where}: this manager is closed")

    def wait(self) -> None:
        """Waits for the pending async save; raises its error, if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._unwaited.clear()
            pending.result()

    def close(self) -> None:
        """Waits for the pending save, stops the background thread and gives up the directory
        (another writer may then open it); puts back the signal handlers ``preemption``
        replaced. Queries and restores still work after."""
        try:
            self.wait()
        finally:
            self._preemption.restore()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._staging = Staging()  # its arrays freed
            self.store.close()
            if self._reporter is not None and not self._closed:
                self._reporter.close()
            self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _info(self, step: int | None) -> CheckpointInfo:
        self.wait()
        self._refresh()
        with self._lock:
            if step is None:
                if not self._checkpoints:
                    raise FileNotFoundError(f"{self._where}: no checkpoint to restore")
                step = max(self._checkpoints)
            step = as_step(step)
            info = self._checkpoints.get(step)
        if info is None:
            raise FileNotFoundError(f"{self._where}: no checkpoint of step {step}")
        return info

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        return f"CheckpointManager({self._where!r}, steps={self.all_steps()}{mode})"
