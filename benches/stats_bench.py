"""Per-tensor statistics (issue 32): ``ortckpt.tensor_stats(path)`` against reading the same bytes,
measured in the same run, in shuffled rounds with ``os.sync()`` around every run
(``measure.time_rounds``), reported as ``measure.paired_ratio`` (the baseline's time / this time,
per round: above 1, faster than the baseline)::

    python benches/stats_bench.py [--gib 1] [--rounds 5] [--dir /path/on/the/disk] [--out benches/out/stats.md]

The rows:
  - warm (the file in the page cache): ``tensor_stats`` of a checkpoint of --gib GiB of float32
    (--tensors tensors) against ``readinto()`` of its file into a buffer allocated beforehand, and
    against the NumPy implementation (``load_checkpoint``, then per tensor the float64 NaN/Inf
    counts, min, max, mean, std and L2 of the finite values: ``statistics._stats_numpy``, the
    tests' oracle) up to --numpy-max-gib;
  - cold (the file's pages dropped from the page cache before each run, ``posix_fadvise
    DONTNEED``): ``tensor_stats`` against ``readinto()``;
  - --small small tensors (4096 float32 each): the per-tensor overhead, warm;
  - the same bytes as one tensor against those --small tensors (issue 41: ``tensor_stats`` of the
    small tensors' checkpoint / of the one tensor's, per round, warm; goal <= 2x): alone with
    --ratio-only;
  - the peak memory ``tensor_stats`` adds (VmHWM above the resident memory before the call, in a
    fresh process): the file's pages are dropped behind the pass.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ortckpt
from measure import paired_ratio, report, time_rounds
from ortckpt import CheckpointState
from ortckpt import statistics as st

GiB = 2**30
READINTO = "readinto() a reused buffer"


def timed_here(fn: Callable[[], object]) -> Callable[[], None]:
    """A contender that ``time_rounds`` times (it returns None)."""

    def run() -> None:
        fn()

    return run


def files_of(path: Path) -> list[Path]:
    return [p for p in (path, Path(f"{path}.data")) if p.exists()]


def read_into(paths: list[Path], buffer: memoryview) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def drop_cache(paths: list[Path]) -> None:
    """Drops the files' pages from the page cache (nobody maps them between runs)."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def numpy_stats(path: Path) -> int:
    state = CheckpointState.load_checkpoint(path)
    return len([st._stats_numpy(key.label, key.role, value) for key, value in state.tensors()])


def make(path: Path, nbytes: int, tensors: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    per = nbytes // 4 // tensors
    arrays = {f"layer{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(tensors)}
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)


PEAK_CHILD = """
import json, sys
import ortckpt

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

before = status("VmRSS")
if sys.argv[2] == "load":
    ortckpt.CheckpointState.load_checkpoint(sys.argv[1])
else:
    ortckpt.tensor_stats(sys.argv[1])
print(json.dumps({"grew": status("VmHWM") - before}))
"""


def small_against_one(args: argparse.Namespace) -> list[str]:
    """``tensor_stats`` of --small tensors of 16 KiB against one tensor of the same bytes, both
    files in the page cache, alternating in shuffled rounds: the per-tensor cost of a pass."""
    with tempfile.TemporaryDirectory(prefix="stats-bench-", dir=args.dir) as tmp:
        small, one = Path(tmp) / "small.ckpt", Path(tmp) / "one.ckpt"
        nbytes = args.small * 4096 * 4
        make(small, nbytes, args.small, 1)
        make(one, nbytes, 1, 1)
        assert len(ortckpt.tensor_stats(small)) == args.small and len(ortckpt.tensor_stats(one)) == 1
        paths = files_of(small) + files_of(one)
        buffer = memoryview(np.ones(max(p.stat().st_size for p in paths) + 1, np.uint8)).cast("B")
        one_name, many_name = "one tensor (baseline)", f"{args.small:,} tensors of 16 KiB"
        contenders: dict[str, Callable[[], float | None]] = {
            one_name: timed_here(lambda: ortckpt.tensor_stats(one)),
            many_name: timed_here(lambda: ortckpt.tensor_stats(small)),
        }

        def warm() -> None:
            os.sync()
            read_into(paths, buffer)

        warm()
        times = time_rounds(contenders, args.rounds, "stats small vs one", after=warm)
    base = times[one_name]
    per_round = [t / b for t, b in zip(times[many_name], base, strict=True)]
    lines = [
        f"# `tensor_stats`: {args.small:,} small tensors against one tensor of the same {nbytes / 2**20:g} MiB",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, ortckpt {ortckpt.__version__}; files in {args.dir}, in the page "
        f"cache; {args.rounds} shuffled rounds. Command: `python benches/stats_bench.py "
        + " ".join(sys.argv[1:])
        + "`",
        "",
        "| checkpoint | median s | range s | µs a tensor above one tensor's time |",
        "|---|---:|---:|---:|",
    ]
    for name, ts in times.items():
        above = (statistics.median(ts) - statistics.median(base)) / args.small * 1e6 if ts is not base else 0.0
        lines.append(f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} | {above:.1f} |")
    lines += [
        "",
        f"Small tensors' time / one tensor's, per round: median {statistics.median(per_round):.2f}x "
        f"(range {min(per_round):.2f}-{max(per_round):.2f}; goal <= 2x).",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--small", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--numpy-max-gib", type=float, default=1.0)
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent / "out"))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "stats.md"))
    parser.add_argument("--ratio-only", action="store_true", help="only the small tensors against one tensor")
    args = parser.parse_args()
    if args.ratio_only:
        report(small_against_one(args), args.out)
        return

    with tempfile.TemporaryDirectory(prefix="stats-bench-", dir=args.dir) as tmp:
        big, small = Path(tmp) / "big.ckpt", Path(tmp) / "small.ckpt"
        make(big, int(args.gib * GiB), args.tensors, 0)
        make(small, args.small * 4096 * 4, args.small, 1)
        big_files, small_files = files_of(big), files_of(small)
        buffer = memoryview(np.ones(max(p.stat().st_size for p in big_files + small_files) + 1, np.uint8)).cast("B")
        size = sum(p.stat().st_size for p in big_files)
        small_size = sum(p.stat().st_size for p in small_files)
        # The figures must be right before they are fast.
        found = ortckpt.tensor_stats(big)
        loaded = CheckpointState.load_checkpoint(big)
        first = next(iter(found))
        oracle = st._stats_numpy(first, "trainable", loaded.parameters[first].data)
        assert (found[first].min, found[first].max) == (oracle.min, oracle.max), (found[first], oracle)
        del loaded

        def warm(paths: list[Path]) -> Callable[[], None]:
            def run() -> None:
                read_into(paths, buffer)  # in the page cache before each run

            return run

        rows = []
        contenders: dict[str, Callable[[], float | None]] = {
            READINTO: timed_here(lambda: read_into(big_files, buffer)),
            "tensor_stats": timed_here(lambda: ortckpt.tensor_stats(big)),
        }
        if args.gib <= args.numpy_max_gib:
            contenders["NumPy (_stats_numpy per tensor)"] = timed_here(lambda: numpy_stats(big))
        times = time_rounds(contenders, args.rounds, "stats warm", after=warm(big_files))
        rows += [("warm", f"{args.gib:g} GiB, {args.tensors} tensors", n, t, times[READINTO]) for n, t in times.items()]

        cold = {
            READINTO: timed_here(lambda: read_into(big_files, buffer)),
            "tensor_stats": timed_here(lambda: ortckpt.tensor_stats(big)),
        }
        drop_cache(big_files)
        times = time_rounds(cold, args.rounds, "stats cold", after=lambda: drop_cache(big_files))
        rows += [("cold", f"{args.gib:g} GiB, {args.tensors} tensors", n, t, times[READINTO]) for n, t in times.items()]

        read_into(small_files, buffer)
        many = {
            READINTO: timed_here(lambda: read_into(small_files, buffer)),
            "tensor_stats": timed_here(lambda: ortckpt.tensor_stats(small)),
            "NumPy (_stats_numpy per tensor)": timed_here(lambda: numpy_stats(small)),
        }
        times = time_rounds(many, args.rounds, "stats small", after=warm(small_files))
        label = f"{args.small} tensors of 16 KiB"
        rows += [("warm", label, n, t, times[READINTO]) for n, t in times.items()]

        grew = {}
        for warmed in ("read()", "mmap"):
            for what in ("load", "stats"):
                drop_cache(big_files)
                if warmed == "read()":
                    read_into(big_files, buffer)
                else:  # the page cache filled through a map, as a load and tensor_stats fill it
                    ortckpt.tensor_stats(big)
                done = subprocess.run(
                    [sys.executable, "-c", PEAK_CHILD, str(big), what],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=600,
                )
                grew[warmed, what] = json.loads(done.stdout)["grew"] / 2**20

    lines = [
        "# Per-tensor statistics: `ortckpt.tensor_stats` (issue 32)",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, ortckpt {ortckpt.__version__}; files in {args.dir}; "
        f"{args.rounds} shuffled rounds, `os.sync()` around every run; cold: the files' pages dropped "
        "(`posix_fadvise DONTNEED`) before every run. Command: `python benches/stats_bench.py "
        + " ".join(sys.argv[1:])
        + "`",
        "",
        "| cache | checkpoint | contender | median s | range s | GB/s | readinto()'s time / this (paired) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for cache, what, name, ts, base in rows:
        nbytes = size if "GiB" in what else small_size
        rate = f"{nbytes / statistics.median(ts) / 1e9:.2f}"
        lines.append(
            f"| {cache} | {what} | {name} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} | {rate} | "
            f"{paired_ratio(ts, base):.2f} |"
        )
    lines += [
        "",
        f"Peak memory added for the {args.gib:g} GiB checkpoint (VmHWM above VmRSS before the call, a fresh process "
        "each), by how its pages came into the page cache:",
        "",
        "| page cache filled by | `load_checkpoint` alone MiB | `tensor_stats(path)` MiB |",
        "|---|---:|---:|",
    ]
    for warmed in ("read()", "mmap"):
        lines.append(f"| {warmed} | {grew[warmed, 'load']:.1f} | {grew[warmed, 'stats']:.1f} |")
    lines += ["", *small_against_one(args)[2:]]
    report(lines, args.out)


if __name__ == "__main__":
    main()
