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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .. import _boundary, documents, steps, targets
from .. import dtypes as _dt
from .._boundary import TensorRecord
from ..checkpoint_state import CheckpointState, OptimizerGroup, TensorSource
from ..dtypes import PackedBits
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointStateError,
)
from ..stepstore import Attempt, Folder, Step, StepStore, open_store
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
    region,
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
    return sorted(open_store(directory, storage_options, writer=False).scan(INDEX_NAME).steps)


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
    reader = open_store(directory, storage_options, writer=False)  # where every rank writes
    held: list[StepStore] = []  # rank 0's writer store: its lock held for the save's duration

    def begin() -> Attempt:
        store = open_store(directory, storage_options, writer=True, create=True)
        held.append(store)
        store.remove_proven_leftovers()  # what crashed saves left: the lock proves them dead
        if store.read(step, INDEX_NAME) is not None:
            raise CheckpointExistsError(f"{reader.name}: a sharded checkpoint of step {step} exists")
        try:
            return store.begin(step)
        except CheckpointExistsError:
            raise CheckpointExistsError(
                f"{steps.step_directory(directory, step)}: step {step} exists, but not as a sharded "
                f"checkpoint (no {INDEX_NAME})"
            ) from None

    def abandon(attempt: Attempt) -> None:
        held[0].abandon(attempt)

    def commit(attempt: Attempt, index: dict[str, Any]) -> None:
        index = {**index, **held[0].attempt_fields(attempt)}  # (where readers find the shards)
        data = encode_index(index, f"{reader.name}/{steps.step_directory_name(step)}/{INDEX_NAME}")
        held[0].commit(attempt, INDEX_NAME, data, durable=durable)

    try:
        write_shards(
            comm,
            reader,
            state_shard,
            slices,
            begin=begin,
            commit=commit,
            abandon=abandon,
            step=step,
            include_optimizer_state=include_optimizer_state,
            durable=durable,
            external_data_threshold=external_data_threshold,
        )
    finally:
        for store in held:
            store.close()
    return reader.step_folder(step)


def remove_leftovers(directory: Any, *, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Removes what sharded saves (and managers) left under ``directory`` or an ``s3://`` prefix
    and no committed document names: the shards of saves that failed or were killed, of steps
    never committed, and on object storage the multipart uploads killed writers left. Steps with
    a damaged document are kept whole. A directory is swept under its writer lock (a second
    writer there is refused); an object store holds no lock, so nothing proves that no job is
    saving there: call it only when none is. Returns what it removed."""
    store = open_store(directory, storage_options, writer=True)
    try:
        return store.remove_leftovers()
    finally:
        store.close()


def write_shards(
    comm: Communicator,
    store: StepStore,
    state: CheckpointState,
    slices: Mapping[str, Slice] | None,
    *,
    begin: Callable[[], Attempt],
    commit: Callable[[Attempt, dict[str, Any]], None],
    abandon: Callable[[Attempt], None],
    step: int,
    include_optimizer_state: bool,
    durable: bool,
    external_data_threshold: int,
    share_with: Step | None = None,
    shareable: bool = False,
    watch_writes: bool = False,
) -> None:
    """The collective save in two rounds, one step transaction of ``store``: every rank
    describes what it holds and rank 0 plans it and stages the step (``begin``); every rank
    writes its shard into the attempt, and rank 0 commits them (``commit``, with the index), or
    removes them when some rank failed (``abandon``, the attempt holding what the ranks that
    succeeded wrote). ``share_with``: the previous committed step (a manager's,
    ``share_unchanged``), whose shard of the same name each rank's shares its unchanged values
    with where the store can; ``shareable``: a manager's step, whose shards may keep their
    values in objects the steps share (see :meth:`StepStore.write_checkpoint`); ``watch_writes``:
    ``state`` holds the caller's own arrays (a manager's save), whose pages the store may watch."""
    rank, world = comm.rank, comm.world_size
    on_root: dict[str, Any] = {}  # what only rank 0 keeps: the plan's tables, its attempt

    def plan_and_begin(descriptions: list[RankDescription]) -> tuple[str, list[list[str]]]:
        writes, tables = plan(descriptions)
        attempt = begin()
        on_root.update(tables=tables, properties=dict(descriptions[0].properties), attempt=attempt)
        return attempt.where, writes

    where, writes = gather_decide_broadcast(
        comm,
        "sharded save (checking the state)",
        lambda: describe(state, slices, rank, include_optimizer_state),
        plan_and_begin,
        deciding="planning",
    )

    def record(results: list[tuple[dict[str, Any], dict[str, Any]]]) -> Attempt:
        attempt: Attempt = on_root["attempt"]
        for files, shared in results:
            attempt.written.update(files)  # every rank's files: what the commit checks and records
            attempt.shared.update(shared)  # (data files shared with the previous step: their entries)
        return attempt

    def index_and_commit(results: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        attempt = record(results)
        written = [{**files, **shared} for files, shared in results]  # (the index lists a shard's data too)
        index = {
            "format": documents.SHARDED_FORMAT,
            "version": documents.SHARDED_VERSION,
            "step": step,
            "world_size": world,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "shards": [
                {"rank": r, "file": shard_file_name(r, world), "files": {n: e["bytes"] for n, e in files.items()}}
                for r, files in enumerate(written)
                if files
            ],
            **on_root["tables"],
            "properties": on_root["properties"],
        }
        commit(attempt, index)

    gather_decide_broadcast(
        comm,
        "sharded save",
        lambda: _write_own_shard(
            store,
            store.join(where, step) if rank else on_root["attempt"],
            state,
            writes[rank],
            rank,
            world,
            include_optimizer_state,
            durable,
            external_data_threshold,
            share_with,
            shareable,
            watch_writes,
        ),
        index_and_commit,
        deciding="committing",
        on_failure=lambda results: abandon(record(results)),
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
    store: StepStore,
    attempt: Attempt,
    state: TensorSource,
    names: list[str],
    rank: int,
    world: int,
    include_optimizer_state: bool,
    durable: bool,
    threshold: int,
    share_with: Step | None,
    shareable: bool = False,
    watch_writes: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Writes the tensors the plan gave this rank into the attempt; returns its files
    {name: {"bytes", ...}}, empty if none, and the entries of its data files kept apart from
    them (hard-linked from ``share_with``: that step's entries; on object storage, a data object
    of the run's shared folder), which rank 0 records as this step's."""
    if not names:
        return {}, {}
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
    files = store.write_checkpoint(
        attempt,
        shard_file_name(rank, world),
        shard.core_state(include_optimizer_state),
        external_data_threshold=threshold,
        durable=durable,
        share_with=share_with,
        shareable=shareable,
        watch_writes=watch_writes,
    )
    return files, {name: entry for name, entry in attempt.shared.items() if name.removesuffix(".data") in files}


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
    store = open_store(directory, storage_options, writer=False)
    folder, index, recorded = root_decides(
        comm, "sharded load (reading the index)", lambda: read_committed(store, step)
    )
    return _load_part(store, folder, index, comm, slices, include_optimizer_state, recorded)


def load_step(
    store: StepStore, step: Step, *, comm: Any = None, slices: Mapping[str, Slice | None] | None = None
) -> tuple[CheckpointState, dict[str, Slice]]:
    """:func:`load_sharded` of one committed step of a store (a manager's restore_sharded)."""
    comm = communicator(comm)
    folder, index = root_decides(comm, "sharded load (reading the index)", lambda: (step.folder, index_of(store, step)))
    # (a writer's restore: the shards it downloads are hashed, for its next save to share: see stepstore.shared)
    return _load_part(store, folder, index, comm, slices, True, step.document.get("files", {}), resuming=step)


def _load_part(
    store: StepStore,
    folder: Folder,
    index: dict[str, Any],
    comm: Communicator,
    slices: Mapping[str, Slice | None] | None,
    include_optimizer_state: bool,
    recorded: Mapping[str, dict[str, Any]],
    *,
    resuming: Step | None = None,
) -> tuple[CheckpointState, dict[str, Slice]]:
    entries = tensor_entries(index)
    if slices is None:
        layout = default_layout(entries.values(), index["world_size"], comm.rank, comm.world_size)
    else:
        layout = _requested_layout(store.name, entries, slices)
    return assemble(store, folder, index, entries, layout, include_optimizer_state, recorded, resuming=resuming), layout


def assemble_step(store: StepStore, folder: Folder, recorded: Mapping[str, dict[str, Any]]) -> CheckpointState:
    """A sharded step's whole state, in one process (``recorded``: its metadata.json's files)."""
    index = _parse_index(store.read_document(folder, INDEX_NAME), f"{store.file(folder, INDEX_NAME).name}")
    entries = tensor_entries(index)
    layout = {name: Slice.whole(e.shape) for name, e in entries.items()}
    return assemble(store, folder, index, entries, layout, True, recorded)


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
    ``storage_options``).
    """
    store = open_store(directory, storage_options, writer=False)
    folder, index, recorded = read_committed(store, step)
    entries = tensor_entries(index)
    layout = {name: Slice.whole(e.shape) for name, e in entries.items()}
    state = assemble(store, folder, index, entries, layout, include_optimizer_state, recorded)
    CheckpointState.save_checkpoint(
        state,
        out,
        include_optimizer_state,
        external_data_threshold=external_data_threshold,
        durable=durable,
        storage_options=storage_options,
    )
    return out if targets.is_object_url(out) else Path(out)


def read_committed(store: StepStore, step: int | None) -> tuple[Folder, dict[str, Any], dict[str, Any]]:
    """(where its shards are, its index, what its metadata.json records of its files: a
    manager's step, else nothing) of a committed sharded checkpoint of ``store`` (the
    store's own folder when it is one step's, else ``step``, else the latest), the index
    validated (:mod:`ortckpt.documents`: shard files are plain names of their rank, pieces
    inside their tensors and tiling them). CheckpointFormatError, naming the index, when it is
    damaged."""
    found = store.locate()
    if found is not None:  # the store's folder is itself a step's
        named = steps.step_of(Path(store.name).name)
        if named is not None and named != found.number:
            raise CheckpointFormatError(
                f"{store.name}/{INDEX_NAME}: step {found.number}, but the directory is of step {named}"
            )
    if found is None or (step is not None and found.number != step):
        if step is None:
            scan = store.scan(INDEX_NAME)
            if not scan.steps and not scan.damaged:
                raise FileNotFoundError(f"{store.name}: no committed sharded checkpoint")
            step = max([*scan.steps, *scan.damaged])  # a damaged latest index is an error, not skipped
        found = store.read(step, INDEX_NAME)
        if found is None:
            raise FileNotFoundError(
                f"{store.name}/{steps.step_directory_name(step)}: no committed sharded checkpoint of step {step} "
                f"(no {INDEX_NAME}: never saved, or its save did not finish)"
            )
    return found.folder, index_of(store, found), found.document.get("files", {})


def index_of(store: StepStore, step: Step) -> dict[str, Any]:
    """A sharded step's index: the document that committed it, or (a manager's sharded step,
    committed by its metadata) the one among its files."""
    if "shards" in step.document:
        return step.document
    data = store.read_document(step.folder, INDEX_NAME)
    index = _parse_index(data, store.file(step.folder, INDEX_NAME).name)
    if index["step"] != step.number:
        raise CheckpointFormatError(
            f"{store.file(step.folder, INDEX_NAME).name}: step {index['step']}, not {step.number}"
        )
    return index


def _parse_index(data: bytes, where: str) -> dict[str, Any]:
    return documents.parse(documents.SHARDED_INDEX, data, where)  # type: ignore[no-any-return]


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
    store: StepStore,
    folder: Folder,
    index: Mapping[str, Any],
    entries: Mapping[str, TensorEntry],
    layout: Mapping[str, Slice],
    include_optimizer_state: bool,
    recorded: Mapping[str, dict[str, Any]],
    *,
    resuming: Step | None = None,
) -> CheckpointState:
    """A state of the pieces ``layout`` asks for, read from the shards (in ``folder`` of
    ``store``) that hold them. Every piece read must have the type and shape the index gives it
    (CheckpointFormatError, naming the shard and the tensor, if not)."""
    shards = _Shards(store, folder, index, recorded, resuming)
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
        (trainable if entry.trainable else frozen)[name] = region(entry, want, functools.partial(shards.tensor, entry))
        if include_optimizer_state:
            for group, m in entry.momentums:
                read = functools.partial(shards.momentum, entry, group=group, m=m)
                groups[group].momentums.setdefault(name, {})[m] = region(entry, want, read)
    state = CheckpointState.from_arrays(trainable, frozen, index.get("properties", {}))
    state.optimizer_groups = groups
    return state


class _Shards:
    """The shard files of one sharded step, opened when first needed (only by the plain names
    the index gives, never through a symlink), and the pieces read from them, checked."""

    def __init__(
        self,
        store: StepStore,
        folder: Folder,
        index: Mapping[str, Any],
        recorded: Mapping[str, dict[str, Any]],
        resuming: Step | None = None,
    ) -> None:
        self.store = store
        self.resuming = resuming
        self.folder = folder
        self.names = {s["rank"]: s["file"] for s in index["shards"]}  # (plain names: the index was validated)
        # {file: entry}: what a load checks, the index's sizes, with what metadata.json records of
        # the file (a manager's step: its SHA-256, and where a data object the steps share is)
        # when it records that size
        self.entries = {
            s["rank"]: {file: self._entry(file, recorded.get(file), size) for file, size in s["files"].items()}
            for s in index["shards"]
        }
        self.files = {rank: store.file(folder, name).name for rank, name in self.names.items()}
        self.opened: dict[int, CheckpointState] = {}
        self.records: dict[int, dict[str, TensorRecord]] = {}

    def _entry(self, file: str, recorded: dict[str, Any] | None, size: int) -> dict[str, Any]:
        """A shard file's entry: the one metadata.json records (none: a step without one), which
        must give the size the index gives."""
        if recorded is None:
            return {"bytes": size}
        if recorded.get("bytes") != size:
            where = self.store.place(self.folder, file, recorded)
            raise CheckpointIntegrityError(
                where, [f"{where}: metadata.json records {recorded.get('bytes')} bytes for {file}, {INDEX_NAME} {size}"]
            )
        return dict(recorded)

    def shard(self, rank: int) -> CheckpointState:
        if rank not in self.opened:
            if rank not in self.files:
                raise CheckpointFormatError(f"{self.store.name}: the index names no shard of rank {rank}")
            # On object storage no shard is downloaded past the sizes its index records; a local
            # shard is mapped, and its pieces checked as they are read.
            self.opened[rank] = self.store.load_shard(
                self.folder, self.names[rank], self.entries[rank], resuming=self.resuming
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


def check_shards(store: StepStore, folder: Folder, index: Mapping[str, Any]) -> list[str]:
    """What :func:`assemble` would refuse, for :func:`ortckpt.verify`: every piece of every
    tensor and momentum the index lists, read from its shard and checked against the index."""
    shards = _Shards(store, folder, index, {})
    problems = []
    for entry in tensor_entries(index).values():
        for piece in entry.pieces:
            try:
                shards.tensor(entry, piece)
                for group, m in entry.momentums:
                    shards.momentum(entry, piece, group, m)
            except (CheckpointError, OSError) as e:
                problems.append(str(e))  # (a shard that fails to open fails each piece: verify says it once)
    return problems


# --- small helpers -------------------------------------------------------------------------------


def encode_index(index: Mapping[str, Any], where: str) -> bytes:
    """The index as written, checked to read back: a save never commits an index that load
    would refuse."""
    index = documents.encode_non_finite(index, ("properties", "optimizer_groups"))  # (JSON has no NaN)
    data = (json.dumps(index, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
    documents.parse(documents.SHARDED_INDEX, data, where)
    return data
