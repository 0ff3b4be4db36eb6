"""Measuring helpers shared by every bench and by the peer helpers that run in other virtualenvs
(ONNX Runtime's, torch's): NumPy and the standard library only. Every bench runs its contenders
in shuffled rounds (:func:`shuffled`, :func:`time_rounds`) and reports each against its baseline
with :func:`paired_ratio`."""

from __future__ import annotations

import os
import random
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np


def xor_all(arrays) -> int:
    """Reads every byte (XOR of 8-byte words where they fit), the same way for every contender."""
    acc = 0
    for a in arrays:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        words = flat[: flat.size // 8 * 8].view(np.uint64)
        acc ^= int(np.bitwise_xor.reduce(words)) if words.size else 0
    return acc


def median_seconds(fn: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_mib() -> float:
    """Resident memory now (peak growth is measured from here, not from an earlier peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


# --- rounds and the baseline: how every bench compares -----------------------------------------


def shuffled(names: Iterable[str], seed: object) -> list[str]:
    """``names`` in a fresh order for one round, seeded by (bench, workload, round): a rerun repeats
    it, and no contender always runs after the same one (whose writeback or discards would then
    always land on it)."""
    order = list(names)
    random.Random(str(seed)).shuffle(order)
    return order


def time_rounds(
    contenders: Mapping[str, Callable[[], float | None]],
    rounds: int,
    seed: object,
    *,
    after: Callable[[], None] = os.sync,
) -> dict[str, list[float]]:
    """Runs every contender once per round, in a shuffled order, with ``os.sync()`` before each run
    and ``after()`` (by default ``os.sync()``) after it, so no run pays for another's dirty pages.
    A contender returns its own seconds when it measured them where it ran (a child process), or
    None to be timed here. Returns each contender's seconds, round by round."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in shuffled(contenders, f"{seed} {r}"):
            os.sync()
            start = time.perf_counter()
            reported = contenders[name]()
            times[name].append(time.perf_counter() - start if reported is None else reported)
            after()
    return times


def paired_ratio(times: Sequence[float], baseline: Sequence[float]) -> float:
    """The one comparison with a baseline that every bench reports: the median over rounds of
    (the baseline's time / the contender's time) in the same round. Above 1: faster than the
    baseline. Pairing by round cancels the swings of a shared, noisy disk."""
    return statistics.median(b / t for b, t in zip(baseline, times, strict=True))


def added_table(times: Mapping[str, Sequence[float]], baseline: str) -> list[str]:
    """The markdown table of what each contender adds to the baseline's time: median, range, the
    median of per-round differences, and :func:`paired_ratio`."""
    base = times[baseline]
    lines = [
        "| save | median s | range s | added to a save (median) | baseline's time / this (paired) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ts in times.items():
        added = statistics.median(t - b for t, b in zip(ts, base, strict=True))
        lines.append(
            f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} | {added:+.3f} s | "
            f"{paired_ratio(ts, base):.2f} |"
        )
    return lines


def report(lines: Sequence[str], out: os.PathLike[str] | None) -> None:
    """Prints a bench's markdown and writes it to ``out`` when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        os.makedirs(os.path.dirname(os.fspath(out)) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
