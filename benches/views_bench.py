"""Views in bulk (issue 30): memory_speed.py's row "open + every tensor as an array" at other sizes, and
what a lazily opened state costs before and at its first use::

    python benches/views_bench.py [--rounds 9] [--out benches/out/views_bench.md]

For each size (by default 16,384 and 1,024 tensors of 256 B, and 8 tensors of 16 MiB, in /dev/shm, warm):
  - open + every tensor as a NumPy array (``{n: p.data for n, p in state.parameters}``) against
    safetensors' ``load_file`` (memory_speed.py's workload and baseline);
  - ``load_checkpoint`` alone, and ``load_checkpoint`` + one tensor's ``.data``, each with its own time
    per tensor (the open stays lazy: nothing is made until asked).

Run it with another build's interpreter (e.g. main's ``.venv/bin/python``) for that build's figures: the
baseline is re-measured in every run, so ratios compare across builds on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
from measure import paired_ratio, report, time_rounds
from ortckpt import CheckpointState

SHM = "/dev/shm"


def timed(fn) -> float:
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(tensors: int, tensor_bytes: int, rounds: int, shm: Path) -> list[str]:
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    per = max(1, tensor_bytes // 4)
    arrays = {f"block{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(tensors)}
    path, reference = shm / "views.ckpt", shm / "views.safetensors"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)
    save_file(arrays, str(reference))
    first = next(iter(arrays))
    del arrays

    def every_array() -> None:
        state = CheckpointState.load_checkpoint(path)
        _ = {n: param.data for n, param in state.parameters}

    def one_array() -> None:
        _ = CheckpointState.load_checkpoint(path).parameters[first].data

    times = time_rounds(
        {
            "safetensors load_file": lambda: timed(lambda: load_file(str(reference))),
            "open + every array": lambda: timed(every_array),
            "open only": lambda: timed(lambda: CheckpointState.load_checkpoint(path)),
            "open + one array": lambda: timed(one_array),
        },
        rounds,
        f"views {tensors}",
        after=lambda: None,  # (tmpfs: no dirty pages to sync)
    )
    path.unlink()
    reference.unlink()
    base = times["safetensors load_file"]
    size = f"{tensors} x {tensor_bytes} B"
    lines = []
    for name in ("open + every array", "open only", "open + one array"):
        median = statistics.median(times[name])
        per_round = [b / t for b, t in zip(base, times[name], strict=True)]
        lines.append(
            f"| {size} | {name} | {median:.5f} | {median / tensors * 1e6:.2f} | {statistics.median(base):.5f} | "
            f"{paired_ratio(times[name], base):.2f} ({min(per_round):.2f}-{max(per_round):.2f}) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sizes", default="16384x256,1024x256,8x16777216", help="TENSORSxBYTES, comma-separated")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shm = Path(tempfile.mkdtemp(prefix="ortckpt-views-", dir=SHM))
    lines = [
        "| tensors | contender | median s | µs per tensor | safetensors load_file median s | "
        "load_file's time / this (paired: median, range of rounds) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    try:
        for size in args.sizes.split(","):
            tensors, tensor_bytes = (int(x) for x in size.split("x"))
            lines += bench(tensors, tensor_bytes, args.rounds, shm)
    finally:
        for p in shm.iterdir():
            p.unlink()
        shm.rmdir()
    report(lines, args.out)


if __name__ == "__main__":
    main()
