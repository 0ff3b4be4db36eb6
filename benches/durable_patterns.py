"""Write patterns side by side on one workload (the follow-up to the suite's "save vs write()"
and "durable vs write()+fsync" columns): which way of getting the bytes into a file is fastest
on this machine, and does ortckpt match the best of them?

    python benches/durable_patterns.py [--rounds 10] [--workload "transformer 1 bfloat16"] [--plain]

Durable (the default): every variant writes the same bytes to a temporary file, fsyncs it,
renames it into place and fsyncs the directory, as a durable save must. --plain: no fsync, as
the suite's plain saves (each followed by os.sync() outside the timing). Rounds are shuffled;
the report gives each variant's median, spread and its median ratio to the first variant
(write() with or without fsync) in the same round.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from measure import paired_ratio, time_rounds
from ortckpt import CheckpointState
from suite import fsync_dir, make_workload

PIECE = 256 << 10  # as ortckpt's src/io/writeback.rs
SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def sync_file_range(fd: int, offset: int, length: int, flags: int) -> None:
    if _libc.sync_file_range(fd, offset, length, flags) != 0:
        raise OSError(ctypes.get_errno(), "sync_file_range")


def batches(arrays: list[np.ndarray], piece: int = PIECE):
    """The tensors' bytes in writev batches of at most `piece` bytes (as ortckpt's write_segments)."""
    batch, size = [], 0
    for a in arrays:
        view = memoryview(a.reshape(-1).view(np.uint8))
        for start in range(0, len(view), piece):
            part = view[start : start + piece]
            if batch and (size + len(part) > piece or len(batch) == 1024):
                yield batch, size
                batch, size = [], 0
            batch.append(part)
            size += len(part)
    if batch:
        yield batch, size


def durable_file(path: Path, write) -> None:
    """A durable save's steps: temporary file, fsync, rename, fsync of the directory."""
    temp = path.with_name(f".{path.name}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temp, path)
    fsync_dir(path)


def plain_file(path: Path, write) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write(fd)
    finally:
        os.close(fd)


def plain(arrays):
    def write(fd):
        for a in arrays:
            view = memoryview(a.reshape(-1).view(np.uint8))
            while view:
                view = view[os.write(fd, view) :]

    return write


def pieces(arrays, wait_previous: bool, writeback: bool = True, piece: int = PIECE):
    """writev in PIECE batches with writeback started after each (unless not `writeback`); with
    `wait_previous`, the batch before is also waited for, so dirty pages stay bounded."""

    def write(fd):
        position, previous = 0, None
        for batch, size in batches(arrays, piece):
            written = os.writev(fd, batch)
            assert written == size
            if writeback:
                sync_file_range(fd, position, size, SYNC_FILE_RANGE_WRITE)
            if wait_previous and previous is not None:
                flags = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
                sync_file_range(fd, previous[0], previous[1], flags)
            previous = (position, size)
            position += size

    return write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workload", default="transformer 1 bfloat16", help='"shape GiB dtype"')
    parser.add_argument("--dir", type=Path, default=None, help="where files go (default: a temp dir on /tmp)")
    parser.add_argument("--plain", action="store_true", help="no fsync: plain saves, as the suite's save column")
    args = parser.parse_args()
    shape, gib, dtype = args.workload.split()
    work = make_workload(shape, float(gib), dtype)
    state = work.state()
    arrays = list(work.arrays().values())
    directory = Path(tempfile.mkdtemp(prefix="ortckpt-patterns-", dir=args.dir))

    def writev_in(piece: int):
        return lambda p: plain_file(p, pieces(arrays, wait_previous=False, writeback=False, piece=piece))

    variants = (
        {
            "write() per tensor": lambda p: plain_file(p, plain(arrays)),
            **{f"writev pieces of {n >> 10} KiB": writev_in(n) for n in (256 << 10, 1 << 20, 4 << 20, 32 << 20)},
            "ortckpt": lambda p: CheckpointState.save_checkpoint(state, p, include_optimizer_state=True),
        }
        if args.plain
        else {
            "write()+fsync": lambda p: durable_file(p, plain(arrays)),
            "writev 32 MiB pieces + writeback": lambda p: durable_file(p, pieces(arrays, False, piece=32 << 20)),
            "writev 32 MiB + writeback, wait previous": lambda p: durable_file(p, pieces(arrays, True, piece=32 << 20)),
            "writev 256 KiB pieces + writeback": lambda p: durable_file(p, pieces(arrays, False, piece=256 << 10)),
            "ortckpt durable": lambda p: CheckpointState.save_checkpoint(
                state, p, include_optimizer_state=True, durable=True
            ),
        }
    )
    paths = {name: directory / f"v{i}" for i, name in enumerate(variants)}

    def remove_written() -> None:
        os.sync()  # written back before the file goes, as in the suite
        for f in directory.iterdir():
            f.unlink()
        os.sync()

    def timed_here(run: Callable[[Path], object], path: Path) -> None:
        run(path)  # what it returns is not a time: measured here

    times = time_rounds(
        {name: functools.partial(timed_here, run, paths[name]) for name, run in variants.items()},
        args.rounds,
        "durable",
        after=remove_written,
    )
    directory.rmdir()
    first = next(iter(times))
    base = times[first]
    print(f"{work.name}: {work.nbytes / 2**30:.2f} GiB, {len(arrays)} tensors, {args.rounds} shuffled rounds")
    print(f"| variant | median s | min-max s | per-round ratio to {first} (median) |")
    print("| --- | --- | --- | --- |")
    for name, t in times.items():
        ratio = paired_ratio(t, base)
        print(f"| {name} | {statistics.median(t):.3f} | {min(t):.2f}-{max(t):.2f} | {ratio:.2f} |")
    print("rounds (s):")
    for name, t in times.items():
        print(f"  {name:42s} " + " ".join(f"{x:.2f}" for x in t))


if __name__ == "__main__":
    main()
