"""One step transaction, two backends: a run of steps in a local directory or under an object
store prefix (the layout: :mod:`ortckpt.steps`).

Every writer of steps (:class:`~ortckpt.CheckpointManager`, sharded saves with or without a
manager) goes through the same transaction, whatever the backend::

    attempt = store.begin(step)                       # stage: a private place for the files
    files = store.write_checkpoint(attempt, name, state, ...)   # write (sizes and SHA-256s)
    ...                                               # verify, validate: the caller's
    store.commit(attempt, steps.METADATA_NAME, doc)   # publish: the step appears whole, or not
    store.retire(step)                                # retention: the step goes whole
    store.remove_leftovers()                          # sweep what killed saves left

and every reader lists (:meth:`StepStore.scan`) and opens steps (:meth:`StepStore.file`) the
same way. :func:`backend` picks the backend (:mod:`.directory` or :mod:`.objects`) by
:func:`ortckpt.targets.is_object_url`, the one place a name is parsed as an ``s3://`` URL; what
differs between backends is behind :class:`StepStore`'s methods, and nowhere outside this package
(``tests/python/design/test_design_rules.py`` holds it).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import steps, targets
from .base import Attempt, Folder, LocalStep, Scan, Step, StepStore
from .directory import DirectoryStore
from .objects import ObjectStore


def backend(where: Any) -> type[DirectoryStore] | type[ObjectStore]:
    """The backend of a run at ``where`` (a directory, or an ``s3://`` prefix), unopened: what a
    caller asks before it opens the run (which options it can take)."""
    return ObjectStore if targets.is_object_url(where) else DirectoryStore


def open_store(
    where: Any,
    storage_options: Mapping[str, Any] | None = None,
    *,
    writer: bool,
    create: bool = False,
    saves: bool | None = None,
) -> StepStore:
    """The step store of a run (a directory or an ``s3://`` prefix). A ``writer`` of a
    directory holds its writer lock from now until :meth:`StepStore.close` (creating the
    directory first with ``create``) and sweeps what dead writers left. ``saves`` (default: a
    ``writer``): whether this process writes checkpoints into the run, as a rank other than 0 of a
    sharded manager does without being its writer (an object store then hashes what it restores,
    for its next save to share: see :mod:`.shared`)."""
    run = targets.run(where, storage_options)
    if isinstance(run, Path):
        return DirectoryStore(run, writer=writer, create=create)
    return ObjectStore(run, writer=writer, saves=saves)


def step_of_checkpoint_object(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[StepStore, Step] | None:
    """The committed step (its store, and the step) whose checkpoint object ``url`` is, on object
    storage (``step_<n>/<save>/checkpoint``: the step's metadata.json names that save's folder);
    None for any other object (a plain one, the leftover of a save that never committed)."""
    location = targets.object_location(url, storage_options)
    if location.key.rpartition("/")[2] != steps.CHECKPOINT_NAME:
        return None
    save_folder = location.parent()
    step_folder = save_folder.parent()
    if step_folder.url == save_folder.url:  # (no folder above the save's: no step)
        return None
    store = open_store(step_folder.url, storage_options, writer=False)
    step = store.locate()
    if step is None or store.user_path(step.folder, steps.CHECKPOINT_NAME) != location.url:
        return None
    return store, step


__all__ = [
    "Attempt",
    "DirectoryStore",
    "Folder",
    "LocalStep",
    "ObjectStore",
    "Scan",
    "Step",
    "StepStore",
    "backend",
    "open_store",
    "step_of_checkpoint_object",
]
