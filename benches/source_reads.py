"""How the arithmetic kernel should read its sources (issue 30): a chunk of each source at a time,
either from the source's private map (pages populated with MADV_POPULATE_READ, read, then dropped with
MADV_DONTNEED, as src/compute does) or with ``pread`` into one reused buffer (a copy, then reads from
the cache). One thread, files in /dev/shm (warm); each chunk is then read once by the same NumPy sum,
so the difference is the access alone. Reported as ``measure.paired_ratio`` (map's time / pread's,
per round: above 1, pread is faster)::

    python benches/source_reads.py [--rounds 9] [--sources 4] [--mib 64]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
from measure import paired_ratio, time_rounds

# The kernel's chunk: 65536 float32 elements.
CHUNK = 256 << 10
MADV_POPULATE_READ = 22


def timed(f: Callable[[], None]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        f()
        return time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    size = args.mib << 20
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        fds = []
        for i in range(args.sources):
            path = os.path.join(shm, f"s{i}")
            np.random.default_rng(i).standard_normal(size // 4).astype(np.float32).tofile(path)
            fds.append(os.open(path, os.O_RDONLY))

        def via_map() -> None:
            maps = [mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ) for fd in fds]
            for at in range(0, size, CHUNK):
                for m in maps:
                    m.madvise(MADV_POPULATE_READ, at, CHUNK)
                    values = np.frombuffer(m, np.float32, CHUNK // 4, at)
                    values.sum(dtype=np.float32)
                    del values
                    m.madvise(mmap.MADV_DONTNEED, at, CHUNK)
            for m in maps:
                m.close()

        buffer = bytearray(CHUNK)
        view, values = memoryview(buffer), np.frombuffer(buffer, np.float32)

        def via_pread() -> None:
            for at in range(0, size, CHUNK):
                for fd in fds:
                    os.preadv(fd, [view], at)
                    values.sum(dtype=np.float32)

        times = time_rounds({"map": timed(via_map), "pread": timed(via_pread)}, args.rounds, "source_reads")
        for fd in fds:
            os.close(fd)
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t):.4f} s")
    print(f"map's time / pread's (paired): {paired_ratio(times['pread'], times['map']):.2f}")


if __name__ == "__main__":
    main()
