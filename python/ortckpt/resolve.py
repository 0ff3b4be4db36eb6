"""What a checkpoint name means, resolved in one place: for every command of the CLI and for
:meth:`CheckpointState.load_checkpoint` (which takes a step folder as it takes a file).

A name is, wherever a checkpoint is read:

- a checkpoint file (and its ``.data``), or an ``s3://bucket/key`` checkpoint object;
- a :class:`~ortckpt.CheckpointManager` step folder, local (``checkpoints/step_00001000``) or
  ``s3://`` (the checkpoint then sits in the folder of the save that committed it, which the
  step's metadata.json names): its ``checkpoint``, or for a sharded step the shards assembled,
  or for a compressed one (``compress_kept``) the archive decompressed.

Anything else is refused with one line naming it: a bucket, a run of steps (the folder that
holds the step folders: the message names its latest step), a directory that is no step.

What has no single file to read (a sharded or compressed step, or an object for a command that
reads local files only) is written into a private temporary directory for the command's
duration; :func:`shown` puts the user's name back in messages that name that copy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import object_store, safe_io, steps, targets
from .errors import NotACheckpointError
from .stepstore import Step, StepStore, open_store, step_of_checkpoint_object

# The temporary copies made: their path -> the name the user gave (kept after the copy is gone:
# the error that ended its block is reported after it).
_copies: dict[str, str] = {}


@dataclass(frozen=True)
class StepFolder:
    """A committed step folder the user named: its store, and the step its document commits."""

    given: str
    store: StepStore
    step: Step

    @property
    def sharded(self) -> bool:
        return "shards" in self.step.document or steps.INDEX_NAME in self.step.document.get("files", {})

    @property
    def compressed(self) -> bool:
        return "compressed" in self.step.document

    def files(self) -> dict[str, int]:
        """The step's files as its document records them: {the user's name for it: bytes}."""
        document = self.step.document
        if "files" in document:
            sizes = {name: entry["bytes"] for name, entry in document["files"].items()}
        else:  # a sharded step without a manager: its index names the shards' files
            sizes = {name: size for shard in document["shards"] for name, size in shard["files"].items()}
        return {f"{self.given.rstrip('/')}/{name}": size for name, size in sorted(sizes.items())}


def shown(text: str) -> str:
    """``text`` with every temporary copy's path replaced by the name the user gave."""
    for copy, given in _copies.items():
        text = text.replace(copy, given)
    return text


def step_folder(given: str, storage_options: Mapping[str, Any] | None = None) -> StepFolder | None:
    """The step folder ``given`` names (on object storage also by the URL of its checkpoint
    object, which holds no values of its own when the step shares them), or None when it names
    a file or an object (which the library then reads, or refuses naming it). A directory or
    prefix that is neither is refused (:class:`NotACheckpointError`); a step whose document is
    damaged raises the document's error."""
    if targets.is_object_url(given):
        return _object_step(given, storage_options)
    path = Path(given)
    if not path.is_dir():
        return None
    store = open_store(path, writer=False)
    if not any(os.path.lexists(path / name) for name in steps.COMMIT_DOCUMENTS):
        raise _not_a_checkpoint(given, _committed_steps(store), "a directory")
    step = store.locate()  # (a document that is there is read, or refused naming it)
    if step is None:  # (deleted since it was seen)
        raise FileNotFoundError(2, "no such file", str(path / steps.METADATA_NAME))
    return StepFolder(given, store, step)


def _object_step(given: str, storage_options: Mapping[str, Any] | None) -> StepFolder | None:
    location = targets.object_location(given, storage_options)
    if not location.key:
        raise NotACheckpointError(
            f"{given}: a bucket, not a checkpoint object or step folder ({targets.SCHEME}bucket/key)"
        )
    if object_store.head(location) is not None:  # an object: a plain one, or a step's checkpoint
        of_step = step_of_checkpoint_object(given, storage_options)
        return None if of_step is None else StepFolder(given, *of_step)
    store = open_store(given, storage_options, writer=False)
    step = store.locate()
    if step is not None:
        return StepFolder(given, store, step)
    found = _committed_steps(store)
    if found:
        raise _not_a_checkpoint(given, found, "a prefix")
    return None


def _committed_steps(store: StepStore) -> list[int]:
    """The steps a run holds, from one listing (a hint for the message: no document is read)."""
    try:
        return store.listed_steps()
    except (OSError, ValueError, RuntimeError):  # (the listing failed: say what the name is not)
        return []


def _not_a_checkpoint(given: str, found: list[int], what: str) -> NotACheckpointError:
    if found:
        latest = f"{given.rstrip('/')}/{steps.step_directory_name(found[-1])}"
        return NotACheckpointError(
            f"{given}: a run of steps ({len(found)}), not one checkpoint: name a step, e.g. {latest}"
        )
    if what == "a directory":
        problem = _legacy(given)
        if problem is not None:
            return NotACheckpointError(problem)
    return NotACheckpointError(
        f"{given}: {what}, but not a checkpoint nor a step folder (one holds {steps.METADATA_NAME})"
    )


def _legacy(given: str) -> str | None:
    from .checkpoint_state import legacy_layout_problem

    return legacy_layout_problem(given)


@dataclass(frozen=True)
class Resolved:
    """What a checkpoint argument resolved to: the file the library reads (a path, or an
    ``s3://`` URL), the step folder it is the checkpoint of (if any), and whether it is a
    temporary copy (then gone after the block)."""

    path: str
    step: StepFolder | None = None
    copy: bool = False


@contextlib.contextmanager
def checkpoint(given: str, *, local: bool = False) -> Iterator[Resolved]:
    """The checkpoint file that ``given`` names (a local one with ``local``), for the block: see
    the module's description."""
    found = step_folder(given)
    if found is None:
        if local and targets.is_object_url(given):
            target = targets.checkpoint(given)
            assert isinstance(target, targets.ObjectFile)
            with _copy(given) as path:
                target.download(path)
                yield Resolved(os.fspath(path), None, True)
            return
        yield Resolved(given)
        return
    store, folder = found.store, found.step.folder
    if found.sharded:
        from .distributed.sharded import merge

        with _copy(given) as path:
            merge(given, path, durable=False)  # (the step's shards, assembled into one checkpoint)
            yield Resolved(os.fspath(path), found, True)
    elif found.compressed:
        from .compression import decompress

        with _copy(given) as path, archive_of(found) as archive:
            decompress(archive, path, follow_symlinks=False)
            yield Resolved(os.fspath(path), found, True)
    else:
        here = store.local_path(folder, steps.CHECKPOINT_NAME)
        if here is not None:
            if not os.path.lexists(here):
                raise FileNotFoundError(2, "missing (the step folder holds no checkpoint)", os.fspath(here))
            yield Resolved(os.fspath(here), found)
        elif local or store.shares_data(found.step):
            # (a step not on this machine: its objects, its data from the run's shared folder when it
            # shares one, which no reader of the checkpoint object alone would find beside it)
            with _copy(given) as path:
                store.download(folder, steps.CHECKPOINT_NAME, path, recorded=found.step.document.get("files"))
                yield Resolved(os.fspath(path), found, True)
        else:
            yield Resolved(os.fspath(store.user_path(folder, steps.CHECKPOINT_NAME)), found)


def load_step(given: str, *, verify: bool = False, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The checkpoint state of the step folder ``given`` (a directory, an ``s3://`` step folder or
    the checkpoint object of one): a plain step's checkpoint checked against what its
    metadata.json records (as a manager's restore checks it: sizes, checksum root, pair id), a
    sharded or compressed one assembled in a temporary copy (mapped: the state stays whole after
    the copy goes). A file or a plain object is loaded as it is; anything else is refused as
    :func:`step_folder` refuses it."""
    from .checkpoint_state import CheckpointState

    found = step_folder(given, storage_options)
    if found is None:  # (a file or an object, not a step)
        return CheckpointState.load_checkpoint(given, verify=verify, storage_options=storage_options)
    if found.sharded or found.compressed or verify:
        with checkpoint(given) as resolved:
            return CheckpointState.load_checkpoint(resolved.path, verify=verify)
    return found.store.load(found.step.folder, steps.CHECKPOINT_NAME, recorded=found.step.document.get("files"))


@contextlib.contextmanager
def checkpoints(given: Sequence[str], *, local: bool = False) -> Iterator[list[str]]:
    """The files :func:`checkpoint` resolves each of ``given`` to."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(checkpoint(name, local=local)).path for name in given]


@contextlib.contextmanager
def archive(given: str) -> Iterator[str]:
    """A local compressed archive for ``given``: a path as it is, an ``s3://`` archive's local
    copy, or a compressed step folder's ``checkpoint.zst``."""
    found = step_folder(given)
    if found is not None:
        if not found.compressed:
            raise NotACheckpointError(f"{given}: the step is not compressed (its checkpoint is there as it is)")
        with archive_of(found) as path:
            yield path
    elif targets.is_object_url(given):
        with _copy(given) as path:
            _download(targets.object_location(given), path)
            yield os.fspath(path)
    else:
        yield given


@contextlib.contextmanager
def archive_of(found: StepFolder) -> Iterator[str]:
    """A compressed step's ``checkpoint.zst`` (on ``s3://``, a local copy)."""
    here = found.store.local_path(found.step.folder, steps.COMPRESSED_NAME)
    if here is not None:
        yield os.fspath(here)
        return
    target = found.store.file(found.step.folder, steps.COMPRESSED_NAME)
    assert isinstance(target, targets.ObjectFile)  # (a step not on this machine: an object)
    with _copy(found.given) as path:
        _download(target.location, path)
        yield os.fspath(path)


def _download(location: Any, path: Path) -> None:
    fd = safe_io.create_exclusive(path)
    try:
        object_store.download_to(location, fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _copy(given: str) -> Iterator[Path]:
    """Where a temporary copy of ``given`` goes (removed after the block), its messages naming
    ``given``."""
    with safe_io.scratch_directory() as scratch:
        path = scratch / steps.CHECKPOINT_NAME
        _copies[os.fspath(path)] = given
        yield path


__all__ = [
    "NotACheckpointError",
    "Resolved",
    "StepFolder",
    "archive",
    "checkpoint",
    "checkpoints",
    "load_step",
    "shown",
    "step_folder",
]
