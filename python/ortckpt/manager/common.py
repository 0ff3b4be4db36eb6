"""What the two checkpoint managers (a directory's, an object store prefix's) share:
:class:`ManagerBase` (queries, the checks and snapshot before a save, async saves, restore's
retries), the copy an async save writes from, the report of an async save nobody waited
for, and how a step number is checked."""

from __future__ import annotations

import abc
import datetime
import operator
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from ..checkpoint_state import CheckpointState
from ..dtypes import PackedBits
from ..errors import CheckpointError, CheckpointExistsError
from . import metadata as _metadata
from .retention import RetentionPolicy


class ManagerBase(abc.ABC):
    """A manager's steps as it last read them (``_checkpoints``: step -> info, each with
    ``step``, ``metrics`` and ``metadata``) and what is done with them the same way wherever
    they are stored. A subclass reads them (``reload``), writes one (``_write_and_commit``)
    and deletes one (``delete``)."""

    def _start(
        self,
        where: str,
        policy: RetentionPolicy,
        *,
        save_every: int | datetime.timedelta | None,
        async_save: bool,
        read_only: bool,
        durable: bool,
        verify_after_save: bool | Literal["process"],
        run_id: str | None,
        config: Mapping[str, Any] | None,
        external_data_threshold: int,
        comm: Any,
    ) -> None:
        """Checks and keeps the arguments both managers take; ``run_id`` is adopted by
        :meth:`_adopt_run_id`, once the steps are read."""
        if isinstance(save_every, int) and save_every < 1:
            raise ValueError(f"save_every must be at least 1, got {save_every}")
        if verify_after_save not in (False, True, "process"):
            raise ValueError(f"verify_after_save is False, True or 'process', got {verify_after_save!r}")
        if run_id is not None and not isinstance(run_id, str):
            raise TypeError(f"run_id is a str, got {type(run_id).__name__}")
        self._where = where
        self.policy = policy
        self.save_every = save_every
        self.async_save = async_save
        self.read_only = read_only
        self.durable = durable
        self.verify_after_save = verify_after_save
        self.config = dict(config or {})
        self.external_data_threshold = external_data_threshold
        self.comm = None
        if comm is not None:
            from ..distributed import communicator

            self.comm = communicator(comm)
        self._lock = threading.Lock()  # guards _checkpoints: the background thread commits into it
        self._checkpoints: dict[int, Any] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        # The pending save as the finalizer sees it, to report a failure nobody waited for.
        self._unwaited = UnwaitedSave(where)
        self._report_lost = weakref.finalize(self, self._unwaited.report)
        # Async saves copy the state into these arrays, reused from one save to the next
        # (free again once the previous save is done: save() waits for it first).
        self._staging = Staging()
        self._last_save = time.monotonic()
        self._closed = False

    def _adopt_run_id(self, run_id: str | None) -> None:
        """The run's id: the one given, else the latest checkpoint's (a resumed run keeps its
        id), else a new one; with ``comm``, rank 0's on every rank."""
        latest = self.latest()
        self.run_id = run_id or (latest.metadata.get("run_id") if latest else None) or uuid.uuid4().hex
        if self.comm is not None:
            self.run_id = self.comm.broadcast(self.run_id)

    @property
    def _is_root(self) -> bool:
        """Whether this process commits and deletes checkpoints (rank 0, or the only one)."""
        return self.comm is None or self.comm.rank == 0

    @abc.abstractmethod
    def reload(self) -> None:
        """Reads the steps again from where they are stored."""

    @abc.abstractmethod
    def delete(self, step: int) -> None:
        """Deletes the checkpoint of ``step``."""

    # --- what is there -----------------------------------------------------------------

    def _refresh(self) -> None:
        if self.read_only:
            self.reload()

    def all(self) -> list[Any]:
        """Every complete checkpoint, oldest step first."""
        self._refresh()
        with self._lock:
            return [self._checkpoints[s] for s in sorted(self._checkpoints)]

    def all_steps(self) -> list[int]:
        return [c.step for c in self.all()]

    def latest(self) -> Any:
        """The complete checkpoint with the highest step, or None."""
        self._refresh()
        with self._lock:
            return self._checkpoints[max(self._checkpoints)] if self._checkpoints else None

    def latest_step(self) -> int | None:
        latest = self.latest()
        return latest.step if latest else None

    def best(self, metric: str | None = None, mode: Literal["min", "max"] | None = None) -> Any:
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

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a checkpoint by ``save_every`` (and newer than the latest)."""
        step = as_step(step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            return False
        if self.save_every is None:
            return True
        if isinstance(self.save_every, datetime.timedelta):
            return time.monotonic() - self._last_save >= self.save_every.total_seconds()
        return step % self.save_every == 0

    def _prepare_save(
        self,
        state: CheckpointState,
        step: int,
        *,
        epoch: int | None,
        metrics: Mapping[str, float] | None,
        metadata: Mapping[str, Any] | None,
        dataset_fingerprint: str | None,
        rng_state: Mapping[str, Any] | None,
        include_optimizer_state: bool,
        run_id: str,
        config: Mapping[str, Any],
    ) -> tuple[int, dict[str, Any], CheckpointState]:
        """Checks a save's arguments and takes the snapshot to write (a copy, for an async
        save), all in the caller's thread: (step, metadata without its files, snapshot)."""
        self._check_writable("save")
        if not isinstance(state, CheckpointState):
            raise TypeError(f"expected a CheckpointState, got {type(state).__name__}")
        step = as_step(step)
        epoch = None if epoch is None else as_integer("epoch", epoch)
        self.wait()  # one save at a time; raises the previous async save's error
        latest = self.latest_step()
        if step in self.all_steps():
            raise CheckpointExistsError(f"{self._where}: a checkpoint of step {step} exists")
        if latest is not None and step < latest:
            raise ValueError(
                f"{self._where}: step {step} is older than the latest checkpoint ({latest}); "
                "delete the newer ones first (manager.delete(step)) to go back"
            )
        properties: dict[str, Any] = {"step": step}
        if epoch is not None:
            properties["epoch"] = epoch
        meta = _metadata.build(
            step=step,
            epoch=epoch,
            run_id=run_id,
            metrics=metrics,
            config=config,
            user=metadata,
            dataset_fingerprint=dataset_fingerprint,
            rng_state=rng_state,
            include_optimizer_state=include_optimizer_state,
        )
        _metadata.check_serializable(meta)
        # Every value is checked (and strings encoded) here, in the caller's thread.
        snapshot = state._snapshot(
            copy_value=self._staging.copy if self.async_save else None,
            include_optimizer_state=include_optimizer_state,
            properties=properties,
        )
        self._last_save = time.monotonic()
        return step, meta, snapshot

    def _write(self, write: Callable[..., None], step: int, *args: Any) -> None:
        """Runs ``write(*args)``: now, or in the background thread with ``async_save``."""
        if not self.async_save:
            write(*args)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ortckpt-save")
        self._pending = self._executor.submit(write, *args)
        self._unwaited.watch(self._pending, step)

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ValueError(f"{self._where}: this manager is read-only (read_only=True): it cannot {what}")
        if self._closed:
            raise ValueError(f"{self._where}: this manager is closed")

    def _apply_retention(self) -> None:
        """Deletes what the policy no longer keeps. The new step is committed by then, so a
        deletion that fails is a warning, not a failed save; the next save tries again."""
        with self._lock:
            keep = self.policy.steps_to_keep([(c.step, c.metrics) for c in self._checkpoints.values()])
            doomed = [s for s in self._checkpoints if s not in keep]
        for step in doomed:
            try:
                self.delete(step)
            except OSError as e:
                warnings.warn(
                    f"{self._where}: could not delete the checkpoint of step {step} (kept, to be "
                    f"retried at the next save): {e}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def wait(self) -> None:
        """Waits for the pending async save; raises its error, if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._unwaited.clear()
            pending.result()

    def _stop_saving(self) -> None:
        """close()'s part common to both: waits for the pending save, stops the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._staging = Staging()  # its arrays freed

    # --- restoring -----------------------------------------------------------------------

    def _retrying(self, step: int | None, load: Any) -> Any:
        attempts = 10 if self.read_only else 1
        for attempt in range(attempts):
            info = self._info(step)
            try:
                return load(info)
            except (OSError, CheckpointError):
                # Deleted while we loaded it (a missing file, or on object storage a checkpoint
                # whose data object went between two requests)? Then look again: a writer keeps
                # the newest. Any other failure is raised.
                self.reload()
                with self._lock:
                    gone = info.step not in self._checkpoints
                if not gone or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _info(self, step: int | None) -> Any:
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


class Staging:
    """Where an async save's copy of the state goes: one array per tensor, reused from one
    save to the next while its shape and dtype match, so a copy is a plain memcpy into
    memory already mapped (fresh memory costs a page fault per 4 KiB)."""

    def __init__(self) -> None:
        self.arrays: dict[tuple[str, ...], np.ndarray] = {}

    def copy(self, key: tuple[str, ...], value: Any) -> Any:
        if isinstance(value, PackedBits) or value.dtype == object:  # rare types: a fresh copy
            return value.copy()
        target = self.arrays.get(key)
        if target is None or target.shape != value.shape or target.dtype != value.dtype:
            target = self.arrays[key] = np.empty(value.shape, value.dtype)
        np.copyto(target, value)
        return target


def as_step(step: Any) -> int:
    """A step as an int: ints and NumPy integers (not bools) from 0 up."""
    step = as_integer("step", step)
    if step < 0:
        raise ValueError(f"step must be an int >= 0, got {step}")
    return step


def as_integer(what: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None


class UnwaitedSave:
    """The async save nobody has waited for yet: if it failed and the manager is collected or
    the program ends first, its failure is reported (a warning on stderr) instead of lost."""

    def __init__(self, where: object) -> None:
        self.where = where
        self.future: Future[None] | None = None
        self.step = 0

    def watch(self, future: Future[None], step: int) -> None:
        self.future, self.step = future, step

    def clear(self) -> None:
        self.future = None

    def report(self) -> None:
        future, self.future = self.future, None
        if future is None:
            return
        if not future.done():  # collected mid-save (only from a finalizer thread): report when done
            future.add_done_callback(self._warn)
            return
        self._warn(future)

    def _warn(self, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            warnings.warn(
                f"{self.where}: the async save of step {self.step} failed and was never waited for "
                f"(wait() or close()): that checkpoint was lost: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=1,
            )
