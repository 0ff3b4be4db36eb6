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
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import _boundary, arguments, extras, interrupts, safe_io, steps, targets
from ..checkpoint_state import CheckpointState, adopt
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    name_file,
)
from ..stepstore import Attempt, Step, StepStore, open_store
from . import arguments as options
from . import artifacts as _artifacts
from . import child
from . import metadata as _metadata
from .common import Staging, UnwaitedSave, as_integer, as_step
from .integrity import Verified, verify_step
from .preemption import Preemption, check_grace, signals_of
from .retention import RetentionPolicy
from .tracking import Reporter, TrackedRun, Tracker, tracker_for
from .validation import Forward

# What only a run in a local directory can do (each needs the step's files on this machine).
_LOCAL_ONLY = ("validate", "compress_kept", "track")


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint of a :class:`CheckpointManager`."""

    step: int
    directory: Any  # the step's folder: a Path in a directory, its URL on object storage
    metadata: dict[str, Any]
    store: StepStore = field(repr=False, compare=False)
    files: Any = field(repr=False, compare=False, default=None)  # where its files are (a Path, or a Location)

    @classmethod
    def of(cls, store: StepStore, step: Step) -> CheckpointInfo:
        # (a directory's files are in the step's directory; on object storage, in its attempt's folder)
        directory = step.folder if store.local else f"{store.name.rstrip('/')}/{steps.step_directory_name(step.number)}"
        return cls(step.number, directory, step.document, store, step.folder)

    @property
    def folder(self) -> Any:
        """Where the step's files are: its directory, or on object storage the folder of the
        save that committed it (a URL)."""
        return self.files if isinstance(self.files, Path) else self.files.url

    @property
    def url(self) -> str:
        """The step folder's URL (on object storage) or path."""
        return os.fspath(self.directory) if isinstance(self.directory, Path) else self.directory

    @property
    def path(self) -> Any:
        """The checkpoint file: what ``load_checkpoint`` (ortckpt's or ONNX Runtime's) takes; a
        URL on object storage."""
        target = self.store.file(self.files, steps.CHECKPOINT_NAME)
        return target.path if isinstance(target, targets.LocalFile) else target.name

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
    def _step(self) -> Step:
        return Step(self.step, self.metadata, self.files)

    @property
    def artifacts(self) -> dict[str, Path]:
        """The run's graphs this step records (``CheckpointManager(artifacts=...)``): role ->
        a local ONNX file, checked against the size and SHA-256 its metadata.json records (on
        object storage, downloaded once into a private folder of this process). Empty when the
        step records none."""
        return _artifacts.local_graphs(self.store, self._step)

    @property
    def sharded(self) -> bool:
        """Whether this is a sharded checkpoint (one shard per rank and an index)."""
        return steps.INDEX_NAME in self.metadata["files"]

    @property
    def compressed(self) -> bool:
        """Whether the step was compressed (``compress_kept``): its files are then in
        ``checkpoint.zst``, and :attr:`path` names a file that is gone (``load()`` reads the
        archive; ``ortckpt decompress`` writes the checkpoint back)."""
        return "compressed" in self.metadata

    def load(self) -> CheckpointState:
        """The whole state, in this process (a sharded checkpoint's pieces assembled, a
        compressed one decompressed). On object storage, a local copy: it stays usable
        whatever retention deletes later, as the mapped files of a directory do."""
        if self.sharded:
            from ..distributed.sharded import assemble_step

            return assemble_step(self.store, self.files)
        try:
            # (checked against what its metadata.json records: a step holding another save's
            # files, or files changed since, is refused, naming the file)
            return self.store.load(self.files, steps.CHECKPOINT_NAME, recorded=self.metadata["files"])
        except FileNotFoundError:
            # Compressed (perhaps since this info was read: the archive is written before the
            # checkpoint goes, so it is there whenever the checkpoint is not).
            archive = self.files / steps.COMPRESSED_NAME if self.store.local else None
            if archive is None or not os.path.lexists(archive):
                raise
        from ..compression import load_compressed

        return load_compressed(archive, follow_symlinks=False)  # a symlink planted there is refused


class CheckpointManager:
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
            step to share. Directories only (on object storage, or with ``comm``, every step is written whole); False:
            every step written whole.
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
        remote = targets.is_object_url(directory)
        if storage_options is not None and not remote:
            raise ValueError(
                f"{directory}: storage_options are for an object store URL ({targets.SCHEME}bucket/prefix)"
            )
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
        if remote:
            asked = {"validate": validate, "compress_kept": compress_kept, "track": track}
            refused = [name for name in _LOCAL_ONLY if asked[name] not in (None, False)]
            if verify_after_save == "process":
                refused.append('verify_after_save="process"')
            if refused:
                raise ValueError(f"{directory}: not available for a manager on object storage: {', '.join(refused)}")
        # An option whose package is missing is refused here, not at the first save it would fail.
        if compress_kept:
            extras.require("zstandard", "compress_kept=True")
        if progress:
            extras.require("tqdm.auto", "progress=True")
        self.policy = policy
        self.save_every = save_every
        self.async_save = async_save
        self._fork_save = fork_save  # (full saves of ONNX Runtime's state, forked: see _forked)
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
        self.store = open_store(directory, storage_options, writer=writer, create=writer)
        if writer:
            self.store.remove_proven_leftovers()
        self.directory: Any = Path(directory) if self.store.local else self.store.name
        # Steps share what is unchanged only in a directory of this machine, and not sharded.
        self.share_unchanged = share_unchanged and self.store.local and self.comm is None
        self.url = self.store.name
        self._where = self.store.name
        self._lock = threading.Lock()  # guards _checkpoints: the background thread commits into it
        self._checkpoints: dict[int, CheckpointInfo] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
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
                self.artifacts = _artifacts.recorded(self.store, None if latest is None else latest._step, missing)
            except BaseException:
                self.store.close()
                raise
        # The run's id: the one given, else the latest checkpoint's (a resumed run keeps its id),
        # else a new one; with comm, rank 0's on every rank.
        self.run_id = run_id or (latest.metadata.get("run_id") if latest else None) or uuid.uuid4().hex
        if self.comm is not None:
            self.run_id = self.comm.broadcast(self.run_id)
        self._reporter: Reporter | None = None
        if track is not None and self._is_root:
            run = TrackedRun(self.run_id, Path(self.directory), self.config, writer=not read_only)
            self._reporter = Reporter(tracker_for(track), run, self.all)
        # Last: a failure above leaves no handler installed.
        self._preemption = Preemption(preemption_signals, preemption_grace, self._where)
        self._preemption_saved = False
        # A manager dropped without close() puts its handlers back too (they hold no reference to it).
        weakref.finalize(self, self._preemption.restore)

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
        the loop should stop once :meth:`should_save`'s save is done."""
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
        with interrupts.held(not self.async_save and self.comm is None and self.store.local) as hold:  # noqa: F841
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
            self._write_and_commit(snapshot, step, meta, include_optimizer_state)
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
        self, state: CheckpointState | _ForkedStep, step: int, meta: dict[str, Any], include_optimizer_state: bool
    ) -> None:
        """The step transaction of one save: stage, write, verify, metadata, commit; then
        retention and the tracker's report."""
        if isinstance(state, _ForkedStep):
            self._commit_forked(state, meta)
            return
        with self._naming_step(step):
            core = state.core_state(include_optimizer_state)
        attempt = self.store.begin(step)
        previous = self.latest() if self.share_unchanged else None
        try:
            self.store.write_checkpoint(
                attempt,
                steps.CHECKPOINT_NAME,
                core,
                external_data_threshold=self.external_data_threshold,
                durable=self.durable,
                progress=self.progress,
                share_with=None if previous is None else Step(previous.step, previous.metadata, previous.files),
            )
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

    def _commit_forked(self, forked: _ForkedStep, meta: dict[str, Any]) -> None:
        """The rest of a forked save's step transaction, in the background thread: the child
        waited for (its deadline), its checkpoint sealed and committed into the attempt, then
        as any save (graphs, verify, metadata, commit, retention, report)."""
        attempt = forked.attempt
        try:
            forked.child.finish(durable=self.durable)
            self.store.record_checkpoint(attempt, steps.CHECKPOINT_NAME)
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
        if not self.store.local:
            meta["attempt"] = attempt.where
        if self.verify_after_save == "process":
            _verify_in_new_process(Path(attempt.folder), meta, self.verify_timeout)
        elif self.verify_after_save:
            verify_step(self.store, Step(attempt.step, meta, attempt.folder))
        if self.validate is not None:
            self.validate.validate(Path(attempt.folder) / steps.CHECKPOINT_NAME, meta.get("metrics"))
        interrupts.before_commit()  # (a Ctrl-C held so far: raised now, nothing committed)
        step = self.store.commit(attempt, steps.METADATA_NAME, _metadata.encode(meta), durable=self.durable)
        return CheckpointInfo.of(self.store, step)

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
        """Every rank writes its shard into rank 0's attempt; rank 0 adds the index inside it
        and commits the step's metadata.json once all have succeeded."""
        from ..distributed.sharded import encode_index, write_shards

        assert self.comm is not None
        committed: list[CheckpointInfo] = []

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
        )
        # Rank 0 knows what it committed; the other ranks read it back.
        info = committed[0] if committed else self._read_step(step)
        self._committed(info)

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
                self.store.retire(Step(info.step, info.metadata, info.files))
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
        return self._reading(step, lambda info: info.load())

    def _reading(self, step: int | None, read: Any) -> Any:
        """``read(info)`` of the checkpoint of ``step`` (default: the latest). A reader whose step
        retention deletes meanwhile (a race, not damage: any failure, once the step is gone) looks
        again: the new latest, or for a step asked by number, the news that it is gone."""
        attempts = 10 if self.read_only else 1
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
            return _artifacts.training_session(info.load(), graphs, chosen, os.fspath(info.url))

        return self._reading(step, session)

    def restore_sharded(
        self, step: int | None = None, *, slices: Mapping[str, Any] | None = None
    ) -> tuple[CheckpointState, dict[str, Any]]:
        """This rank's part of the checkpoint of ``step`` (default: the latest) and the
        :class:`ortckpt.distributed.Slice` of each parameter it holds, as
        :func:`ortckpt.distributed.load_sharded` gives them (resharding to this world size)."""
        from ..distributed.sharded import load_step

        info = self._info(step)
        return load_step(self.store, Step(info.step, info.metadata, info.files), comm=self.comm, slices=slices)

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

    def verify(self, step: int | None = None) -> Verified:
        """:func:`ortckpt.verify` on the checkpoint of ``step`` (default: the latest): every
        file's size and SHA-256 against its metadata, then every value and property decoded."""
        return self._reading(step, lambda info: verify_step(self.store, Step(info.step, info.metadata, info.files)))

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        return f"CheckpointManager({self._where!r}, steps={self.all_steps()}{mode})"


# The manager of an object store prefix is the same class (kept as a name for older code).
ObjectStoreCheckpointManager = CheckpointManager


@dataclass
class _ForkedStep:
    """A forked save's step: its attempt, and the child writing its checkpoint."""

    attempt: Attempt
    child: Any  # a forked_save.ForkedSave (imported on first use)


def _verify_in_new_process(directory: Path, meta: dict[str, Any], timeout: float | None) -> None:
    """Verifies the staged step in a fresh Python process that imports what this one did."""
    if timeout is None:
        timeout = child.default_timeout(sum(int(f.get("bytes", 0)) for f in meta["files"].values()))
    _metadata.write(directory, meta, False)  # what verify checks the files against
    try:
        child.run(child.verify, (str(directory),), subject=directory, what="verification process", timeout=timeout)
    finally:
        os.unlink(directory / steps.METADATA_NAME)
