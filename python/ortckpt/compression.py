"""Compressed checkpoints: for checkpoints kept but no longer trained from.

ONNX Runtime cannot read a compressed tensor, so a compressed checkpoint is an archive of the
checkpoint's files, lossless to the byte, which :func:`decompress` (or ``ortckpt decompress``)
turns back into the files ONNX Runtime loads, and :func:`load_compressed` loads directly.

The codec, chosen by measurement (benches/compression_bench.py, on real trained weights):
zstd (level 3) over the file with the bytes of each floating-point tensor *grouped*: a float32
tensor's first bytes, then its second bytes, and so on (ZipNN's observation: the exponent bytes
of trained weights repeat a few values, the low mantissa bytes are noise; grouped, zstd finds
the former). Grouping goes in blocks of ``block_elements`` elements, so memory stays bounded.

An archive::

    b"ORTCKPTZ" | zstd frame of the checkpoint | zstd frame of its external data file, if any
              | footer (JSON: sizes, SHA-256 of each uncompressed file, grouped regions)
              | footer length (8 bytes, little-endian) | b"ORTCKPTZ"

The SHA-256 of each file is that of its uncompressed bytes: what a manager's metadata.json
records, checked again on every decompression.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from . import _boundary, documents, extras, safe_io, targets
from . import dtypes as _dt
from .checkpoint_state import CheckpointState, open_checkpoint
from .errors import CheckpointFormatError, CheckpointIntegrityError
from .progress import maybe_bar

MAGIC = b"ORTCKPTZ"
SUFFIX = ".zst"  # what the manager and the command name an archive: <checkpoint>.zst
LEVEL = 3
BLOCK_ELEMENTS = 1 << 22  # grouped per 4 Mi elements: 16 MiB of float32 at a time
PIECE = 16 << 20  # ungrouped bytes go through in pieces of this size
_FOOTER_TAIL = 8 + len(MAGIC)
MAX_IN_MEMORY = 2**31  # a checkpoint without external data is one flatbuffer: under 2 GiB
# Floating-point types whose bytes are grouped, by ONNX code: their element size.
_GROUPED = {_dt.FLOAT: 4, _dt.FLOAT16: 2, _dt.DOUBLE: 8, _dt.BFLOAT16: 2}


@dataclass(frozen=True)
class Compressed:
    """What :func:`compress` wrote: the archive, and its files' sizes before and after."""

    path: Path
    size: int
    compressed_size: int

    @property
    def ratio(self) -> float:
        return self.size / self.compressed_size if self.compressed_size else 1.0


def _zstd() -> Any:
    return extras.require("zstandard", "compressed checkpoints")


def is_compressed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that starts like a compressed checkpoint."""
    try:
        with safe_io.open_regular(path) as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


# --- compressing ------------------------------------------------------------------------------------


def compress(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    level: int = LEVEL,
    durable: bool = False,
    progress: bool = False,
) -> Compressed:
    """Writes the checkpoint ``src`` (and its external data file) as one compressed archive
    ``dst`` (atomically: a temporary file renamed over it). ``src`` is verified first, so an
    archive never holds a checkpoint that does not load. ``progress``: a bar (tqdm) over the
    bytes compressed."""
    targets.output(dst, "dst")
    zstandard = _zstd()
    loaded = _boundary.load(src)  # verified, mapped
    roles = zip(documents.COMPRESSED_ROLES, loaded.mappings, strict=True)
    files = [(role, mapping) for role, mapping in roles if mapping is not None]
    regions = _grouped_regions(loaded)
    entries: list[dict[str, Any]] = []
    total = sum(len(memoryview(mapping)) for _, mapping in files)
    with (
        maybe_bar(progress, f"compressing {Path(src).name}", total) as bar,
        safe_io.atomic_file(dst, durable=durable) as out,
    ):
        out.write(MAGIC)
        for index, (role, mapping) in enumerate(files):
            view = memoryview(mapping).cast("B")
            digest = hashlib.sha256()
            frame_start = out.tell()
            # closefd=False: the frame ends, the archive goes on.
            with zstandard.ZstdCompressor(level=level).stream_writer(out, size=len(view), closefd=False) as frame:
                for begin, end, itemsize in _segments(len(view), regions[index], BLOCK_ELEMENTS):
                    original = view[begin:end]
                    digest.update(original)  # one read of the file: hashed and compressed together
                    frame.write(_grouped(original, itemsize) if itemsize else original)
                    bar.update(end - begin)
            entries.append(
                {
                    "role": role,
                    "size": len(view),
                    "sha256": digest.hexdigest(),
                    "frame_offset": frame_start,
                    "frame_size": out.tell() - frame_start,
                    "grouped": [list(r) for r in regions[index]],
                }
            )
        footer = {
            "format": documents.COMPRESSED_FORMAT,
            "version": documents.COMPRESSED_VERSION,
            "codec": "zstd",
            "block_elements": BLOCK_ELEMENTS,
            "files": entries,
        }
        data = json.dumps(footer, separators=(",", ":")).encode()
        documents.parse(documents.COMPRESSED_FOOTER, data, os.fspath(dst))  # what a reader will accept
        out.write(data)
        out.write(len(data).to_bytes(8, "little") + MAGIC)
        compressed_size = out.tell()
    return Compressed(Path(dst), sum(e["size"] for e in entries), compressed_size)


def _grouped_regions(loaded: _boundary.Loaded) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(offset, length, element size) of every floating-point tensor's bytes, per file, ascending."""
    regions: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]] = ([], [])
    for _, (_, code, _, stored) in loaded.tensors():
        itemsize = _GROUPED.get(code)
        if itemsize is not None and isinstance(stored, tuple) and stored[1]:
            offset, nbytes, external = stored
            regions[1 if external else 0].append((offset, nbytes, itemsize))
    return sorted(regions[0]), sorted(regions[1])


def _segments(size: int, regions: list[tuple[int, int, int]], block_elements: int) -> Iterator[tuple[int, int, int]]:
    """A file's layout in an archive, in order, as (start, end, element size): pieces of at most
    PIECE bytes kept as they are (element size 0), and each region's blocks of at most
    ``block_elements`` elements, grouped. Compression and decompression walk the same one."""
    at = 0
    for offset, length, itemsize in [*regions, (size, 0, 0)]:
        for start in range(at, offset, PIECE):
            yield start, min(start + PIECE, offset), 0
        block = block_elements * itemsize
        for start in range(offset, offset + length, block or 1):
            yield start, min(start + block, offset + length), itemsize
        at = offset + length


def _grouped(data: Any, itemsize: int) -> np.ndarray:
    """Whole elements' bytes grouped: every element's byte 0, then every byte 1, ..."""
    return np.ascontiguousarray(np.frombuffer(data, np.uint8).reshape(-1, itemsize).T)


def _ungrouped(data: Any, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(np.frombuffer(data, np.uint8).reshape(itemsize, -1).T)


# --- decompressing ----------------------------------------------------------------------------------


def read_footer(archive: IO[bytes], where: str) -> dict[str, Any]:
    """The archive's footer, validated (:mod:`ortckpt.documents`); frames inside the archive."""
    size = os.fstat(archive.fileno()).st_size
    if size < len(MAGIC) + _FOOTER_TAIL:
        raise CheckpointFormatError(f"{where}: {size} bytes: too short to be a compressed checkpoint")
    archive.seek(0)
    head = archive.read(len(MAGIC))
    archive.seek(size - _FOOTER_TAIL)
    tail = archive.read(_FOOTER_TAIL)
    if head != MAGIC or tail[8:] != MAGIC:
        raise CheckpointFormatError(f"{where}: not a compressed checkpoint (no {MAGIC.decode()} marks)")
    length = int.from_bytes(tail[:8], "little")
    if length > min(documents.COMPRESSED_FOOTER.max_bytes, size - len(MAGIC) - _FOOTER_TAIL):
        raise CheckpointFormatError(f"{where}: a footer of {length} bytes does not fit the archive")
    footer_start = size - _FOOTER_TAIL - length
    archive.seek(footer_start)
    footer = documents.parse(documents.COMPRESSED_FOOTER, archive.read(length), where)
    last = footer["files"][-1]
    if last["frame_offset"] + last["frame_size"] > footer_start:
        raise CheckpointFormatError(f"{where}: the frames run into the footer")
    return footer  # type: ignore[no-any-return]


def decompress(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    durable: bool = False,
    follow_symlinks: bool = True,
    progress: bool = False,
) -> Path:
    """Writes the checkpoint held in the archive ``src`` back to ``dst`` (and ``dst.data``),
    byte for byte as it was compressed; every file's size and SHA-256 are checked
    (:class:`~ortckpt.CheckpointIntegrityError`), the whole archive before anything is
    replaced. Returns ``dst``.
    Without ``follow_symlinks``, a symlink at ``src`` is refused (for an archive a step names).
    ``progress``: a bar (tqdm) over the bytes restored."""
    targets.output(dst, "dst")
    dst = Path(dst)
    with safe_io.open_regular(src, follow_symlinks=follow_symlinks) as archive:
        footer = read_footer(archive, os.fspath(src))
        total = sum(int(entry["size"]) for entry in footer["files"])
        bar = maybe_bar(progress, f"decompressing {Path(src).name}", total)
        # Every file is decompressed and checked into the core's staged files first; only then
        # does the one commit put them in place (the data file first, the checkpoint last).
        staged = _boundary.stage(os.fspath(dst), with_data=len(footer["files"]) > 1)
        try:
            for entry in footer["files"]:
                external = entry["role"] != "checkpoint"
                with safe_io.staged_writer(staged.fileno(data=external)) as out:
                    _restore(archive, entry, footer["block_elements"], out, os.fspath(src), bar.update)
            staged.commit(durable=durable)
        finally:
            staged.discard()
            bar.close()
    return dst


def decompress_to_memory(src: str | os.PathLike[str]) -> bytearray:
    """The checkpoint in the archive ``src`` as bytes in memory (checked as :func:`decompress`
    checks it), for :meth:`CheckpointState.from_bytes`; one buffer cannot hold a checkpoint
    with external data, so such an archive is refused (ValueError)."""
    with safe_io.open_regular(src) as archive:
        footer = read_footer(archive, os.fspath(src))
        if len(footer["files"]) > 1:
            raise ValueError(f"{os.fspath(src)}: the checkpoint has an external data file: decompress it to files")
        entry = footer["files"][0]
        if entry["size"] > MAX_IN_MEMORY:  # a footer's word is not enough to allocate on
            raise CheckpointFormatError(
                f"{os.fspath(src)}: the footer claims a checkpoint of {entry['size']} bytes; one without "
                f"external data holds at most {MAX_IN_MEMORY}"
            )
        out = _IntoBuffer(bytearray(entry["size"]))
        _restore(archive, entry, footer["block_elements"], out, os.fspath(src))  # type: ignore[arg-type]
    return out.buffer


class _IntoBuffer:
    """A file to write that fills a buffer of the right size: no copy when it is done."""

    def __init__(self, buffer: bytearray) -> None:
        self.buffer, self.at = buffer, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.buffer[self.at : self.at + view.nbytes] = view  # never past the end: _restore reads sizes
        self.at += view.nbytes
        return view.nbytes


def _restore(
    archive: IO[bytes],
    entry: dict[str, Any],
    block_elements: int,
    out: IO[bytes],
    where: str,
    on_bytes: Any = None,
) -> None:
    """Decompresses one file's frame into ``out``, ungrouping its regions, checking size and
    SHA-256; ``on_bytes`` (a progress bar's update) is told of each piece."""
    zstandard = _zstd()
    archive.seek(entry["frame_offset"])
    frame = io.BufferedReader(_Limited(archive, entry["frame_size"]))
    digest = hashlib.sha256()
    problems: list[str] = []
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame, closefd=False) as reader:
            for start, end, itemsize in _segments(entry["size"], entry["grouped"], block_elements):
                data = reader.read(end - start)
                while len(data) < end - start:
                    more = reader.read(end - start - len(data))
                    if not more:
                        raise CheckpointIntegrityError(where, [f"{entry['role']}: the frame ends early"])
                    data += more
                original = _ungrouped(data, itemsize) if itemsize else data
                digest.update(original)
                out.write(original)
                if on_bytes is not None:
                    on_bytes(end - start)
            if reader.read(1):
                problems.append(f"{entry['role']}: the frame holds more than {entry['size']} bytes")
    except zstandard.ZstdError as e:
        problems.append(f"{entry['role']}: the frame does not decompress ({e})")
    if not problems and digest.hexdigest() != entry["sha256"]:
        problems.append(f"{entry['role']}: SHA-256 {digest.hexdigest()}, the archive says {entry['sha256']}")
    if problems:
        raise CheckpointIntegrityError(where, problems)


class _Limited(io.RawIOBase):
    """At most ``limit`` bytes of ``stream`` from where it is: one frame, never the next."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self.stream, self.left = stream, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: self.left]
        n = self.stream.readinto(view) if view.nbytes else 0  # type: ignore[attr-defined]
        self.left -= n or 0
        return n or 0


def load_compressed(src: str | os.PathLike[str], *, follow_symlinks: bool = True) -> CheckpointState:
    """The checkpoint in the archive ``src``, loaded: decompressed into a private temporary
    directory, memory-mapped, and the directory removed (the maps keep the data; the page cache
    holds it, not the process's heap: chosen by measurement, see benches/README.md)."""
    with safe_io.scratch_directory() as scratch:
        checkpoint = decompress(src, scratch / "checkpoint", follow_symlinks=follow_symlinks)
        return open_checkpoint(checkpoint, follow_symlinks=False)  # (the maps outlive the directory)


__all__ = ["Compressed", "compress", "decompress", "decompress_to_memory", "is_compressed", "load_compressed"]
