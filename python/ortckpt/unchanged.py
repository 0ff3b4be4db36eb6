"""What cannot have changed since a file was written: an array that *is* that file's bytes.

A tensor restored from a step is a view of a private mapping of the step's files. As long as this
process writes none of its pages, it reads the file itself (the page cache), so saving it again
where that very file keeps it at that very offset needs neither a comparison nor a checksum pass:
it cannot differ. The kernel tells which pages are still the file's (``/proc/self/pagemap``); a
page written, even with the byte it held, is the process's own copy from then on and proves
nothing. Arrays of the process's own memory prove nothing either: they are compared.

The directory store's shared steps get this from the core (``src/sharing.rs`` asks
``io::FileBacked`` while it saves); this module is the same proof for the store code in Python
(object storage's steps, whose restored values are a file of the local cache).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from . import _boundary


class FileSpan(NamedTuple):
    """The file (``st_dev``, ``st_ino``) whose current bytes an array's are, and where they start."""

    device: int
    inode: int
    offset: int


def file_span(array: np.ndarray) -> FileSpan | None:
    """The file whose current bytes ``array``'s are, proven; None when nothing proves it (an array
    of this process's own memory, a mapped one written since, a strided view, not Linux)."""
    span = _boundary.file_span(array)
    return None if span is None else FileSpan(*span)


def is_file_bytes(array: np.ndarray, path: str | os.PathLike[str], offset: int) -> bool:
    """Whether ``array``'s bytes are, provably, the bytes of the file ``path`` names (never
    followed through a symlink) from ``offset`` on: True means they cannot differ from them."""
    span = file_span(array)
    if span is None:
        return False
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return (span.device, span.inode, span.offset) == (found.st_dev, found.st_ino, offset)
