"""What a step's metadata.json records of each file it holds, and how a file is checked
against it: the one place that knows the entries' kinds.

- A checkpoint file: ``{"bytes", "xxh3"}``, the root checksum of the checksum block the core
  wrote into it (which covers every tensor, the metadata and the file's pair id: a file
  swapped for another differs). Read from the file's last bytes, never by reading it back.
- Its external data file: ``{"bytes", "pair"}``, the pair id both files end with. Its tensors
  are checked through the checkpoint's block, tensor by tensor (so a data file holding bytes
  this checkpoint does not reference, or shared by hard link with the previous step, checks
  the same); the entry of a data file that is the same inode as the previous step's can be
  copied from that step's metadata.
- Documents, older steps' files, files on object storage, and with ``digest="sha256"`` every
  file: ``{"bytes", "sha256"}`` (a cryptographic digest; for a file the core wrote it costs
  a read of the file after writing it).

Files are opened without following symlinks, and must be regular files.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from .. import _boundary, safe_io
from ..errors import CheckpointIntegrityError
from ..targets import PAIR_MAGIC, PAIR_TRAILER_BYTES

DATA_SUFFIX = ".data"


def of_written(path: Path, *, sha256: bool, on_bytes: Any = None) -> dict[str, Any]:
    """The entry of a file a save just wrote (read back only for ``sha256``)."""
    if path.name.endswith(DATA_SUFFIX):
        size, pair = _pair_of(path)
        entry: dict[str, Any] = {"bytes": size} if pair is None else {"bytes": size, "pair": pair}
    else:
        size, root = _boundary.checksum_root(path, follow_symlinks=False)
        entry = {"bytes": size} if root is None else {"bytes": size, "xxh3": f"{root:016x}"}
    if sha256 or len(entry) == 1:  # nothing cheaper to record: a digest it is
        entry["bytes"], entry["sha256"] = safe_io.sha256_of(path, on_bytes)
    return entry


def of_document(data: bytes) -> dict[str, Any]:
    """The entry of a small document the step writes from memory."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _pair_of(path: Path) -> tuple[int, str | None]:
    """(size, the pair id the file ends with in hex, or None without a pair trailer)."""
    with safe_io.open_regular(path, follow_symlinks=False) as f:
        size = os.fstat(f.fileno()).st_size
        if size < PAIR_TRAILER_BYTES:
            return size, None
        tail = os.pread(f.fileno(), PAIR_TRAILER_BYTES, size - PAIR_TRAILER_BYTES)
    return size, (tail[16:].hex() if tail[:16] == PAIR_MAGIC else None)


def check(path: Path, expected: dict[str, Any], on_bytes: Any = None) -> tuple[str | None, str]:
    """(problem or None, what matched) of the file at ``path`` against its entry: its size and
    every digest the entry records (SHA-256 by reading the file; a checksum root or pair id from
    its last bytes), so that no digest an entry carries goes unchecked beside another. What
    matched is the strongest (the SHA-256, when recorded). Raises OSError (FileNotFoundError:
    missing) and CheckpointError (a damaged checksum block) as reading does."""
    found: dict[str, tuple[int, str]] = {}  # kind -> (size, digest found)
    if "sha256" in expected:
        status = os.lstat(path)  # (a file of another size is not read: it may be huge)
        if stat.S_ISREG(status.st_mode) and status.st_size != expected["bytes"]:
            return f"{status.st_size} bytes, metadata says {expected['bytes']}", ""
        found["sha256"] = safe_io.sha256_of(path, on_bytes)
    if "xxh3" in expected:
        size, root = _boundary.checksum_root(path, follow_symlinks=False)
        found["xxh3"] = size, "none" if root is None else f"{root:016x}"
    if "pair" in expected:
        size, pair = _pair_of(path)
        found["pair"] = size, pair or "none"
    names = {"sha256": "SHA-256", "xxh3": "checksum root", "pair": "pair id"}
    for kind, (size, digest) in found.items():
        if size != expected["bytes"]:
            return f"{size} bytes, metadata says {expected['bytes']}", ""
        if digest != expected[kind]:
            return f"{names[kind]} {digest} differs from metadata's {expected[kind]}", ""
    return None, next(iter(found.values()))[1]


def check_graph(path: Path, entry: dict[str, Any], shown: str) -> None:
    """A step's graph file against its entry (size and SHA-256, read without following a
    symlink): CheckpointIntegrityError naming it (as ``shown``) when it differs or is missing."""
    try:
        problem, _ = check(path, {"bytes": entry["bytes"], "sha256": entry["sha256"]})
    except FileNotFoundError:
        problem = "missing"
    except OSError as e:
        problem = str(e).replace(f"'{path}'", "").strip(": ") or type(e).__name__
    if problem is not None:
        raise CheckpointIntegrityError(shown, [f"{shown}: {problem} (not the graph this step recorded)"])


def check_cheaply(path: Path, expected: dict[str, Any]) -> str | None:
    """The problem, or None, of the file at ``path`` against its entry by what costs no read of
    the file: its size, and the checksum root or pair id the entry records (from its last bytes).
    A SHA-256 is not read (restore checks this; verify reads the whole file). Raises as
    :func:`check` does."""
    cheap = {kind: value for kind, value in expected.items() if kind in ("bytes", "xxh3", "pair")}
    if len(cheap) > 1:
        return check(path, cheap)[0]
    with safe_io.open_regular(path, follow_symlinks=False) as f:
        size = os.fstat(f.fileno()).st_size
    return None if size == expected["bytes"] else f"{size} bytes, metadata says {expected['bytes']}"


__all__ = ["check", "check_cheaply", "check_graph", "of_document", "of_written"]
