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

from .. import documents, safe_io
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


def versions() -> dict[str, str]:
    from .. import __version__

    return {"python": platform.python_version(), "numpy": np.__version__, "ortckpt": __version__}


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


def encode(metadata: Mapping[str, Any]) -> bytes:
    return (json.dumps(_json_safe(metadata), indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def check_serializable(metadata: Mapping[str, Any]) -> None:
    """Raises now, in the caller's thread, for metadata this manager could not write or read
    back (rather than later, in an async save's background thread, or at the next start):
    values JSON cannot hold (TypeError), metrics that are not numbers (TypeError), nesting
    (TypeError) or size (a CheckpointFormatError, a ValueError) beyond metadata.json's caps."""
    for name, value in (metadata.get("metrics") or {}).items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"checkpoint metrics are numbers: metrics[{name!r}] is {type(value).__name__}")
    # (before encoding, which recurses: so deep a structure would exhaust the stack there)
    if documents.depth_of(metadata, documents.METADATA.max_depth) > documents.METADATA.max_depth:
        raise TypeError(f"checkpoint metadata is nested deeper than {documents.METADATA.max_depth} levels")
    try:
        data = encode({**metadata, "files": {}})
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata must be JSON-serialisable: {e}") from None
    documents.parse(documents.METADATA, data, METADATA_NAME)  # what a reader will check, its size cap included


def _json_safe(value: Any) -> Any:
    """Non-finite floats as strings (metrics decode back: documents.decode_metric); NumPy
    scalars as Python numbers."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return documents.encode_metric(value)
    return value
