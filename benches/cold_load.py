"""A cold load that reads every byte, against a sequential read() of the same files (issue 41).

    python benches/cold_load.py [--gib 4] [--tensors 64] [--rounds 3] [--dir /tmp]
        [--baseline-python PYTHON] [--drop-caches]

Saves a float32 checkpoint of ``--gib`` GiB (a checkpoint + ``.data`` pair above 1800 MiB), then in
shuffled rounds, each run in a fresh process with the files' pages dropped from the page cache just
before it (``posix_fadvise DONTNEED`` on both files after ``os.sync()``; with ``--drop-caches``,
``echo 3 > /proc/sys/vm/drop_caches`` instead, the whole machine's cache):

- ``read()``: both files read in order with ``readinto()`` into one 8 MiB buffer, every chunk XORed
  as 8-byte words (the baseline);
- ``load_checkpoint + every byte``: ``ortckpt.load_checkpoint`` (lazy: views of the mapped files),
  then every tensor's values XORed the same way, in file order;
- with ``--baseline-python``, the same load in that interpreter (another build of ortckpt, e.g.
  ``PYTHONPATH`` set to a copy of main's package: say so in a wrapper script).

Reports each contender's median and range and ``measure.paired_ratio`` against ``read()`` (above 1:
faster). The checkpoint is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import ortckpt
from measure import paired_ratio, time_rounds

# One run, in a fresh process (nothing of the files mapped or cached by the parent): prints its seconds.
CHILD = """
import sys, time
import numpy as np
kind, path = sys.argv[1], sys.argv[2]

def xor(buffer):
    return int(np.bitwise_xor.reduce(np.frombuffer(buffer, np.uint64)))

started = time.perf_counter()
acc = 0
if kind == "read":
    chunk = bytearray(8 << 20)
    view = memoryview(chunk)
    for name in (path, path + ".data"):
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(chunk):
                acc ^= xor(view[: n // 8 * 8])
else:
    import ortckpt
    state = ortckpt.load_checkpoint(path)
    for _, parameter in state.parameters:
        acc ^= xor(parameter.data.reshape(-1).view(np.uint8))
print(time.perf_counter() - started)
"""


def drop_pages(paths: list[str], whole_machine: bool) -> None:
    os.sync()
    if whole_machine:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--baseline-python", help="another interpreter whose ortckpt is the baseline build")
    parser.add_argument("--drop-caches", action="store_true", help="drop the whole page cache before each run")
    args = parser.parse_args()
    elements = int(args.gib * 2**30) // 4 // args.tensors // 16 * 16
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        path = os.path.join(where, "checkpoint")
        rng = np.random.default_rng(0)
        arrays = {f"layer{i:03}.weight": rng.random(elements, dtype=np.float32) for i in range(args.tensors)}
        ortckpt.save_checkpoint(ortckpt.CheckpointState.from_arrays(arrays), path)
        del arrays
        files = [p for p in (path, path + ".data") if os.path.exists(p)]
        if len(files) < 2:
            sys.exit("use at least 1800 MiB: the read() baseline reads a checkpoint + .data pair")

        def child(python: str, kind: str):  # type: ignore[no-untyped-def]
            def run() -> float:
                out = subprocess.run([python, "-c", CHILD, kind, path], check=True, capture_output=True, text=True)
                return float(out.stdout)

            return run

        contenders = {
            "read()": child(sys.executable, "read"),
            "load_checkpoint + every byte": child(sys.executable, "load"),
        }
        if args.baseline_python:
            contenders["load_checkpoint + every byte (baseline build)"] = child(args.baseline_python, "load")
        evict = lambda: drop_pages(files, args.drop_caches)  # noqa: E731
        times = time_rounds(
            {name: (lambda run=run: (evict(), run())[1]) for name, run in contenders.items()},
            args.rounds,
            "cold_load",
        )
    how = "drop_caches" if args.drop_caches else "posix_fadvise DONTNEED"
    print(f"{args.gib:g} GiB in {args.tensors} float32 tensors, {args.rounds} shuffled rounds, cold ({how})")
    for name, ts in times.items():
        ratios = [b / t for b, t in zip(times["read()"], ts, strict=True)]
        print(
            f"{name}: median {statistics.median(ts):.3f} s (range {min(ts):.3f}-{max(ts):.3f});"
            f" read()'s time / this: {paired_ratio(ts, times['read()']):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
