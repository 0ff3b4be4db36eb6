"""What a step's metadata.json records of each file it holds, and how a file is checked
against it: the one place that knows the entries' kinds.

- A checkpoint file: ``{"bytes", "xxh3"}``, the root checksum of the checksum block the core
  wrote into it (which covers every tensor, the metadata and the file's pair id: a file
  swapped for another differs). Read from the file's last bytes, never by reading it back.
- Its external data file: ``{"bytes", "pair"}``, the pair id both files end with. Its tensors
  are checked through the checkpoint's block, tensor by tensor (so a data file holding bytes
  this checkpoint does not reference, or shared by hard link with the previous step, checks
  the same); the entry of a file that is the same inode as the previous step's can be copied
  from that step's metadata.
- Documents, older steps' files, and with ``digest="sha256"`` every file: ``{"bytes",
  "sha256"}`` (a cryptographic digest, for people who publish digests; it costs a read of
  every file after writing it).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from .. import _boundary, safe_io

# The kinds of digest an entry may carry; at least one per entry (documents.py checks them).
DIGESTS = ("sha256", "xxh3", "pair")

# The core's pair trailer: 16 bytes of magic, then the 16-byte id.
_PAIR_MAGIC = b"ortckpt pair id\0"
_TRAILER = 32


def of_written(path: Path, *, sha256: bool, on_bytes: Any = None) -> dict[str, Any]:
    """The entry of a file a save just wrote (not read back, unless ``sha256``)."""
    entry: dict[str, Any] = {"bytes": os.lstat(path).st_size}
    root = _boundary.checksum_root(path) if not path.name.endswith(".data") else None
    if root is not None:
        entry["xxh3"] = f"{root:016x}"
    else:
        pair = pair_of(path)
        if pair is not None:
            entry["pair"] = pair
    if sha256 or len(entry) == 1:  # nothing cheaper to record: a digest it is
        entry["bytes"], entry["sha256"] = safe_io.sha256_of(path, on_bytes)
    return entry


def of_document(data: bytes) -> dict[str, Any]:
    """The entry of a small document the step writes from memory."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def pair_of(path: Path) -> str | None:
    """The pair id the file ends with (hex), if it ends with a pair trailer."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _TRAILER:
            return None
        f.seek(size - _TRAILER)
        tail = f.read(_TRAILER)
    return tail[16:].hex() if tail[:16] == _PAIR_MAGIC else None


def check(path: Path, expected: dict[str, Any], on_bytes: Any = None) -> tuple[str | None, str]:
    """(problem or None, what matched) of the file at ``path`` against its entry: its size, then
    each digest the entry records (SHA-256 by reading the file; a checksum root or pair id from
    its last bytes). Raises OSError (FileNotFoundError: missing) as reading does."""
    size = os.lstat(path).st_size
    if size != expected["bytes"]:
        return f"{size} bytes, metadata says {expected['bytes']}", ""
    if "sha256" in expected:
        _, digest = safe_io.sha256_of(path, on_bytes)
        if digest != expected["sha256"]:
            return f"SHA-256 {digest} differs from metadata's {expected['sha256']}", ""
        return None, digest
    if "xxh3" in expected:
        root = _boundary.checksum_root(path)
        found = "none" if root is None else f"{root:016x}"
        if found != expected["xxh3"]:
            return f"checksum root {found} differs from metadata's {expected['xxh3']}", ""
        return None, f"xxh3:{found}"
    pair = pair_of(path)
    if pair != expected["pair"]:
        return f"pair id {pair or 'none'} differs from metadata's {expected['pair']}", ""
    return None, f"pair:{pair}"


__all__ = ["DIGESTS", "check", "of_document", "of_written", "pair_of"]
