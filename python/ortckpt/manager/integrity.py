"""``ortckpt.verify``: is this checkpoint whole, byte for byte, and does every tensor decode?"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import documents, object_store, safe_io, steps
from .. import progress as _progress
from ..checkpoint_state import CheckpointState, open_checkpoint
from ..dtypes import PackedBits
from ..errors import CheckpointError, CheckpointIntegrityError
from . import metadata as _metadata


@dataclass
class Verified:
    """What :func:`verify` checked."""

    path: Path | str  # a str: the URL of a step on object storage
    step: int | None
    tensors: int
    tensor_bytes: int
    files: dict[str, str] = field(default_factory=dict)  # name -> SHA-256 checked (empty without metadata)


def verify(
    path: str | os.PathLike[str], *, progress: bool = False, storage_options: Mapping[str, Any] | None = None
) -> Verified:
    """Re-reads a checkpoint and checks it: every file's size and SHA-256 against its
    metadata.json (for a :class:`~ortckpt.CheckpointManager` step directory), then that the
    checkpoint decodes and every parameter, momentum and property can be read in full.

    ``path`` is a step directory or a checkpoint file (then only decoding is checked: a bare
    file carries no hashes). A sharded step directory (:mod:`ortckpt.distributed`) has its
    index validated and every shard it names checked alike: sizes against the index, and each
    piece's type and shape, as :func:`~ortckpt.distributed.load_sharded` would check them.
    Files are read only by the plain names the documents give, inside the directory, never
    through a symlink. Raises :class:`~ortckpt.CheckpointIntegrityError` listing every problem
    found, each naming its file; FileNotFoundError or SpecialFileError when ``path`` itself is
    missing or not a file or directory. ``progress``: a bar (tqdm) over the bytes read.

    ``path`` may be an ``s3://`` URL (configured by ``storage_options``, see
    :mod:`ortckpt.object_store`): a manager's step folder there (its objects' SHA-256s are
    read as streams), or a checkpoint object.
    """
    if object_store.is_url(path):
        return verify_object(path, storage_options)  # type: ignore[arg-type]
    path = Path(path)
    mode = os.stat(path).st_mode  # a missing path is FileNotFoundError, not an integrity problem
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise safe_io.special_file(path, mode)
    bar = _progress.bar(f"verifying {path.name}") if progress else None
    try:
        return _verify(path, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


def _check_hash(
    name: str, file: Path | str, expected: Mapping[str, Any], hashed: Any, problems: list[str], files: dict[str, str]
) -> None:
    """Compares a file's (or object's) size and SHA-256, as ``hashed()`` reads them, with its
    metadata entry: a problem said, or its digest recorded under its name."""
    try:
        size, digest = hashed()
    except FileNotFoundError:
        problems.append(f"{file}: missing")
        return
    except OSError as e:
        problems.append(_problem(file, e))
        return
    if size != expected["bytes"]:
        problems.append(f"{file}: {size} bytes, metadata says {expected['bytes']}")
    elif digest != expected["sha256"]:
        problems.append(f"{file}: SHA-256 {digest} differs from metadata's {expected['sha256']}")
    else:
        files[name] = digest


def _problem(path: Path | str, error: BaseException) -> str:
    """``path: error``, without naming the file twice when the error already does."""
    text = str(error)
    return text if text.startswith(f"{path}:") or f"'{path}'" in text else f"{path}: {text}"


def _verify(path: Path, on_bytes: Any) -> Verified:
    if not path.is_dir():
        return _verify_file(path, on_bytes)
    with contextlib.ExitStack() as cleanup:  # what decompressing a compressed step leaves, removed after
        return _verify_directory(path, on_bytes, cleanup)


def _verify_directory(path: Path, on_bytes: Any, cleanup: contextlib.ExitStack) -> Verified:
    problems: list[str] = []
    files: dict[str, str] = {}
    directory = path
    sharded = os.path.isfile(directory / steps.INDEX_NAME) and not os.path.islink(directory / steps.INDEX_NAME)
    index: dict[str, Any] | None = None
    later: list[str] = []  # reported with the rest, after decoding
    if sharded:
        index, shard_problems = _check_index(directory)
        (problems if index is None else later).extend(shard_problems)
    checkpoints = [directory / steps.CHECKPOINT_NAME] if index is None else _shard_paths(directory, index)
    try:
        meta = _metadata.read(directory)
    except FileNotFoundError:
        if not sharded:  # a manager's directory always has metadata; save_sharded's need not
            raise CheckpointIntegrityError(path, [f"{directory / steps.METADATA_NAME}: missing"]) from None
        meta = None
    except (CheckpointError, OSError) as e:
        raise CheckpointIntegrityError(path, [_problem(directory / steps.METADATA_NAME, e)]) from None
    step = None
    if meta is not None:
        step = meta["step"]
        named = steps.step_of(directory.name)
        if named is not None and named != step:
            later.append(f"{directory / steps.METADATA_NAME}: step {step}, but the directory is of step {named}")
        for name, expected in sorted(meta["files"].items()):
            file = directory / name
            _check_hash(name, file, expected, lambda file=file: _metadata.sha256_of(file, on_bytes), problems, files)
        if "compressed" in meta and not problems:
            checkpoints = _decompressed(directory, meta["compressed"], cleanup, problems, files, on_bytes)
        for checkpoint in checkpoints:
            if checkpoint.name not in meta.get("compressed", meta["files"]):
                problems.append(f"{directory / steps.METADATA_NAME}: lists no {checkpoint.name} file")
    if problems:  # decoding a file that failed its hash only repeats it
        raise CheckpointIntegrityError(path, problems)
    tensors = tensor_bytes = 0
    if index is not None:
        from ..distributed.sharded import check_shards

        problems += check_shards(directory, index)
    for checkpoint in checkpoints:
        try:
            # Hashed files were just read in full; others are read here instead.
            count, nbytes, saved_step = _decode_everything(checkpoint, checkpoint.name not in files, on_bytes)
        except (CheckpointError, OSError) as e:
            problems.append(_problem(checkpoint, e))
            continue
        tensors, tensor_bytes = tensors + count, tensor_bytes + nbytes
        if step is not None and saved_step is not None and saved_step != step:
            problems.append(f"{checkpoint}: property step={saved_step}, metadata says step={step}")
    problems += later
    if problems:
        raise CheckpointIntegrityError(path, problems)
    return Verified(path, step, tensors, tensor_bytes, files)


def _decompressed(
    directory: Path,
    expected: dict[str, Any],
    cleanup: contextlib.ExitStack,
    problems: list[str],
    files: dict[str, str],
    on_bytes: Any,
) -> list[Path]:
    """A compressed step's checkpoint, decompressed into a private temporary directory (removed
    by ``cleanup``; the archive checks each file's SHA-256 against its own footer) and checked
    against metadata.json's record of the files before compression; the checkpoint to decode,
    or [] with ``problems`` said."""
    from ..compression import decompress

    scratch = Path(tempfile.mkdtemp(prefix="ortckpt-verify-"))
    cleanup.callback(safe_io.remove_tree_quietly, scratch)
    archive = directory / steps.COMPRESSED_NAME
    try:
        checkpoint = decompress(archive, scratch / steps.CHECKPOINT_NAME, follow_symlinks=False)
    except (CheckpointError, OSError) as e:
        problems.append(_problem(archive, e))
        return []
    for name, entry in sorted(expected.items()):
        try:
            size, digest = _metadata.sha256_of(scratch / name, on_bytes)
        except FileNotFoundError:
            problems.append(f"{archive}: holds no {name}, which metadata.json lists")
            continue
        if (size, digest) != (entry["bytes"], entry["sha256"]):
            problems.append(
                f"{archive}: its {name} is {size} bytes, SHA-256 {digest}; "
                f"metadata says {entry['bytes']}, {entry['sha256']}"
            )
        else:
            files[name] = digest
    return [checkpoint]


def _verify_file(path: Path, on_bytes: Any) -> Verified:
    """A bare checkpoint file: no hashes, so decoding (and reading every byte) is the check."""
    try:
        count, nbytes, _ = _decode_everything(path, True, on_bytes, follow_symlinks=True)
    except (CheckpointError, OSError) as e:
        raise CheckpointIntegrityError(path, [_problem(path, e)]) from None
    return Verified(path, None, count, nbytes)


def _check_index(directory: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The validated index of a sharded step, and problems with its shard files' sizes."""
    from ..distributed.sharded import read_committed

    try:
        _, index = read_committed(directory, None)
    except (CheckpointError, OSError) as e:
        return None, [_problem(directory / steps.INDEX_NAME, e)]
    problems = []
    for shard in index["shards"]:
        for name, size in shard["files"].items():
            file = directory / name
            try:
                actual = os.lstat(file)
            except FileNotFoundError:
                problems.append(f"{file}: missing")
                continue
            if not stat.S_ISREG(actual.st_mode):
                problems.append(f"{file}: not a regular file")
            elif actual.st_size != size:
                problems.append(f"{file}: {actual.st_size} bytes, {steps.INDEX_NAME} says {size}")
    return index, problems


def _shard_paths(directory: Path, index: dict[str, Any]) -> list[Path]:
    return [safe_io.member(directory, shard["file"]) for shard in index["shards"]]


def _decode_everything(
    checkpoint: Path, read_bytes: bool, on_bytes: Any = None, *, follow_symlinks: bool = False
) -> tuple[int, int, Any]:
    """Loads the checkpoint and forms every value (reading every byte when ``read_bytes``):
    (tensors, bytes of values, step property)."""
    return read_everything(open_checkpoint(checkpoint, follow_symlinks=follow_symlinks), read_bytes, on_bytes)


def read_everything(state: CheckpointState, read_bytes: bool, on_bytes: Any = None) -> tuple[int, int, Any]:
    """Forms every value of a loaded state (reading every byte when ``read_bytes``) and every
    property: (tensors, bytes of values, step property)."""
    values: list[Any] = []
    if not state.is_nominal:
        values += [param.data for _, param in state.parameters]
    for group in state.optimizer_groups.values():
        values += [m for moms in group.momentums.values() for m in moms.values() if m is not None]
    total = 0
    for value in values:
        array = value.packed if isinstance(value, PackedBits) else np.asarray(value)
        if read_bytes and array.dtype != object and array.size:  # an I/O error surfaces here, not in training
            np.bitwise_xor.reduce(array.reshape(-1).view(np.uint8))
            if on_bytes is not None:
                on_bytes(array.nbytes)
        total += array.nbytes
    for name, _ in state.properties:
        state.properties[name]
    step = state.properties.get("step", None)
    return len(values), total, step


# --- on object storage ----------------------------------------------------------------------------


def verify_object(url: str, storage_options: Mapping[str, Any] | None = None) -> Verified:
    """:func:`verify` of an ``s3://`` URL: a step folder of a manager on object storage (it has
    a metadata.json), else a checkpoint object (then decoding is the check)."""
    where = object_store.locate(url, storage_options)
    meta_at = where.child(steps.METADATA_NAME)
    found = object_store.head(meta_at)
    if found is None:
        try:
            count, nbytes, _ = read_everything(_over_object(where), read_bytes=False)
        except FileNotFoundError:
            raise
        except (CheckpointError, OSError) as e:
            raise CheckpointIntegrityError(url, [_problem(where.url, e)]) from None
        return Verified(where.url, None, count, nbytes)
    try:
        if found.size > documents.METADATA.max_bytes:
            raise documents.DocumentError(f"{meta_at.url}: {found.size} bytes, over its cap")
        meta = documents.parse(documents.METADATA, bytes(object_store.get(meta_at, found.etag)), meta_at.url)
    except (CheckpointError, OSError) as e:
        raise CheckpointIntegrityError(where.url, [_problem(meta_at.url, e)]) from None
    return verify_step_objects(where, meta, storage_options)


def verify_step_objects(
    step: object_store.Location, meta: Mapping[str, Any], storage_options: Mapping[str, Any] | None = None
) -> Verified:
    """A committed step on object storage, its metadata read: every object's size and SHA-256
    (streamed) against it, then every value and property decoded (of a sharded step, every
    shard, after its index is checked against them)."""
    attempt = meta.get("attempt")
    folder = step.child(attempt) if attempt else step
    problems: list[str] = []
    files: dict[str, str] = {}
    for name, expected in sorted(meta["files"].items()):
        where = folder.child(name)
        _check_hash(name, where.url, expected, lambda where=where: object_store.sha256_of(where), problems, files)
    sharded = steps.INDEX_NAME in meta["files"]
    if not sharded and steps.CHECKPOINT_NAME not in meta["files"]:
        problems.append(f"{step.url}/{steps.METADATA_NAME}: lists no {steps.CHECKPOINT_NAME}")
    named = steps.step_of(step.key.rsplit("/", 1)[-1])
    if named is not None and named != meta["step"]:
        problems.append(f"{step.url}/{steps.METADATA_NAME}: step {meta['step']}, but the folder is of step {named}")
    if problems:
        raise CheckpointIntegrityError(step.url, problems)
    checkpoints = [folder.child(steps.CHECKPOINT_NAME)]
    if sharded:
        checkpoints = _checked_shards(step, folder, meta["step"], storage_options)
    count = nbytes = 0
    for checkpoint in checkpoints:
        try:
            tensors, values, saved_step = read_everything(_over_object(checkpoint), read_bytes=False)
        except (CheckpointError, OSError) as e:
            raise CheckpointIntegrityError(step.url, [_problem(checkpoint.url, e)]) from None
        if saved_step is not None and saved_step != meta["step"]:
            raise CheckpointIntegrityError(
                step.url, [f"{checkpoint.url}: property step={saved_step}, metadata says step={meta['step']}"]
            )
        count, nbytes = count + tensors, nbytes + values
    return Verified(step.url, meta["step"], count, nbytes, files)


def _checked_shards(
    step: object_store.Location, folder: object_store.Location, number: int, storage_options: Mapping[str, Any] | None
) -> list[object_store.Location]:
    """A sharded step's shards, its index (hashed already) validated and every piece in them
    checked against it as a load would (CheckpointIntegrityError if not)."""
    from ..distributed.sharded import check_shards

    index_at = folder.child(steps.INDEX_NAME)
    try:
        index = documents.parse(documents.SHARDED_INDEX, bytes(object_store.get(index_at)), index_at.url)
    except (CheckpointError, OSError) as e:
        raise CheckpointIntegrityError(step.url, [_problem(index_at.url, e)]) from None
    problems = check_shards(folder.url, index, storage_options)
    if index["step"] != number:
        problems.append(f"{index_at.url}: step {index['step']}, metadata says {number}")
    if problems:
        raise CheckpointIntegrityError(step.url, problems)
    return [folder.child(shard["file"]) for shard in index["shards"]]


def _over_object(location: object_store.Location) -> CheckpointState:
    """The checkpoint object downloaded whole (its external data too): every value in memory."""
    return CheckpointState._over(object_store.load_at(location, lazy=False))
