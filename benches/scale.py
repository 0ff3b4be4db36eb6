"""Scale figures (`make bench` runs this after suite.py): how opening grows with tensor
count and checkpoint size, ONNX Runtime's load_checkpoint on the same 4 GiB file, and
peak memory of a large save.

Writes benches/out/scale.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import median_seconds
from ortckpt import CheckpointState

HERE = Path(__file__).resolve().parent

GiB = 2**30


def open_figures(path: Path, first: str) -> tuple[float, float]:
    lazy = median_seconds(lambda: CheckpointState.load_checkpoint(path), runs=20)
    first_access = median_seconds(CheckpointState.load_checkpoint(path).parameters[first].data.sum, runs=20)
    return lazy, first_access


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-gib", type=float, default=4.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--ort-python", default=os.environ.get("ORTCKPT_ORT_PYTHON"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="ortckpt-scale-", dir=args.dir))
    lines = [
        "# Scale\n",
        f"`python benches/scale.py {' '.join(sys.argv[1:])}`\n",
        "| checkpoint | tensors | file bytes | lazy open ms | open + first tensor ms |",
        "|---|---|---|---|---|",
    ]
    try:
        # Opening as the tensor count grows (64-element float32 tensors, inline).
        for count in (1_000, 10_000, 100_000):
            state = CheckpointState.from_arrays({f"t{i:06d}": np.full(64, i, np.float32) for i in range(count)})
            path = directory / f"small_{count}.ckpt"
            CheckpointState.save_checkpoint(state, path)
            lazy, first = open_figures(path, "t000000")
            lines.append(f"| small tensors | {count} | {path.stat().st_size} | {lazy * 1e3:.2f} | {first * 1e3:.2f} |")
            path.unlink()

        # The big one: 1,000 tensors, external data (past ONNX Runtime's 1800 MiB threshold).
        per = int(args.big_gib * GiB) // 1000 // 4
        arrays = {f"layer{i:04d}.weight": np.full(per, i, np.float32) for i in range(1000)}
        path = directory / "big.ckpt"
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        start = time.perf_counter()
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)
        save_s = time.perf_counter() - start
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
        del arrays
        size = path.stat().st_size + Path(f"{path}.data").stat().st_size
        lazy, first = open_figures(path, "layer0000.weight")
        lines.append(f"| {args.big_gib:g} GiB, external data | 1000 | {size} | {lazy * 1e3:.2f} | {first * 1e3:.2f} |")
        lines.append(
            f"\nSaving the {args.big_gib:g} GiB checkpoint: {save_s:.2f} s "
            f"({size / GiB / save_s:.2f} GiB/s), peak RSS growth beyond the arrays {growth:.1f} MiB "
            f"(budget: 64 MiB + 0.5 % = {64 + 0.005 * size / 2**20:.0f} MiB)."
        )
        if args.ort_python and Path(args.ort_python).exists():
            times = []
            for _ in range(3):
                done = subprocess.run(
                    [args.ort_python, str(HERE / "ort_bench.py"), "load", str(path)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                times.append(json.loads(done.stdout.strip().splitlines()[-1])["open_seconds"])
            ort = statistics.median(times)
            lines.append(
                f"\nONNX Runtime 1.19.2 load_checkpoint on the same {args.big_gib:g} GiB checkpoint "
                f"(median of 3): {ort * 1e3:.0f} ms; ortckpt's lazy open: {lazy * 1e3:.2f} ms, "
                f"{ort / lazy:.0f}x faster."
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    text = "\n".join(lines) + "\n"
    (args.out / "scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
