"""One committed checkpoint of a :class:`~ortckpt.CheckpointManager`, as its readers see it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import steps
from ..checkpoint_state import CheckpointState
from ..stepstore import Folder, Step, StepStore
from . import artifacts as _artifacts


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint of a :class:`CheckpointManager`."""

    step: int
    directory: Any  # the step's folder: a Path in a directory, its URL on object storage (trackers: a Path)
    metadata: dict[str, Any]
    store: StepStore = field(repr=False, compare=False)
    files: Folder | None = field(repr=False, compare=False, default=None)  # where its files are (the store's)

    @classmethod
    def of(cls, store: StepStore, step: Step) -> CheckpointInfo:
        # (a directory's files are in the step's directory; on object storage, in its attempt's folder)
        return cls(step.number, store.step_folder(step.number), step.document, store, step.folder)

    @property
    def _files(self) -> Folder:
        assert self.files is not None  # (every info is made by `of`)
        return self.files

    @property
    def folder(self) -> Path | str:
        """Where the step's files are: its directory, or on object storage the folder of the
        save that committed it (a URL)."""
        return self.store.user_path(self._files)

    @property
    def url(self) -> str:
        """The step folder's URL (on object storage) or path."""
        return os.fspath(self.directory)

    @property
    def path(self) -> Path | str:
        """The checkpoint file: what ``load_checkpoint`` (ortckpt's or ONNX Runtime's) takes; a
        URL on object storage."""
        return self.store.user_path(self._files, steps.CHECKPOINT_NAME)

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
    def step_record(self) -> Step:
        return Step(self.step, self.metadata, self._files)

    @property
    def artifacts(self) -> dict[str, Path]:
        """The run's graphs this step records (``CheckpointManager(artifacts=...)``): role ->
        a local ONNX file, checked against the size and SHA-256 its metadata.json records (on
        object storage, downloaded once into a private folder of this process). Empty when the
        step records none."""
        return _artifacts.local_graphs(self.store, self.step_record)

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

    def load(self, *, resuming: bool = False) -> CheckpointState:
        """The whole state, in this process (a sharded checkpoint's pieces assembled, a
        compressed one decompressed). On object storage, a local copy: it stays usable
        whatever retention deletes later, as the mapped files of a directory do. ``resuming``:
        its writer's restore (:meth:`CheckpointManager.restore`), whose next save on object
        storage shares the values of the data object this step shares (see
        :mod:`ortckpt.stepstore.shared`)."""
        if self.sharded:
            from ..distributed.sharded import assemble_step

            return assemble_step(self.store, self._files, self.metadata.get("files", {}))
        try:
            # (checked against what its metadata.json records: a step holding another save's
            # files, or files changed since, is refused, naming the file)
            return self.store.load(
                self._files,
                steps.CHECKPOINT_NAME,
                recorded=self.metadata["files"],
                resuming=self.step_record if resuming else None,
            )
        except FileNotFoundError:
            # Compressed (perhaps since this info was read: the archive is written before the
            # checkpoint goes, so it is there whenever the checkpoint is not; compress_kept is
            # for steps on this machine only).
            archive = self.store.local_path(self._files, steps.COMPRESSED_NAME)
            if archive is None or not os.path.lexists(archive):
                raise
        from ..compression import load_compressed

        return load_compressed(archive, follow_symlinks=False)  # a symlink planted there is refused
