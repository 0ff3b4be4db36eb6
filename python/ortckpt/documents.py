"""Every JSON document ortckpt reads, validated before anything uses it.

A document is read by :func:`parse` with the caps of its kind, checked before it is parsed
(its bytes, and the JSON values those bytes can make: what parsing will allocate) and after
(its nesting depth), then checked against its schema: the manager's ``metadata.json``, the
sharded ``index.json``, the safetensors header and its ``__ortckpt__`` entry, the footer of a
compressed checkpoint and the holder record of a directory's writer lock. The checks' own work
is bounded too (linear in the values, and a budget for what is not, e.g. an index's tiling
grids), so a hostile document under its caps costs time and memory known in advance. Whatever
is wrong raises :class:`DocumentError` (a :class:`~ortckpt.CheckpointFormatError`) naming the
file and the place in the document, e.g. ``index.json: shards[0].file``; no caller ever indexes
into unchecked JSON.

The schemas are written as plain functions over the parsed value (no dependency), one per
kind, in the order the document's fields appear.
"""

from __future__ import annotations

import json
import math
import operator
import re
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

from . import dtypes as _dt
from .errors import CheckpointFormatError
from .safe_io import is_plain_name


class DocumentError(CheckpointFormatError):
    """A JSON document that is malformed, too large, too deep, or not of its schema."""


@dataclass
class Kind:
    """What a document may be: its name in messages, its caps and its schema check (which
    returns the document, possibly with values decoded, e.g. non-finite metrics).

    ``max_bytes`` bounds the text, in the bytes its characters take once decoded;
    ``max_values`` the JSON values parsing makes of it, each a Python object of at most about
    :data:`BYTES_PER_VALUE` bytes. So parsing a document takes at most about
    ``2 * max_bytes + BYTES_PER_VALUE * max_values`` bytes besides its own (the decoded text,
    the strings parsed from it, the objects), whatever the document."""

    name: str
    max_bytes: int
    max_values: int
    max_depth: int
    check: Callable[[Any, str], Any]


# The most memory one JSON value takes once parsed, as measured on CPython 3.11 (a list or
# object of one item, nested, or a one-character string past Latin-1: about 97 bytes; an empty
# list or object, a number: 36 to 40). What a document costs is bounded with it.
BYTES_PER_VALUE = 100


def parse(kind: Kind, data: bytes | str, where: str) -> Any:
    """The document in ``data`` (from ``where``, a file name for messages), checked."""
    # (a str, e.g. an entry of a header read within its own caps, counts as its UTF-8)
    _check_size(kind, data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data, where)
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise DocumentError(f"{where}: not a {kind.name}: nested deeper than {kind.max_depth} levels") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise DocumentError(f"{where}: not a {kind.name}: not JSON ({e})") from None
    depth = depth_of(value, kind.max_depth)
    if depth > kind.max_depth:
        raise DocumentError(f"{where}: not a {kind.name}: nested deeper than {kind.max_depth} levels")
    try:
        return kind.check(value, where)
    except DocumentError as e:  # "<where>: <what is wrong>" -> "<where>: not a <kind>: <what is wrong>"
        raise DocumentError(f"{where}: not a {kind.name}: {str(e).removeprefix(f'{where}: ')}") from None


def _check_size(kind: Kind, data: bytes, where: str) -> None:
    """Refuses, from its bytes alone and before anything is allocated for it, a document that
    parsing would make larger than its kind allows (in time linear in the bytes, at memory speed)."""
    size = len(data)
    if size > kind.max_bytes:
        raise DocumentError(f"{where}: {size} bytes, more than the {kind.max_bytes} a {kind.name} may have")
    width = _char_width(data)
    if size * width > kind.max_bytes:
        raise DocumentError(
            f"{where}: {size} bytes, of characters that take {width} bytes each in memory: more than the "
            f"{kind.max_bytes // width} such a {kind.name} may have"
        )
    # Every JSON value but the first comes after one of these ("[" or "," in an array; "{" or ","
    # before a key, ":" before its value): counted in strings too, they bound the values.
    values = 1 + sum(map(data.count, (b"{", b"[", b",", b":")))
    if values > kind.max_values:
        raise DocumentError(
            f"{where}: up to {values} JSON values (its [, {{, commas and colons), more than the "
            f"{kind.max_values} a {kind.name} may have"
        )


# CPython stores a string in 1, 2 or 4 bytes a character, by its widest: one character past
# Latin-1 (raw in UTF-8, or \u-escaped) doubles the decoded text or a string parsed from it, one
# past the Basic Multilingual Plane (a 4-byte sequence, or an escaped surrogate) quadruples it.
_PAST_BMP = re.compile(rb"[\xf0-\xff]|\\u[dD][89abAB]")
_PAST_LATIN1 = re.compile(rb"[\xc4-\xef]|\\u(?!00)")


def _char_width(data: bytes) -> int:
    """The bytes a character of ``data`` may take in memory once decoded (1, 2 or 4)."""
    if data.isascii() and b"\\u" not in data:
        return 1
    if _PAST_BMP.search(data):
        return 4
    return 2 if _PAST_LATIN1.search(data) else 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# What ``depth_of`` looks into: JSON's lists and objects, and (a value about to be encoded)
# tuples and other mappings. The scalars of JSON are told apart first, by their type alone.
_NESTING = (list, dict, tuple, Mapping)
_SCALARS = frozenset({str, int, float, bool, type(None)})


def depth_of(value: Any, limit: int) -> int:
    """How deeply ``value`` nests lists and dicts (a scalar: 0), counting no further than
    ``limit + 1``; level by level, so no document can exhaust the stack, in time linear in its
    values and memory for the containers of one level."""
    level = [value] if type(value) not in _SCALARS and isinstance(value, _NESTING) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            break
        level = list(filter(None, level))  # (an empty list or object holds no deeper level)
        children = chain.from_iterable(
            item if type(item) is list else item.values() if isinstance(item, Mapping) else item for item in level
        )
        level = [child for child in children if type(child) not in _SCALARS and isinstance(child, _NESTING)]
    return depth


# --- building blocks ----------------------------------------------------------------------------------


def _bad(where: str, at: str, value: Any, expected: str) -> DocumentError:
    return DocumentError(f"{where}: {at} is {_shown(value)}, expected {expected}")


_ENCODER = json.JSONEncoder()  # (its iterencode is lazy: a message encodes only what it shows)


def _shown(value: Any, room: int = 80) -> str:
    """``value`` as JSON, cut to ``room`` characters, encoding no more of it than that (a
    message about a huge value must not cost what the value does)."""
    shown = ""
    try:
        for chunk in _ENCODER.iterencode(value[:room] if isinstance(value, str) else value):
            shown += chunk
            if len(shown) >= room:
                break
    except (TypeError, ValueError):
        return reprlib.repr(value)[:room]
    return shown[:room]


def _name(key: str) -> str:
    """A key of the document (a tensor's name, a file's) as a message shows it: cut when long."""
    return key if len(key) <= 100 else f"{key[:100]}..."


def _object(value: Any, where: str, at: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(where, at, value, "an object")
    return value


def _list(value: Any, where: str, at: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(where, at, value, "a list")
    return value


def _versioned(value: Any, where: str, format_name: str, version: int, what: str) -> dict[str, Any]:
    """A document object of ``format_name``, in the one ``version`` this ortckpt reads."""
    document = _object(value, where, "the document")
    if document.get("format") != format_name:
        raise _bad(where, "format", document.get("format"), repr(format_name))
    if document.get("version") != version:
        found = document.get("version")
        raise DocumentError(f"{where}: {what} version {_shown(found)}; this ortckpt reads version {version}")
    return document


def _int(value: Any, where: str, at: str, low: int | None = 0, high: int | None = None) -> int:
    if type(value) is not int or (low is not None and value < low) or (high is not None and value > high):
        bounds = f" from {low}" if low is not None else ""
        bounds += f" to {high}" if high is not None else ""
        raise _bad(where, at, value, f"an integer{bounds}")
    return value


def _number(value: Any, where: str, at: str) -> float | int:
    if type(value) not in (int, float):
        raise _bad(where, at, value, "a number")
    return value


def _str(value: Any, where: str, at: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, at, value, "a string")
    return value


def _optional(check: Callable[..., Any], value: Any, where: str, at: str, *args: Any) -> Any:
    return None if value is None else check(value, where, at, *args)


def _ints(value: Any, where: str, at: str, low: int = 0, high: int | None = None) -> list[int]:
    values = _list(value, where, at)
    # Checked all at once (in C: an index has millions of these lists), then one by one only
    # to name the first that is wrong.
    if values and (
        not all(map(operator.is_, map(type, values), repeat(int)))
        or min(values) < low
        or (high is not None and max(values) > high)
    ):
        for i, v in enumerate(values):
            _int(v, where, f"{at}[{i}]", low, high)
    return values


INT64_MAX = 2**63 - 1
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# --- metadata.json ------------------------------------------------------------------------------------

METADATA_FORMAT = "ortckpt-metadata/1"
_SHA256 = re.compile(r"[0-9a-f]{64}")
ATTEMPT = re.compile(r"[0-9a-f]{32}")


# JSON has no NaN nor infinities: metadata.json (and a sharded index.json, for its properties
# and learning rates) holds a non-finite float as the string "nan", "inf" or "-inf", and lists
# where under this key (each place a list of keys and indices from the document's top, e.g.
# ["config", "max_grad_norm"]), so that exactly those strings become floats again and a string
# "inf" of the user's stays a string. Metrics are numbers: their strings are decoded without a
# list (as metadata.json written before the list held them).
NON_FINITE_KEY = "non_finite"


def check_metadata(value: Any, where: str) -> dict[str, Any]:
    """A step's metadata.json: returns it with non-finite floats decoded (the places
    ``non_finite`` lists, and metrics)."""
    meta = _object(value, where, "the document")
    if meta.get("format") != METADATA_FORMAT:
        raise _bad(where, "format", meta.get("format"), repr(METADATA_FORMAT))
    _decode_non_finite(meta, where)  # (first: the fields are then checked as they will be used)
    _int(meta.get("step"), where, "step", 0, INT64_MAX)
    _optional(_int, meta.get("epoch"), where, "epoch", None)
    _optional(_str, meta.get("run_id"), where, "run_id")
    _optional(_str, meta.get("dataset_fingerprint"), where, "dataset_fingerprint")
    for key in ("config", "user"):
        _object(meta.get(key, {}), where, key)
    _optional(_object, meta.get("rng_state"), where, "rng_state")
    metrics = {}
    for name, metric in _object(meta.get("metrics", {}), where, "metrics").items():
        metrics[name] = decode_metric(metric, where, f"metrics.{_name(name)}")
    _file_entries(meta.get("files"), where, "files")
    _attempt(meta, where)
    _optional(_artifacts, meta.get("artifacts"), where, "artifacts")
    _optional(_short_str, meta.get("execution_provider"), where, "execution_provider")
    _optional(_short_str, meta.get("device"), where, "device")
    if "compressed" in meta:  # the files before compression: what the archive holds
        _file_entries(meta["compressed"], where, "compressed")
    return {**meta, "metrics": metrics}


def _attempt(document: dict[str, Any], where: str) -> None:
    """On object storage, a step's files are in the folder of the save that committed it."""
    attempt = document.get("attempt")
    if attempt is not None and not (isinstance(attempt, str) and ATTEMPT.fullmatch(attempt)):
        raise _bad(where, "attempt", attempt, "32 hexadecimal digits")


# The run's graphs a step records (CheckpointManager(artifacts=...)): by role, each the file
# ``<role>_model.onnx`` of the step (training_model.onnx, eval_model.onnx, optimizer_model.onnx, as
# ONNX Runtime's generate_artifacts names them), its size and SHA-256. A role is a short lowercase
# word, so that its file name is a plain name of the step folder; an ONNX model is one protobuf,
# which cannot pass 2 GiB, so a size past that is refused before anything is downloaded.
ARTIFACT_ROLE = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_ARTIFACTS = 16
MAX_ARTIFACT_BYTES = 2**31


def artifact_name(role: str) -> str:
    """The file a step holds the graph of ``role`` in (a checked role: a plain name)."""
    return f"{role}_model.onnx"


def _artifacts(value: Any, where: str, at: str) -> None:
    """{role: {"name": "<role>_model.onnx", "bytes": size, "sha256": hex digest}}."""
    roles = _object(value, where, at)
    if len(roles) > MAX_ARTIFACTS:
        raise DocumentError(f"{where}: {at} lists {len(roles)} graphs, more than the {MAX_ARTIFACTS} a step may have")
    for role, raw in roles.items():
        if not ARTIFACT_ROLE.fullmatch(role):
            raise DocumentError(f"{where}: {at} names the role {_name(role)!r}, which is not a lowercase word")
        entry = _object(raw, where, f"{at}.{role}")
        if entry.get("name") != artifact_name(role):
            raise _bad(where, f"{at}.{role}.name", entry.get("name"), repr(artifact_name(role)))
        _int(entry.get("bytes"), where, f"{at}.{role}.bytes", 0, MAX_ARTIFACT_BYTES)
        sha = entry.get("sha256")
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise _bad(where, f"{at}.{role}.sha256", sha, "64 hexadecimal digits")


def _short_str(value: Any, where: str, at: str) -> str:
    text = _str(value, where, at)
    if len(text) > 200:
        raise _bad(where, at, text, "at most 200 characters")
    return text


# A file entry's digests (ortckpt.stepstore.entries): the pattern each must match, as said.
_DIGESTS = {
    "sha256": (_SHA256, "64 hexadecimal digits"),
    "xxh3": (re.compile(r"[0-9a-f]{16}"), "16 lowercase hexadecimal digits"),
    "pair": (re.compile(r"[0-9a-f]{32}"), "32 lowercase hexadecimal digits"),
}


# An object's ETag as a server gave it (an entry's "etag", on object storage): printable ASCII.
_ETAG = re.compile(r"[\x21-\x7e]{1,200}")


def is_etag(value: Any) -> bool:
    """Whether ``value`` is an ETag a file entry may record."""
    return isinstance(value, str) and _ETAG.fullmatch(value) is not None


def _file_entries(value: Any, where: str, at: str) -> None:
    """{plain file name: {"bytes": size, and one or more of "sha256": hex digest, "xxh3": the
    checkpoint's checksum root, "pair": its data file's pair id; on object storage "etag": the
    object's ETag, as its upload got it}}."""
    for name, raw_entry in _object(value, where, at).items():
        if not is_plain_name(name):
            raise DocumentError(f"{where}: {at} names {_name(name)!r}, which is not a file of the step directory")
        entry = _object(raw_entry, where, f"{at}.{name}")
        _int(entry.get("bytes"), where, f"{at}.{name}.bytes", 0, INT64_MAX)
        if not any(kind in entry for kind in _DIGESTS):
            raise _bad(where, f"{at}.{name}.sha256", entry.get("sha256"), "64 hexadecimal digits")
        for kind, (pattern, said) in _DIGESTS.items():
            if kind in entry and not (isinstance(entry[kind], str) and pattern.fullmatch(entry[kind])):
                raise _bad(where, f"{at}.{name}.{kind}", entry[kind], said)
        if "etag" in entry and not is_etag(entry["etag"]):
            raise _bad(where, f"{at}.{name}.etag", entry["etag"], "1 to 200 printable ASCII characters")


def encode_non_finite(document: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """``document`` with the non-finite floats inside its ``fields`` (small ones: a sharded
    index's properties and optimizer groups) written as strings, their places listed under
    ``non_finite``: what :func:`_decode_non_finite` reads back."""
    places: list[list[str | int]] = []

    def encoded(value: Any, place: list[str | int]) -> Any:
        if isinstance(value, Mapping):
            return {k: encoded(v, [*place, k]) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encoded(v, [*place, i]) for i, v in enumerate(value)]
        if isinstance(value, float) and not math.isfinite(value):
            places.append(place)
            return encode_metric(value)
        return value

    out = {**document, **{field: encoded(document[field], [field]) for field in fields if field in document}}
    if places:
        out[NON_FINITE_KEY] = places
    return out


def _decode_non_finite(document: dict[str, Any], where: str) -> None:
    """Turns the strings at the places ``non_finite`` lists into floats, in place, and drops the
    list. Each place is walked from the top (time linear in the list, which the caps bound)."""
    for i, raw in enumerate(_list(document.pop(NON_FINITE_KEY, []), where, NON_FINITE_KEY)):
        at = f"{NON_FINITE_KEY}[{i}]"
        place = _list(raw, where, at)
        parent: Any = document
        for depth, key in enumerate(place):
            inside = (type(parent) is dict and isinstance(key, str) and key in parent) or (
                type(parent) is list and type(key) is int and 0 <= key < len(parent)
            )
            if not inside:
                raise _bad(where, at, place, "the place of a value in the document")
            if depth < len(place) - 1:
                parent = parent[key]
                continue
            if not (isinstance(parent[key], str) and parent[key] in NON_FINITE):
                raise _bad(where, f"the value at {at}", parent[key], '"nan", "inf" or "-inf"')
            parent[key] = NON_FINITE[parent[key]]
        if not place:
            raise _bad(where, at, place, "the place of a value in the document")


def decode_metric(value: Any, where: str, at: str) -> float | int:
    """A metric as metadata.json stores it: a number, or "nan", "inf", "-inf"."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    return _number(value, where, at)


def encode_metric(value: Any) -> float | int | str:
    """The other way: non-finite floats as strings, which every JSON parser reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


# A step's metadata is what a run records beside its checkpoint (config, metrics, file digests),
# written with indent=1: 16 MiB of it is far more than any run writes, and 2^21 values (about
# 200 MiB parsed, at worst) more than any 16 MiB of it written so holds but lists of small numbers.
# (A save checks its metadata against these caps: a run learns of them then, not at restore.)
METADATA = Kind(
    "checkpoint metadata document", max_bytes=16 << 20, max_values=1 << 21, max_depth=64, check=check_metadata
)


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
    index = _versioned(value, where, SHARDED_FORMAT, SHARDED_VERSION, "sharded checkpoint")
    _decode_non_finite(index, where)  # (a property or learning rate that is NaN or infinite)
    _int(index.get("step"), where, "step", 0, INT64_MAX)
    world = _int(index.get("world_size"), where, "world_size", 1, MAX_WORLD_SIZE)
    _attempt(index, where)
    ranks = set()
    for i, raw_shard in enumerate(_list(index.get("shards"), where, "shards")):
        at = f"shards[{i}]"
        shard = _object(raw_shard, where, at)
        rank = _int(shard.get("rank"), where, f"{at}.rank", 0, world - 1)
        if rank in ranks:
            raise DocumentError(f"{where}: {at}: rank {rank} has two shards")
        ranks.add(rank)
        name = shard_file_name(rank, world)
        if shard.get("file") != name:
            raise _bad(where, f"{at}.file", shard.get("file"), f"the shard file name {name!r}")
        for file, size in _object(shard.get("files"), where, f"{at}.files").items():
            if file not in (name, f"{name}.data"):
                raise DocumentError(f"{where}: {at}.files names {_name(file)!r}, not a file of shard {name}")
            _int(size, where, f"{at}.files.{file}", 0, INT64_MAX)
    groups = _object(index.get("optimizer_groups", {}), where, "optimizer_groups")
    for name, raw_group in groups.items():
        gat = f"optimizer_groups.{_name(name)}"
        group = _object(raw_group, where, gat)
        _int(group.get("step"), where, f"{gat}.step", None)
        _number(group.get("initial_learning_rate"), where, f"{gat}.initial_learning_rate")
    for name, prop in _object(index.get("properties", {}), where, "properties").items():
        if type(prop) not in (int, float, str):
            raise _bad(where, f"properties.{_name(name)}", prop, "an int, float or string")
    budget = TilingBudget(MAX_INDEX_TILING_CELLS)
    for name, tensor in _object(index.get("tensors"), where, "tensors").items():
        at = f"tensors.{_name(name)}"
        _check_tensor(_object(tensor, where, at), where, at, ranks, groups, world, budget)
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
    _int(tensor.get("code"), where, f"{at}.code", 1, len(_dt.NAMES) - 1)
    shape = _ints(tensor.get("shape"), where, f"{at}.shape", 0, INT64_MAX)
    if len(shape) > MAX_RANK:
        raise DocumentError(f"{where}: {at}.shape has {len(shape)} dimensions, more than a tensor's {MAX_RANK}")
    if type(tensor.get("trainable")) is not bool:
        raise _bad(where, f"{at}.trainable", tensor.get("trainable"), "true or false")
    for i, raw_pair in enumerate(_list(tensor.get("momentums"), where, f"{at}.momentums")):
        pair = _list(raw_pair, where, f"{at}.momentums[{i}]")
        if len(pair) != 2 or not all(isinstance(p, str) for p in pair) or pair[0] not in groups:
            raise _bad(where, f"{at}.momentums[{i}]", pair, "[optimizer group of the index, momentum name]")
    offsets: list[list[int]] = []
    sizes: list[list[int]] = []
    shards = set()
    for i, raw_piece in enumerate(_list(tensor.get("pieces"), where, f"{at}.pieces")):
        pat = f"{at}.pieces[{i}]"
        piece = _object(raw_piece, where, pat)
        shard = piece.get("shard")
        if type(shard) is not int or shard not in ranks:
            _int(shard, where, f"{pat}.shard")
            raise DocumentError(f"{where}: {pat} is in shard {shard}, which the index does not list")
        if shard in shards:  # each rank writes at most one piece of a tensor
            raise DocumentError(f"{where}: {pat}: shard {shard} holds two pieces of the tensor")
        shards.add(shard)
        _ints(piece.get("holders"), where, f"{pat}.holders", 0, world - 1)
        offset = _ints(piece.get("offset"), where, f"{pat}.offset", 0, INT64_MAX)
        size = _ints(piece.get("shape"), where, f"{pat}.shape", 0, INT64_MAX)
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


# --- the safetensors header and ortckpt's entry in its metadata ----------------------------------------


def check_safetensors_header(value: Any, where: str) -> dict[str, Any]:
    """Types only (dtype names, integer shapes and offsets, string metadata); the byte ranges
    are checked against the file by the reader, which knows its size."""
    header = _object(value, where, "the header")
    metadata = header.get("__metadata__", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DocumentError(f"{where}: __metadata__ is not a map of strings")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        at = f"tensor {_name(name)}"
        if not isinstance(entry, dict):
            raise _bad(where, at, entry, "a dtype, shape and data_offsets")
        if not isinstance(entry.get("dtype"), str):
            raise _bad(where, f"{at}: dtype", entry.get("dtype"), "a dtype name")
        shape = _ints(entry.get("shape"), where, f"{at}: shape", 0, INT64_MAX)
        if len(shape) > MAX_RANK:  # (the reader multiplies them: quadratic in a hostile rank)
            raise DocumentError(f"{where}: {at}: shape has {len(shape)} dimensions, more than a tensor's {MAX_RANK}")
        offsets = _ints(entry.get("data_offsets"), where, f"{at}: data_offsets", 0, INT64_MAX)
        if len(offsets) != 2 or offsets[0] > offsets[1]:
            raise _bad(where, f"{at}: data_offsets", offsets, "[begin, end] with begin <= end")
    return {**header, "__metadata__": metadata}


# The safetensors format caps a header at 100 MB (so does the safetensors package). A tensor's
# entry is 12 values in 60 bytes or more ({"dtype": ..., "shape": [a, b], "data_offsets": [b, e]}
# under its name): 2^23 values are 700,000 tensors, beyond any file's, and about 800 MiB parsed
# at worst.
SAFETENSORS_HEADER = Kind(
    "safetensors header", max_bytes=100_000_000, max_values=1 << 23, max_depth=4, check=check_safetensors_header
)


def check_structure(value: Any, where: str) -> dict[str, Any]:
    """ortckpt's ``__ortckpt__`` entry in a safetensors file's metadata."""
    at = "__ortckpt__"
    structure = _object(value, where, at)
    for i, name in enumerate(_list(structure.get("frozen", []), where, f"{at}.frozen")):
        _str(name, where, f"{at}.frozen[{i}]")
    for name, kind in _object(structure.get("property_types", {}), where, f"{at}.property_types").items():
        if kind not in ("int", "float"):
            raise _bad(where, f"{at}.property_types.{_name(name)}", kind, '"int" or "float"')
    for name, raw_group in _object(structure.get("optimizer_groups", {}), where, f"{at}.optimizer_groups").items():
        gat = f"{at}.optimizer_groups.{_name(name)}"
        group = _object(raw_group, where, gat)
        _int(group.get("step"), where, f"{gat}.step", None)
        _number(group.get("initial_learning_rate"), where, f"{gat}.initial_learning_rate")
        for tensor, pair in _object(group.get("momentums"), where, f"{gat}.momentums").items():
            if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
                raise _bad(where, f"{gat}.momentums.{_name(tensor)}", pair, "[parameter, momentum]")
    return structure


# Inside a safetensors header (its caps), 5 values a momentum ("parameter": [parameter, momentum])
# and one a frozen tensor: 2^22 values are 800,000 momentums, about 400 MiB parsed at worst.
ORTCKPT_STRUCTURE = Kind(
    "__ortckpt__ entry", max_bytes=100_000_000, max_values=1 << 22, max_depth=6, check=check_structure
)


# --- the holder record of a directory's writer lock ---------------------------------------------------


def check_holder(value: Any, where: str) -> dict[str, Any]:
    """Who holds a directory's writer lock, as it wrote it: shown in an error message, so only
    known fields, and strings without control characters (no terminal escapes)."""
    holder = _object(value, where, "the holder record")
    out: dict[str, Any] = {}
    for key in ("pid", "host", "started", "command"):
        item = holder.get(key)
        if type(item) is int:
            out[key] = item
        elif isinstance(item, str):
            out[key] = "".join(c if c.isprintable() else "?" for c in item[:200])
    return out


WRITER_HOLDER = Kind("writer lock record", max_bytes=64 << 10, max_values=1 << 12, max_depth=2, check=check_holder)


# --- the footer of a compressed checkpoint (ortckpt.compression) ------------------------------------

COMPRESSED_FORMAT = "ortckpt.compressed"
COMPRESSED_VERSION = 1
COMPRESSED_ROLES = ("checkpoint", "external data")  # the files of a checkpoint, in the archive's order
GROUPED_ITEMSIZES = (2, 4, 8)


def check_compressed(value: Any, where: str) -> dict[str, Any]:
    """A compressed checkpoint's footer: one entry per file of the checkpoint (the checkpoint,
    then its external data file), each frame inside the archive and after the previous one,
    sizes and SHA-256 of the uncompressed bytes, and the byte-grouped regions inside the file,
    ascending, not overlapping, whole elements of 2, 4 or 8 bytes."""
    footer = _versioned(value, where, COMPRESSED_FORMAT, COMPRESSED_VERSION, "compressed checkpoint")
    if footer.get("codec") != "zstd":
        raise _bad(where, "codec", footer.get("codec"), '"zstd"')
    # A block is held in memory to regroup it: at most 2^24 elements (128 MiB of 8-byte ones).
    _int(footer.get("block_elements"), where, "block_elements", 1, 1 << 24)
    files = _list(footer.get("files"), where, "files")
    if not 1 <= len(files) <= len(COMPRESSED_ROLES):
        raise DocumentError(f"{where}: files lists {len(files)} files, expected 1 or 2")
    frame_end = len(b"ORTCKPTZ")
    for i, raw in enumerate(files):
        at = f"files[{i}]"
        entry = _object(raw, where, at)
        if entry.get("role") != COMPRESSED_ROLES[i]:
            raise _bad(where, f"{at}.role", entry.get("role"), repr(COMPRESSED_ROLES[i]))
        size = _int(entry.get("size"), where, f"{at}.size", 0, INT64_MAX)
        frame = _int(entry.get("frame_offset"), where, f"{at}.frame_offset", frame_end, INT64_MAX)
        frame_end = frame + _int(entry.get("frame_size"), where, f"{at}.frame_size", 1, INT64_MAX)
        sha = entry.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise _bad(where, f"{at}.sha256", sha, "64 lowercase hex digits")
        end = 0
        for j, region in enumerate(_list(entry.get("grouped"), where, f"{at}.grouped")):
            values = _ints(region, where, f"{at}.grouped[{j}]")
            offset, length, itemsize = values if len(values) == 3 else (0, 0, 0)
            if itemsize not in GROUPED_ITEMSIZES or length % itemsize or offset < end or offset + length > size:
                raise DocumentError(
                    f"{where}: {at}.grouped[{j}] is {_shown(region)}: expected [offset, length, item size 2, 4 or 8] "
                    f"inside the file, after the previous region, of whole elements"
                )
            end = offset + length
    return footer


# One grouped region, 5 values ([offset, length, item size]), for each tensor of 2, 4 or 8-byte
# elements: 2^22 values are 800,000 tensors, about 400 MiB parsed at worst.
COMPRESSED_FOOTER = Kind(
    "compressed checkpoint footer", max_bytes=64 << 20, max_values=1 << 22, max_depth=5, check=check_compressed
)
