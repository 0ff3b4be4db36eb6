"""A Flower round's commit against a plain ``save_checkpoint`` of the same model (issue 39: "a
round's commit costs the server no more than a plain save_checkpoint of the model").

The model is a Flower ``ArrayRecord`` (float32, ``--tensors`` tensors, ``--mib`` MiB), as
``aggregate_train`` hands it to ``start``. Contenders, shuffled each round, ``os.sync()`` before
each, every one writing into a fresh folder of ``--dir``:

- ``save_checkpoint``: ``from_arrayrecord`` then ``ortckpt.save_checkpoint`` (page cache, the default);
- ``save_checkpoint durable``: the same with ``durable=True`` (fsync'd before it returns);
- ``commit``: ``FedAvg(manager=CheckpointManager(dir)).commit(round, arrays, result)``, the manager's
  defaults (durable: the round is on disk when ``commit`` returns);
- ``commit page cache``: the same with ``CheckpointManager(dir, durable=False)``;
- ``commit async``: the same with ``CheckpointManager(dir, async_save=True)``: the time the server is
  blocked (the write goes on in the manager's thread, waited for outside the clock).

Ratios are a plain save's time over the contender's (page cache and durable), paired by round
(at or above 1: the commit costs no more than that plain save). Runs in flwr's venv:

    PYTHONPATH=python:benches .venv-flower/bin/python benches/flower_commit_bench.py --mib 100 --tensors 25
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import Result
from measure import shuffled
from ortckpt import CheckpointManager, save_checkpoint
from ortckpt.flower import FedAvg, from_arrayrecord


def model(mib: float, tensors: int) -> ArrayRecord:
    rng = np.random.default_rng(0)
    elements = int(mib * 2**20 / 4 / tensors)
    return ArrayRecord(
        {f"layer{i}.weight": Array(rng.standard_normal(elements).astype(np.float32)) for i in range(tensors)}
    )


def run(contender: str, arrays: ArrayRecord, where: Path) -> float:
    os.sync()
    if contender.startswith("save_checkpoint"):
        where.mkdir()
        start = time.perf_counter()
        save_checkpoint(from_arrayrecord(arrays), where / "checkpoint", durable=contender.endswith("durable"))
        return time.perf_counter() - start
    manager = CheckpointManager(
        where, async_save=contender.endswith("async"), durable=not contender.endswith("page cache")
    )
    strategy = FedAvg(manager=manager)
    try:
        start = time.perf_counter()
        strategy.commit(1, arrays, Result(arrays=arrays))
        took = time.perf_counter() - start
        manager.wait()
    finally:
        manager.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=100)
    parser.add_argument("--tensors", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    arrays = model(args.mib, args.tensors)
    contenders = ["save_checkpoint", "save_checkpoint durable", "commit", "commit page cache", "commit async"]
    times: dict[str, list[float]] = {c: [] for c in contenders}
    root = Path(tempfile.mkdtemp(prefix="flower-commit-", dir=args.dir))
    try:
        for r in range(args.rounds + 1):  # (round 0 warms up, not counted)
            for contender in shuffled(contenders, seed=r):
                where = root / f"{r}-{contender.replace(' ', '-')}"
                took = run(contender, arrays, where)
                shutil.rmtree(where)
                if r:
                    times[contender].append(took)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.mib:g} MiB in {args.tensors} tensors, {args.rounds} rounds, into {args.dir or tempfile.gettempdir()}")
    print("| contender | median s (range) | save_checkpoint's time / its | durable save_checkpoint's / its |")
    print("|---|---:|---:|---:|")
    for contender in contenders:
        t = times[contender]
        cells = []
        for baseline in ("save_checkpoint", "save_checkpoint durable"):
            ratios = [b / c for b, c in zip(times[baseline], t, strict=True)]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"| {contender} | {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
