"""Checkpoints of a long training run: periodic saves, retention, resume, async saves.

What ONNX Runtime's distributed TrainingRunner offered (``checkpoints_dir``,
``checkpoint_period``, ``max_num_checkpoints``, resume from the latest on start), shaped
like Orbax's ``CheckpointManager``, in ONNX Runtime's own format::

    with CheckpointManager("ckpts", save_every=100, max_to_keep=3) as manager:
        state = manager.restore() if manager.latest() else initial_state
        for step in range(start, steps):
            ...
            if manager.should_save(step):
                manager.save(state, step, metrics={"loss": loss})

Layout of ``directory``: one directory per step, ``step_00000100/`` holding
``checkpoint`` (what ONNX Runtime's ``load_checkpoint`` takes; ``checkpoint.data``
beside it when large) and ``metadata.json``. A step directory is written under a hidden
temporary name and renamed into place only once complete (and fsynced, when durable), so
a reader never sees half a checkpoint. One manager writes a directory at a time (a lock
proves it, :mod:`ortckpt.steps`); any number read it (``read_only=True``). Leftovers of
crashed saves are removed when a writer starts.

With ``comm`` (an mpi4py communicator or a torch.distributed group), every rank of a
distributed job calls the same methods together and each saves only its part of the state:
the step directory then holds one shard per rank and an ``index.json`` (see
:mod:`ortckpt.distributed`) instead of ``checkpoint``; rank 0 commits, keeps and deletes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import _boundary, safe_io, steps
from ..checkpoint_state import CheckpointState, open_checkpoint
from ..errors import CheckpointError, CheckpointIntegrityError
from . import metadata as _metadata
from .common import ManagerBase, as_step
from .integrity import Verified, verify
from .retention import RetentionPolicy
from .tracking import Reporter, TrackedRun, Tracker, tracker_for
from .validation import Forward


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint of a :class:`CheckpointManager`."""

    step: int
    directory: Path
    metadata: dict[str, Any]

    @property
    def path(self) -> Path:
        """The checkpoint file: what ``load_checkpoint`` (ortckpt's or ONNX Runtime's) takes."""
        return self.directory / steps.CHECKPOINT_NAME

    @property
    def metrics(self) -> dict[str, Any]:
        return self.metadata.get("metrics") or {}

    @property
    def epoch(self) -> int | None:
        return self.metadata.get("epoch")

    @property
    def rng_state(self) -> dict[str, Any] | None:
        """What :func:`ortckpt.capture_rng_state` captured at save, if given."""
        return self.metadata.get("rng_state")

    @property
    def sharded(self) -> bool:
        """Whether this is a sharded checkpoint (one shard per rank and an index)."""
        return (self.directory / steps.INDEX_NAME).is_file()

    @property
    def compressed(self) -> bool:
        """Whether the step was compressed (``compress_kept``): its files are then in
        ``checkpoint.zst``, and :attr:`path` names a file that is gone (``load()`` reads the
        archive; ``ortckpt decompress`` writes the checkpoint back)."""
        return "compressed" in self.metadata

    def load(self) -> CheckpointState:
        """The whole state, in this process (a sharded checkpoint's pieces assembled, a
        compressed one decompressed)."""
        if self.sharded:
            from ..distributed import SingleProcess, load_sharded

            return load_sharded(self.directory, comm=SingleProcess())[0]
        try:
            return open_checkpoint(self.path, follow_symlinks=False)
        except FileNotFoundError:
            # Compressed (perhaps since this info was read: the archive is written before the
            # checkpoint goes, so it is there whenever the checkpoint is not).
            archive = self.directory / steps.COMPRESSED_NAME
            if not os.path.lexists(archive):
                raise
        from ..compression import load_compressed

        return load_compressed(archive, follow_symlinks=False)  # a symlink planted there is refused


class CheckpointManager(ManagerBase):
    """Saves, keeps and restores the checkpoints of one training run in ``directory``.

    Args:
        directory: Where step directories go (created if missing).
        save_every: :meth:`should_save` is True every this many steps (an int), or once this
            much time has passed since the last save (a ``datetime.timedelta``); None: every step.
        max_to_keep: Keep the newest K checkpoints.
        keep_best: ``(metric name, "min" or "max", k)``: keep the k best by that metric.
        keep_every: Keep every checkpoint whose step is a multiple of this, forever.
            The rules combine as Orbax's: a checkpoint is kept when any rule keeps it; the
            newest is always kept; with no rule, all are kept (see :mod:`ortckpt.retention`).
        async_save: :meth:`save` returns once it has copied the state (the caller may then
            change its arrays); writing, fsync, commit and retention happen in a background
            thread. An error there is raised by the next :meth:`save` or :meth:`wait`. The
            copy is kept for the next save to copy into: memory the size of the state.
        durable: fsync each checkpoint's files and directories before it counts as saved.
        verify_after_save: Before committing, re-read the new checkpoint (:func:`ortckpt.verify`):
            True in this process, ``"process"`` in a fresh Python process. A checkpoint that
            fails is not committed.
        compress_kept: Compress the steps kept only by ``keep_every`` or ``keep_best`` (never the
            latest, nor the newest ``max_to_keep``) into ``checkpoint.zst`` (:mod:`ortckpt.compression`):
            ONNX Runtime cannot read them, :meth:`restore` and ``load()`` decompress them, and
            :func:`ortckpt.verify` checks the SHA-256 of the uncompressed files.
        validate: A :class:`~ortckpt.manager.validation.Forward`: before committing, run the eval
            model with the new checkpoint's weights in ONNX Runtime; a checkpoint whose forward
            pass fails, is not finite, fails ``check`` or disagrees with the logged metric is not
            committed (:class:`~ortckpt.CheckpointIntegrityError`) and the previous step stays
            the latest.
        track: Report each checkpoint to an experiment tracker: ``"mlflow"`` (an
            :class:`~ortckpt.manager.tracking.MlflowTracker` configured by MLflow's environment
            variables), a configured ``MlflowTracker(...)``, or any
            :class:`~ortckpt.manager.tracking.Tracker`. Metrics at their step, the config as
            params, the step's directory and SHA-256s as tags; a resumed run continues its
            tracker run. A tracker that fails is a warning; what it missed is reported later.
            :meth:`register_best` hands the best checkpoint to its model registry.
        run_id: Recorded in every checkpoint's metadata; default: the latest checkpoint's
            (a resumed run keeps its id), else a new random id.
        config: The run's hyperparameters or configuration (JSON-able), recorded in every
            checkpoint's metadata.
        progress: Progress bars (tqdm) while a checkpoint is written and hashed, for saves
            that take more than half a second.
        external_data_threshold: As for :meth:`CheckpointState.save_checkpoint`: past this many
            bytes of values, they go to ``checkpoint.data`` beside ``checkpoint``.
        comm: Sharded saves across the ranks of a distributed job: an mpi4py communicator, a
            torch.distributed process group or an :class:`ortckpt.distributed.Communicator`.
            Every rank creates the manager and calls save, restore and wait together; each
            saves the part of the state it holds (:meth:`save`'s ``slices`` say which part of a
            split parameter). Not with ``async_save`` or ``verify_after_save``.
        read_only: A reader: lists, restores and verifies checkpoints that another process
            writes (training running elsewhere), seeing new and deleted steps as they come; takes
            no lock and changes nothing. A writer (the default) holds ``directory`` for itself
            until :meth:`close`: a second writer gets :class:`~ortckpt.CheckpointDirectoryInUseError`
            naming the first.
        storage_options: For an ``s3://bucket/prefix`` URL in place of ``directory`` (see
            :mod:`ortckpt.object_store`): the manager is then an
            :class:`~ortckpt.manager.object_store_manager.ObjectStoreCheckpointManager`, with the
            same methods (see there for the layout, the commit and what it does not do).
    """

    def __new__(cls, directory: str | os.PathLike[str], **options: Any) -> Any:
        # An object store URL gets the manager of an object store prefix, with the same methods.
        if isinstance(directory, str) and directory.startswith("s3://"):
            from .object_store_manager import ObjectStoreCheckpointManager

            return ObjectStoreCheckpointManager(directory, **options)
        return super().__new__(cls)

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save_every: int | datetime.timedelta | None = None,
        max_to_keep: int | None = None,
        keep_best: tuple[str, Literal["min", "max"], int] | None = None,
        keep_every: int | None = None,
        async_save: bool = False,
        durable: bool = True,
        verify_after_save: bool | Literal["process"] = False,
        validate: Forward | None = None,
        compress_kept: bool = False,
        track: str | Tracker | None = None,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        progress: bool = False,
        external_data_threshold: int = _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD,
        comm: Any = None,
        read_only: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if storage_options is not None:
            raise ValueError(f"{directory}: storage_options are for an object store URL (s3://bucket/prefix)")
        if comm is not None and (async_save or verify_after_save or validate is not None):
            raise ValueError("async_save, verify_after_save and validate are not available for sharded saves (comm=)")
        if comm is not None and compress_kept:
            raise ValueError("compress_kept is not available for sharded saves (comm=)")
        if validate is not None and not isinstance(validate, Forward):
            raise TypeError(f"validate takes an ortckpt.manager.Forward, got {type(validate).__name__}")
        self.directory = Path(directory)
        self._start(
            str(self.directory),
            RetentionPolicy(max_to_keep, keep_best, keep_every),
            save_every=save_every,
            async_save=async_save,
            read_only=read_only,
            durable=durable,
            verify_after_save=verify_after_save,
            run_id=run_id,
            config=config,
            external_data_threshold=external_data_threshold,
            comm=comm,
        )
        self.validate = validate
        self.compress_kept = compress_kept
        self.progress = progress
        self._writer: steps.WriterLock | None = None
        if self._is_root and not read_only:
            safe_io.make_directories(self.directory)
            # The metadata's git commit comes from a subprocess: asked now, before the lock, since
            # a child forked while the lock is held shares it until it execs, and a writer killed
            # in that moment would leave its directory locked after it is gone.
            _metadata.git_commit()
            self._writer = steps.WriterLock(self.directory)
            steps.remove_leftovers(self.directory, self._writer)
        if self.comm is not None:
            self.comm.barrier()  # the directory exists and is tidy before any rank looks
        self.reload()
        self._adopt_run_id(run_id)
        self._reporter: Reporter | None = None
        if track is not None and self._is_root:
            run = TrackedRun(self.run_id, self.directory, self.config, writer=not read_only)
            self._reporter = Reporter(tracker_for(track), run, self.all)

    # --- what is there -----------------------------------------------------------------

    def reload(self) -> None:
        """Reads the directory again: what ``all()``, ``latest()`` and ``restore()`` see. A
        read-only manager does this on every query; a writer knows what it wrote."""
        found = self._scan()
        with self._lock:
            self._checkpoints = found

    def _scan(self) -> dict[int, CheckpointInfo]:
        """Every committed step whose metadata.json reads and validates. A step directory with a
        damaged metadata.json is skipped with a warning (and kept on disk, for a person to look
        at); one without any is not this manager's (e.g. a save_sharded step) and is ignored."""
        found = {}
        for step, directory in steps.step_directories(self.directory).items():
            try:
                meta = _metadata.read(directory)
            except FileNotFoundError:
                continue
            except (CheckpointError, OSError, ValueError) as e:
                warnings.warn(f"{directory}: skipped, its metadata is damaged: {e}", RuntimeWarning, stacklevel=3)
                continue
            if meta["step"] != step:
                warnings.warn(
                    f"{directory}: skipped, its metadata.json says step {meta['step']}", RuntimeWarning, stacklevel=3
                )
                continue
            found[step] = CheckpointInfo(step, directory, meta)
        return found

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
        and infinities round-trip) rank checkpoints for ``keep_best``; ``metadata`` is any
        JSON-able data of yours; ``rng_state`` comes from :func:`ortckpt.capture_rng_state`.
        With ``async_save``, returns once the state is copied; otherwise once it is committed.
        With ``comm``, ``state`` is this rank's part and ``slices`` (tensor name ->
        :class:`ortckpt.distributed.Slice`) say which part of a split parameter it holds.
        """
        step, meta, snapshot = self._prepare_save(
            state,
            step,
            epoch=epoch,
            metrics=metrics,
            metadata=metadata,
            dataset_fingerprint=dataset_fingerprint,
            rng_state=rng_state,
            include_optimizer_state=include_optimizer_state,
            run_id=self.run_id,
            config=self.config,
        )
        if self.comm is not None:
            self._save_sharded(snapshot, step, meta, include_optimizer_state, slices)
            return
        if slices is not None:
            raise ValueError("slices are for sharded saves: create the manager with comm=")
        self._write(self._write_and_commit, step, snapshot, step, meta, include_optimizer_state)

    def _write_and_commit(
        self, state: CheckpointState, step: int, meta: dict[str, Any], include_optimizer_state: bool
    ) -> None:
        temp = steps.new_temp_directory(self.directory, step)
        try:
            CheckpointState.save_checkpoint(
                state,
                temp / steps.CHECKPOINT_NAME,
                include_optimizer_state,
                external_data_threshold=self.external_data_threshold,
                durable=self.durable,
                progress=self.progress,
            )
            final = self._commit_directory(temp, step, meta)
        except BaseException:
            safe_io.remove_tree_quietly(temp)
            raise
        info = CheckpointInfo(step, final, meta)
        with self._lock:
            self._checkpoints[step] = info
        self._apply_retention()
        if self._reporter is not None:
            self._reporter.committed(info)

    def _commit_directory(self, temp: Path, step: int, meta: dict[str, Any]) -> Path:
        """Hashes the written files into metadata.json, verifies if asked, and renames the
        temporary directory to the step's name (fsynced when durable)."""
        name = steps.step_directory_name(step)
        written = sorted(e.name for e in safe_io.entries(temp) if not e.name.startswith("."))
        meta["files"] = _metadata.describe_files(temp, written, progress=name if self.progress else None)
        _metadata.write(temp, meta, self.durable)
        if self.verify_after_save == "process":
            _verify_in_new_process(temp)
        elif self.verify_after_save:
            verify(temp)
        if self.validate is not None:
            self.validate.validate(temp / steps.CHECKPOINT_NAME, meta.get("metrics"))
        return steps.commit(temp, self.directory, step, durable=self.durable)

    def _save_sharded(
        self,
        state: CheckpointState,
        step: int,
        meta: dict[str, Any],
        include_optimizer_state: bool,
        slices: Mapping[str, Any] | None,
    ) -> None:
        """Every rank writes its shard into rank 0's temporary step directory; rank 0 adds the
        index and metadata and renames it into place once all have succeeded."""
        from ..distributed.sharded import write_index, write_shards

        assert self.comm is not None

        def commit(temp: str, index: dict[str, Any]) -> None:
            write_index(Path(temp) / steps.INDEX_NAME, index, self.durable)
            self._commit_directory(Path(temp), step, meta)

        write_shards(
            self.comm,
            state,
            slices,
            prepare=lambda: steps.new_temp_directory(self.directory, step),
            commit=commit,
            step=step,
            include_optimizer_state=include_optimizer_state,
            durable=self.durable,
            external_data_threshold=self.external_data_threshold,
        )
        final = steps.step_directory(self.directory, step)
        with self._lock:  # rank 0 holds meta as written; the other ranks read it back
            self._checkpoints[step] = CheckpointInfo(step, final, meta if self._is_root else _metadata.read(final))
        self._apply_retention()
        if self._reporter is not None:  # rank 0's alone
            self._reporter.committed(CheckpointInfo(step, final, meta))

    def _apply_retention(self) -> None:
        super()._apply_retention()
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
            if info.sharded or (info.compressed and not info.path.exists()):
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

        directory = info.directory
        if not info.compressed:
            archive = directory / steps.COMPRESSED_NAME
            compress(info.path, archive, durable=self.durable)
            size, digest = _metadata.sha256_of(archive)
            meta = {
                **info.metadata,
                "compressed": info.metadata["files"],
                "files": {steps.COMPRESSED_NAME: {"bytes": size, "sha256": digest}},
            }
            _metadata.rewrite(directory, meta, self.durable)
            info = CheckpointInfo(info.step, directory, meta)
            with self._lock:
                if info.step in self._checkpoints:
                    self._checkpoints[info.step] = info
        for name in info.metadata["compressed"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)
        if self.durable:
            safe_io.fsync_directory(directory)

    def delete(self, step: int) -> None:
        """Deletes the checkpoint of ``step``: renamed out of sight first (atomic), then removed,
        so a crash midway never leaves a partial checkpoint under a step's name. A step whose
        directory is already gone is forgotten; one that cannot be deleted stays listed."""
        self._check_writable("delete")
        step = as_step(step)
        with self._lock:
            info = self._checkpoints.get(step)
        if info is None:
            raise KeyError(f"{self.directory}: no checkpoint of step {step}")
        if self._is_root:  # rank 0 deletes; the other ranks only forget it
            with contextlib.suppress(FileNotFoundError):  # removed by hand: nothing left to delete
                steps.delete(info.directory)
        with self._lock:
            self._checkpoints.pop(step, None)

    def close(self) -> None:
        """Waits for the pending save, stops the background thread and gives up the directory
        (another writer may then open it). Queries and restores still work after."""
        try:
            self._stop_saving()
        finally:
            if self._writer is not None:
                self._writer.release()
            if self._reporter is not None and not self._closed:
                self._reporter.close()
            self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def register_best(
        self,
        name: str,
        eval_model: str | os.PathLike[str] | Any,
        *,
        output_names: list[str] | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] | None = None,
    ) -> Any:
        """Exports the best checkpoint (:meth:`best`, by ``keep_best``'s metric or the one given)
        into ``eval_model`` as an inference model (:func:`ortckpt.inference_model`) and registers
        it with the tracker (``track=``) as a new version of the registered model ``name``, with
        the checkpoint's metrics and lineage (tracker run, step, SHA-256s). Returns what the
        tracker returns: MLflow's ``ModelVersion``. A read-only manager registers too."""
        if self._reporter is None:
            raise ValueError(f"{self.directory}: register_best needs a tracker: create the manager with track=")
        info = self.best(metric, mode)
        if info is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint has the metric to rank by")
        from ..convert.onnx_model import inference_model

        model = inference_model(info.load(), eval_model, output_names=output_names)
        return self._reporter.register(name, model, info)

    # --- restoring -----------------------------------------------------------------------

    def restore(self, step: int | None = None) -> CheckpointState:
        """Loads the checkpoint of ``step`` (default: the latest). With ``comm``, this rank's
        part: see :meth:`restore_sharded`. A reader whose step is deleted (by retention)
        while it loads tries again with the new latest."""
        if self.comm is not None:
            return self.restore_sharded(step)[0]
        return self._retrying(step, lambda info: info.load())

    def restore_sharded(
        self, step: int | None = None, *, slices: Mapping[str, Any] | None = None
    ) -> tuple[CheckpointState, dict[str, Any]]:
        """This rank's part of the checkpoint of ``step`` (default: the latest) and the
        :class:`ortckpt.distributed.Slice` of each parameter it holds, as
        :func:`ortckpt.distributed.load_sharded` gives them (resharding to this world size)."""
        from ..distributed import load_sharded

        return load_sharded(self._info(step).directory, comm=self.comm, slices=slices)

    def verify(self, step: int | None = None) -> Verified:
        """:func:`ortckpt.verify` on the checkpoint of ``step`` (default: the latest)."""
        info = self.latest() if step is None else {c.step: c for c in self.all()}.get(as_step(step))
        if info is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint of step {step}")
        return verify(info.directory)

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        return f"CheckpointManager({str(self.directory)!r}, steps={self.all_steps()}{mode})"


def _verify_in_new_process(directory: Path) -> None:
    code = "import sys, ortckpt; ortckpt.verify(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CheckpointIntegrityError(
            directory,
            [
                done.stderr.strip().splitlines()[-1]
                if done.stderr
                else f"verification process exited with {done.returncode}"
            ],
        )
