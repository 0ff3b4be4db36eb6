"""``ortckpt.verify``: is this checkpoint whole, byte for byte, and does every tensor decode?

One verification for every kind of step (:mod:`ortckpt.stepstore`): each file against its
entry in the step's metadata.json (:mod:`ortckpt.stepstore.entries`: its size, and the root of
its checksums, its pair id or its SHA-256), a sharded step's index against its shards, then
every checkpoint's bytes against the checksums it carries (in the core, at about the speed of
reading them; a file without checksums is read in full instead), every value and property
decoded. A step on object storage is first streamed into a private
temporary directory (its SHA-256s taken as the bytes come), then checked there: one download,
memory bounded as for a directory.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import _boundary, documents, safe_io, steps, targets
from .. import progress as _progress
from ..checkpoint_state import CheckpointState, open_checkpoint
from ..dtypes import PackedBits
from ..errors import CheckpointError, CheckpointIntegrityError
from ..stepstore import Step, StepStore, entries, open_store


@dataclass
class Verified:
    """What :func:`verify` checked."""

    path: Path | str  # a str: the URL of a step on object storage
    step: int | None
    tensors: int
    tensor_bytes: int
    files: dict[str, str] = field(default_factory=dict)  # name -> digest checked (empty without metadata)
    # Whether every checkpoint file carried checksums (False: one had none, as ONNX Runtime's
    # files and older ortckpt's: it was decoded and read in full instead).
    checksums: bool = True


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
    :mod:`ortckpt.object_store`): a manager's step folder there, or a checkpoint object.
    """
    if targets.is_object_url(path):
        return _verify_object(open_store(path, storage_options, writer=False))
    run = Path(path)
    mode = os.stat(run).st_mode  # a missing path is FileNotFoundError, not an integrity problem
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise safe_io.special_file(run, mode)
    bar = _progress.bar(f"verifying {run.name}") if progress else None
    on_bytes = bar.update if bar is not None else None
    try:
        if not stat.S_ISDIR(mode):
            return _verify_file(run, on_bytes)
        store = open_store(run, writer=False)
        try:
            step = store.locate()
        except (CheckpointError, OSError) as e:
            raise CheckpointIntegrityError(run, [_problem(run / steps.METADATA_NAME, e)]) from None
        if step is None:
            raise CheckpointIntegrityError(run, [f"{run / steps.METADATA_NAME}: missing"])
        return verify_step(store, step, on_bytes)
    finally:
        if bar is not None:
            bar.close()


def verify_step(store: StepStore, step: Step, on_bytes: Any = None) -> Verified:
    """Checks a committed (or staged) step of ``store``: see :func:`verify`. A step on object
    storage is checked in the scratch folder its files are downloaded into."""
    with store.local_step(step) as here:
        return _verify_folder(here.folder, step, here.hashed, on_bytes, name=here.name, places=here.places)


def _verify_object(store: StepStore) -> Verified:
    """An ``s3://`` URL: a manager's step folder, else a checkpoint object (decoding is the check)."""
    try:
        step = store.locate()
    except (CheckpointError, OSError) as e:
        raise CheckpointIntegrityError(store.name, [_problem(f"{store.name}/{steps.METADATA_NAME}", e)]) from None
    if step is not None:
        return verify_step(store, step)
    target = targets.checkpoint(store.name)  # (a bucket is refused: its listing is no checkpoint)
    assert isinstance(target, targets.ObjectFile)
    with safe_io.scratch_directory() as scratch:
        local = scratch / steps.CHECKPOINT_NAME
        try:
            target.download(local)
            count, nbytes, _ = read_everything(open_checkpoint(local, follow_symlinks=False), read_bytes=True)
        except FileNotFoundError:
            raise
        except (CheckpointError, OSError) as e:  # (the local copy named as the object)
            problem = _problem(store.name, e).replace(f"{local}: ", "").replace(str(local), store.name)
            raise CheckpointIntegrityError(store.name, [problem]) from None
    return Verified(store.name, None, count, nbytes)


def _verify_folder(
    directory: Path,
    step: Step,
    hashed: Mapping[str, tuple[int, str] | BaseException],
    on_bytes: Any,
    *,
    name: Any,
    places: Mapping[str, str] | None = None,
) -> Verified:
    """The checks of one step whose files are in ``directory``. ``hashed``: sizes and
    SHA-256s already taken (as a download came), by file name; ``name``: the step in messages;
    ``places``: files kept elsewhere, as messages name them."""
    problems: list[str] = []
    files: dict[str, str] = {}
    later: list[str] = []  # reported with the rest, after decoding
    meta = step.document if "files" in step.document else None
    index: dict[str, Any] | None = step.document if "shards" in step.document else None

    def shown(file: str) -> str:
        return (places or {}).get(file) or f"{name}/{file}"

    def as_named(problem: str) -> str:
        """A problem found in ``directory`` (a scratch folder for a step on object storage) with
        each file named where the step keeps it (a shared data object by its own URL)."""
        for file in sorted(places or {}, key=len, reverse=True):  # (a checkpoint's name prefixes its .data's)
            problem = problem.replace(str(directory / file), shown(file))
        return problem.replace(str(directory), str(name))

    if meta is not None and steps.INDEX_NAME in meta["files"]:
        try:
            data = safe_io.read_regular(
                directory / steps.INDEX_NAME, limit=documents.SHARDED_INDEX.max_bytes, follow_symlinks=False
            )
            index = documents.parse(documents.SHARDED_INDEX, data, shown(steps.INDEX_NAME))
        except (CheckpointError, OSError) as e:
            problems.append(_problem(shown(steps.INDEX_NAME), e))
    named = steps.step_of(Path(str(name)).name)  # the step its folder's name gives
    if index is not None:
        if index["step"] != step.number:
            later.append(f"{shown(steps.INDEX_NAME)}: step {index['step']}, metadata says {step.number}")
        elif meta is None and named is not None and named != index["step"]:
            later.append(f"{shown(steps.INDEX_NAME)}: step {index['step']}, but the directory is of step {named}")
        later += _shard_sizes(directory, index, shown)  # (after what decoding the shards finds)
    checkpoints = [steps.CHECKPOINT_NAME] if index is None else [shard["file"] for shard in index["shards"]]
    with contextlib.ExitStack() as cleanup:  # what decompressing a compressed step leaves, removed after
        if meta is not None:
            if named is not None and named != meta["step"]:
                later.append(f"{shown(steps.METADATA_NAME)}: step {meta['step']}, but the directory is of step {named}")
            for file, expected in sorted(meta["files"].items()):
                _check_file(file, shown(file), expected, directory / file, hashed.get(file), problems, files, on_bytes)
            for entry in meta.get("artifacts", {}).values():  # the run's graphs the step records
                graph = {"bytes": entry["bytes"], "sha256": entry["sha256"]}
                at = entry["name"]
                _check_file(at, shown(at), graph, directory / at, hashed.get(at), problems, files, on_bytes)
            if "compressed" in meta and not problems:
                directory = _decompressed(directory, meta["compressed"], cleanup, problems, files, on_bytes, shown)
            for checkpoint in checkpoints:
                if checkpoint not in meta.get("compressed", meta["files"]):
                    problems.append(f"{shown(steps.METADATA_NAME)}: lists no {checkpoint} file")
        if problems:  # decoding a file that failed its hash only repeats it
            raise CheckpointIntegrityError(name, problems)
        tensors = tensor_bytes = 0
        if index is not None:
            from ..distributed.sharded import check_shards

            problems += [as_named(p) for p in check_shards(open_store(directory, writer=False), directory, index)]
        no_checksums = []
        for checkpoint in checkpoints:
            try:
                path = safe_io.member(directory, checkpoint)
                checked = _boundary.verify_checksums(path, follow_symlinks=False)
                if checked is not None and on_bytes is not None:
                    on_bytes(checked[1])
                state = open_checkpoint(path, follow_symlinks=False)
                # Files with checksums were just checked in full, files whose SHA-256 matched read
                # in full; others are read here instead.
                sha_read = len(files.get(checkpoint, "")) == 64
                count, nbytes, saved_step = read_everything(state, checked is None and not sha_read, on_bytes)
            except CheckpointIntegrityError as e:
                problems += [as_named(p) for p in e.problems]
                continue
            except (CheckpointError, OSError) as e:
                problems.append(as_named(_problem(str(directory / checkpoint), e)))
                continue
            if checked is None:
                no_checksums.append(checkpoint)
            tensors, tensor_bytes = tensors + count, tensor_bytes + nbytes
            if meta is not None and saved_step is not None and saved_step != meta["step"]:
                problems.append(f"{shown(checkpoint)}: property step={saved_step}, metadata says step={meta['step']}")
    problems += later
    if problems:  # (a shard that fails to open fails its check and its decoding alike: said once)
        raise CheckpointIntegrityError(name, list(dict.fromkeys(problems)))
    number = step.number if meta is not None else None
    return Verified(name, number, tensors, tensor_bytes, files, checksums=not no_checksums)


def _check_file(
    name: str,
    file: str,
    expected: Mapping[str, Any],
    where: Path,
    downloaded: tuple[int, str] | BaseException | None,
    problems: list[str],
    files: dict[str, str],
    on_bytes: Any,
) -> None:
    """Compares a file with its metadata entry (:func:`entries.check`; for a download, the
    size and SHA-256 taken as it came): a problem said, or what matched recorded under its name."""
    try:
        if isinstance(downloaded, BaseException):
            raise downloaded
        if downloaded is not None and "sha256" in expected:
            size, digest = downloaded
            problem = (
                f"{size} bytes, metadata says {expected['bytes']}"
                if size != expected["bytes"]
                else f"SHA-256 {digest} differs from metadata's {expected['sha256']}"
                if digest != expected["sha256"]
                else None
            )
            matched = digest
        else:
            problem, matched = entries.check(where, dict(expected), on_bytes)
    except FileNotFoundError:
        problems.append(f"{file}: missing")
        return
    except CheckpointIntegrityError as e:  # a damaged checksum block: each problem names the file
        problems += [p.replace(str(where), file) for p in e.problems]
        return
    except (OSError, CheckpointError) as e:
        problems.append(_problem(file, e))
        return
    if problem is not None:
        problems.append(f"{file}: {problem}")
    else:
        files[name] = matched


def _problem(path: Path | str, error: BaseException) -> str:
    """``path: error``, without naming the file twice when the error already does."""
    text = str(error)
    return text if text.startswith(f"{path}:") or f"'{path}'" in text else f"{path}: {text}"


def _shard_sizes(directory: Path, index: dict[str, Any], shown: Any) -> list[str]:
    """Problems with a sharded step's shard files' sizes, against its index."""
    problems = []
    for shard in index["shards"]:
        for name, size in shard["files"].items():
            try:
                actual = os.lstat(safe_io.member(directory, name))
            except FileNotFoundError:
                problems.append(f"{shown(name)}: missing")
                continue
            if not stat.S_ISREG(actual.st_mode):
                problems.append(f"{shown(name)}: not a regular file")
            elif actual.st_size != size:
                problems.append(f"{shown(name)}: {actual.st_size} bytes, {steps.INDEX_NAME} says {size}")
    return problems


def _decompressed(
    directory: Path,
    expected: dict[str, Any],
    cleanup: contextlib.ExitStack,
    problems: list[str],
    files: dict[str, str],
    on_bytes: Any,
    shown: Any,
) -> Path:
    """A compressed step's checkpoint, decompressed into a private temporary directory (removed
    by ``cleanup``; the archive checks each file's SHA-256 against its own footer) and checked
    against metadata.json's record of the files before compression: that directory."""
    from ..compression import decompress

    scratch = cleanup.enter_context(safe_io.scratch_directory())
    archive = directory / steps.COMPRESSED_NAME
    try:
        decompress(archive, scratch / steps.CHECKPOINT_NAME, follow_symlinks=False)
    except (CheckpointError, OSError) as e:
        problems.append(_problem(shown(steps.COMPRESSED_NAME), e))
        return scratch
    for name, entry in sorted(expected.items()):
        try:
            problem, matched = entries.check(scratch / name, entry, on_bytes)
        except FileNotFoundError:
            problems.append(f"{shown(steps.COMPRESSED_NAME)}: holds no {name}, which metadata.json lists")
            continue
        except (OSError, CheckpointError) as e:
            problems.append(f"{shown(steps.COMPRESSED_NAME)}: its {name}: {e}")
            continue
        if problem is not None:
            problems.append(f"{shown(steps.COMPRESSED_NAME)}: its {name}: {problem}")
        else:
            files[name] = matched
    return scratch


def _verify_file(path: Path, on_bytes: Any) -> Verified:
    """A bare checkpoint file: its checksums, and decoding (reading every byte when it has none)."""
    try:
        checked = _boundary.verify_checksums(path)
        if checked is not None and on_bytes is not None:
            on_bytes(checked[1])
        count, nbytes, _ = read_everything(open_checkpoint(path), checked is None, on_bytes)
    except CheckpointIntegrityError:
        raise
    except (CheckpointError, OSError) as e:
        raise CheckpointIntegrityError(path, [_problem(path, e)]) from None
    return Verified(path, None, count, nbytes, checksums=checked is not None)


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


__all__ = ["Verified", "read_everything", "verify", "verify_step"]
