"""The schema of a sharded checkpoint's ``index.json`` (:data:`SHARDED_INDEX`), with the bounded
check of each tensor's tiling by the shards' pieces."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import dtypes as _dt
from .base import (
    INT64_MAX,
    DocumentError,
    Kind,
    bad_value,
    check_int,
    check_ints,
    check_list,
    check_number,
    check_object,
    check_versioned,
    key_shown,
)
from .metadata import check_attempt, decode_non_finite

# --- index.json of a sharded checkpoint ---------------------------------------------------------------

SHARDED_FORMAT = "ortckpt.sharded"
SHARDED_VERSION = 1
MAX_WORLD_SIZE = 1 << 20


# A sharded step directory's index (the commit point of a sharded save).
INDEX_NAME = "index.json"


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}"


# A tensor has at most this many dimensions (NumPy's most), each of at most INT64_MAX elements.
MAX_RANK = 64


def check_index(value: Any, where: str) -> dict[str, Any]:
    """A sharded checkpoint's index: every shard a plain name of the form its rank gives, every
    piece inside its tensor and held by a shard, the pieces of a tensor tiling it exactly."""
    index = check_versioned(value, where, SHARDED_FORMAT, SHARDED_VERSION, "sharded checkpoint")
    decode_non_finite(index, where)  # (a property or learning rate that is NaN or infinite)
    check_int(index.get("step"), where, "step", 0, INT64_MAX)
    world = check_int(index.get("world_size"), where, "world_size", 1, MAX_WORLD_SIZE)
    check_attempt(index, where)
    ranks = set()
    for i, raw_shard in enumerate(check_list(index.get("shards"), where, "shards")):
        at = f"shards[{i}]"
        shard = check_object(raw_shard, where, at)
        rank = check_int(shard.get("rank"), where, f"{at}.rank", 0, world - 1)
        if rank in ranks:
            raise DocumentError(f"{where}: {at}: rank {rank} has two shards")
        ranks.add(rank)
        name = shard_file_name(rank, world)
        if shard.get("file") != name:
            raise bad_value(where, f"{at}.file", shard.get("file"), f"the shard file name {name!r}")
        for file, size in check_object(shard.get("files"), where, f"{at}.files").items():
            if file not in (name, f"{name}.data"):
                raise DocumentError(f"{where}: {at}.files names {key_shown(file)!r}, not a file of shard {name}")
            check_int(size, where, f"{at}.files.{file}", 0, INT64_MAX)
    groups = check_object(index.get("optimizer_groups", {}), where, "optimizer_groups")
    for name, raw_group in groups.items():
        gat = f"optimizer_groups.{key_shown(name)}"
        group = check_object(raw_group, where, gat)
        check_int(group.get("step"), where, f"{gat}.step", None)
        check_number(group.get("initial_learning_rate"), where, f"{gat}.initial_learning_rate")
    for name, prop in check_object(index.get("properties", {}), where, "properties").items():
        if type(prop) not in (int, float, str):
            raise bad_value(where, f"properties.{key_shown(name)}", prop, "an int, float or string")
    budget = TilingBudget(MAX_INDEX_TILING_CELLS)
    for name, tensor in check_object(index.get("tensors"), where, "tensors").items():
        at = f"tensors.{key_shown(name)}"
        _check_tensor(check_object(tensor, where, at), where, at, ranks, groups, world, budget)
    return index


def _check_tensor(
    tensor: dict[str, Any],
    where: str,
    at: str,
    ranks: set[int],
    groups: Mapping[str, Any],
    world: int,
    budget: TilingBudget,
) -> None:
    check_int(tensor.get("code"), where, f"{at}.code", 1, len(_dt.NAMES) - 1)
    shape = check_ints(tensor.get("shape"), where, f"{at}.shape", 0, INT64_MAX)
    if len(shape) > MAX_RANK:
        raise DocumentError(f"{where}: {at}.shape has {len(shape)} dimensions, more than a tensor's {MAX_RANK}")
    if type(tensor.get("trainable")) is not bool:
        raise bad_value(where, f"{at}.trainable", tensor.get("trainable"), "true or false")
    for i, raw_pair in enumerate(check_list(tensor.get("momentums"), where, f"{at}.momentums")):
        pair = check_list(raw_pair, where, f"{at}.momentums[{i}]")
        if len(pair) != 2 or not all(isinstance(p, str) for p in pair) or pair[0] not in groups:
            raise bad_value(where, f"{at}.momentums[{i}]", pair, "[optimizer group of the index, momentum name]")
    offsets: list[list[int]] = []
    sizes: list[list[int]] = []
    shards = set()
    for i, raw_piece in enumerate(check_list(tensor.get("pieces"), where, f"{at}.pieces")):
        pat = f"{at}.pieces[{i}]"
        piece = check_object(raw_piece, where, pat)
        shard = piece.get("shard")
        if type(shard) is not int or shard not in ranks:
            check_int(shard, where, f"{pat}.shard")
            raise DocumentError(f"{where}: {pat} is in shard {shard}, which the index does not list")
        if shard in shards:  # each rank writes at most one piece of a tensor
            raise DocumentError(f"{where}: {pat}: shard {shard} holds two pieces of the tensor")
        shards.add(shard)
        check_ints(piece.get("holders"), where, f"{pat}.holders", 0, world - 1)
        offset = check_ints(piece.get("offset"), where, f"{pat}.offset", 0, INT64_MAX)
        size = check_ints(piece.get("shape"), where, f"{pat}.shape", 0, INT64_MAX)
        if len(offset) != len(shape) or len(size) != len(shape):
            raise DocumentError(f"{where}: {pat} has {len(offset)}/{len(size)} dimensions, the tensor {len(shape)}")
        if any(map(operator.gt, map(operator.add, offset, size), shape)):
            raise DocumentError(
                f"{where}: {pat} (offset {offset}, shape {size}) reaches outside the tensor's shape {shape}"
            )
        offsets.append(offset)
        sizes.append(size)
    covered = sum(map(math.prod, sizes))
    total = math.prod(shape)
    if covered != total or not sizes:
        raise DocumentError(f"{where}: the pieces of {at} cover {covered} of its {total} elements")
    problem = tiling_problem(shape, list(zip(offsets, sizes, strict=True)), budget)
    if problem is not None:
        raise DocumentError(f"{where}: the pieces of {at} {problem}")


# Pieces that are not each one cell of the grid their edges cut (saves split tensors along one
# dimension, or several at the same places: one cell each) are checked by marking that grid, at
# about a nanosecond a cell: at most MAX_TILING_CELLS cells for a tensor (5 ms), and
# MAX_INDEX_TILING_CELLS for all the tensors of an index (80 ms), so that no index repeats for
# every tensor the most one may cost. A grid counts as GRID_CELLS_MIN cells at least (setting one
# up takes about 20 us): 16,384 small ones, a third of a second, at most.
MAX_TILING_CELLS = 1 << 22
MAX_INDEX_TILING_CELLS = 1 << 26
GRID_CELLS_MIN = 1 << 12


@dataclass
class TilingBudget:
    """The grid cells the tiling checks of one index may still mark, all its tensors together."""

    cells: int


def tiling_problem(
    shape: list[int], boxes: list[tuple[list[int], list[int]]], budget: TilingBudget | None = None
) -> str | None:
    """Why the boxes (offset, shape), each inside ``shape``, do not tile it exactly once, or None
    when they do. Never pairwise (an index is untrusted, and may list a million pieces): in time
    linear in the boxes (log-linear where one dimension is split), or in the grid their edges
    make, which is charged to ``budget``."""
    if math.prod(shape) == 0:
        return None  # nothing to cover
    boxes = [(offset, size) for offset, size in boxes if math.prod(size)]  # (the empty cover nothing)
    if not boxes:
        return "leave part of it uncovered"
    split = [d for d, extent in enumerate(shape) if any(o[d] or s[d] != extent for o, s in boxes)]
    if len(split) <= 1:  # intervals along one dimension (every box whole in the others), in order
        if not split:
            return None if len(boxes) == 1 else "overlap"
        d = split[0]
        end = 0
        for start, length in sorted((offset[d], size[d]) for offset, size in boxes):
            if start != end:
                return "overlap" if start < end else "leave part of it uncovered"
            end = start + length
        return None if end == shape[d] else "leave part of it uncovered"
    cuts = []
    for d in split:
        edges = {0, shape[d]}
        for offset, size in boxes:
            edges.update((offset[d], offset[d] + size[d]))
        cuts.append({edge: i for i, edge in enumerate(sorted(edges))})  # edge -> its grid line
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_TILING_CELLS:
        return f"cut the tensor into a grid of {cells} cells, more than ortckpt checks ({MAX_TILING_CELLS})"
    # Every box covers a cell at least: with more boxes than cells two overlap; with as many,
    # they tile the grid when each is one cell, a different one (and two overlap otherwise).
    if len(boxes) > cells:
        return "overlap"
    if len(boxes) == cells:
        taken = set()
        for offset, size in boxes:
            cell = tuple(c[offset[d]] for c, d in zip(cuts, split, strict=True))
            if cell in taken or any(
                c[offset[d] + size[d]] != line + 1 for c, d, line in zip(cuts, split, cell, strict=True)
            ):
                return "overlap"
            taken.add(cell)
        return None
    if budget is not None:
        budget.cells -= max(cells, GRID_CELLS_MIN)
        if budget.cells < 0:
            return (
                f"cut it into a grid of {cells} cells: with the tensors before it, more than the "
                f"{MAX_INDEX_TILING_CELLS} cells ortckpt checks in one index"
            )
    import numpy as np

    grid = np.zeros([len(c) - 1 for c in cuts], np.int8)  # (2 to 22 dimensions: each split in 2 or more)
    for offset, size in boxes:
        cells_of_box = grid[
            tuple(slice(c[offset[d]], c[offset[d] + size[d]]) for c, d in zip(cuts, split, strict=True))
        ]
        # Checked box by box: until the first overlap the boxes are disjoint, so the work is
        # at most twice the grid's size, however the boxes are chosen.
        if cells_of_box.any():
            return "overlap"
        cells_of_box += 1
    if not grid.all():
        return "leave part of it uncovered"
    return None


# An index lists every piece of every tensor. As saves write it (indent=1) a piece is 14 JSON
# values in about 160 bytes ({"holders": [r], "offset": [a, b], "shape": [c, d], "shard": r}), a
# tensor's own fields 20 more (with two momentums): 48,000 tensors of 16 pieces each (a very large
# model, 16-way tensor-parallel) are 11.7 million values in about 125 MiB, under both caps. Saves
# spend about 11 bytes a value, so 2^24 values (8 bytes each) admit any index a save writes under
# the byte cap. A hostile index of as many values (2 bytes each, up to 100 once parsed) takes
# about 10 s and 1.5 GiB to parse and be refused (2^25 and 256 MiB: 25 s and 3 GiB; the adversarial
# review measured 63-69 s and 5 GiB before any budget): the price of reading the largest indexes.
SHARDED_INDEX = Kind(
    "sharded checkpoint index", max_bytes=128 << 20, max_values=1 << 24, max_depth=8, check=check_index
)
