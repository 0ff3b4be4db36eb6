"""What the HTML report costs beyond the statistics it shows (issue 32), and how large the page is::

    python benches/report_bench.py [--mib 64] [--tensors 200,5000] [--rounds 3] [--out benches/out/report.md]

For each count of float32 tensors (--mib MiB in all, AdamW's two momentums beside each, in
/dev/shm, warm) the rows are, timed in shuffled rounds (``measure.time_rounds``):

  - baseline: ``tensor_stats(load_checkpoint(path))``, the figures the page shows;
  - ``write_report(path, out)``: the page, histograms for the largest 100 tensors (the default);
  - ``write_report(path, out, against=other)``: with the change figures against a second checkpoint;

each as the median seconds and the page's size. The report's own work is the difference.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from pathlib import Path

import measure
import numpy as np
from ortckpt import CheckpointState, OptimizerGroup, tensor_stats, write_report


def checkpoint(path: Path, count: int, mib: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    each = max(1, mib * (1 << 20) // 4 // count // 3)  # (a parameter and its two momentums)
    weights = {f"layer{i:05}.weight": rng.normal(0, 0.05, each).astype(np.float32) for i in range(count)}
    weights["layer00000.weight"][:3] = np.nan
    state = CheckpointState.from_arrays(weights)
    momentums = {n: {"momentum0": v * 0.1, "momentum1": np.abs(v) * 0.01} for n, v in weights.items()}
    state.optimizer_groups = {"group0": OptimizerGroup(100, 0.001, momentums)}
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)


def rows(count: int, mib: int, rounds: int, where: str | None) -> list[str]:
    """The table's rows for ``count`` tensors (a third parameters, two thirds momentums)."""
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        a, b, out = Path(tmp, "a.ckpt"), Path(tmp, "b.ckpt"), Path(tmp, "report.html")
        checkpoint(a, count // 3, mib, 1)
        checkpoint(b, count // 3, mib, 2)
        contenders = {
            "statistics (baseline)": lambda: tensor_stats(CheckpointState.load_checkpoint(a)) and None,
            "write_report": lambda: write_report(a, out) and None,
            "write_report --against": lambda: write_report(a, out, against=b) and None,
        }
        sizes = {}
        for name, run in contenders.items():  # (a warm-up, and each page's size)
            run()
            sizes[name] = None if name.startswith("statistics") else out.stat().st_size
        times = measure.time_rounds(contenders, rounds, f"report {count}")
        tensors = len(tensor_stats(CheckpointState.load_checkpoint(a)))
    base = statistics.median(times["statistics (baseline)"])
    found = []
    for name, seconds in times.items():
        median = statistics.median(seconds)
        size = "" if sizes[name] is None else f"{sizes[name] / 1024:.0f} KiB"
        found.append(f"| {tensors:,} | {name} | {median:.3f} | {median / base:.2f}x | {size} |")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--tensors", default="200,5000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    lines = [
        f"# The HTML report: {args.mib} MiB of float32 (parameters and AdamW momentums), {args.rounds} rounds",
        "",
        f"{platform.platform()}, {os.cpu_count()} CPUs; in {where or tempfile.gettempdir()}, warm.",
        "",
        "| tensors | what | median s | vs the statistics | page |",
        "|---:|---|---:|---:|---:|",
    ]
    for count in (int(c) for c in args.tensors.split(",")):
        lines += rows(count, args.mib, args.rounds, where)
    measure.report(lines, args.out)


if __name__ == "__main__":
    main()
