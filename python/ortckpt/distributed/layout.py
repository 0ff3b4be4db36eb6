"""Where each tensor of a sharded checkpoint lives: slices, the save plan, and the index; and a
slice of a tensor cut from the saved pieces it overlaps (:func:`region`).

Pure data and rules, no I/O and no collectives, so that every check a sharded save makes
(ranks agreeing on types and shapes, pieces tiling each tensor exactly) runs on rank 0
before any rank writes a byte.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import PackedBits
from ..errors import CheckpointFormatError, CheckpointStateError
from ..steps import INDEX_NAME as INDEX_NAME  # a step directory's names: ortckpt.steps
from ..steps import shard_file_name as shard_file_name


@dataclass(frozen=True)
class Slice:
    """The part of a tensor one rank holds: a box of ``shape`` at ``offset`` inside
    ``global_shape`` (what torch's DTensor and DCP call a chunk)."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        object.__setattr__(self, "offset", tuple(int(d) for d in self.offset))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not len(self.global_shape) == len(self.offset) == len(self.shape):
            raise ValueError(f"slice {self}: global_shape, offset and shape need the same number of dimensions")
        for o, s, g in zip(self.offset, self.shape, self.global_shape, strict=True):
            if o < 0 or s < 0 or o + s > g:
                raise ValueError(f"slice {self}: reaches outside the tensor's shape {self.global_shape}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Slice:
        return cls(tuple(shape), (0,) * len(shape), tuple(shape))

    @classmethod
    def split(cls, global_shape: Sequence[int], rank: int, world_size: int, dim: int = 0) -> Slice:
        """Rank ``rank``'s part of ``global_shape`` cut into ``world_size`` parts along ``dim``,
        the first parts one longer when it does not divide (``numpy.array_split``'s rule)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        global_shape = tuple(global_shape)
        length = global_shape[dim]
        base, extra = divmod(length, world_size)
        start = rank * base + min(rank, extra)
        size = base + (1 if rank < extra else 0)
        offset = tuple(start if d == dim else 0 for d in range(len(global_shape)))
        shape = tuple(size if d == dim else n for d, n in enumerate(global_shape))
        return cls(global_shape, offset, shape)

    @property
    def index(self) -> tuple[slice, ...]:
        """For ``array[slice.index]``: this part of the whole tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape, strict=True))

    @property
    def is_whole(self) -> bool:
        return self.shape == self.global_shape

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def intersection(self, other: Slice) -> Slice | None:
        """The box both cover, or None when they share no element."""
        start = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        stop = tuple(
            min(a + n, b + m) for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape, strict=True)
        )
        if any(lo >= hi for lo, hi in zip(start, stop, strict=True)):
            return None
        return Slice(self.global_shape, start, tuple(hi - lo for lo, hi in zip(start, stop, strict=True)))

    def within(self, outer: Slice) -> tuple[slice, ...]:
        """This box's position inside ``outer`` (which contains it), for indexing ``outer``'s array."""
        return tuple(slice(o - p, o - p + s) for o, p, s in zip(self.offset, outer.offset, self.shape, strict=True))

    def to_json(self) -> dict[str, list[int]]:
        return {"offset": list(self.offset), "shape": list(self.shape)}


# --- what each rank holds, and the plan of who writes what ----------------------------------------


@dataclass(frozen=True)
class Held:
    """One tensor (or part of one) as a rank describes it before a save."""

    name: str
    code: int  # ONNX data type
    trainable: bool
    slice: Slice
    momentums: tuple[tuple[str, str], ...]  # (group, momentum name) saved with it


@dataclass(frozen=True)
class RankDescription:
    rank: int
    tensors: tuple[Held, ...]
    groups: tuple[tuple[str, int, float], ...]  # (name, step, initial learning rate)
    properties: tuple[tuple[str, Any], ...]


def plan(descriptions: Sequence[RankDescription]) -> tuple[list[list[str]], dict[str, Any]]:
    """Who writes what, and the index's tensor table, from every rank's description.

    A piece held by several ranks (replicated parameters, data-parallel copies of a
    tensor-parallel slice) is written once, by the lowest of them. Refuses, naming the
    tensor and ranks: a name whose type, shape or role differs between ranks, pieces that
    overlap without being equal, pieces that leave part of a tensor uncovered, and optimizer
    groups whose step or learning rate differ.
    """
    tensors: dict[str, dict[str, Any]] = {}
    writes: list[list[str]] = [[] for _ in descriptions]
    for desc in descriptions:
        for held in desc.tensors:
            entry = tensors.setdefault(
                held.name,
                {
                    "code": held.code,
                    "shape": list(held.slice.global_shape),
                    "trainable": held.trainable,
                    "first_rank": desc.rank,
                    "pieces": [],
                    "momentums": set(),
                },
            )
            _agree(held, entry, desc.rank)
            pieces = entry["pieces"]
            same = next((p for p in pieces if p["slice"] == held.slice), None)
            if same is not None:
                same["holders"].append(desc.rank)
                if set(held.momentums) != same["momentum_set"]:
                    raise CheckpointStateError(
                        f"{held.name}: ranks {same['shard']} and {desc.rank} hold the same piece with different "
                        f"momentums ({sorted(same['momentum_set'])} and {sorted(held.momentums)})"
                    )
                continue
            for p in pieces:
                if p["slice"].intersection(held.slice) is not None:
                    raise CheckpointStateError(
                        f"{held.name}: the pieces of rank {p['shard']} ({p['slice'].to_json()}) and rank "
                        f"{desc.rank} ({held.slice.to_json()}) overlap"
                    )
            pieces.append(
                {"shard": desc.rank, "slice": held.slice, "holders": [desc.rank], "momentum_set": set(held.momentums)}
            )
            entry["momentums"] |= set(held.momentums)
            writes[desc.rank].append(held.name)
    table = {}
    for name in sorted(tensors):
        entry = tensors[name]
        if any(p["momentum_set"] != entry["momentums"] for p in entry["pieces"]):
            raise CheckpointStateError(
                f"{name}: some ranks hold optimizer momentums for their piece of it, others do not"
            )
        covered = sum(p["slice"].size for p in entry["pieces"])
        if covered != math.prod(entry["shape"]):
            raise CheckpointStateError(
                f"{name}: the ranks' pieces cover {covered} of its {math.prod(entry['shape'])} elements "
                f"(shape {tuple(entry['shape'])}); every element must be held by some rank"
            )
        table[name] = {
            "code": entry["code"],
            "shape": entry["shape"],
            "trainable": entry["trainable"],
            "momentums": sorted([list(m) for m in entry["momentums"]]),
            "pieces": [{"shard": p["shard"], "holders": p["holders"], **p["slice"].to_json()} for p in entry["pieces"]],
        }
    return writes, {"tensors": table, "optimizer_groups": _agreed_groups(descriptions)}


def _agree(held: Held, entry: Mapping[str, Any], rank: int) -> None:
    first = entry["first_rank"]
    if held.code != entry["code"]:
        raise CheckpointStateError(
            f"{held.name}: ONNX data type {held.code} on rank {rank}, {entry['code']} on rank {first}"
        )
    if list(held.slice.global_shape) != entry["shape"]:
        raise CheckpointStateError(
            f"{held.name}: shape {held.slice.global_shape} on rank {rank}, {tuple(entry['shape'])} on rank {first}"
        )
    if held.trainable != entry["trainable"]:
        raise CheckpointStateError(f"{held.name}: trainable on one of ranks {first} and {rank}, frozen on the other")


def _agreed_groups(descriptions: Sequence[RankDescription]) -> dict[str, dict[str, Any]]:
    groups: dict[str, tuple[int, float, int]] = {}
    for desc in descriptions:
        for name, step, lr in desc.groups:
            seen = groups.setdefault(name, (step, lr, desc.rank))
            if (seen[0], seen[1]) != (step, lr):
                raise CheckpointStateError(
                    f"optimizer group {name}: step {seen[0]} and learning rate {seen[1]} on rank {seen[2]}, "
                    f"step {step} and learning rate {lr} on rank {desc.rank}"
                )
    return {name: {"step": step, "initial_learning_rate": lr} for name, (step, lr, _) in sorted(groups.items())}


# --- reading the index back -----------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    shard: int
    holders: tuple[int, ...]
    slice: Slice


@dataclass(frozen=True)
class TensorEntry:
    name: str
    code: int
    shape: tuple[int, ...]
    trainable: bool
    momentums: tuple[tuple[str, str], ...]
    pieces: tuple[Piece, ...]


def tensor_entries(index: Mapping[str, Any]) -> dict[str, TensorEntry]:
    out = {}
    for name, t in index["tensors"].items():
        shape = tuple(t["shape"])
        pieces = tuple(
            Piece(p["shard"], tuple(p["holders"]), Slice(shape, p["offset"], p["shape"])) for p in t["pieces"]
        )
        out[name] = TensorEntry(name, t["code"], shape, t["trainable"], tuple(tuple(m) for m in t["momentums"]), pieces)
    return out


def default_layout(entries: Iterable[TensorEntry], saved_world: int, rank: int, world_size: int) -> dict[str, Slice]:
    """What ``rank`` of ``world_size`` loads when the caller does not say.

    The same world size: exactly the pieces this rank held at save. Another world size
    (resharding): a tensor split along one dimension is split again, evenly, along it; a
    tensor every rank held, every rank gets; any other whole tensor goes to rank
    (saving rank mod world size). Tensors tiled along several dimensions need explicit slices.
    """
    layout: dict[str, Slice] = {}
    for entry in entries:
        if world_size == saved_world:
            mine = [p.slice for p in entry.pieces if rank in p.holders]
            if len(mine) > 1:
                raise CheckpointStateError(f"{entry.name}: rank {rank} held {len(mine)} pieces of it")
            if mine:
                layout[entry.name] = mine[0]
            continue
        if len(entry.pieces) == 1:
            holders = entry.pieces[0].holders
            if set(holders) == set(range(saved_world)) or rank in {h % world_size for h in holders}:
                layout[entry.name] = Slice.whole(entry.shape)
            continue
        dim = split_dimension(entry)
        if dim is None:
            raise CheckpointStateError(
                f"{entry.name}: its pieces are not a split along one dimension; pass slices= to say which "
                "part each rank loads"
            )
        layout[entry.name] = Slice.split(entry.shape, rank, world_size, dim)
    return layout


def split_dimension(entry: TensorEntry) -> int | None:
    """The one dimension along which the pieces divide the tensor, if they do."""
    dims = {d for p in entry.pieces for d, (s, g) in enumerate(zip(p.slice.shape, entry.shape, strict=True)) if s != g}
    return dims.pop() if len(dims) == 1 else None


def region(entry: TensorEntry, want: Slice, read: Callable[[Piece], Any]) -> Any:
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
