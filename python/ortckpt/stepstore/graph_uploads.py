"""The run's graph files going up to an object store (:mod:`.objects`): hashed from the file as
it is read, so that no object is left under another content's digest."""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

from .. import object_store, safe_io
from ..object_store import Location


def sha256_of_file(f: Any) -> tuple[int, str]:
    """(size, SHA-256) of an open file, read to its end."""
    digest = hashlib.sha256()
    size = 0
    while chunk := f.read(8 << 20):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def upload_file(source: Path, where: Location, digest: str) -> None:
    """Uploads the graph file ``source`` as ``where`` (mapped, streamed), hashing what goes up:
    a file changed since it was hashed is not left under another content's name."""
    sent = hashlib.sha256()
    with safe_io.open_regular(source) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            object_store.put(where, b"")
        else:
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
                object_store.put_stream(where, [mapped], digest=sent)
    if size and sent.hexdigest() != digest:
        object_store.remove([where])
        raise OSError(f"{source}: changed while it was uploaded (recorded again at the next save)")


__all__ = ["sha256_of_file", "upload_file"]
