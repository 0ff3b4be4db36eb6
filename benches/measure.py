"""Measuring helpers shared by the suite and the peer helpers that run in other virtualenvs
(ONNX Runtime's, torch's): NumPy and the standard library only."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable

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
