"""How long does a CheckpointManager save block the training loop? (`make bench`)

For a state of --gib GiB (transformer-like: parameters and AdamW momentums), rounds in
alternating order of:
  - snapshot baseline: copying every array into fresh memory (np.array(copy=True)),
    what an async save must do before it may return;
  - async save: the time save() blocks, then the time wait() takes for the rest
    (write, SHA-256, commit, retention) in the background;
  - sync save: save() doing all of it before returning.
Durable (fsync) as the manager's default. Writes benches/out/async_save.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ortckpt import CheckpointManager

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from suite import GiB, make_workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args()

    work = make_workload("transformer", args.gib, "float32")
    state = work.state()
    arrays = list(work.arrays().values())
    nbytes = sum(a.nbytes for a in arrays)
    times: dict[str, list[float]] = {"snapshot (copy of every array)": [], "async save: save() blocks": [],
                                     "async save: wait() for the rest": [], "sync save": []}  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="ortckpt-async-", dir=args.dir))
    try:
        for r in range(args.rounds):

            def snapshot():
                start = time.perf_counter()
                copies = [np.array(a, copy=True) for a in arrays]
                times["snapshot (copy of every array)"].append(time.perf_counter() - start)
                del copies

            def asynchronous():
                with CheckpointManager(root / f"async{r}", async_save=True) as manager:
                    start = time.perf_counter()
                    manager.save(state, 1)
                    blocked = time.perf_counter()
                    manager.wait()
                    times["async save: save() blocks"].append(blocked - start)
                    times["async save: wait() for the rest"].append(time.perf_counter() - blocked)

            def synchronous():
                manager = CheckpointManager(root / f"sync{r}")
                start = time.perf_counter()
                manager.save(state, 1)
                times["sync save"].append(time.perf_counter() - start)

            order = [snapshot, asynchronous, synchronous]
            for step in order if r % 2 == 0 else order[::-1]:
                step()
                os.sync()
            for d in root.iterdir():
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    snap = times["snapshot (copy of every array)"]
    lines = [
        "# How long a save blocks the training loop\n",
        f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores; "
        f"`python benches/async_save.py {' '.join(sys.argv[1:])}`; transformer-like state with AdamW momentums, "
        f"{len(arrays)} tensors, {nbytes / GiB:.2f} GiB; durable saves (fsync), SHA-256 of every file; "
        f"medians of {args.rounds} rounds in alternating order.\n",
        "| operation | median s | range s | vs snapshot copy |",
        "|---|---|---|---|",
    ]
    for name, ts in times.items():
        ratio = statistics.median(t / s for t, s in zip(ts, snap))
        lines.append(f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} | {ratio:.2f}x |")
    lines.append("\n`vs snapshot copy`: median over rounds of (time / that round's snapshot copy time).")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "async_save.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
