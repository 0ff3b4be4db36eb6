"""The schema of a manager's ``metadata.json`` (:data:`METADATA`): its files, artifacts, metrics
and the non-finite values JSON cannot spell."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ..safe_io import is_plain_name
from .base import (
    INT64_MAX,
    NON_FINITE,
    DocumentError,
    Kind,
    bad_value,
    check_int,
    check_list,
    check_number,
    check_object,
    check_optional,
    check_str,
    key_shown,
)

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
    meta = check_object(value, where, "the document")
    if meta.get("format") != METADATA_FORMAT:
        raise bad_value(where, "format", meta.get("format"), repr(METADATA_FORMAT))
    decode_non_finite(meta, where)  # (first: the fields are then checked as they will be used)
    check_int(meta.get("step"), where, "step", 0, INT64_MAX)
    check_optional(check_int, meta.get("epoch"), where, "epoch", None)
    check_optional(check_str, meta.get("run_id"), where, "run_id")
    check_optional(check_str, meta.get("dataset_fingerprint"), where, "dataset_fingerprint")
    for key in ("config", "user"):
        check_object(meta.get(key, {}), where, key)
    check_optional(check_object, meta.get("rng_state"), where, "rng_state")
    metrics = {}
    for name, metric in check_object(meta.get("metrics", {}), where, "metrics").items():
        metrics[name] = decode_metric(metric, where, f"metrics.{key_shown(name)}")
    _file_entries(meta.get("files"), where, "files")
    check_attempt(meta, where)
    check_optional(_artifacts, meta.get("artifacts"), where, "artifacts")
    check_optional(_short_str, meta.get("execution_provider"), where, "execution_provider")
    check_optional(_short_str, meta.get("device"), where, "device")
    if "compressed" in meta:  # the files before compression: what the archive holds
        _file_entries(meta["compressed"], where, "compressed")
    return {**meta, "metrics": metrics}


def check_attempt(document: dict[str, Any], where: str) -> None:
    """On object storage, a step's files are in the folder of the save that committed it."""
    attempt = document.get("attempt")
    if attempt is not None and not (isinstance(attempt, str) and ATTEMPT.fullmatch(attempt)):
        raise bad_value(where, "attempt", attempt, "32 hexadecimal digits")


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
    roles = check_object(value, where, at)
    if len(roles) > MAX_ARTIFACTS:
        raise DocumentError(f"{where}: {at} lists {len(roles)} graphs, more than the {MAX_ARTIFACTS} a step may have")
    for role, raw in roles.items():
        if not ARTIFACT_ROLE.fullmatch(role):
            raise DocumentError(f"{where}: {at} names the role {key_shown(role)!r}, which is not a lowercase word")
        entry = check_object(raw, where, f"{at}.{role}")
        if entry.get("name") != artifact_name(role):
            raise bad_value(where, f"{at}.{role}.name", entry.get("name"), repr(artifact_name(role)))
        check_int(entry.get("bytes"), where, f"{at}.{role}.bytes", 0, MAX_ARTIFACT_BYTES)
        sha = entry.get("sha256")
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise bad_value(where, f"{at}.{role}.sha256", sha, "64 hexadecimal digits")


def _short_str(value: Any, where: str, at: str) -> str:
    text = check_str(value, where, at)
    if len(text) > 200:
        raise bad_value(where, at, text, "at most 200 characters")
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
    object's ETag, as its upload got it; for a data object the steps share, "object": its key under
    the run's prefix}}."""
    for name, raw_entry in check_object(value, where, at).items():
        if not is_plain_name(name):
            raise DocumentError(f"{where}: {at} names {key_shown(name)!r}, which is not a file of the step directory")
        entry = check_object(raw_entry, where, f"{at}.{name}")
        check_int(entry.get("bytes"), where, f"{at}.{name}.bytes", 0, INT64_MAX)
        if not any(kind in entry for kind in _DIGESTS):
            raise bad_value(where, f"{at}.{name}.sha256", entry.get("sha256"), "64 hexadecimal digits")
        for kind, (pattern, said) in _DIGESTS.items():
            if kind in entry and not (isinstance(entry[kind], str) and pattern.fullmatch(entry[kind])):
                raise bad_value(where, f"{at}.{name}.{kind}", entry[kind], said)
        if "etag" in entry and not is_etag(entry["etag"]):
            raise bad_value(where, f"{at}.{name}.etag", entry["etag"], "1 to 200 printable ASCII characters")
        if "object" in entry and not (
            isinstance(entry["object"], str) and _SHARED_OBJECT.fullmatch(entry["object"]) and name.endswith(".data")
        ):
            raise bad_value(where, f"{at}.{name}.object", entry["object"], "'shared/<32 hexadecimal digits>.data'")


# Where a data file shared by several steps on object storage is, under the run's prefix (an entry's
# "object"; see ortckpt.steps.shared_data_name): nowhere else, so no step names another run's objects.
_SHARED_OBJECT = re.compile(r"shared/[0-9a-f]{32}\.data")


def encode_non_finite(document: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """``document`` with the non-finite floats inside its ``fields`` (small ones: a sharded
    index's properties and optimizer groups) written as strings, their places listed under
    ``non_finite``: what :func:`decode_non_finite` reads back."""
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


def decode_non_finite(document: dict[str, Any], where: str) -> None:
    """Turns the strings at the places ``non_finite`` lists into floats, in place, and drops the
    list. Each place is walked from the top (time linear in the list, which the caps bound)."""
    for i, raw in enumerate(check_list(document.pop(NON_FINITE_KEY, []), where, NON_FINITE_KEY)):
        at = f"{NON_FINITE_KEY}[{i}]"
        place = check_list(raw, where, at)
        parent: Any = document
        for depth, key in enumerate(place):
            inside = (type(parent) is dict and isinstance(key, str) and key in parent) or (
                type(parent) is list and type(key) is int and 0 <= key < len(parent)
            )
            if not inside:
                raise bad_value(where, at, place, "the place of a value in the document")
            if depth < len(place) - 1:
                parent = parent[key]
                continue
            if not (isinstance(parent[key], str) and parent[key] in NON_FINITE):
                raise bad_value(where, f"the value at {at}", parent[key], '"nan", "inf" or "-inf"')
            parent[key] = NON_FINITE[parent[key]]
        if not place:
            raise bad_value(where, at, place, "the place of a value in the document")


def decode_metric(value: Any, where: str, at: str) -> float | int:
    """A metric as metadata.json stores it: a number, or "nan", "inf", "-inf"."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    return check_number(value, where, at)


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
