"""ortckpt.save_checkpoint against a plain write() of the same bytes, into tmpfs (no disk in the way).

    python benches/save_vs_write.py [--mib 768] [--rounds 7] [--dir /dev/shm]

Separates the writer's own cost (its flatbuffers header, per-tensor checksums taken as it writes,
the atomic rename) from the shared disk's swings that the suite's page-cache rows carry. Rounds are
shuffled; the ratio is the median over rounds of write()'s time / the save's (above 1: faster).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import numpy as np
import ortckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    tensors = max(1, args.mib // 8)
    arrays = {f"layer{i}.weight": np.random.rand(2 * 2**20).astype(np.float32) for i in range(tensors)}
    state = ortckpt.CheckpointState.from_arrays(arrays)
    with tempfile.TemporaryDirectory(dir=args.dir) as where:

        def plain_write() -> None:
            with open(os.path.join(where, "raw"), "wb") as f:
                for a in arrays.values():
                    f.write(a.data)

        def save() -> None:
            ortckpt.save_checkpoint(state, os.path.join(where, "checkpoint"))

        times: dict[str, list[float]] = {"write()": [], "save_checkpoint": []}
        contenders = [("write()", plain_write), ("save_checkpoint", save)]
        for _ in range(args.rounds):
            random.shuffle(contenders)
            for name, run in contenders:
                for leftover in os.listdir(where):
                    os.unlink(os.path.join(where, leftover))
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    ratio = statistics.median(w / s for w, s in zip(times["write()"], times["save_checkpoint"], strict=True))
    print(f"{tensors} float32 tensors, {tensors * 8} MiB, into {args.dir}, {args.rounds} shuffled rounds")
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.3f} s (range {min(ts):.3f}-{max(ts):.3f})")
    print(f"save vs write(): {ratio:.2f}")


if __name__ == "__main__":
    main()
