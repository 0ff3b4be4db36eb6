"""What every document shares: :func:`parse` (the one ``json.loads``, with its kind's caps),
:class:`Kind`, :class:`DocumentError`, and the building blocks the schemas are written with."""

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

from ..errors import DocumentError


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


def bad_value(where: str, at: str, value: Any, expected: str) -> DocumentError:
    return DocumentError(f"{where}: {at} is {value_shown(value)}, expected {expected}")


_ENCODER = json.JSONEncoder()  # (its iterencode is lazy: a message encodes only what it shows)


def value_shown(value: Any, room: int = 80) -> str:
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


def key_shown(key: str) -> str:
    """A key of the document (a tensor's name, a file's) as a message shows it: cut when long."""
    return key if len(key) <= 100 else f"{key[:100]}..."


def check_object(value: Any, where: str, at: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_value(where, at, value, "an object")
    return value


def check_list(value: Any, where: str, at: str) -> list[Any]:
    if not isinstance(value, list):
        raise bad_value(where, at, value, "a list")
    return value


def check_versioned(value: Any, where: str, format_name: str, version: int, what: str) -> dict[str, Any]:
    """A document object of ``format_name``, in the one ``version`` this ortckpt reads."""
    document = check_object(value, where, "the document")
    if document.get("format") != format_name:
        raise bad_value(where, "format", document.get("format"), repr(format_name))
    if document.get("version") != version:
        found = document.get("version")
        raise DocumentError(f"{where}: {what} version {value_shown(found)}; this ortckpt reads version {version}")
    return document


def check_int(value: Any, where: str, at: str, low: int | None = 0, high: int | None = None) -> int:
    if type(value) is not int or (low is not None and value < low) or (high is not None and value > high):
        bounds = f" from {low}" if low is not None else ""
        bounds += f" to {high}" if high is not None else ""
        raise bad_value(where, at, value, f"an integer{bounds}")
    return value


def check_number(value: Any, where: str, at: str) -> float | int:
    if type(value) not in (int, float):
        raise bad_value(where, at, value, "a number")
    return value


def check_str(value: Any, where: str, at: str) -> str:
    if not isinstance(value, str):
        raise bad_value(where, at, value, "a string")
    return value


def check_optional(check: Callable[..., Any], value: Any, where: str, at: str, *args: Any) -> Any:
    return None if value is None else check(value, where, at, *args)


def check_ints(value: Any, where: str, at: str, low: int = 0, high: int | None = None) -> list[int]:
    values = check_list(value, where, at)
    # Checked all at once (in C: an index has millions of these lists), then one by one only
    # to name the first that is wrong.
    if values and (
        not all(map(operator.is_, map(type, values), repeat(int)))
        or min(values) < low
        or (high is not None and max(values) > high)
    ):
        for i, v in enumerate(values):
            check_int(v, where, f"{at}[{i}]", low, high)
    return values


INT64_MAX = 2**63 - 1
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
