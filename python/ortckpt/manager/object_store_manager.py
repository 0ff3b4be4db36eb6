"""A checkpoint manager whose run lives under an object store prefix: what
``CheckpointManager("s3://bucket/run", storage_options=...)`` returns.

Layout under the prefix: one folder per step, ``step_00000100/``, holding ``metadata.json``
(as in a directory, plus ``attempt``) and the folder of the save that committed it,
``<attempt: 32 hex digits>/checkpoint`` (and ``checkpoint.data``). A save streams its
checkpoint into a fresh attempt folder (:func:`ortckpt.object_store.save_at`, SHA-256s taken
as the bytes go), then commits by creating ``metadata.json`` with a conditional PUT: of two
writers of one step, one commits and the other gets CheckpointExistsError; a save that fails
or is killed before that leaves objects that no metadata names, which nothing reads. Deleting
a step removes its ``metadata.json`` first (the step is gone at once), then its objects.

An object store holds no locks, so nothing proves another writer absent: the objects of saves
that never committed are removed only by :meth:`ObjectStoreCheckpointManager.remove_leftovers`,
called when you know that no other writer is saving under the prefix. One writer per prefix, as
with a directory (where the lock enforces it); any number of readers (``read_only=True``).
"""

from __future__ import annotations

import datetime
import hashlib
import secrets
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import _boundary, documents, object_store, steps
from ..checkpoint_state import CheckpointState
from ..errors import CheckpointExistsError
from . import metadata as _metadata
from .common import ManagerBase, as_step
from .integrity import Verified, verify_step_objects
from .retention import RetentionPolicy


@dataclass(frozen=True)
class ObjectCheckpointInfo:
    """One committed checkpoint under an object store prefix."""

    step: int
    url: str  # the step's folder: s3://bucket/prefix/step_00000100
    metadata: dict[str, Any]
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def folder(self) -> str:
        """Where the step's files are: the committed attempt's folder (a step uploaded from
        a directory, e.g. by ``aws s3 sync``, names none: its files are in the step's)."""
        attempt = self.metadata.get("attempt")
        return f"{self.url}/{attempt}" if attempt else self.url

    @property
    def path(self) -> str:
        """The checkpoint's URL: what ``load_checkpoint`` takes (with ``storage_options``)."""
        return f"{self.folder}/{steps.CHECKPOINT_NAME}"

    @property
    def metrics(self) -> dict[str, Any]:
        return self.metadata.get("metrics") or {}

    @property
    def epoch(self) -> int | None:
        return self.metadata.get("epoch")

    @property
    def rng_state(self) -> dict[str, Any] | None:
        return self.metadata.get("rng_state")

    @property
    def sharded(self) -> bool:
        """Whether this is a sharded checkpoint (one shard per rank and an index)."""
        return steps.INDEX_NAME in self.metadata["files"]

    def load(self, *, lazy: bool = True) -> CheckpointState:
        """The state: the checkpoint downloaded, its external data read by ranged GETs as
        tensors are used (or downloaded whole without ``lazy``); a sharded one assembled
        whole, in this process."""
        if self.sharded:
            from ..distributed import SingleProcess, load_sharded

            return load_sharded(self.folder, comm=SingleProcess(), storage_options=self.storage_options)[0]
        return CheckpointState.load_checkpoint(self.path, storage_options=self.storage_options, lazy=lazy)


# The directory manager's options that have no meaning, or no implementation yet, here.
_NOT_ON_OBJECT_STORAGE = ("validate", "compress_kept", "track", "progress")


class ObjectStoreCheckpointManager(ManagerBase):
    """:class:`~ortckpt.CheckpointManager` on an object store prefix (``s3://bucket/prefix``):
    the same methods, arguments and retention; see the module's description for the layout.

    ``durable`` is accepted and changes nothing (an object is durable once its PUT returns);
    ``validate``, ``compress_kept``, ``track``, ``progress`` and ``verify_after_save="process"``
    are refused (ValueError). ``storage_options`` configure the store as for
    :func:`ortckpt.object_store.locate`. With ``comm``, every rank uploads its shard into the
    step's attempt folder (with its index), and rank 0 commits, keeps and deletes.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        save_every: int | datetime.timedelta | None = None,
        max_to_keep: int | None = None,
        keep_best: tuple[str, Literal["min", "max"], int] | None = None,
        keep_every: int | None = None,
        async_save: bool = False,
        durable: bool = True,
        verify_after_save: bool | Literal["process"] = False,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        external_data_threshold: int = _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD,
        comm: Any = None,
        read_only: bool = False,
        **unsupported: Any,
    ) -> None:
        if comm is not None and (async_save or verify_after_save):
            raise ValueError("async_save and verify_after_save are not available for sharded saves (comm=)")
        refused = sorted(name for name, value in unsupported.items() if value not in (None, False))
        unknown = sorted(name for name in unsupported if name not in _NOT_ON_OBJECT_STORAGE)
        if unknown:
            raise TypeError(f"CheckpointManager() got unexpected keyword arguments: {', '.join(unknown)}")
        if verify_after_save == "process":
            refused.append('verify_after_save="process"')
        if refused:
            raise ValueError(f"{url}: not available for a manager on object storage: {', '.join(refused)}")
        self.prefix = object_store.locate(url, storage_options)
        self.url = self.prefix.url
        self.storage_options = dict(storage_options or {})
        self._start(
            self.url,
            RetentionPolicy(max_to_keep, keep_best, keep_every),
            save_every=save_every,
            async_save=async_save,
            read_only=read_only,
            durable=durable,  # kept, and changes nothing: an object is durable once its PUT returns
            verify_after_save=verify_after_save,
            run_id=run_id,
            config=config,
            external_data_threshold=external_data_threshold,
            comm=comm,
        )
        self.reload()
        self._adopt_run_id(run_id)

    # --- what is there -----------------------------------------------------------------

    def reload(self) -> None:
        """Lists the prefix again: what ``all()``, ``latest()`` and ``restore()`` see. A
        read-only manager does this on every query; a writer knows what it wrote."""
        found = self._scan()
        with self._lock:
            self._checkpoints = found

    def _scan(self, listed: list[tuple[str, int]] | None = None) -> dict[int, ObjectCheckpointInfo]:
        """Every committed step whose metadata.json reads and validates (from ``listed``, the
        prefix's listing, or a new one); a damaged one is skipped with a warning (and kept, for a
        person to look at)."""
        if listed is None:
            listed = object_store.list_keys(self.prefix)
        found = {}
        for step, size in sorted(steps.steps_holding(listed, steps.METADATA_NAME).items()):
            folder = self._step_folder(step)
            where = folder.child(steps.METADATA_NAME)
            if size > documents.METADATA.max_bytes:
                warnings.warn(f"{where.url}: skipped, {size} bytes is over its cap", RuntimeWarning, stacklevel=3)
                continue
            try:
                data = bytes(object_store.get(where))
            except FileNotFoundError:  # deleted since it was listed
                continue
            try:
                meta = documents.parse(documents.METADATA, data, where.url)
            except documents.DocumentError as e:
                warnings.warn(f"{where.url}: skipped, its metadata is damaged: {e}", RuntimeWarning, stacklevel=3)
                continue
            if meta["step"] != step:
                warnings.warn(f"{where.url}: skipped, it says step {meta['step']}", RuntimeWarning, stacklevel=3)
                continue
            found[step] = ObjectCheckpointInfo(step, folder.url, meta, self.storage_options)
        return found

    def _step_folder(self, step: int) -> object_store.Location:
        return self.prefix.child(steps.step_directory_name(step))

    # --- saving --------------------------------------------------------------------------

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
        """As :meth:`ortckpt.CheckpointManager.save`: uploads, then commits ``step``. With
        ``comm``, ``state`` is this rank's part and ``slices`` say which part of a split
        parameter it holds (:class:`ortckpt.distributed.Slice`)."""
        if slices is not None and self.comm is None:
            raise ValueError("slices are for sharded saves: create the manager with comm=")
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
        self._write(self._write_and_commit, step, snapshot, step, meta, include_optimizer_state)

    def _write_and_commit(
        self, state: CheckpointState, step: int, meta: dict[str, Any], include_optimizer_state: bool
    ) -> None:
        folder = self._step_folder(step)
        attempt = secrets.token_hex(16)  # unguessable: no other save writes into this folder
        try:
            uploaded = object_store.save_at(
                folder.child(attempt).child(steps.CHECKPOINT_NAME),
                state,
                include_optimizer_state,
                self.external_data_threshold,
            )
            meta = {**meta, "attempt": attempt, "files": uploaded}
            info = ObjectCheckpointInfo(step, folder.url, meta, self.storage_options)
            if self.verify_after_save:
                self._verify(info)
            document = _metadata.encode(meta)
        except BaseException:
            self._remove_quietly(folder.child(attempt))
            raise
        # The commit. An error here is not proof that it failed (the PUT may have landed and
        # its answer been lost), so the uploaded objects stay: remove_leftovers() finds them.
        if not object_store.put_new(folder.child(steps.METADATA_NAME), document):
            self._remove_quietly(folder.child(attempt))
            raise CheckpointExistsError(f"{folder.url}: another writer committed step {step} first")
        with self._lock:
            self._checkpoints[step] = info
        self._apply_retention()

    def _save_sharded(
        self,
        state: CheckpointState,
        step: int,
        meta: dict[str, Any],
        include_optimizer_state: bool,
        slices: Mapping[str, Any] | None,
    ) -> None:
        """Every rank uploads its shard into the step's attempt folder; rank 0 adds the index
        there and commits the step's metadata.json (naming the attempt, with every object's
        SHA-256) once all have succeeded, as a single save commits."""
        from ..distributed.sharded import encode_index, write_shards

        assert self.comm is not None
        folder = self._step_folder(step)
        digests: dict[str, Any] = {}  # rank 0's: each uploaded shard's size and SHA-256
        committing: list[bool] = []  # set once the commit's PUT is sent: from then on it may have landed

        def commit(where: str, index: dict[str, Any]) -> None:
            attempt = where.rsplit("/", 1)[-1]
            index_at = folder.child(attempt).child(steps.INDEX_NAME)
            data = encode_index(index, index_at.url)
            object_store.put(index_at, data)
            files = {**digests, steps.INDEX_NAME: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
            meta.update(attempt=attempt, files=files)
            committing.append(True)
            if not object_store.put_new(folder.child(steps.METADATA_NAME), _metadata.encode(meta)):
                committing.clear()  # another writer's commit: ours certainly did not land
                raise CheckpointExistsError(f"{folder.url}: another writer committed step {step} first")

        def abandon(where: str) -> None:
            if not committing:
                self._remove_quietly(object_store.locate(where, self.storage_options))

        write_shards(
            self.comm,
            state,
            slices,
            prepare=lambda: folder.child(secrets.token_hex(16)).url,
            commit=commit,
            step=step,
            include_optimizer_state=include_optimizer_state,
            durable=False,
            external_data_threshold=self.external_data_threshold,
            abandon=abandon,
            storage_options=self.storage_options,
            digests=digests,
        )
        committed = self.comm.broadcast(meta if self._is_root else None)  # rank 0's, as committed
        with self._lock:
            self._checkpoints[step] = ObjectCheckpointInfo(step, folder.url, committed, self.storage_options)
        self._apply_retention()

    def _remove_quietly(self, folder: object_store.Location) -> None:
        """Removes what a failed save uploaded; what stays is for remove_leftovers()."""
        try:
            object_store.remove_under(folder)
        except OSError as e:
            warnings.warn(f"{folder.url}: could not remove a failed save's objects: {e}", RuntimeWarning, stacklevel=3)

    def delete(self, step: int) -> None:
        """Deletes the checkpoint of ``step``: its metadata.json first (from then on it is not
        listed), then its objects. A step whose metadata is already gone is forgotten."""
        self._check_writable("delete")
        step = as_step(step)
        with self._lock:
            info = self._checkpoints.get(step)
        if info is None:
            raise KeyError(f"{self.url}: no checkpoint of step {step}")
        if self._is_root:  # rank 0 deletes; the other ranks only forget it
            folder = self._step_folder(step)
            object_store.remove([folder.child(steps.METADATA_NAME)])
        with self._lock:
            self._checkpoints.pop(step, None)
        if self._is_root:
            object_store.remove_under(folder)

    def remove_leftovers(self) -> list[str]:
        """Deletes the objects under step folders that no committed metadata.json names: what
        saves that failed or were killed mid-upload left, and the uploads of writers that lost
        a step to another. Call it only when no other writer is saving under this prefix:
        nothing on an object store proves that, so it never happens by itself. A step whose
        metadata is damaged keeps everything, as does a step of ``save_sharded`` (an index.json).
        Returns the URLs deleted."""
        self._check_writable("remove leftovers")
        self.wait()
        listing = object_store.list_keys(self.prefix)  # one listing, judged whole
        committed = self._scan(listing)
        listed = steps.steps_holding(listing, steps.METADATA_NAME)
        sharded = steps.steps_holding(listing, steps.INDEX_NAME)
        doomed = []
        for key, _ in listing:
            folder, _, rest = key.partition("/")
            step = steps.step_of(folder)
            if step is None or not rest or step in sharded:
                continue  # not a step's, or a save_sharded step's: not this manager's to judge
            info = committed.get(step)
            if info is None and step in listed:
                continue  # a step with damaged metadata: kept whole
            if info is not None:
                attempt = info.metadata.get("attempt")
                in_attempt = rest.startswith(f"{attempt}/") if attempt else "/" not in rest  # (none: files beside)
                if rest == steps.METADATA_NAME or in_attempt:
                    continue  # the committed files
            doomed.append(self.prefix.child(key))
        object_store.remove(doomed)
        return [location.url for location in doomed]

    def close(self) -> None:
        """Waits for the pending save and stops the background thread. Queries and restores
        still work after."""
        try:
            self._stop_saving()
        finally:
            self._closed = True

    def __enter__(self) -> ObjectStoreCheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- restoring -----------------------------------------------------------------------

    def restore(self, step: int | None = None, *, lazy: bool = True) -> CheckpointState:
        """Loads the checkpoint of ``step`` (default: the latest): downloaded, its external
        data read by ranged GETs as tensors are used (or downloaded whole without ``lazy``).
        A reader whose step is deleted while it loads tries again with the new latest. With
        ``comm``, this rank's part: see :meth:`restore_sharded`."""
        if self.comm is not None:
            return self.restore_sharded(step)[0]
        return self._retrying(step, lambda info: info.load(lazy=lazy))

    def restore_sharded(
        self, step: int | None = None, *, slices: Mapping[str, Any] | None = None
    ) -> tuple[CheckpointState, dict[str, Any]]:
        """This rank's part of the checkpoint of ``step`` (default: the latest) and the
        :class:`ortckpt.distributed.Slice` of each parameter it holds, as
        :func:`ortckpt.distributed.load_sharded` gives them (resharding to this world size)."""
        from ..distributed import load_sharded

        info = self._info(step)
        return load_sharded(info.folder, comm=self.comm, slices=slices, storage_options=self.storage_options)

    def verify(self, step: int | None = None) -> Verified:
        """Checks the checkpoint of ``step`` (default: the latest): every object's size and
        SHA-256 against its metadata (read as a stream), then that it decodes and every value
        and property can be formed. Raises CheckpointIntegrityError listing what is wrong."""
        return self._verify(self._info(step))

    def _verify(self, info: ObjectCheckpointInfo) -> Verified:
        return verify_step_objects(
            object_store.locate(info.url, self.storage_options), info.metadata, self.storage_options
        )

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        return f"CheckpointManager({self.url!r}, steps={self.all_steps()}{mode})"
