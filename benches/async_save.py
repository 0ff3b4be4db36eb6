"""How long does a CheckpointManager save block the training loop? (`make bench`)

For a state of --gib GiB (transformer-like: parameters and AdamW momentums), rounds in
alternating order of:
  - baselines: memcpy of every array into memory already allocated (what an async save
    must at least do before it may return), and a copy into new memory (np.array);
  - async save: the time save() blocks, then the time wait() takes for the rest
    (write, SHA-256, commit, retention) in the background;
  - sync save: save() doing all of it before returning.
One manager of each kind serves every round, as in a training loop.
Durable (fsync) as the manager's default. Writes benches/out/async_save.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import paired_ratio
from ortckpt import CheckpointManager
from suite import GiB, make_workload

HERE = Path(__file__).resolve().parent


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
    times: dict[str, list[float]] = {
        "memcpy into allocated memory": [],
        "copy into new memory (np.array)": [],
        "async save: save() blocks": [],
        "async save: wait() for the rest": [],
        "sync save": [],
    }
    root = Path(tempfile.mkdtemp(prefix="ortckpt-async-", dir=args.dir))
    # One manager of each kind for the whole run, as a training loop has: the async one reuses
    # its copy of the state from one save to the next.
    async_manager = CheckpointManager(root / "async", async_save=True, max_to_keep=1)
    sync_manager = CheckpointManager(root / "sync", max_to_keep=1)
    targets = [np.empty_like(a) for a in arrays]
    for t in targets:
        t.fill(0)  # mapped in before timing, as the manager's copy is after its first save
    try:
        for r in range(args.rounds):

            def memcpy():
                start = time.perf_counter()
                for t, a in zip(targets, arrays, strict=True):
                    np.copyto(t, a)
                times["memcpy into allocated memory"].append(time.perf_counter() - start)

            def fresh_copy():
                start = time.perf_counter()
                copies = [np.array(a, copy=True) for a in arrays]
                times["copy into new memory (np.array)"].append(time.perf_counter() - start)
                del copies

            def asynchronous(r=r):
                start = time.perf_counter()
                async_manager.save(state, r + 1)
                blocked = time.perf_counter()
                async_manager.wait()
                times["async save: save() blocks"].append(blocked - start)
                times["async save: wait() for the rest"].append(time.perf_counter() - blocked)

            def synchronous(r=r):
                start = time.perf_counter()
                sync_manager.save(state, r + 1)
                times["sync save"].append(time.perf_counter() - start)

            order = [memcpy, fresh_copy, asynchronous, synchronous]
            for step in order if r % 2 == 0 else order[::-1]:
                step()
                os.sync()
        async_manager.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    snap = times["memcpy into allocated memory"]
    lines = [
        "# How long a save blocks the training loop\n",
        f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores; "
        f"`python benches/async_save.py {' '.join(sys.argv[1:])}`; transformer-like state with AdamW momentums, "
        f"{len(arrays)} tensors, {nbytes / GiB:.2f} GiB; durable saves (fsync), SHA-256 of every file; "
        f"medians of {args.rounds} rounds in alternating order.\n",
        "| operation | median s | range s | memcpy's time / this (paired) |",
        "|---|---|---|---|",
    ]
    for name, ts in times.items():
        ratio = paired_ratio(ts, snap)
        lines.append(f"| {name} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} | {ratio:.2f} |")
    first = times["async save: save() blocks"][0]
    lines.append(
        f"\nThe last column: median over rounds of (that round's memcpy time / this time), below 1 slower "
        f"than memcpy (benches/measure.py `paired_ratio`). The first async save "
        f"blocked {first:.3f} s: it allocates the manager's copy of the state, reused by later saves."
    )
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "async_save.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
