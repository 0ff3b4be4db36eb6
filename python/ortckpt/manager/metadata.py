"""metadata.json, written beside each checkpoint a :class:`~ortckpt.CheckpointManager` saves:
what a person (or a script) needs to know which run, code and data produced it, and the
SHA-256 of every file so that :func:`ortckpt.verify` can tell a damaged copy.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .. import _boundary, documents, safe_io
from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..steps import METADATA_NAME

FORMAT = documents.METADATA_FORMAT


@lru_cache(maxsize=1)
def git_commit() -> dict[str, Any] | None:
    """The commit of the training code (the directory of ``__main__``, else the working
    directory), and whether it has uncommitted changes; None outside a git checkout."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return git_commit_of(Path(main).resolve().parent if main else Path.cwd())


def git_commit_of(where: Path) -> dict[str, Any] | None:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status)}


def versions() -> dict[str, str | None]:
    """The versions of what wrote the step: Python, NumPy, ortckpt, and ONNX Runtime and onnx
    (None when not installed; neither is imported for this)."""
    from .._boundary import VERSION

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "ortckpt": VERSION,
        "onnxruntime": _version_of("onnxruntime", _ONNXRUNTIME_DISTRIBUTIONS),
        "onnx": _version_of("onnx", ("onnx",)),
    }


# The distributions that install the onnxruntime package (the training one first: its loop is
# what a manager with artifacts records).
_ONNXRUNTIME_DISTRIBUTIONS = (
    "onnxruntime-training-cpu",
    "onnxruntime-training",
    "onnxruntime",
    "onnxruntime-gpu",
)


def _version_of(module: str, distributions: tuple[str, ...]) -> str | None:
    """The version of ``module`` as imported in this process, else of the installed
    distribution that provides it, else None."""
    loaded = getattr(sys.modules.get(module), "__version__", None)
    if isinstance(loaded, str):
        return loaded
    return _installed_version(distributions)


@lru_cache(maxsize=8)
def _installed_version(distributions: tuple[str, ...]) -> str | None:
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def build(
    *,
    step: int,
    epoch: int | None,
    run_id: str,
    metrics: Mapping[str, float] | None,
    config: Mapping[str, Any] | None,
    user: Mapping[str, Any] | None,
    dataset_fingerprint: str | None,
    rng_state: Mapping[str, Any] | None,
    include_optimizer_state: bool,
) -> dict[str, Any]:
    """Everything but ``files`` (added once the files are written)."""
    return {
        "format": FORMAT,
        "step": step,
        "epoch": epoch,
        "run_id": run_id,
        "metrics": dict(metrics or {}),
        "config": dict(config or {}),
        "user": dict(user or {}),
        "dataset_fingerprint": dataset_fingerprint,
        "rng_state": dict(rng_state) if rng_state is not None else None,
        "include_optimizer_state": include_optimizer_state,
        "git": git_commit(),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "versions": versions(),
    }


def write(directory: Path, metadata: Mapping[str, Any], durable: bool) -> None:
    """Writes metadata.json into a step directory being filled (created exclusively: a file or
    symlink planted there makes the save fail, never written through)."""
    safe_io.write_new(directory / METADATA_NAME, encode(metadata), durable=durable)


def rewrite(directory: Path, metadata: Mapping[str, Any], durable: bool) -> None:
    """Replaces a committed step's metadata.json (atomically: a locked temporary file renamed
    over it), as compressing a kept step does."""
    data = encode(metadata)
    documents.parse(documents.METADATA, data, METADATA_NAME)  # what a reader will accept
    safe_io.write_atomically(directory / METADATA_NAME, data, durable=durable)


def encode(metadata: Mapping[str, Any], where: str = METADATA_NAME) -> bytes:
    """metadata.json's bytes: strict JSON, which any reader parses, from which
    :func:`documents.check_metadata` gives back the values given here (see :class:`_Encoder`).
    Raises for values it cannot hold, naming the place (``where``: whose metadata)."""
    encoder = _Encoder(where)
    document = encoder.mapping(metadata, [])
    if encoder.non_finite:
        document[documents.NON_FINITE_KEY] = encoder.non_finite
    return (json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def check_serializable(metadata: Mapping[str, Any], where: str = METADATA_NAME) -> None:
    """Raises now, in the caller's thread, for metadata this manager could not write or read
    back (rather than later, in an async save's background thread, or at the next start),
    naming the place (e.g. ``metadata['opt'][0]``) and ``where``: values JSON cannot hold, keys
    that are not str or int (:class:`~ortckpt.InvalidArgumentTypeError`, a TypeError), metrics
    that are not numbers (the same), two keys that are one once written (``1`` and ``"1"``) or
    text that is not Unicode (:class:`~ortckpt.InvalidArgumentError`, a ValueError), nesting
    (TypeError) or size (a CheckpointFormatError, a ValueError) beyond metadata.json's caps."""
    for name, value in (metadata.get("metrics") or {}).items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise InvalidArgumentTypeError(
                f"{where}: checkpoint metrics are numbers: metrics[{name!r}] is {type(value).__name__}",
                "metrics",
                f"metrics[{name!r}]",
            )
        if isinstance(value, (int, np.integer)) and not -_FLOAT_INTS <= value <= _FLOAT_INTS:
            raise InvalidArgumentError(  # (a metric is ranked, and tracked, as a float)
                f"{where}: metrics[{name!r}] is past a float's range", "metrics", f"metrics[{name!r}]"
            )
    fingerprint = metadata.get("dataset_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise InvalidArgumentTypeError(
            f"{where}: dataset_fingerprint is a str, got {type(fingerprint).__name__}", "dataset_fingerprint"
        )
    # (before encoding, which recurses: so deep a structure would exhaust the stack there)
    if documents.depth_of(metadata, documents.METADATA.max_depth) > documents.METADATA.max_depth:
        raise InvalidArgumentTypeError(
            f"{where}: checkpoint metadata is nested deeper than {documents.METADATA.max_depth} levels"
        )
    data = encode({**metadata, "files": {}}, where)
    documents.parse(documents.METADATA, data, METADATA_NAME)  # what a reader will check, its size cap included


def check_config(config: Any, where: str) -> dict[str, Any]:
    """A manager's ``config`` (None: empty), as every save will record it: refused now if a
    save could not (see :func:`check_serializable`)."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise InvalidArgumentTypeError(f"config is a mapping (a dict), got {type(config).__name__}", "config")
    if documents.depth_of(config, documents.METADATA.max_depth - 1) > documents.METADATA.max_depth - 1:
        raise InvalidArgumentTypeError(
            f"{where}: config is nested deeper than metadata.json holds ({documents.METADATA.max_depth - 1} levels)",
            "config",
        )
    _Encoder(where).mapping({"config": config}, [])
    return dict(config)


# How the places in metadata.json are called in messages: by the argument that gave them.
_ARGUMENTS = {"user": "metadata"}

# Python neither writes nor reads back an int of more than 4300 digits (sys.get_int_max_str_digits()
# by default); 4000 bits are 1205 digits, well inside.
_MAX_INT_BITS = 4000
# The largest int a float holds (about 1.8e308).
_FLOAT_INTS = int(np.finfo(np.float64).max)


class _Encoder:
    """The metadata as JSON values, checked on the way. Keys are str, or int (written as
    their digits, as JSON keys are strings); two that are one once written are refused, not
    one silently kept. Strings must be Unicode (no lone surrogate). NumPy scalars become Python
    numbers; tuples, lists. A non-finite float is written as the string "nan", "inf" or
    "-inf" and its place listed under ``non_finite`` (see documents.NON_FINITE_KEY), except in
    the metrics, which are numbers."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.non_finite: list[list[str | int]] = []

    def value(self, value: Any, place: list[str | int]) -> Any:
        if isinstance(value, Mapping):
            return self.mapping(value, place)
        if isinstance(value, (list, tuple)):
            return [self.value(item, [*place, i]) for i, item in enumerate(value)]
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, str):
            self.text(value, place, "is")
        elif isinstance(value, float) and not math.isfinite(value):
            if place[0] != "metrics":
                self.non_finite.append(place)
            return documents.encode_metric(value)
        elif isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise self.refused(place, f"is an int of {value.bit_length()} bits, more than JSON's readers take")
        elif not (value is None or isinstance(value, (bool, int, float))):
            raise self.refused(
                place, f"is a {type(value).__name__}: checkpoint metadata must be JSON-serialisable", TypeError
            )
        return value

    def mapping(self, value: Mapping[Any, Any], place: list[str | int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        given: dict[str, Any] = {}  # the key each written key came from
        for key, item in value.items():
            if isinstance(key, (bool, np.bool_)) or not isinstance(key, (str, int, np.integer)):
                raise self.refused(
                    place, f"has the key {key!r}, a {type(key).__name__}: keys are str or int", TypeError
                )
            written = str(key) if isinstance(key, str) else str(int(key))
            self.text(written, place, "has the key")
            if written in given:
                raise self.refused(
                    place,
                    f"has the keys {given[written]!r} and {key!r}, which are both {written!r} once written "
                    "(JSON keys are strings): one would be lost",
                )
            given[written] = key
            out[written] = self.value(item, [*place, written])
        return out

    def text(self, text: str, place: list[str | int], what: str) -> None:
        at = _boundary.unencodable_at(text)
        if at is not None:
            raise self.refused(
                place,
                f"{what} {text!r}, which is not text: the character {text[at]!r} at position {at} is a lone "
                "surrogate (metadata.json holds UTF-8)",
            )

    def refused(self, place: list[str | int], problem: str, kind: type = ValueError) -> InvalidArgumentError:
        argument = _ARGUMENTS.get(str(place[0]), str(place[0])) if place else "metadata"
        key = argument + "".join(f"[{p!r}]" for p in place[1:])
        error = InvalidArgumentTypeError if kind is TypeError else InvalidArgumentError
        return error(f"{self.where}: {key} {problem}", argument, key)
