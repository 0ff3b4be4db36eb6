"""metadata.json, written beside each checkpoint a :class:`~ortckpt.CheckpointManager` saves:
what a person (or a script) needs to know which run, code and data produced it, and the
SHA-256 of every file so that :func:`ortckpt.verify` can tell a damaged copy.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from . import progress as _progress

METADATA_NAME = "metadata.json"
FORMAT = "ortckpt-metadata/1"
_CHUNK = 8 << 20


def sha256_of(path: Path, on_bytes: Callable[[int], object] | None = None) -> str:
    """SHA-256 of a file (hashlib releases the GIL on large chunks); ``on_bytes(n)`` after each chunk."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            if on_bytes:
                on_bytes(n)
    return digest.hexdigest()


def describe_files(directory: Path, names: list[str], progress: str | None = None) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of each file; ``progress``: the label of a progress bar, if one is wanted."""
    sizes = {name: (directory / name).stat().st_size for name in names}
    bar = _progress.bar(f"hashing {progress}", sum(sizes.values())) if progress else None
    try:
        on_bytes = bar.update if bar is not None else None
        return {name: {"bytes": sizes[name], "sha256": sha256_of(directory / name, on_bytes)} for name in names}
    finally:
        if bar is not None:
            bar.close()


@lru_cache(maxsize=1)
def git_commit() -> dict[str, Any] | None:
    """The commit of the training code (the directory of ``__main__``, else the working
    directory), and whether it has uncommitted changes; None outside a git checkout."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return git_commit_of(Path(main).resolve().parent if main else Path.cwd())


def git_commit_of(where: Path) -> dict[str, Any] | None:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status)}


def versions() -> dict[str, str]:
    from . import __version__

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
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "versions": versions(),
    }


def write(directory: Path, metadata: Mapping[str, Any], durable: bool) -> None:
    path = directory / METADATA_NAME
    with open(path, "w", encoding="utf-8") as f:
        # allow_nan=False: metrics such as NaN losses must not make a file other tools cannot parse.
        json.dump(_json_safe(metadata), f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())


def check_serializable(metadata: Mapping[str, Any]) -> None:
    """Raises TypeError now, in the caller's thread, for values JSON cannot hold (rather
    than later, in an async save's background thread)."""
    try:
        json.dumps(_json_safe(metadata), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata must be JSON-serialisable: {e}") from None


def read(directory: Path) -> dict[str, Any]:
    with open(directory / METADATA_NAME, encoding="utf-8") as f:
        return json.load(f)


def _json_safe(value: Any) -> Any:
    """NaN and infinities as strings; NumPy scalars as Python numbers."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    return value
