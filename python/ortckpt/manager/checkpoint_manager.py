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

One class, whatever holds the run: a local directory or an ``s3://bucket/prefix``. Each save is
one step transaction of :mod:`ortckpt.stepstore` (stage, write, verify, write metadata,
commit, retire), so a reader never sees half a checkpoint, and a crash at any point leaves the
previous step the latest. The layout (:mod:`ortckpt.steps`): one folder per step,
``step_00000100/``, holding ``checkpoint`` (what ONNX Runtime's ``load_checkpoint`` takes;
``checkpoint.data`` beside it when large) and ``metadata.json``; on object storage the files
are in the folder of the save that committed the step, which ``metadata.json`` names. One
manager writes a directory at a time (a lock proves it); any number read it
(``read_only=True``). Leftovers of crashed saves are removed when a writer of a directory
starts; under an object store prefix by :meth:`CheckpointManager.remove_leftovers`.

With ``comm`` (an mpi4py communicator or a torch.distributed group), every rank of a
distributed job calls the same methods together and each saves only its part of the state:
the step then holds one shard per rank and an ``index.json`` (see :mod:`ortckpt.distributed`)
instead of ``checkpoint``; rank 0 commits, keeps and deletes.

The class is read in layers: this module's :class:`CheckpointManager` (its arguments, checked
and opened; restoring), over :mod:`.saving` (the save transaction, retention, deletion), over
:mod:`.base` (what a manager holds, listing, waiting, closing); :mod:`.info` holds
:class:`CheckpointInfo`.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from .. import _boundary, arguments, extras, stepstore, targets
from ..checkpoint_state import CheckpointState
from ..errors import (
    CheckpointError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
)
from ..stepstore import open_store
from . import arguments as options
from . import artifacts as _artifacts
from . import child
from . import metadata as _metadata
from .common import Staging, UnwaitedSave
from .info import CheckpointInfo
from .integrity import Verified, verify_step
from .preemption import Preemption, check_grace, signals_of
from .retention import RetentionPolicy
from .saving import Saving
from .tracking import Reporter, TrackedRun, Tracker, tracker_for
from .validation import Forward

# What needs the step's files on this machine (refused by a store whose steps are not).
_NEEDING_FILES = ("validate", "compress_kept", "track")


class CheckpointManager(Saving):
    """Saves, keeps and restores the checkpoints of one training run in ``directory`` (a
    local directory, or an ``s3://bucket/prefix`` URL).

    Args:
        directory: Where step directories go (created if missing), or an ``s3://bucket/prefix``
            (configured by ``storage_options``, see :mod:`ortckpt.object_store`).
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
            ``"fork"``: as True, but a full save of a state ONNX Runtime trains (on the CPU, to
            a directory, on Linux) is taken by a forked process instead of a copy: the caller
            is blocked only while the process forks, the child has ONNX Runtime's saver write
            the step's checkpoint (ONNX Runtime's layout, shared with no other step), and the
            background thread commits it once the child reports (a child that fails, dies or
            runs past its deadline: :class:`~ortckpt.ForkedSaveError`, nothing committed). Other
            saves go as with True. See docs/ort-loop.md for what a fork costs and risks.
        durable: fsync each checkpoint's files and directories before it counts as saved (on
            object storage an object is durable once its PUT returns: nothing changes).
        verify_after_save: Before committing, re-read the new checkpoint (:func:`ortckpt.verify`):
            True in this process, ``"process"`` in a fresh Python process (directories only; it
            imports the same ortckpt as this one). A checkpoint that fails is not committed.
        digest: ``"sha256"`` records each file's SHA-256 in metadata.json too, for whoever
            publishes cryptographic digests: each file is then read back after it is written.
            Without it (the default) a checkpoint file is recorded by its size and the root of
            the checksums the core writes into it as it writes it (XXH3-64, not cryptographic),
            its data file by size and pair id: nothing is read back.
        verify_timeout: For ``verify_after_save="process"``: seconds the fresh process may take
            (default: 120 s plus 1 s per 64 MiB of checkpoint); past it, it is killed and the
            step refused (:class:`~ortckpt.ValidationTimeoutError`).
        compress_kept: Compress the steps kept only by ``keep_every`` or ``keep_best`` (never the
            latest, nor the newest ``max_to_keep``) into ``checkpoint.zst`` (:mod:`ortckpt.compression`):
            ONNX Runtime cannot read them, :meth:`restore` and ``load()`` decompress them, and
            :func:`ortckpt.verify` checks the SHA-256 of the uncompressed files. Directories only.
        validate: A :class:`~ortckpt.manager.validation.Forward`: before committing, run the eval
            model with the new checkpoint's weights in ONNX Runtime; a checkpoint whose forward
            pass fails, is not finite, fails ``check`` or disagrees with the logged metric is not
            committed (:class:`~ortckpt.CheckpointIntegrityError`) and the previous step stays
            the latest. Directories only.
        track: Report each checkpoint to an experiment tracker: ``"mlflow"`` (an
            :class:`~ortckpt.manager.tracking.MlflowTracker` configured by MLflow's environment
            variables), a configured ``MlflowTracker(...)``, or any
            :class:`~ortckpt.manager.tracking.Tracker`. Metrics at their step, the config as
            params, the step's directory and SHA-256s as tags; a resumed run continues its
            tracker run. A tracker that fails is a warning, and one that does not answer costs
            a save at most its deadline (``MlflowTracker(timeout=5.0)``, a tracker's ``timeout``);
            what it missed is reported later.
            :meth:`register_best` hands the best checkpoint to its model registry. Directories only.
        run_id: Recorded in every checkpoint's metadata; default: the latest checkpoint's
            (a resumed run keeps its id), else a new random id.
        config: The run's hyperparameters or configuration (JSON-able), recorded in every
            checkpoint's metadata.
        progress: Progress bars (tqdm) while a checkpoint is written (or uploaded) and hashed,
            for saves that take more than half a second. A bar never holds up or fails a save.
        external_data_threshold: As for :meth:`CheckpointState.save_checkpoint`: past this many
            bytes of values, they go to ``checkpoint.data`` beside ``checkpoint``.
        share_unchanged: A step does not write or store again the tensors whose bytes are equal to the previous step's
            (frozen layers): it hard-links the previous step's ``checkpoint.data`` as its own and writes only the
            changed tensors, inline in its ``checkpoint`` (each step still loads on its own, in ONNX Runtime too;
            deleting one leaves the other whole). Equality is decided by comparing the bytes. The previous data file is
            shared only when it is still what its step's metadata records (its size and pair id; a SHA-256 entry, with
            ``digest="sha256"``, hashed when this manager wrote it, else once when first shared) and is the user's own
            with a new file's permissions; else the step is written whole. A step is also written whole when less than
            half of the previous data file would be shared, or the changed tensors would pass ONNX Runtime's 2 GiB
            inline limit, or the previous step has no data file; a whole step with at least half of its values unchanged
            since the previous step keeps them in ``checkpoint.data`` (as ``external_data_threshold=0``), for the next
            step to share. On object storage, a checkpoint of 64 MiB of values or more keeps them in a data object
            of the run's ``shared/`` folder, and the next steps upload only the tensors whose bytes (by SHA-256) are
            not in it (see docs/object-storage.md); with ``comm``, in a directory, each rank's shard shares so with its
            shard of the previous step (same world size: a shard of another is written whole), on object storage
            each rank's shard keeps its values in a data object of its own in ``shared/`` (64 MiB of values or
            more) that the rank's next shards share by content; False: every step written whole.
        comm: Sharded saves across the ranks of a distributed job: an mpi4py communicator, a
            torch.distributed process group or an :class:`ortckpt.distributed.Communicator`.
            Every rank creates the manager and calls save, restore and wait together; each
            saves the part of the state it holds (:meth:`save`'s ``slices`` say which part of a
            split parameter). Not with ``async_save`` or ``verify_after_save``.
        read_only: A reader: lists, restores and verifies checkpoints that another process
            writes (training running elsewhere), seeing new and deleted steps as they come; takes
            no lock and changes nothing. A writer (the default) holds a directory for itself
            until :meth:`close`: a second writer gets :class:`~ortckpt.CheckpointDirectoryInUseError`
            naming the first. An object store holds no lock: one writer per prefix is yours to keep.
        storage_options: For an ``s3://bucket/prefix`` URL (see :mod:`ortckpt.object_store`).
        artifacts: The run's graphs, recorded with every step: a folder of training artifacts
            (``generate_artifacts``' ``training_model.onnx``, ``eval_model.onnx``,
            ``optimizer_model.onnx``; its ``checkpoint`` is what :meth:`save` saves, not a graph),
            or a mapping of role (``"training"``, ``"eval"``, ``"optimizer"``, ``"inference"``...)
            to ONNX file. Where they are missing (a step folder copied alone to another machine,
            resumed with the same script), the run's latest step's graphs are recorded again. Each
            distinct graph is stored once in the run's ``artifacts/`` and shared
            by the steps that use it (in a directory each step holds hard links to it, so a step
            folder copied alone is whole); a graph changed during the run is stored again.
            :meth:`verify` checks them, retention removes the ones no kept step uses,
            :attr:`CheckpointInfo.artifacts` gives them and :meth:`restore_training` trains on.
            Not with ``comm``.
        device: ONNX Runtime's device the run trains on (``"cpu"``, ``"cuda"``, ``"cuda:1"``):
            recorded in metadata.json with its execution provider, and the device
            :meth:`restore_training` makes the Module on. Default: ``"cpu"`` with ``artifacts``.
        preemption: True: SIGTERM and SIGINT (Ctrl-C) mean "preempted" (or a collection of
            signals): from the signal on, :meth:`should_save` is True at the next step whatever
            ``save_every`` says, that save is synchronous (pending async saves and tracker
            reports flushed first), and :attr:`preempted` tells the loop to stop. Handlers are
            installed here (the main thread only), chained to the ones before and put back by
            :meth:`close`; see :mod:`ortckpt.manager.preemption`. Not for a reader or ``comm``.
        preemption_grace: Seconds: if the manager is not closed that long after the signal,
            the process ends (status 128 + the signal), saving or not (the previous step
            stands); None (the default): no such watchdog.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        save_every: int | datetime.timedelta | None = None,
        max_to_keep: int | None = None,
        keep_best: tuple[str, Literal["min", "max"], int] | None = None,
        keep_every: int | None = None,
        async_save: bool | Literal["fork"] = False,
        durable: bool = True,
        verify_after_save: bool | Literal["process"] = False,
        verify_timeout: float | None = None,
        digest: Literal["sha256"] | None = None,
        validate: Forward | None = None,
        compress_kept: bool = False,
        track: str | Tracker | None = None,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        progress: bool = False,
        external_data_threshold: int = _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD,
        share_unchanged: bool = True,
        comm: Any = None,
        read_only: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        artifacts: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None = None,
        device: str | None = None,
        preemption: bool | Iterable[int] = False,
        preemption_grace: float | None = None,
    ) -> None:
        # Every argument is checked first, naming it, before anything is opened or written
        # (manager.arguments: a float or a bool is no count, a string no flag).
        if not isinstance(directory, (str, os.PathLike)):
            raise InvalidArgumentTypeError(
                f"directory is a path or an {targets.SCHEME} URL, got {type(directory).__name__}", "directory"
            )
        if isinstance(directory, str) and not directory:  # (Path("") is the working directory)
            raise InvalidArgumentError(
                f"directory is a path or an {targets.SCHEME} URL, got '' (an empty name)", "directory"
            )
        save_every = options.save_every(save_every)
        fork_save = isinstance(async_save, str) and async_save == "fork"
        async_save, durable, compress_kept, progress, read_only, share_unchanged = (
            arguments.flag(name, value)
            for name, value in (
                ("async_save", True if fork_save else async_save),
                ("durable", durable),
                ("compress_kept", compress_kept),
                ("progress", progress),
                ("read_only", read_only),
                ("share_unchanged", share_unchanged),
            )
        )
        verify_after_save = options.verify_after_save(verify_after_save)
        verify_timeout = child.check_timeout("verify_timeout", verify_timeout)
        if verify_timeout is not None and verify_after_save != "process":
            raise InvalidArgumentError(
                'verify_timeout is for verify_after_save="process": a check in this process cannot be cut',
                "verify_timeout",
            )
        run_id = None if run_id is None else arguments.text("run_id", run_id)
        external_data_threshold = arguments.count(
            "external_data_threshold", external_data_threshold, 0, arguments.MAX_BYTES
        )
        track = options.track(track)
        preemption_signals = signals_of(preemption)
        preemption_grace = check_grace(preemption_grace)
        if preemption_signals and (read_only or comm is not None):
            raise ValueError(
                "preemption is for the writer of a run, without comm (each rank would stop at its own step)"
            )
        policy = RetentionPolicy(max_to_keep, keep_best, keep_every)
        config = _metadata.check_config(config, os.fspath(directory))
        storage_options = None if storage_options is None else arguments.mapping("storage_options", storage_options)
        backend = stepstore.backend(directory)
        backend.check_options(directory, storage_options)
        if comm is not None and (async_save or verify_after_save or validate is not None):
            raise ValueError("async_save, verify_after_save and validate are not available for sharded saves (comm=)")
        if comm is not None and compress_kept:
            raise ValueError("compress_kept is not available for sharded saves (comm=)")
        missing: _artifacts.MissingArtifacts | None = None
        try:
            graphs = _artifacts.resolve(artifacts)
        except _artifacts.MissingArtifacts as e:  # (the latest step's, if it records them: below)
            graphs, missing = {}, e
        device = _artifacts.check_device(device)
        if (graphs or missing) and (comm is not None or read_only):
            raise ValueError("artifacts are recorded by a writer of unsharded steps: not with comm= or read_only=True")
        if validate is not None and not isinstance(validate, Forward):
            raise InvalidArgumentTypeError(
                f"validate takes an ortckpt.manager.Forward, got {type(validate).__name__}", "validate"
            )
        asked = {"validate": validate, "compress_kept": compress_kept, "track": track}
        needing = [name for name in _NEEDING_FILES if asked[name] not in (None, False)]
        if verify_after_save == "process":
            needing.append('verify_after_save="process"')
        backend.refuse_needing_files(directory, needing)
        # An option whose package is missing is refused here, not at the first save it would fail.
        if compress_kept:
            extras.require("zstandard", "compress_kept=True")
        if progress:
            extras.require("tqdm.auto", "progress=True")
        self.policy = policy
        self.save_every = save_every
        self.async_save = async_save
        self._fork_save = fork_save  # (full saves of ONNX Runtime's state, forked: see Saving._forked)
        self.read_only = read_only
        self.durable = durable
        self.verify_after_save = verify_after_save
        if digest not in (None, "sha256"):
            raise InvalidArgumentError(f'digest is None or "sha256", got {digest!r}', "digest")
        self.digest = digest
        self.verify_timeout = verify_timeout
        self.config = config
        self.external_data_threshold = external_data_threshold
        self.validate = validate
        self.compress_kept = compress_kept
        self.progress = progress
        self.storage_options = dict(storage_options or {})
        self.artifacts = graphs  # role -> the ONNX file recorded with every step
        self.device = device if device is not None or not (graphs or missing) else "cpu"
        self.comm = None
        if comm is not None:
            from ..distributed import communicator

            self.comm = communicator(comm)
        writer = self._is_root and not read_only
        if missing is not None:
            # (refused before anything is created when no step of the run records graphs either)
            _artifacts.recorded_by(open_store(directory, storage_options, writer=False), missing)
        if writer:
            # The metadata's git commit comes from a subprocess: asked now, before the lock, since
            # a child forked while the lock is held shares it until it execs, and a writer killed
            # in that moment would leave its directory locked after it is gone.
            _metadata.git_commit()
        self.store = open_store(directory, storage_options, writer=writer, create=writer, saves=not read_only)
        if writer:
            self.store.remove_proven_leftovers()
        self.directory = self.store.run_folder
        # Steps share what is unchanged where a store can (see write_checkpoint); a sharded step's
        # shards, each with its shard of the previous step, in a directory.
        self.share_unchanged = share_unchanged
        self.url = self.store.name
        self._where = self.store.name
        self._lock = threading.Lock()  # guards _checkpoints: the background thread commits into it
        self._checkpoints = {}
        self._executor = None
        self._pending = None
        # The pending save as the finalizer sees it, to report a failure nobody waited for.
        self._unwaited = UnwaitedSave(self._where)
        self._report_lost = weakref.finalize(self, self._unwaited.report)
        # Async saves copy the state into these arrays, reused from one save to the next
        # (free again once the previous save is done: save() waits for it first).
        self._staging = Staging()
        self._last_save = time.monotonic()
        self._closed = False
        if self.comm is not None:
            self.comm.barrier()  # the directory exists and is tidy before any rank looks
        self.reload()
        latest = self.latest()
        if missing is not None:  # the artifacts are not on this machine: the run's latest step has them
            try:
                self.artifacts = _artifacts.recorded(
                    self.store, None if latest is None else latest.step_record, missing
                )
            except BaseException:
                self.store.close()
                raise
        # The run's id: the one given, else the latest checkpoint's (a resumed run keeps its id),
        # else a new one; with comm, rank 0's on every rank.
        self.run_id = run_id or (latest.metadata.get("run_id") if latest else None) or uuid.uuid4().hex
        if self.comm is not None:
            self.run_id = self.comm.broadcast(self.run_id)
        self._reporter = None
        if track is not None and self._is_root:
            run = TrackedRun(self.run_id, Path(self.directory), self.config, writer=not read_only)
            self._reporter = Reporter(tracker_for(track), run, self.all)
        # Last: a failure above leaves no handler installed.
        self._preemption = Preemption(preemption_signals, preemption_grace, self._where)
        self._preemption_saved = False
        # A manager dropped without close() puts its handlers back too (they hold no reference to it).
        weakref.finalize(self, self._preemption.restore)

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
            raise ValueError(f"{self._where}: register_best needs a tracker: create the manager with track=")
        info = self.best(metric, mode)
        if info is None:
            raise FileNotFoundError(f"{self._where}: no checkpoint has the metric to rank by")
        from ..convert.onnx_model import inference_model

        model = inference_model(info.load(), eval_model, output_names=output_names)
        return self._reporter.register(name, model, info)

    # --- restoring -----------------------------------------------------------------------

    def restore(self, step: int | None = None) -> CheckpointState:
        """Loads the checkpoint of ``step`` (default: the latest). With ``comm``, this rank's
        part: see :meth:`restore_sharded`. A reader whose step is deleted (by retention) while
        it loads tries again with the new latest; the state it gets stays usable whatever
        retention deletes later."""
        if self.comm is not None:
            return self.restore_sharded(step)[0]
        return self._reading(step, lambda info: info.load(resuming=not self.read_only))

    def _reading(self, step: int | None, read: Any) -> Any:
        """``read(info)`` of the checkpoint of ``step`` (default: the latest). A reader whose step
        retention deletes meanwhile (a race, not damage: any failure, once the step is gone) looks
        again: the new latest, or for a step asked by number, the news that it is gone."""
        attempts = 10 if self.read_only or self.store.shared_with_writers else 1
        for attempt in range(attempts):
            info = self._info(step)
            try:
                return read(info)
            except (OSError, CheckpointError):
                self.reload()
                with self._lock:
                    gone = info.step not in self._checkpoints
                if not gone or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def restore_training(
        self, step: int | None = None, *, device: str | None = None
    ) -> tuple[CheckpointState, Any, Any]:
        """The checkpoint of ``step`` (default: the latest) ready to train on: ``(state, module,
        optimizer)``, ONNX Runtime's ``Module`` over the restored state with the step's training
        and eval graphs, and its ``Optimizer`` with the step's optimizer graph (None if the step
        records none), which take the parameters, moments, step and learning rate from the
        checkpoint as ONNX Runtime's do. The graphs are the ones the step recorded
        (``artifacts=``), checked against their SHA-256 first, so a step folder copied alone to
        another machine resumes. ``device``: ONNX Runtime's (default: the manager's, else the
        one the step records, else ``"cpu"``). Needs onnxruntime-training (ImportError naming
        it otherwise); ortckpt never requires it."""
        device = _artifacts.check_device(device)
        _artifacts.training_api()  # (before anything is read: ImportError naming the package)

        def session(info: CheckpointInfo) -> tuple[CheckpointState, Any, Any]:
            graphs = info.artifacts
            chosen = device or self.device or info.metadata.get("device")
            return _artifacts.training_session(
                info.load(resuming=not self.read_only), graphs, chosen, os.fspath(info.url)
            )

        return self._reading(step, session)

    def restore_sharded(
        self, step: int | None = None, *, slices: Mapping[str, Any] | None = None
    ) -> tuple[CheckpointState, dict[str, Any]]:
        """This rank's part of the checkpoint of ``step`` (default: the latest) and the
        :class:`ortckpt.distributed.Slice` of each parameter it holds, as
        :func:`ortckpt.distributed.load_sharded` gives them (resharding to this world size)."""
        from ..distributed.sharded import load_step

        info = self._info(step)
        return load_step(self.store, info.step_record, comm=self.comm, slices=slices)

    def verify(self, step: int | None = None) -> Verified:
        """:func:`ortckpt.verify` on the checkpoint of ``step`` (default: the latest): every
        file's size and SHA-256 against its metadata, then every value and property decoded."""
        return self._reading(step, lambda info: verify_step(self.store, info.step_record))


# The manager of an object store prefix is the same class (kept as a name for older code).
ObjectStoreCheckpointManager = CheckpointManager
