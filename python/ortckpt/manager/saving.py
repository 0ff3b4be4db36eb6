"""How a :class:`~ortckpt.CheckpointManager` saves: each save one step transaction of
:mod:`ortckpt.stepstore` (stage, write, verify, validate, commit), async or not, sharded with
``comm``; then retention (delete, compress the kept) and the sweep of leftovers."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _boundary, arguments, interrupts, safe_io, steps
from ..checkpoint_state import CheckpointState, adopt
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    name_file,
)
from ..stepstore import Attempt, Step
from . import artifacts as _artifacts
from . import child
from . import metadata as _metadata
from .base import ManagerBase
from .common import as_integer, as_step
from .info import CheckpointInfo
from .integrity import verify_step


class Saving(ManagerBase):
    """Saving, keeping and deleting steps (see the module's description)."""

    def save(
        self,
        state: CheckpointState,
        step: int,
        *,
        epoch: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        dataset_fingerprint: str | None = None,
        rng_state: Mapping[str, Any] | None = None,
        include_optimizer_state: bool = True,
        slices: Mapping[str, Any] | None = None,
    ) -> None:
        """Saves ``state`` as the checkpoint of ``step``.

        ``step`` (and ``epoch``, when given) also go into the checkpoint's properties, where
        ONNX Runtime sees them; both are ints (NumPy integers too). ``metrics`` (numbers; NaN
        and infinities round-trip) rank checkpoints for ``keep_best``; ``metadata`` is a mapping
        of JSON-able data of yours (keys str or int, two never the same once written as JSON's
        strings; floats come back as floats, NaN and infinities too); ``rng_state`` comes from
        :func:`ortckpt.capture_rng_state`. What metadata.json cannot hold is refused here,
        naming its key (:class:`~ortckpt.InvalidArgumentError`).
        With ``async_save``, returns once the state is copied; otherwise once it is committed.
        With ``comm``, ``state`` is this rank's part and ``slices`` (tensor name ->
        :class:`ortckpt.distributed.Slice`) say which part of a split parameter it holds.
        """
        if slices is not None and self.comm is None:
            raise ValueError("slices are for sharded saves: create the manager with comm=")
        details: dict[str, Any] = {
            "epoch": epoch,
            "metrics": metrics,
            "metadata": metadata,
            "dataset_fingerprint": dataset_fingerprint,
            "rng_state": rng_state,
            "include_optimizer_state": include_optimizer_state,
        }
        if self.preempted and self.comm is None:
            self._save_preempted(state, step, details)
            return
        # A Ctrl-C during a synchronous save: KeyboardInterrupt before the step's commit (nothing
        # committed), or after this returns (see ortckpt.interrupts): `hold` stays a local here.
        with interrupts.held(not self.async_save and self.comm is None and self.store.holds_interrupts) as hold:  # noqa: F841
            self._save(state, step, **details, slices=slices)

    def _save_preempted(self, state: CheckpointState, step: int, details: dict[str, Any]) -> None:
        """The preemption save: the pending async save first, then this one synchronously (its
        tracker report waited for, as every save's); another signal meanwhile is noted only."""
        self.wait()
        self._preemption.saving = True
        try:
            self._save(state, step, **details, slices=None, synchronous=True)
        finally:
            self._preemption.saving = False
        self._preemption_saved = True

    def _save(
        self,
        state: CheckpointState,
        step: int,
        epoch: int | None,
        metrics: Mapping[str, float] | None,
        metadata: Mapping[str, Any] | None,
        dataset_fingerprint: str | None,
        rng_state: Mapping[str, Any] | None,
        include_optimizer_state: bool,
        slices: Mapping[str, Any] | None,
        *,
        synchronous: bool = False,
    ) -> None:
        step, meta, snapshot = self._prepare_save(
            state,
            step,
            epoch=epoch,
            metrics=metrics,
            metadata=metadata,
            dataset_fingerprint=dataset_fingerprint,
            rng_state=rng_state,
            include_optimizer_state=include_optimizer_state,
            copy=self.async_save and not synchronous,
        )
        if self.comm is not None:
            assert isinstance(snapshot, CheckpointState)  # (no async save with comm: never forked)
            self._save_sharded(snapshot, step, meta, include_optimizer_state, slices)
            return
        if not self.async_save or synchronous:
            # (the caller's own arrays, in place: their pages may be watched for the next step)
            self._write_and_commit(snapshot, step, meta, include_optimizer_state, watch_writes=True)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ortckpt-save")
        self._pending = self._executor.submit(self._write_and_commit, snapshot, step, meta, include_optimizer_state)
        self._unwaited.watch(self._pending, step)

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
        copy: bool,
    ) -> tuple[int, dict[str, Any], CheckpointState | _ForkedStep]:
        """Checks a save's arguments and takes the snapshot to write (a copy, for an async
        save; a forked process's, see :meth:`_forked`), all in the caller's thread: (step,
        metadata without its files, snapshot)."""
        self._check_writable("save")
        state = adopt(state)  # (ONNX Runtime's own state, the one its Module trains, saves as well)
        if not isinstance(state, CheckpointState):
            raise TypeError(f"expected a CheckpointState, got {type(state).__name__}")
        step = as_step(step)
        epoch = None if epoch is None else as_integer("epoch", epoch)
        arguments.flag("include_optimizer_state", include_optimizer_state)
        for name, value in (("metrics", metrics), ("metadata", metadata), ("rng_state", rng_state)):
            arguments.mapping(name, value)
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
            run_id=self.run_id,
            metrics=metrics,
            config=self.config,
            user=metadata,
            dataset_fingerprint=dataset_fingerprint,
            rng_state=rng_state,
            include_optimizer_state=include_optimizer_state,
        )
        if self.device is not None:
            meta.update(_artifacts.runtime(self.device))
        _metadata.check_serializable(meta, f"{self._step_folder(step)}/{steps.METADATA_NAME}")
        # The state itself (ONNX Runtime's included) carries the step and epoch of its latest save,
        # not a restored checkpoint's: a plain save_checkpoint after this one writes them.
        with self._naming_step(step):
            for name, value in properties.items():
                state.properties[name] = value
        if copy and include_optimizer_state:
            forked = self._forked(state, step)
            if forked is not None:
                self._last_save = time.monotonic()
                return step, meta, forked
        # Every value is checked (and strings encoded) here, in the caller's thread.
        with self._naming_step(step):
            snapshot = state.snapshot(
                copy_value=self._staging.copy if copy else None,
                include_optimizer_state=include_optimizer_state,
                properties=properties,
            )
            if copy:  # (its values are copies by now: views only) refused here, not in the background
                snapshot.core_state(include_optimizer_state)
        self._last_save = time.monotonic()
        return step, meta, snapshot

    def _forked(self, state: CheckpointState, step: int) -> _ForkedStep | None:
        """With ``async_save="fork"``, a full save of a state ONNX Runtime trains, to a
        directory: the step's attempt begun and a child forked that has ONNX Runtime save the
        state, as it is now, into its staged checkpoint (:mod:`ortckpt.forked_save`); None where
        that cannot be (the thread's copy then)."""
        ort_state = state.bound_ort_state
        if not self._fork_save or ort_state is None or state.is_nominal:
            return None
        if self.external_data_threshold != _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD or self.progress:
            return None  # (ONNX Runtime's saver has its own layout, and no progress to report)
        from .. import forked_save

        if not forked_save.available(ort_state):
            return None
        attempt = self.store.begin(step)
        try:
            target = self.store.staged_checkpoint(attempt, steps.CHECKPOINT_NAME)
            if target is None:
                self.store.abandon(attempt)
                return None
            values = sum(int(getattr(p.data, "nbytes", 0)) for _, p in state.parameters)  # (moments: ~2x more)
            shown = f"{self._step_folder(step)}/{steps.CHECKPOINT_NAME}"
            child = forked_save.start(ort_state, target, checkpoint_bytes=3 * values, shown=shown)
        except forked_save.ForkFailed:
            self.store.abandon(attempt)
            return None  # (no fork to be had now, out of processes or memory: the thread's copy)
        except BaseException:
            self.store.abandon(attempt)
            raise
        return _ForkedStep(attempt, child)

    def _write_and_commit(
        self,
        state: CheckpointState | _ForkedStep,
        step: int,
        meta: dict[str, Any],
        include_optimizer_state: bool,
        *,
        watch_writes: bool = False,
    ) -> None:
        """The step transaction of one save: stage, write, verify, metadata, commit; then
        retention and the tracker's report. A forked save's checkpoint is the child's (waited for
        with its deadline, then sealed); any other is written here. ``watch_writes``: ``state``
        holds the caller's own arrays (a synchronous save), whose pages the store may watch."""
        if isinstance(state, _ForkedStep):
            attempt = state.attempt
            child = state.child

            def write() -> None:
                child.finish(durable=self.durable)
                self.store.record_checkpoint(attempt, steps.CHECKPOINT_NAME)

        else:
            with self._naming_step(step):
                core = state.core_state(include_optimizer_state)
            attempt = self.store.begin(step)
            previous = self.latest() if self.share_unchanged else None

            def write() -> None:
                self.store.write_checkpoint(
                    attempt,
                    steps.CHECKPOINT_NAME,
                    core,
                    external_data_threshold=self.external_data_threshold,
                    durable=self.durable,
                    progress=self.progress,
                    share_with=None if previous is None else previous.step_record,
                    watch_writes=watch_writes and self.share_unchanged,
                )

        try:
            write()
            for role, source in self.artifacts.items():
                self.store.store_graph(attempt, role, source, durable=self.durable)
            committed = self._commit(attempt, meta)
        except OSError as e:
            self.store.abandon(attempt)
            raise self._named_by_step(e, attempt) from None
        except BaseException:
            self.store.abandon(attempt)
            raise
        self._committed(committed)

    def _named_by_step(self, e: OSError, attempt: Attempt) -> OSError:
        """An OS error (a full disk) met writing a step's staged files, naming the file by the
        name it has in the step (its staging folder, a name of ours, is gone with the attempt), and
        saying that nothing changed."""
        if not isinstance(attempt.folder, (str, os.PathLike)):  # (an object store's: its errors name objects)
            return e
        staged = os.fspath(attempt.folder)
        if e.errno is None or not str(e.filename or "").startswith(staged):
            return e
        inside = str(e.filename)[len(staged) :].lstrip("/")
        step_folder = self._step_folder(attempt.step)
        return OSError(
            e.errno,
            f"{e.strerror} (saving step {attempt.step}: nothing was committed, the steps saved before stand)",
            f"{step_folder}/{inside}" if inside else step_folder,
        )

    @contextlib.contextmanager
    def _naming_step(self, step: int) -> Iterator[None]:
        """A value or name no file can hold, refused as the state is copied or handed to the
        core, is named with the step's folder."""
        try:
            yield
        except CheckpointError as e:
            name_file(e, self._step_folder(step))
            raise

    def _step_folder(self, step: int) -> str:
        """The step's folder, as messages name it (a path, or on object storage its URL)."""
        return f"{self._where.rstrip('/')}/{steps.step_directory_name(step)}"

    def _commit(self, attempt: Attempt, meta: dict[str, Any]) -> CheckpointInfo:
        """Records the written files (sizes, SHA-256s) in the metadata, verifies and validates
        if asked, and commits the step by its metadata.json."""
        on_bytes = None
        bar = None
        if self.progress:
            from .. import progress as _progress

            bar = _progress.bar(f"describing {steps.step_directory_name(attempt.step)}")
            on_bytes = bar.update
        try:
            files = self.store.describe(attempt, on_bytes, sha256=self.digest == "sha256")
        finally:
            if bar is not None:
                bar.close()
        meta = {**meta, "files": files}
        if attempt.graphs:
            meta["artifacts"] = dict(attempt.graphs)
        meta.update(self.store.attempt_fields(attempt))
        if self.verify_after_save == "process":
            _verify_in_new_process(self._files_here(attempt), meta, self.verify_timeout)
        elif self.verify_after_save:
            verify_step(self.store, Step(attempt.step, meta, attempt.folder))
        if self.validate is not None:
            self.validate.validate(self._files_here(attempt) / steps.CHECKPOINT_NAME, meta.get("metrics"))
        interrupts.before_commit()  # (a Ctrl-C held so far: raised now, nothing committed)
        step = self.store.commit(attempt, steps.METADATA_NAME, _metadata.encode(meta), durable=self.durable)
        return CheckpointInfo.of(self.store, step)

    def _files_here(self, attempt: Attempt) -> Path:
        """The attempt's folder on this machine (what needs it was refused on a store without)."""
        folder = self.store.local_path(attempt.folder)
        assert folder is not None
        return folder

    def _committed(self, info: CheckpointInfo) -> None:
        with self._lock:
            self._checkpoints[info.step] = info
        self._apply_retention()
        if self._reporter is not None:
            self._reporter.committed(info)

    def _save_sharded(
        self,
        state: CheckpointState,
        step: int,
        meta: dict[str, Any],
        include_optimizer_state: bool,
        slices: Mapping[str, Any] | None,
    ) -> None:
        """Every rank writes its shard into rank 0's attempt (sharing what did not change with its
        shard of the previous step, as ``share_unchanged`` says); rank 0 adds the index inside it
        and commits the step's metadata.json once all have succeeded."""
        from ..distributed.sharded import encode_index, write_shards

        assert self.comm is not None
        committed: list[CheckpointInfo] = []
        previous = self.latest() if self.share_unchanged else None

        def commit(attempt: Attempt, index: dict[str, Any]) -> None:
            self.store.write_document(
                attempt, steps.INDEX_NAME, encode_index(index, attempt.where), durable=self.durable
            )
            committed.append(self._commit(attempt, meta))

        write_shards(
            self.comm,
            self.store,
            state,
            slices,
            begin=lambda: self.store.begin(step),
            commit=commit,
            abandon=self.store.abandon,
            step=step,
            include_optimizer_state=include_optimizer_state,
            durable=self.durable,
            external_data_threshold=self.external_data_threshold,
            share_with=None if previous is None else previous.step_record,
            shareable=self.share_unchanged,
            watch_writes=self.share_unchanged,  # (always synchronous: the caller's own arrays)
        )
        # Rank 0 knows what it committed; the other ranks read it back.
        info = committed[0] if committed else self._read_step(step)
        self._committed(info)

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
        if self.compress_kept and self._is_root:
            self._compress_kept()

    def _compress_kept(self) -> None:
        """Compresses the steps kept only by ``keep_every``/``keep_best``. As a deletion, one
        that fails is a warning (the step stays as it was), retried at the next save."""
        with self._lock:
            checkpoints = dict(self._checkpoints)
        wanted = self.policy.steps_to_compress([(c.step, c.metrics) for c in checkpoints.values()])
        for step in sorted(wanted):
            info = checkpoints[step]
            if info.sharded or (info.compressed and not Path(info.path).exists()):
                continue
            try:
                self._compress_step(info)
            except (OSError, CheckpointError) as e:
                warnings.warn(
                    f"{info.directory}: could not compress the checkpoint of step {step} (kept as it is, "
                    f"to be retried at the next save): {e}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _compress_step(self, info: CheckpointInfo) -> None:
        """The archive first (atomic), then metadata.json naming it (atomic), then the files
        it replaces: a crash at any point leaves a step that loads and verifies."""
        from ..compression import compress

        directory = Path(info.directory)
        if not info.compressed:
            archive = directory / steps.COMPRESSED_NAME
            compress(info.path, archive, durable=self.durable, progress=self.progress)
            size, digest = safe_io.sha256_of(archive)
            meta = {
                **info.metadata,
                "compressed": info.metadata["files"],
                "files": {steps.COMPRESSED_NAME: {"bytes": size, "sha256": digest}},
            }
            _metadata.rewrite(directory, meta, self.durable)
            info = CheckpointInfo(info.step, directory, meta, self.store, directory)
            with self._lock:
                if info.step in self._checkpoints:
                    self._checkpoints[info.step] = info
        for name in info.metadata["compressed"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)
        if self.durable:
            safe_io.fsync_directory(directory)

    def delete(self, step: int) -> None:
        """Deletes the checkpoint of ``step``: hidden from readers first (in a directory, renamed
        out of sight; on object storage, marked retired), then removed, so a crash midway never
        leaves a partial checkpoint under a step's name. A step already gone is forgotten; one
        that cannot be deleted stays listed."""
        self._check_writable("delete")
        step = as_step(step)
        with self._lock:
            info = self._checkpoints.get(step)
        if info is None:
            raise KeyError(f"{self._where}: no checkpoint of step {step}")
        if self._is_root:  # rank 0 deletes; the other ranks only forget it
            with contextlib.suppress(FileNotFoundError):  # removed by hand: nothing left to delete
                self.store.retire(info.step_record)
        with self._lock:
            self._checkpoints.pop(step, None)
        if self._is_root and _artifacts.graphs_of(info.metadata):
            self.store.remove_unused_graphs()  # (the step is gone: what only it used goes too)

    def remove_leftovers(self) -> list[str]:
        """Removes what saves that failed or were killed left (and, on object storage, the
        multipart uploads they left, and retirements that did not finish); returns what it
        removed. A writer of a directory does this when it starts, under its lock, which
        proves their writers gone. On object storage nothing proves that no other writer is
        saving under the prefix, so it never happens by itself: call it when none is."""
        self._check_writable("remove leftovers")
        self.wait()
        self.reload()  # (says which steps are damaged: those are kept whole)
        return self.store.remove_leftovers()


def _verify_in_new_process(directory: Path, meta: dict[str, Any], timeout: float | None) -> None:
    """Verifies the staged step in a fresh Python process that imports what this one did."""
    if timeout is None:
        timeout = child.default_timeout(sum(int(f.get("bytes", 0)) for f in meta["files"].values()))
    _metadata.write(directory, meta, False)  # what verify checks the files against
    try:
        child.run(child.verify, (str(directory),), subject=directory, what="verification process", timeout=timeout)
    finally:
        os.unlink(directory / steps.METADATA_NAME)


@dataclass
class _ForkedStep:
    """A forked save's step: its attempt, and the child writing its checkpoint."""

    attempt: Attempt
    child: Any  # a forked_save.ForkedSave (imported on first use)
