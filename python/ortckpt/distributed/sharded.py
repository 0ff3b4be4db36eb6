"""Sharded checkpoints: every rank writes its own part in parallel; rank 0 commits with an index.

Layout of one step, ``<directory>/step_00000100/``::

    shard-00000-of-00004        rank 0's tensors: an ordinary ONNX Runtime checkpoint
    shard-00000-of-00004.data   (beside it when past the external data threshold)
    shard-00001-of-00004 ...
    index.json                  which piece of which tensor is in which shard; written last

A save runs in two collective rounds (:func:`.comm.gather_decide_broadcast`): every rank
describes what it holds and rank 0 checks and plans it (nobody has written anything yet, so a
bad state fails everywhere, cleanly); every rank writes its shard and rank 0, only if every
rank succeeded, writes the index into the step's hidden temporary directory and renames it
to ``step_<n>`` (:mod:`ortckpt.steps`, the protocol a manager's steps follow). A crash of any
rank at any point leaves the previous step as the latest; the next writer removes what it left.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .. import _boundary, documents, object_store, safe_io, steps
from .. import dtypes as _dt
from .._boundary import TensorRecord
from ..checkpoint_state import CheckpointState, OptimizerGroup, TensorSource, open_checkpoint
from ..dtypes import PackedBits
from ..errors import CheckpointError, CheckpointExistsError, CheckpointFormatError, CheckpointStateError
from .comm import Communicator, communicator, gather_decide_broadcast, root_decides
from .layout import (
    INDEX_NAME,
    Held,
    Piece,
    RankDescription,
    Slice,
    TensorEntry,
    default_layout,
    plan,
    shard_file_name,
    tensor_entries,
)


def step_directory(directory: str | os.PathLike[str], step: int) -> Path:
    return steps.step_directory(directory, step)


def committed_steps(
    directory: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> list[int]:
    """Steps of ``directory`` (or of an ``s3://bucket/prefix``) that hold a sharded checkpoint
    (committed with its index), oldest first."""
    if object_store.is_url(directory):
        return _steps_in_store(object_store.locate(directory, storage_options))  # type: ignore[arg-type]
    return sorted(s for s, where in steps.step_directories(Path(directory)).items() if (where / INDEX_NAME).is_file())


def _steps_in_store(prefix: object_store.Location) -> list[int]:
    return sorted(steps.steps_holding(object_store.list_keys(prefix), INDEX_NAME))


def latest_step(directory: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> int | None:
    """The newest committed step of ``directory``, or None: where a restarted job resumes."""
    committed = committed_steps(directory, storage_options=storage_options)
    return committed[-1] if committed else None


# --- saving --------------------------------------------------------------------------------------


def save_sharded(
    state_shard: CheckpointState,
    directory: str | os.PathLike[str],
    *,
    step: int,
    comm: Any = None,
    slices: Mapping[str, Slice] | None = None,
    include_optimizer_state: bool = True,
    durable: bool = True,
    external_data_threshold: int = _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Saves this rank's part of the training state as step ``step`` of ``directory``; every
    rank of ``comm`` calls it together. Returns the step's directory (a Path) once committed,
    or its URL on object storage.

    Args:
        state_shard: The parameters (and momentums) this rank holds. A parameter that another
            rank holds too (a replicated one) is written once, by the lowest rank.
        directory: Shared by all ranks (a shared or parallel filesystem across machines).
        step: The training step; the checkpoint goes to ``directory/step_<step>/``.
        comm: An mpi4py communicator, a torch.distributed process group, a
            :class:`Communicator`, or None for whichever engine is running (a single process
            if none).
        slices: For a parameter split across ranks, which part of it this rank's array is
            (see :meth:`Slice.split`); its momentums are split alike. Others are whole.
        include_optimizer_state: Save the optimizer groups and momentums.
        durable: fsync every shard, the index and the directories before the save counts.
        external_data_threshold: Per shard, as in :meth:`CheckpointState.save_checkpoint`.
        storage_options: For an ``s3://bucket/prefix`` in place of ``directory`` (see
            :mod:`ortckpt.object_store`): every rank uploads its shard into a fresh folder of the
            step, and rank 0 commits by creating the step's index.json with a conditional PUT
            (of two jobs saving one step, one commits; the other gets CheckpointExistsError).
            ``durable`` does not apply.
    """
    comm = communicator(comm)
    if object_store.is_url(directory):
        return _save_to_store(
            comm,
            state_shard,
            object_store.locate(directory, storage_options),  # type: ignore[arg-type]
            step,
            slices,
            include_optimizer_state,
            external_data_threshold,
            storage_options,
        )
    root, target = Path(directory), step_directory(directory, step)
    writer: list[steps.WriterLock] = []  # rank 0's hold on the directory, for the save's duration

    def prepare() -> Path:  # the step layout's protocol, as a manager's (ortckpt.steps)
        safe_io.make_directories(root)
        lock = steps.WriterLock(root)  # one writer at a time, as for a manager
        writer.append(lock)
        steps.remove_leftovers(root, lock)  # what crashed saves left: holding the lock proves them dead
        if (target / INDEX_NAME).is_file():
            raise CheckpointExistsError(f"{target}: a sharded checkpoint of step {step} exists")
        if os.path.lexists(target):
            raise CheckpointExistsError(
                f"{target}: step {step} exists, but not as a sharded checkpoint (no {INDEX_NAME})"
            )
        return steps.new_temp_directory(root, step)

    def commit(temp: str, index: dict[str, Any]) -> None:
        write_index(Path(temp) / INDEX_NAME, index, durable)
        steps.commit(Path(temp), root, step, durable=durable)

    try:
        write_shards(
            comm,
            state_shard,
            slices,
            prepare=prepare,
            commit=commit,
            step=step,
            include_optimizer_state=include_optimizer_state,
            durable=durable,
            external_data_threshold=external_data_threshold,
        )
    finally:
        for lock in writer:
            lock.release()
    return target


def _save_to_store(
    comm: Communicator,
    state: CheckpointState,
    prefix: object_store.Location,
    step: int,
    slices: Mapping[str, Slice] | None,
    include_optimizer_state: bool,
    external_data_threshold: int,
    storage_options: Mapping[str, Any] | None,
) -> str:
    """save_sharded to an object store: the shards go to ``step_<n>/<attempt>/`` (a folder
    of a fresh random name: no other save writes there), and the index, naming the attempt,
    to ``step_<n>/index.json``, created only if absent."""
    folder = prefix.child(steps.step_directory_name(step))
    index_at = folder.child(INDEX_NAME)
    committing = []  # set once the commit's PUT is sent: from then on it may have landed

    def prepare() -> str:
        if object_store.head(index_at) is not None:
            raise CheckpointExistsError(f"{folder.url}: a sharded checkpoint of step {step} exists")
        return folder.child(secrets.token_hex(16)).url

    def commit(where: str, index: dict[str, Any]) -> None:
        attempt = where.rsplit("/", 1)[-1]
        data = encode_index({**index, "attempt": attempt}, index_at.url)
        committing.append(True)
        if not object_store.put_new(index_at, data):
            committing.clear()  # another job's commit: ours certainly did not land
            raise CheckpointExistsError(f"{folder.url}: another writer committed step {step} first")

    def abandon(where: str) -> None:
        if not committing:  # once the commit is sent it may have landed: its shards stay
            object_store.remove_under(object_store.locate(where, storage_options))

    write_shards(
        comm,
        state,
        slices,
        prepare=prepare,
        commit=commit,
        step=step,
        include_optimizer_state=include_optimizer_state,
        durable=False,
        external_data_threshold=external_data_threshold,
        abandon=abandon,
        storage_options=storage_options,
    )
    return folder.url


def remove_leftovers(url: str, *, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Deletes what sharded saves to the ``s3://`` prefix ``url`` left and no index names: the
    shards of saves that failed after their commit's PUT was sent, or were killed, and of steps
    never committed. An object store holds no lock, so nothing proves that no job is saving
    there: call it only when none is. Steps with a damaged index, and any step with a manager's
    metadata.json, are kept whole. Returns the URLs deleted. (In a directory, the next save
    removes leftovers by itself, under the directory's lock.)"""
    if not object_store.is_url(url):
        raise ValueError(f"{url}: not an s3:// prefix (a directory's leftovers go at its next save, under its lock)")
    prefix = object_store.locate(url, storage_options)
    listed = object_store.list_keys(prefix)
    folders: dict[int, set[str]] = {}
    for key, _ in listed:
        folder, _, rest = key.partition("/")
        step = steps.step_of(folder)
        if step is not None and rest:
            folders.setdefault(step, set()).add(rest)
    doomed = []
    for step, names in sorted(folders.items()):
        if steps.METADATA_NAME in names:
            continue  # a manager's step: its own remove_leftovers judges it
        keep: str | None = None  # the committed attempt's folder
        if INDEX_NAME in names:
            try:
                _, index = _read_committed_in_store(prefix.child(steps.step_directory_name(step)), None)
            except (CheckpointError, OSError):
                continue  # damaged: kept for a person to look at
            keep = index.get("attempt") or ""
        for rest in sorted(names):
            if rest == INDEX_NAME or (keep is not None and _in_attempt(rest, keep)):
                continue
            doomed.append(prefix.child(f"{steps.step_directory_name(step)}/{rest}"))
    object_store.remove(doomed)
    return [location.url for location in doomed]


def _size_of(entry: Any) -> int:
    """A written file's size: a file's is its size; an object's is {"bytes", "sha256"}."""
    return entry["bytes"] if isinstance(entry, dict) else entry


def _in_attempt(name: str, attempt: str) -> bool:
    """Whether ``name`` (under a step's folder) is in the attempt's folder; an index that names no
    attempt (a directory uploaded as it was) has its shards beside it."""
    return name.startswith(f"{attempt}/") if attempt else "/" not in name


def write_shards(
    comm: Communicator,
    state: CheckpointState,
    slices: Mapping[str, Slice] | None,
    *,
    prepare: Callable[[], str | Path],
    commit: Callable[[str, dict[str, Any]], None],
    step: int,
    include_optimizer_state: bool,
    durable: bool,
    external_data_threshold: int,
    abandon: Callable[[str], None] = safe_io.remove_tree_quietly,
    storage_options: Mapping[str, Any] | None = None,
    digests: dict[str, Any] | None = None,
) -> None:
    """The collective save in two rounds: every rank describes what it holds and rank 0 plans
    it (``prepare``, rank 0, makes the directory the shards go to, or names the object store
    folder); every rank writes its shard and rank 0 commits them (``commit``), or removes them
    when some rank failed (``abandon``). On object storage, ``digests`` (rank 0's) is filled
    before the commit with each uploaded file's {"bytes", "sha256"}, taken as it went up."""
    rank, world = comm.rank, comm.world_size
    on_root: dict[str, Any] = {}  # what only rank 0 keeps from the plan for the index

    def plan_and_prepare(descriptions: list[RankDescription]) -> tuple[str, list[list[str]]]:
        writes, tables = plan(descriptions)
        on_root.update(tables=tables, properties=dict(descriptions[0].properties))
        return str(prepare()), writes

    where_name, writes = gather_decide_broadcast(
        comm,
        "sharded save (checking the state)",
        lambda: describe(state, slices, rank, include_optimizer_state),
        plan_and_prepare,
        deciding="planning",
    )
    where = where_name  # a directory's path, or an object store folder's URL

    def index_and_commit(written: list[dict[str, Any]]) -> None:
        if digests is not None:
            digests.update({name: entry for files in written for name, entry in files.items()})
        written = [{name: _size_of(entry) for name, entry in files.items()} for files in written]
        index = {
            "format": documents.SHARDED_FORMAT,
            "version": documents.SHARDED_VERSION,
            "step": step,
            "world_size": world,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "shards": [
                {"rank": r, "file": shard_file_name(r, world), "files": files}
                for r, files in enumerate(written)
                if files
            ],
            **on_root["tables"],
            "properties": on_root["properties"],
        }
        commit(where, index)

    gather_decide_broadcast(
        comm,
        "sharded save",
        lambda: _write_own_shard(
            state,
            where,
            writes[rank],
            rank,
            world,
            include_optimizer_state,
            durable,
            external_data_threshold,
            storage_options,
        ),
        index_and_commit,
        deciding="committing",
        on_failure=lambda: abandon(where),
    )


def describe(
    state: TensorSource, slices: Mapping[str, Slice] | None, rank: int, include_optimizer_state: bool
) -> RankDescription:
    """What this rank holds, checked against itself: every slice names a tensor of the state and
    matches its array's shape; every momentum belongs to a held parameter and has its shape."""
    if not isinstance(state, CheckpointState):
        raise TypeError(f"expected a CheckpointState, got {type(state).__name__}")
    if state.is_nominal:
        raise CheckpointStateError("a nominal state (no values) cannot be saved sharded")
    slices = dict(slices or {})
    records = {record.name: record for record in state.tensor_records()}
    unknown = sorted(set(slices) - set(records))
    if unknown:
        raise CheckpointStateError(f"slices name tensors this rank does not hold: {', '.join(unknown)}")
    groups = state.optimizer_groups if include_optimizer_state else {}
    momentums: dict[str, list[tuple[str, str]]] = {}
    for group_name, group in groups.items():
        for param, moms in group.momentums.items():
            if param not in records:
                raise CheckpointStateError(
                    f"optimizer group {group_name}: momentums of {param}, a parameter this rank does not hold"
                )
            dims = records[param].dims
            for m, value in moms.items():
                if value is None or tuple(np.shape(value)) != tuple(dims):
                    raise CheckpointStateError(
                        f"optimizer group {group_name}: {param}/{m} has shape "
                        f"{None if value is None else np.shape(value)}, its parameter "
                        f"{tuple(dims)}"
                    )
                momentums.setdefault(param, []).append((group_name, m))
    held = []
    for name, tensor in sorted(records.items()):
        part = slices.get(name)
        if part is None:
            part = Slice.whole(tensor.dims)
        elif not isinstance(part, Slice):
            raise TypeError(f"slices[{name!r}]: expected an ortckpt.distributed.Slice, got {type(part).__name__}")
        elif part.shape != tuple(tensor.dims):
            raise CheckpointStateError(
                f"{name}: the slice is {part.shape} but this rank's array is {tuple(tensor.dims)}"
            )
        held.append(Held(name, tensor.code, tensor.requires_grad, part, tuple(sorted(momentums.get(name, [])))))
    return RankDescription(
        rank=rank,
        tensors=tuple(held),
        groups=tuple((n, int(g.step), float(g.initial_learning_rate)) for n, g in sorted(groups.items())),
        properties=tuple(state.properties),
    )


def _write_own_shard(
    state: TensorSource,
    where: str,
    names: list[str],
    rank: int,
    world: int,
    include_optimizer_state: bool,
    durable: bool,
    threshold: int,
    storage_options: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Writes the tensors the plan gave this rank; returns {file name: size} (on object storage
    {file name: {"bytes", "sha256"}}), empty if none."""
    if not names:
        return {}
    wanted = set(names)
    trainable = {record.name for record in state.tensor_records() if record.requires_grad}
    values = {name: state.tensor_value(name) for name in names}
    shard = CheckpointState.from_arrays(
        {n: v for n, v in values.items() if n in trainable},
        {n: v for n, v in values.items() if n not in trainable},
        dict(state.properties),
    )
    if include_optimizer_state:
        shard.optimizer_groups = {
            group_name: OptimizerGroup(
                group.step, group.initial_learning_rate, {p: m for p, m in group.momentums.items() if p in wanted}
            )
            for group_name, group in state.optimizer_groups.items()
        }
    if object_store.is_url(where):
        location = object_store.locate(f"{where}/{shard_file_name(rank, world)}", storage_options)
        return object_store.save_at(location, shard, include_optimizer_state, threshold)  # sizes and SHA-256s
    path = Path(where) / shard_file_name(rank, world)
    CheckpointState.save_checkpoint(
        shard, path, include_optimizer_state, external_data_threshold=threshold, durable=durable
    )
    return {p.name: p.stat().st_size for p in sorted(path.parent.glob(path.name + "*"))}


# --- loading -------------------------------------------------------------------------------------


def load_sharded(
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    comm: Any = None,
    slices: Mapping[str, Slice | None] | None = None,
    include_optimizer_state: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[CheckpointState, dict[str, Slice]]:
    """Loads this rank's part of a sharded checkpoint; every rank of ``comm`` calls it together.

    Returns the state (parameters, momentums, groups, properties) and, for each parameter,
    the :class:`Slice` of it that the state holds: what :func:`save_sharded` takes back.

    Args:
        directory: The directory given to :func:`save_sharded`, or one step's directory.
        step: Which step (default: the latest committed).
        slices: What this rank loads: tensor name -> its :class:`Slice`, or None for the whole
            tensor; tensors not named are not loaded. By default, on the world size it was
            saved with, each rank gets what it saved; on another, tensors split along one
            dimension are split again evenly along it, tensors every rank held go to every
            rank, other whole tensors to rank (saving rank mod world size).
        include_optimizer_state: Load the momentums of the parameters loaded.
        storage_options: For an ``s3://bucket/prefix`` (or one step's URL) in place of
            ``directory``: see :mod:`ortckpt.object_store`. Each shard is then downloaded when
            first needed, its external data read by ranged GETs of the pieces used.

    Only the shards holding the wanted pieces are opened; a piece loaded exactly as it was
    saved is a view over its memory-mapped shard (no copy), others are assembled.
    """
    comm = communicator(comm)
    where, index = root_decides(
        comm, "sharded load (reading the index)", lambda: read_committed(directory, step, storage_options)
    )
    entries = tensor_entries(index)
    if slices is None:
        layout = default_layout(entries.values(), index["world_size"], comm.rank, comm.world_size)
    else:
        layout = _requested_layout(where, entries, slices)
    return assemble(where, index, entries, layout, include_optimizer_state, storage_options), layout


def merge(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    include_optimizer_state: bool = True,
    external_data_threshold: int = _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD,
    durable: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Any:
    """Writes one ordinary checkpoint, which ONNX Runtime loads, of a sharded one (one process).
    Returns ``out`` (a Path, or the URL when ``out`` is one).

    Split tensors are assembled in memory (the largest assembled at once is the sum of the
    split tensors); whole ones go from their shard's mapping to the new file without a copy.
    ``directory`` and ``out`` may each be on object storage (``s3://``, configured by
    ``storage_options``): whole tensors then stream from ranged GETs of the shards.
    """
    where, index = read_committed(directory, step, storage_options)
    entries = tensor_entries(index)
    layout = {name: Slice.whole(e.shape) for name, e in entries.items()}
    state = assemble(where, index, entries, layout, include_optimizer_state, storage_options)
    CheckpointState.save_checkpoint(
        state,
        out,
        include_optimizer_state,
        external_data_threshold=external_data_threshold,
        durable=durable,
        storage_options=storage_options,
    )
    return out if object_store.is_url(out) else Path(out)


def read_committed(
    directory: str | os.PathLike[str], step: int | None, storage_options: Mapping[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """(where its shards are, its index) of a committed sharded checkpoint, the index validated
    (:mod:`ortckpt.documents`: shard files are plain names of their rank, pieces inside their
    tensors and tiling them). CheckpointFormatError, naming the index, when it is damaged. On
    object storage, where the shards are is the URL of the committed attempt's folder."""
    if object_store.is_url(directory):
        return _read_committed_in_store(object_store.locate(directory, storage_options), step)  # type: ignore[arg-type]
    directory = Path(directory)
    if (directory / INDEX_NAME).is_file():
        where = directory
    else:
        if step is None:
            step = latest_step(directory)
            if step is None:
                raise FileNotFoundError(f"{directory}: no committed sharded checkpoint")
        where = step_directory(directory, step)
        if not (where / INDEX_NAME).is_file():
            raise FileNotFoundError(
                f"{where}: no committed sharded checkpoint of step {step} "
                f"(no {INDEX_NAME}: never saved, or its save did not finish)"
            )
    path = where / INDEX_NAME
    data = safe_io.read_regular(path, limit=documents.SHARDED_INDEX.max_bytes, follow_symlinks=False)
    index = documents.parse(documents.SHARDED_INDEX, data, os.fspath(path))
    named = steps.step_of(where.name)
    if named is not None and named != index["step"]:
        raise CheckpointFormatError(f"{path}: step {index['step']}, but the directory is of step {named}")
    return str(where), index


def _read_committed_in_store(prefix: object_store.Location, step: int | None) -> tuple[str, dict[str, Any]]:
    folder = prefix
    found = object_store.head(prefix.child(INDEX_NAME))  # the URL of one step's folder?
    if found is None:
        if step is None:
            committed = _steps_in_store(prefix)
            step = committed[-1] if committed else None
            if step is None:
                raise FileNotFoundError(f"{prefix.url}: no committed sharded checkpoint")
        folder = prefix.child(steps.step_directory_name(step))
        found = object_store.head(folder.child(INDEX_NAME))
        if found is None:
            raise FileNotFoundError(
                f"{folder.url}: no committed sharded checkpoint of step {step} "
                f"(no {INDEX_NAME}: never saved, or its save did not finish)"
            )
    index_at = folder.child(INDEX_NAME)
    if found.size > documents.SHARDED_INDEX.max_bytes:
        raise CheckpointFormatError(f"{index_at.url}: {found.size} bytes, over an index's cap")
    data = bytes(object_store.get(index_at, found.etag))
    index = documents.parse(documents.SHARDED_INDEX, data, index_at.url)
    named = steps.step_of(folder.key.rsplit("/", 1)[-1])
    if named is not None and named != index["step"]:
        raise CheckpointFormatError(f"{index_at.url}: step {index['step']}, but the folder is of step {named}")
    attempt = index.get("attempt")
    return (folder.child(attempt).url if attempt else folder.url), index


def _requested_layout(
    where: str, entries: Mapping[str, TensorEntry], slices: Mapping[str, Slice | None]
) -> dict[str, Slice]:
    layout = {}
    for name, asked in slices.items():
        entry = entries.get(name)
        if entry is None:
            raise KeyError(f"{where}: no tensor {name} in this checkpoint")
        part = Slice.whole(entry.shape) if asked is None else asked
        if part.global_shape != entry.shape:
            raise CheckpointStateError(
                f"{where}: {name} has shape {entry.shape}, the slice asked for is of {part.global_shape}"
            )
        layout[name] = part
    return layout


def assemble(
    where: str | os.PathLike[str],
    index: Mapping[str, Any],
    entries: Mapping[str, TensorEntry],
    layout: Mapping[str, Slice],
    include_optimizer_state: bool,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointState:
    """A state of the pieces ``layout`` asks for, read from the shards that hold them. Every
    piece read must have the type and shape the index gives it (CheckpointFormatError, naming
    the shard and the tensor, if not)."""
    shards = _Shards(os.fspath(where), index, storage_options)
    trainable: dict[str, Any] = {}
    frozen: dict[str, Any] = {}
    groups = (
        {
            name: OptimizerGroup(g["step"], g["initial_learning_rate"], {})
            for name, g in index.get("optimizer_groups", {}).items()
        }
        if include_optimizer_state
        else {}
    )
    for name, want in layout.items():
        entry = entries[name]
        (trainable if entry.trainable else frozen)[name] = _region(entry, want, functools.partial(shards.tensor, entry))
        if include_optimizer_state:
            for group, m in entry.momentums:
                read = functools.partial(shards.momentum, entry, group=group, m=m)
                groups[group].momentums.setdefault(name, {})[m] = _region(entry, want, read)
    state = CheckpointState.from_arrays(trainable, frozen, index.get("properties", {}))
    state.optimizer_groups = groups
    return state


class _Shards:
    """The shard files of one sharded step, opened when first needed (only by the plain names
    the index gives, never through a symlink), and the pieces read from them, checked."""

    def __init__(self, where: str, index: Mapping[str, Any], storage_options: Mapping[str, Any] | None) -> None:
        self.where = where
        self.remote = object_store.is_url(where)
        self.storage_options = storage_options
        self.files = {
            s["rank"]: f"{where}/{s['file']}" if self.remote else safe_io.member(Path(where), s["file"])
            for s in index["shards"]  # (plain names: the index was validated)
        }
        self.opened: dict[int, CheckpointState] = {}
        self.records: dict[int, dict[str, TensorRecord]] = {}

    def shard(self, rank: int) -> CheckpointState:
        if rank not in self.opened:
            if rank not in self.files:
                raise CheckpointFormatError(f"{self.where}: the index names no shard of rank {rank}")
            file = self.files[rank]
            self.opened[rank] = (
                CheckpointState.load_checkpoint(file, storage_options=self.storage_options)  # type: ignore[arg-type]
                if self.remote
                else open_checkpoint(file, follow_symlinks=False)
            )
            self.records[rank] = {record.name: record for record in self.opened[rank].tensor_records()}
        return self.opened[rank]

    def tensor(self, entry: TensorEntry, piece: Piece) -> Any:
        shard = self.shard(piece.shard)
        tensor = self.records[piece.shard].get(entry.name)
        if tensor is None:
            raise CheckpointFormatError(
                f"{self.files[piece.shard]}: has no tensor {entry.name}, which the index places there"
            )
        if tensor.code != entry.code:
            raise CheckpointFormatError(
                f"{self.files[piece.shard]}: tensor {entry.name} is "
                f"{_dt.name_of(tensor.code)}, the index says {_dt.name_of(entry.code)}"
            )
        return self._checked(entry, piece, shard.tensor_value(entry.name), tensor.dims, entry.name)

    def momentum(self, entry: TensorEntry, piece: Piece, group: str, m: str) -> Any:
        try:
            value = self.shard(piece.shard).optimizer_groups[group].momentums[entry.name][m]
        except KeyError:
            raise CheckpointFormatError(
                f"{self.files[piece.shard]}: has no momentum {group}/{entry.name}/{m}, which the index places there"
            ) from None
        shape = value.shape if isinstance(value, PackedBits) else np.shape(value)
        return self._checked(entry, piece, value, shape, f"{entry.name}/{m}")

    def _checked(self, entry: TensorEntry, piece: Piece, value: Any, shape: Any, what: str) -> Any:
        if tuple(shape) != piece.slice.shape:
            raise CheckpointFormatError(
                f"{self.files[piece.shard]}: tensor {what} has shape {list(shape)}, the "
                f"index says its piece is {list(piece.slice.shape)}"
            )
        return value


def check_shards(
    where: str | os.PathLike[str], index: Mapping[str, Any], storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """What :func:`assemble` would refuse, for :func:`ortckpt.verify`: every piece of every
    tensor and momentum the index lists, read from its shard and checked against the index."""
    shards = _Shards(os.fspath(where), index, storage_options)
    problems = []
    for entry in tensor_entries(index).values():
        for piece in entry.pieces:
            try:
                shards.tensor(entry, piece)
                for group, m in entry.momentums:
                    shards.momentum(entry, piece, group, m)
            except (CheckpointError, OSError) as e:
                problems.append(str(e))
    return problems


def _region(entry: TensorEntry, want: Slice, read: Callable[[Piece], Any]) -> Any:
    """The ``want`` part of a tensor, from the saved pieces it overlaps: the piece's own mapped
    array when it is exactly that piece, else a new array filled from each overlap."""
    for piece in entry.pieces:
        if piece.slice == want:
            return read(piece)
    out = None
    filled = 0
    for piece in entry.pieces:
        overlap = piece.slice.intersection(want)
        if overlap is None:
            continue
        source = read(piece)
        if isinstance(source, PackedBits):
            raise CheckpointStateError(f"{entry.name}: sub-byte tensors load only as the pieces they were saved in")
        if out is None:
            out = np.empty(want.shape, dtype=source.dtype)
        out[overlap.within(want)] = source[overlap.within(piece.slice)]
        filled += overlap.size
    if out is None or filled != want.size:
        raise CheckpointFormatError(
            f"{entry.name}: the saved pieces cover {filled} of the {want.size} elements asked for"
        )
    return out


# --- small helpers -------------------------------------------------------------------------------


def write_index(path: Path, index: Mapping[str, Any], durable: bool) -> None:
    """Writes the index atomically (a locked temporary file of a fresh name, then rename)."""
    safe_io.write_atomically(path, encode_index(index, os.fspath(path)), durable=durable)


def encode_index(index: Mapping[str, Any], where: str) -> bytes:
    """The index as written, checked to read back: a save never commits an index that load
    would refuse."""
    data = (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
    documents.parse(documents.SHARDED_INDEX, data, where)
    return data
