"""``ortckpt.verify``: is this checkpoint whole, byte for byte, and does every tensor decode?"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import metadata as _metadata
from . import progress as _progress
from .checkpoint_state import CheckpointState
from .distributed.layout import INDEX_NAME
from .dtypes import PackedInt4
from .errors import CheckpointError, CheckpointIntegrityError

CHECKPOINT_NAME = "checkpoint"  # the checkpoint file inside a manager's step directory


@dataclass
class Verified:
    """What :func:`verify` checked."""

    path: Path
    step: int | None
    tensors: int
    tensor_bytes: int
    files: dict[str, str] = field(default_factory=dict)  # name -> SHA-256 checked (empty without metadata)


def verify(path: str | os.PathLike[str], *, progress: bool = False) -> Verified:
    """Re-reads a checkpoint and checks it: every file's size and SHA-256 against its
    metadata.json (for a :class:`~ortckpt.CheckpointManager` step directory), then that the
    checkpoint decodes and every parameter, momentum and property can be read in full.

    ``path`` is a step directory or a checkpoint file (then only decoding is checked: a bare
    file carries no hashes). A sharded step directory (:mod:`ortckpt.distributed`) has every
    shard its index names checked alike, and their sizes against the index. Raises :class:`~ortckpt.CheckpointIntegrityError` listing every
    problem found, each naming its file. ``progress``: a bar (tqdm) over the bytes read.
    """
    path = Path(path)
    bar = _progress.bar(f"verifying {path.name}") if progress else None
    try:
        return _verify(path, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


def _verify(path: Path, on_bytes: Any) -> Verified:
    problems: list[str] = []
    files: dict[str, str] = {}
    step = None
    checkpoints = [path]
    if path.is_dir():
        directory, checkpoints = path, [path / CHECKPOINT_NAME]
        sharded = (directory / INDEX_NAME).is_file()
        if sharded:
            checkpoints, problems = _shards_of(directory)
        try:
            meta = _metadata.read(directory)
        except FileNotFoundError:
            if not sharded:  # a manager's directory always has metadata; save_sharded's need not
                raise CheckpointIntegrityError(path, [f"{directory / _metadata.METADATA_NAME}: missing"]) from None
            meta = {}
        except (ValueError, OSError) as e:
            raise CheckpointIntegrityError(path, [f"{directory / _metadata.METADATA_NAME}: unreadable ({e})"]) from None
        step = meta.get("step")
        for name, expected in sorted(meta.get("files", {}).items()):
            file = directory / name
            if not file.is_file():
                problems.append(f"{file}: missing")
                continue
            size = file.stat().st_size
            if size != expected["bytes"]:
                problems.append(f"{file}: {size} bytes, metadata says {expected['bytes']}")
                continue
            digest = _metadata.sha256_of(file, on_bytes)
            if digest != expected["sha256"]:
                problems.append(f"{file}: SHA-256 {digest} differs from metadata's {expected['sha256']}")
                continue
            files[name] = digest
        listed = meta.get("files", {})
        for checkpoint in checkpoints:
            if meta and checkpoint.name not in listed:
                problems.append(f"{directory / _metadata.METADATA_NAME}: lists no {checkpoint.name} file")
    tensors = tensor_bytes = 0
    for checkpoint in checkpoints if not problems else ():  # decoding a file that failed its hash only repeats it
        try:
            # Hashed files were just read in full; a bare file is read here instead.
            count, nbytes, saved_step = _decode_everything(checkpoint, checkpoint.name not in files, on_bytes)
        except (CheckpointError, OSError) as e:
            problems.append(f"{checkpoint}: {e}")
            continue
        tensors, tensor_bytes = tensors + count, tensor_bytes + nbytes
        if step is not None and saved_step is not None and saved_step != step:
            problems.append(f"{checkpoint}: property step={saved_step}, metadata says step={step}")
    if problems:
        raise CheckpointIntegrityError(path, problems)
    return Verified(path, step, tensors, tensor_bytes, files)


def _shards_of(directory: Path) -> tuple[list[Path], list[str]]:
    """The shard files a sharded step's index names, and any whose size differs from it."""
    from .distributed.sharded import read_committed

    problems = []
    try:
        _, index = read_committed(directory, None)
    except (CheckpointError, OSError) as e:
        return [], [f"{directory / INDEX_NAME}: {e}"]
    shards = []
    for shard in index["shards"]:
        shards.append(directory / shard["file"])
        for name, size in shard["files"].items():
            file = directory / name
            if not file.is_file():
                problems.append(f"{file}: missing")
            elif file.stat().st_size != size:
                problems.append(f"{file}: {file.stat().st_size} bytes, {INDEX_NAME} says {size}")
    return shards, problems


def _decode_everything(checkpoint: Path, read_bytes: bool, on_bytes: Any = None) -> tuple[int, int, Any]:
    """Loads the checkpoint and forms every value (reading every byte when ``read_bytes``):
    (tensors, bytes of values, step property)."""
    state = CheckpointState.load_checkpoint(checkpoint)
    values: list[Any] = []
    if not state.is_nominal:
        values += [param.data for _, param in state.parameters]
    for group in state.optimizer_groups.values():
        values += [m for moms in group.momentums.values() for m in moms.values() if m is not None]
    total = 0
    for value in values:
        array = value.packed if isinstance(value, PackedInt4) else np.asarray(value)
        if read_bytes and array.dtype != object and array.size:  # an I/O error surfaces here, not in training
            np.bitwise_xor.reduce(array.reshape(-1).view(np.uint8))
            if on_bytes is not None:
                on_bytes(array.nbytes)
        total += array.nbytes
    for name, _ in state.properties:
        state.properties[name]
    step = state.properties["step"] if "step" in state.properties else None
    return len(values), total, step
