"""How long Python threads stall while ortckpt saves and loads 1 GiB.

A ticker thread records the time every 1 ms; the worst gap between its ticks
while the main thread saves (or loads and reads every byte) shows whether the
GIL is held. Baseline: the same ticker while the main thread sleeps.

    .venv/bin/python benches/gil_ticker.py [--gib 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from ortckpt import CheckpointState


def worst_gap_during(action) -> tuple[float, float, int]:
    """(seconds the action took, worst gap between ticks in ms, ticks) while it ran."""
    ticks: list[float] = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    action()
    end = time.perf_counter()
    done.set()
    thread.join()
    inside = [start] + [t for t in ticks if start <= t <= end] + [end]
    return end - start, 1000 * max(b - a for a, b in itertools.pairwise(inside)), len(inside) - 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    n = int(args.gib * (1 << 30)) // 4 // 64
    state = CheckpointState.from_arrays({f"w{i}": np.full(n, i, np.float32) for i in range(64)})
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "ckpt"

        def load_and_read():
            loaded = CheckpointState.load_checkpoint(path)
            for name in loaded.parameters.names():
                float(loaded.parameters[name].data.sum())  # NumPy holds the GIL while it sums

        rows = [
            ("sleep (baseline)", lambda: time.sleep(0.5)),
            ("save", lambda: CheckpointState.save_checkpoint(state, path)),
            ("save durable", lambda: CheckpointState.save_checkpoint(state, path, durable=True)),
            ("load (lazy open)", lambda: CheckpointState.load_checkpoint(path)),
            ("load + sum every tensor", load_and_read),
        ]
        print(f"{platform.machine()}, {args.gib:g} GiB in 64 tensors, ticker every 1 ms\n")
        print("| main thread | seconds | worst tick gap ms | ticks |")
        print("|---|---|---|---|")
        for name, action in rows:
            seconds, gap, ticks = worst_gap_during(action)
            print(f"| {name} | {seconds:.3f} | {gap:.1f} | {ticks} |")


if __name__ == "__main__":
    main()
