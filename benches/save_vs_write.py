"""ortckpt.save_checkpoint against a plain write() of the same bytes, into tmpfs (no disk in the way).

    python benches/save_vs_write.py [--mib 1024] [--tensors 96] [--rounds 9] [--dir /dev/shm]

Issue 41's rows: 1 GiB of float32 values in 96 tensors, saved with their checksums (every save
takes them) as one checkpoint file (inline values) and as a checkpoint + ``.data`` pair
(``external_data_threshold=0``). The baseline is a plain ``write()`` of the same value bytes into one
file, in the same rounds. The writer's own cost shows alone: its flatbuffers header, the per-tensor
checksums, the pair trailer, the temporary file and its rename. Contenders run in shuffled rounds
with ``os.sync()`` around every run (``measure.time_rounds``); each ratio is
``measure.paired_ratio``: the median over rounds of write()'s time / the save's (above 1: faster),
with its range over rounds. The CPU time of each (every thread of the process) shows what a
loaded machine hides: the save's checksums run on a second thread beside its writer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import ortckpt
from measure import paired_ratio, time_rounds

WRITE = "write()"
INLINE = "save_checkpoint"
EXTERNAL = "save_checkpoint, external data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    elements = args.mib * 2**20 // 4 // args.tensors
    rng = np.random.default_rng(0)
    arrays = {f"layer{i}.weight": rng.random(elements, dtype=np.float32) for i in range(args.tensors)}
    state = ortckpt.CheckpointState.from_arrays(arrays)
    with tempfile.TemporaryDirectory(dir=args.dir) as where:

        def fresh() -> None:
            for leftover in os.listdir(where):
                os.unlink(os.path.join(where, leftover))

        def plain_write() -> None:
            with open(os.path.join(where, "raw"), "wb") as f:
                for a in arrays.values():
                    f.write(a.data)

        def save(threshold: int) -> None:
            ortckpt.save_checkpoint(state, os.path.join(where, "checkpoint"), external_data_threshold=threshold)

        cpu: dict[str, list[float]] = {WRITE: [], INLINE: [], EXTERNAL: []}

        def costed(name: str, body: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                start = time.process_time()  # (every thread of this process: the save's included)
                body()
                cpu[name].append(time.process_time() - start)

            return run

        contenders = {
            WRITE: costed(WRITE, plain_write),
            INLINE: costed(INLINE, lambda: save(2**62)),
            EXTERNAL: costed(EXTERNAL, lambda: save(0)),
        }
        # Each run starts in an empty directory: the last run's files are removed after it, untimed.
        times = time_rounds(contenders, args.rounds, "save_vs_write", after=lambda: (fresh(), os.sync()))
    total = elements * 4 * args.tensors
    print(
        f"{args.tensors} float32 tensors, {total / 2**20:.0f} MiB, into {args.dir}, {args.rounds} shuffled rounds"
        f" (ortckpt from {os.path.dirname(ortckpt.__file__)})"
    )
    for name, ts in times.items():
        line = (
            f"{name}: median {statistics.median(ts):.3f} s (range {min(ts):.3f}-{max(ts):.3f}),"
            f" CPU {statistics.median(cpu[name]):.3f} s"
        )
        if name != WRITE:
            ratios = [w / s for w, s in zip(times[WRITE], ts, strict=True)]
            line += (
                f"; write()'s time / this: {paired_ratio(ts, times[WRITE]):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            )
        print(line)


if __name__ == "__main__":
    main()
