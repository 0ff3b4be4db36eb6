"""Every document ortckpt reads has its cost known before memory is allocated for it: a hostile
document under its byte cap (an index.json of millions of empty objects, a string one emoji
widens to 4 bytes a character, an index whose tensors each make the largest tiling grid) is
refused from its bytes, or by a budget of the schema checks' work, in bounded time and memory;
a legitimate document as large as saves write still parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from ortckpt import CheckpointFormatError, CheckpointManager, CheckpointState, documents
from ortckpt.documents import DocumentError

KINDS = {
    "index": documents.SHARDED_INDEX,
    "metadata": documents.METADATA,
    "safetensors": documents.SAFETENSORS_HEADER,
    "structure": documents.ORTCKPT_STRUCTURE,
    "footer": documents.COMPRESSED_FOOTER,
    "holder": documents.WRITER_HOLDER,
}


def values_in(data: bytes) -> int:
    return 1 + sum(data.count(c) for c in (b"{", b"[", b",", b":"))


# --- what parsing would allocate, refused from the bytes ----------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS), ids=list(KINDS))
@pytest.mark.parametrize(
    "shape",
    [
        b"[" + b",".join([b"{}"] * 2000) + b"]",
        b"[" + b",".join([b"[[0]]"] * 1000) + b"]",
        b'{"a":' * 40 + b"0" + b"}" * 40,
    ],
    ids=["empty-objects", "nested-lists", "nested-objects"],
)
def test_a_document_of_too_many_values_is_refused_before_it_is_parsed(monkeypatch, kind, shape):
    monkeypatch.setattr(KINDS[kind], "max_values", 64)  # millions in earnest: the same refusal, smaller
    parsed = []
    monkeypatch.setattr(documents.base.json, "loads", lambda *a, **k: parsed.append(1))
    with pytest.raises(DocumentError, match=r"^doc\.json: up to \d+ JSON values .* more than the 64 ") as e:
        documents.parse(KINDS[kind], shape, "doc.json")
    assert isinstance(e.value, CheckpointFormatError)
    assert parsed == [], "refused from its bytes, before json.loads allocated anything"


def test_the_values_of_a_document_are_bounded_from_above():
    """Every value but the first follows a [, {, comma or colon: the count never misses one
    (it may count more, in strings: a bound, not a census)."""
    documents_ = [
        b"0",
        b"[]",
        b"{}",
        b'[1, "a", [2, {"b": [3, 4]}], {}, [], null, true]',
        b'{"k": "x,y:z[{"}',
        json.dumps({"format": "ortckpt.sharded", "tensors": {"w": {"shape": [2, 3], "pieces": [{}]}}}).encode(),
    ]
    for data in documents_:
        parsed = json.loads(data)
        scalars_and_containers = [parsed]
        made = 0
        while scalars_and_containers:
            value = scalars_and_containers.pop()
            made += 1
            if isinstance(value, dict):
                made += len(value)  # the keys
                scalars_and_containers.extend(value.values())
            elif isinstance(value, list):
                scalars_and_containers.extend(value)
        assert made <= values_in(data), data


def test_a_document_at_its_budget_parses(monkeypatch):
    text = b"[" + b",".join([b"0"] * 99) + b"]"  # 100 values: the list and 99 numbers
    monkeypatch.setattr(documents.SHARDED_INDEX, "max_values", 100)
    with pytest.raises(DocumentError, match="the document is"):  # parsed, then refused by the schema
        documents.parse(documents.SHARDED_INDEX, text, "index.json")
    monkeypatch.setattr(documents.SHARDED_INDEX, "max_values", 99)
    with pytest.raises(DocumentError, match="up to 100 JSON values"):
        documents.parse(documents.SHARDED_INDEX, text, "index.json")


WIDE = {
    "latin-1": ("\u00e9", 1),
    "latin-1-escaped": ("\\u00e9", 1),
    "past-latin-1": ("\u0100", 2),
    "past-latin-1-escaped": ("\\u4e2d", 2),
    "past-the-bmp": ("\U0001f600", 4),
    "past-the-bmp-escaped": ("\\ud83d\\ude00", 4),
}


@pytest.mark.parametrize("case", list(WIDE), ids=list(WIDE))
def test_characters_that_widen_the_parsed_text_shrink_the_byte_cap(monkeypatch, case):
    """CPython stores a string in 1, 2 or 4 bytes a character, by its widest: one emoji in a
    240 MiB string makes it 960 MiB (and the decoded text as much again)."""
    char, width = WIDE[case]
    monkeypatch.setattr(documents.METADATA, "max_bytes", 4000)
    head = '{"format": "ortckpt-metadata/1", "step": 1, "files": {}, "user": {"note": "' + char
    fits = (head + "a" * (4000 // width - len((head + '"}}').encode())) + '"}}').encode()
    assert len(fits) * width <= 4000
    assert documents.parse(documents.METADATA, fits, "metadata.json")["user"]["note"].startswith(
        json.loads(f'"{char}"')
    )
    if width > 1:  # one byte more than the cap allows for its width
        with pytest.raises(DocumentError, match=rf"take {width} bytes each in memory: more than the {4000 // width} "):
            documents.parse(documents.METADATA, fits[:-3] + b'a"}}', "metadata.json")


# At the real caps, in a process whose address space is limited: the original checks parsed
# these (tens of millions of objects, or a string 4 bytes a character) and ran out of memory.
HOSTILE_AT_THE_CAPS = {
    # 2^25 values and more: 28 million empty objects (2 GiB parsed, as many again to check depth)
    "empty-objects": "b'[' + b'{},' * (28 << 20) + b'{}]'",
    # 70 MiB of text under the 256 MiB cap, but 280 MiB decoded and as much parsed
    "astral-string": (
        'b\'{"format": "ortckpt.sharded", "version": 1, "padding": "\' + \'\\U0001f600\'.encode()'
        " + b'a' * (70 << 20) + b'\"}'"
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_AT_THE_CAPS), ids=list(HOSTILE_AT_THE_CAPS))
def test_a_hostile_index_at_the_real_caps_is_refused_within_a_memory_limit(case):
    script = textwrap.dedent(
        f"""
        import resource
        from ortckpt import documents

        data = {HOSTILE_AT_THE_CAPS[case]}
        assert len(data) < documents.SHARDED_INDEX.max_bytes
        for line in open("/proc/self/status"):
            if line.startswith("VmSize"):
                used = int(line.split()[1]) << 10
        # what the document and the interpreter already take, and 400 MiB more
        resource.setrlimit(resource.RLIMIT_AS, (used + (400 << 20), resource.RLIM_INFINITY))
        try:
            documents.parse(documents.SHARDED_INDEX, data, "index.json")
        except documents.DocumentError as e:
            print("refused:", e)
        except MemoryError:
            print("out of memory")
        """
    )
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120, env=env
    )
    assert run.stdout.startswith("refused: index.json: "), run.stdout + run.stderr


# --- nesting, checked without a value's worth of memory each ------------------------------------------


def test_the_depth_check_takes_memory_for_containers_not_values():
    wide = json.loads("[" + ",".join(["0"] * 1_000_000) + "]")
    tracemalloc.start()
    try:
        assert documents.depth_of(wide, 8) == 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes to find the depth of one list"  # (was a tuple a value: 64 MiB)


def test_the_depth_check_still_counts_lists_objects_tuples_and_mappings():
    from types import MappingProxyType

    assert documents.depth_of(0, 8) == 0
    assert documents.depth_of([], 8) == 1
    assert documents.depth_of({"a": [{"b": ()}]}, 8) == 4
    assert documents.depth_of(MappingProxyType({"a": ({"b": [[]]},)}), 8) == 5
    deep: list = []
    for _ in range(100_000):
        deep = [deep, 1]
    assert documents.depth_of(deep, 64) == 65


# --- the schema checks' work ---------------------------------------------------------------------------


def index_of(tensors: dict[str, dict], world: int) -> dict:
    return {
        "format": "ortckpt.sharded",
        "version": 1,
        "step": 1,
        "world_size": world,
        "shards": [{"rank": r, "file": f"shard-{r:05d}-of-{world:05d}", "files": {}} for r in range(world)],
        "tensors": tensors,
    }


def tensor(shape: list[int], pieces: list[tuple[list[int], list[int]]], **fields: object) -> dict:
    return {
        "code": 1,
        "shape": shape,
        "trainable": True,
        "momentums": [],
        "pieces": [{"shard": r, "holders": [r], "offset": o, "shape": s} for r, (o, s) in enumerate(pieces)],
        **fields,
    }


def bricks(layers: int) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """A valid tiling of [L, M, M] by 4 pieces a layer, each layer split at other places: the
    pieces' edges cut the tensor into a grid of about 2 L^3 cells (4,145,280 for L = 127, just
    under MAX_TILING_CELLS) that the check marks."""
    m = 2 * layers + 2
    pieces = []
    for i in range(layers):
        a, b, c = i + 1, i + 1, layers + i + 1
        pieces += [
            ([i, 0, 0], [1, a, b]),
            ([i, 0, b], [1, a, m - b]),
            ([i, a, 0], [1, m - a, c]),
            ([i, a, c], [1, m - a, m - c]),
        ]
    return [layers, m, m], pieces


def test_the_tiling_grids_of_an_index_share_one_budget():
    """Each tensor's grid is under MAX_TILING_CELLS, but the index repeats it: its checks would
    take 83 s for a 256 MiB index of such tensors; the budget for the whole index refuses it in
    a fraction of a second, naming the tensor that exceeded it."""
    shape, pieces = bricks(127)
    cells = 127 * 128 * 255
    assert cells <= documents.MAX_TILING_CELLS
    fit = documents.MAX_INDEX_TILING_CELLS // cells
    documents.check_index(index_of({f"t{i}": tensor(shape, pieces) for i in range(fit)}, len(pieces)), "index.json")
    hostile = index_of({f"t{i}": tensor(shape, pieces) for i in range(fit + 3)}, len(pieces))
    with pytest.raises(
        DocumentError, match=rf"^index.json: the pieces of tensors.t{fit} cut it into a grid of {cells} "
    ):
        documents.check_index(hostile, "index.json")
    with pytest.raises(DocumentError, match=f"more than the {documents.MAX_INDEX_TILING_CELLS} cells ortckpt checks"):
        documents.check_index(hostile, "index.json")


def test_small_grids_count_against_the_budget_at_their_setting_up_cost(monkeypatch):
    monkeypatch.setattr(documents.index, "MAX_INDEX_TILING_CELLS", 10 * documents.GRID_CELLS_MIN)
    # a 2 x 2 grid with a piece across two cells: 3 pieces, 4 cells, the grid marked
    layout = tensor([2, 2], [([0, 0], [1, 2]), ([1, 0], [1, 1]), ([1, 1], [1, 1])])
    documents.check_index(index_of({f"t{i}": layout for i in range(10)}, 3), "index.json")
    with pytest.raises(DocumentError, match=r"tensors\.t10 cut it into a grid of 4 cells"):
        documents.check_index(index_of({f"t{i}": layout for i in range(11)}, 3), "index.json")


SPLITS = {
    # (shape, pieces, the problem or None)
    "rows": ([4, 3], [([0, 0], [1, 3]), ([1, 0], [3, 3])], None),
    "columns-unordered": ([2, 6], [([0, 4], [2, 2]), ([0, 0], [2, 4])], None),
    "one-piece": ([5], [([0], [5])], None),
    "scalar": ([], [([], [])], None),
    "scalar-twice": ([], [([], []), ([], [])], "overlap"),
    "whole-twice": ([2, 2], [([0, 0], [2, 2]), ([0, 0], [2, 2])], "overlap"),
    "rows-overlap": ([4], [([0], [3]), ([2], [2])], "overlap"),
    "rows-gap": ([4], [([0], [1]), ([2], [2])], "leave part of it uncovered"),
    "rows-short": ([4], [([0], [1]), ([1], [2])], "leave part of it uncovered"),
    "grid": ([4, 4], [([r, c], [2, 2]) for r in (0, 2) for c in (0, 2)], None),
    "grid-repeated-cell": ([4, 4], [([0, 0], [2, 2]), ([0, 0], [2, 2]), ([2, 0], [2, 4])], "overlap"),
    "grid-cell-twice": ([2, 2], [([0, 0], [1, 1]), ([0, 0], [1, 1]), ([1, 0], [1, 1]), ([0, 1], [1, 1])], "overlap"),
    "grid-piece-of-two-cells": (
        [2, 2],
        [([0, 0], [1, 2]), ([0, 0], [1, 1]), ([1, 0], [1, 1]), ([1, 1], [1, 1])],
        "overlap",
    ),
    "bricks": ([2, 3], [([0, 0], [1, 1]), ([0, 1], [1, 2]), ([1, 0], [1, 2]), ([1, 2], [1, 1])], None),
    "bricks-gap": ([2, 3], [([0, 0], [1, 1]), ([0, 1], [1, 2]), ([1, 0], [1, 2])], "leave part of it uncovered"),
    "bricks-overlap": ([2, 3], [([0, 0], [1, 2]), ([0, 1], [1, 2]), ([1, 0], [1, 3])], "overlap"),
    "with-empty": ([2], [([0], [0]), ([0], [2]), ([2], [0])], None),
}


@pytest.mark.parametrize("case", list(SPLITS), ids=list(SPLITS))
def test_tilings_are_told_apart_along_each_path(case):
    shape, boxes, problem = SPLITS[case]
    assert documents.tiling_problem(shape, boxes) == problem
    grid = np.zeros(shape, np.int8)
    for offset, size in boxes:
        grid[tuple(slice(o, o + s) for o, s in zip(offset, size, strict=True))] += 1
    assert (problem is None) == bool((grid == 1).all()), "what marking every element says"


def test_a_tensor_of_more_dimensions_than_numpy_is_refused():
    shape = [1] * (documents.MAX_RANK + 1)
    index = index_of({"t": tensor(shape, [([0] * len(shape), shape)])}, 1)
    with pytest.raises(DocumentError, match=r"tensors.t.shape has 65 dimensions, more than a tensor's 64"):
        documents.check_index(index, "index.json")
    header = {"t": {"dtype": "F32", "shape": [2] * 100_000, "data_offsets": [0, 4]}}
    with pytest.raises(DocumentError, match=r"tensor t: shape has 100000 dimensions"):
        documents.check_safetensors_header(header, "header")
    with pytest.raises(DocumentError, match=r"tensor t: shape\[0\] is 9223372036854775808, expected an integer"):
        documents.check_safetensors_header({"t": {"dtype": "F32", "shape": [2**63], "data_offsets": [0, 4]}}, "header")


def test_messages_about_huge_values_stay_short():
    long_name = "w" * 1_000_000
    index = index_of({long_name: tensor([2], [([0], [2])], code=99)}, 1)
    with pytest.raises(DocumentError) as e:
        documents.check_index(index, "index.json")
    assert str(e.value).startswith("index.json: tensors.www") and len(str(e.value)) < 400, len(str(e.value))
    footer = {
        "format": "ortckpt.compressed",
        "version": 1,
        "codec": "zstd",
        "block_elements": 1024,
        "files": [
            {"role": "checkpoint", "size": 8, "frame_offset": 8, "frame_size": 1, "sha256": "0" * 64},
        ],
    }
    footer["files"][0]["grouped"] = [list(range(1_000_000))]
    with pytest.raises(DocumentError) as e:
        documents.check_compressed(footer, "footer")
    assert "footer: files[0].grouped[0] is [0, 1, 2" in str(e.value) and len(str(e.value)) < 400
    shards = {str(i): i for i in range(1_000_000)}
    with pytest.raises(DocumentError, match=r'^index.json: shards is \{"0": 0, "1": 1, .{40,}, expected a list$'):
        documents.check_index({**index_of({}, 1), "shards": shards}, "index.json")


# --- legitimate documents, as large as saves write them -----------------------------------------------


def legitimate_index(tensors: int, pieces: int, momentums: int = 2) -> bytes:
    """As a save writes it (encode_index: indent=1, sorted keys): every tensor split in
    ``pieces`` along its first dimension, piece r held by rank r."""
    table = {
        f"model.layers.{t // 10}.block.weight_{t % 10}": tensor(
            [256 * pieces, 4096],
            [([256 * r, 0], [256, 4096]) for r in range(pieces)],
            momentums=[["AdamOptimizer", f"momentum{m}"] for m in range(momentums)],
        )
        for t in range(tensors)
    }
    index = {
        **index_of(table, pieces),
        "created": "2026-01-01T00:00:00+00:00",
        "optimizer_groups": {"AdamOptimizer": {"step": 1000, "initial_learning_rate": 0.001}},
        "properties": {"epoch": 3},
    }
    return (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()


def test_the_value_budget_admits_an_index_of_48k_tensors_of_16_pieces():
    """Counted on 1,000 tensors, scaled: 48,000 tensors of 16 pieces, with two momentums each,
    are about 11.7 million values (2^24 is 16.8 million) in about 125 MiB."""
    sample = legitimate_index(1000, 16)
    per_tensor = (values_in(sample) - values_in(legitimate_index(0, 16))) / 1000
    assert 240 <= per_tensor <= 250
    assert 48_000 * per_tensor < 0.75 * documents.SHARDED_INDEX.max_values
    # and a save spends 8 bytes a value or more: any index under the byte cap is under the budget
    assert len(sample) / values_in(sample) > 8
    assert documents.SHARDED_INDEX.max_bytes / 8 <= documents.SHARDED_INDEX.max_values


def test_a_large_legitimate_index_parses():
    data = legitimate_index(2000, 16)  # 32,000 pieces, 5 MiB
    index = documents.parse(documents.SHARDED_INDEX, data, "index.json")
    assert len(index["tensors"]) == 2000
    from ortckpt.distributed.layout import tensor_entries

    entries = tensor_entries(index)
    assert all(len(entry.pieces) == 16 for entry in entries.values())


def test_a_save_learns_of_the_value_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(documents.METADATA, "max_values", 1000)
    state = CheckpointState.from_arrays({"w": np.ones(3, np.float32)})
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(CheckpointFormatError, match="JSON values"):
            manager.save(state, 1, metadata={"table": list(range(2000))})
        manager.save(state, 1, metadata={"table": list(range(100))})
        assert manager.all_steps() == [1]
