"""The layout of a run of steps: the one place that spells it, for both backends of
:mod:`ortckpt.stepstore` (a directory, an object store prefix).

- **A step** is a folder ``step_00000100``. A manager's step holds ``checkpoint`` (its
  ``.data`` beside it when large) and is committed by ``metadata.json`` (files, sizes,
  SHA-256s, metrics); once compressed (``compress_kept``), ``checkpoint.zst`` replaces the
  checkpoint's files. A sharded step holds one ``shard-RRRRR-of-WWWWW`` checkpoint per rank
  that held tensors and is committed by ``index.json`` (whose schema, in
  :mod:`ortckpt.documents`, checks those names); a manager's sharded step has both documents.
- **In a directory** a step is written privately under a hidden temporary name
  (``.step_<n>.tmp-<random>``), its documents last, and committed by renaming it to its name;
  deleted by renaming it out of sight (``.step_<n>.deleting-<random>``) first. One writer at a
  time holds ``.ortckpt-writer.lock``.
- **Under an object store prefix** a save uploads its files into a folder of its own,
  ``step_<n>/<attempt: 32 hex digits>/``, and commits by creating ``step_<n>/metadata.json`` (or
  ``index.json``) naming the attempt, with a conditional PUT. Retiring a step first creates
  ``step_<n>/retired-<attempt>``, which hides it from every reader and marks its objects for
  deletion until they are all gone.
- **The run's graphs** (``CheckpointManager(artifacts=...)``): each distinct ONNX model is stored
  once, named by its SHA-256, in the run's ``artifacts/<sha256>.onnx``. In a directory each step
  holds its graphs as ``<role>_model.onnx`` (``training_model.onnx``...), hard links to those
  files: a step folder is whole on its own, and a stored graph no step links to any more (one
  link left) is removed. Under an object store prefix a step's metadata.json names the stored
  objects by digest.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path

from .documents import ATTEMPT as ATTEMPT
from .documents import INDEX_NAME as INDEX_NAME  # checked by the index's schema
from .documents import artifact_name as artifact_name  # checked by metadata.json's schema
from .documents import shard_file_name as shard_file_name

STEP_DIR = re.compile(r"step_(\d+)")
TEMPORARY = re.compile(r"\.step_\d+\.(tmp|deleting)-.*", re.DOTALL)
RETIRED_PREFIX = "retired-"
WRITER_LOCK_NAME = ".ortckpt-writer.lock"
CHECKPOINT_NAME = "checkpoint"  # a manager's checkpoint file
METADATA_NAME = "metadata.json"  # a manager's record of the step: files, sizes, SHA-256s, metrics
COMPRESSED_NAME = "checkpoint.zst"  # a kept step's checkpoint files, compressed (compress_kept=True)
ARTIFACTS_FOLDER = "artifacts"  # the run's graphs, one file (or object) per distinct content
STORED_GRAPH = re.compile(r"[0-9a-f]{64}\.onnx")


# On object storage, the data objects that a run's steps share (each step's metadata.json names
# the one its checkpoint reads from): named by the pair id their trailer carries, fresh for each.
SHARED_FOLDER = "shared"
SHARED_DATA = re.compile(r"[0-9a-f]{32}\.data")


def shared_data_name(pair: str) -> str:
    """The key, under the run's prefix, of the shared data object whose pair id is ``pair`` (hex)."""
    return f"{SHARED_FOLDER}/{pair}.data"


def stored_graph_name(sha256: str) -> str:
    """The name of a stored graph in the run's artifacts folder: its content's digest."""
    return f"{sha256}.onnx"


# The documents that commit a step, in the order a reader prefers them.
COMMIT_DOCUMENTS = (METADATA_NAME, INDEX_NAME)


def step_directory_name(step: int) -> str:
    return f"step_{step:08d}"


def step_directory(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / step_directory_name(step)


def step_of(name: str) -> int | None:
    """The step a committed step folder's name gives, or None for any other name (``step_1``
    is not ``step_00000001``: only the name a save gives is a step's)."""
    match = STEP_DIR.fullmatch(name)
    if match is None or step_directory_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


def temporary_name(step: int, purpose: str) -> str:
    """A hidden name for a step directory being written (``tmp``) or deleted (``deleting``)."""
    return f".{step_directory_name(step)}.{purpose}-{secrets.token_hex(16)}"


def new_attempt() -> str:
    """A fresh attempt: the folder of one save under an object store step, unguessable so that
    no other save writes into it."""
    return secrets.token_hex(16)


def retired_marker(attempt: str) -> str:
    return f"{RETIRED_PREFIX}{attempt}"


def split_key(key: str) -> tuple[int, str] | None:
    """(step, the rest of the key) for a key under a step folder of a prefix's listing, or None."""
    folder, _, rest = key.partition("/")
    step = step_of(folder)
    return None if step is None or not rest else (step, rest)


def steps_holding(listed: Iterable[tuple[str, int]], name: str) -> dict[int, int]:
    """step -> size of ``step_<n>/<name>``, from an object store prefix's listing ((key under
    the prefix, size) pairs): the steps that ``name`` (metadata.json, index.json) commits."""
    found = {}
    for key, size in listed:
        parts = split_key(key)
        if parts is not None and parts[1] == name:
            found[parts[0]] = size
    return found
