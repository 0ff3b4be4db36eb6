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
same way. :func:`open_store` picks the backend from what :func:`ortckpt.targets.run` found:
:mod:`.directory` or :mod:`.objects`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import targets
from .base import Attempt, Scan, Step, StepStore
from .directory import DirectoryStore
from .objects import ObjectStore


def open_store(
    where: Any, storage_options: Mapping[str, Any] | None = None, *, writer: bool, create: bool = False
) -> StepStore:
    """The step store of a run (a directory or an ``s3://`` prefix). A ``writer`` of a
    directory holds its writer lock from now until :meth:`StepStore.close` (creating the
    directory first with ``create``) and sweeps what dead writers left."""
    run = targets.run(where, storage_options)
    if isinstance(run, Path):
        return DirectoryStore(run, writer=writer, create=create)
    return ObjectStore(run)


__all__ = ["Attempt", "DirectoryStore", "ObjectStore", "Scan", "Step", "StepStore", "open_store"]
