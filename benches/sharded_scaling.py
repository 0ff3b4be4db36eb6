"""Aggregate save throughput of sharded checkpoints with 1, 2 and 4 ranks (`make bench`).

The same model (32 float32 matrices, each split by rows across the ranks, as tensor
parallelism splits them) is saved by 1, 2 and 4 MPI ranks on this machine, and the same
bytes by one plain write(), in shuffled rounds with os.sync() between runs. A save is timed
on rank 0 from a barrier before it to a barrier after it, so it includes planning, every
rank's shard and the commit. Writes benches/out/sharded.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measure import paired_ratio, time_rounds

HERE = Path(__file__).resolve().parent
GiB = 2**30
MATRICES = 32


def child(gib: float, directory: Path) -> None:
    """One rank of a timed save (under mpirun)."""
    from mpi4py import MPI
    from ortckpt import CheckpointState
    from ortckpt.distributed import Slice, save_sharded

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    columns = 1024
    rows = int(gib * GiB) // (MATRICES * columns * 4)
    slices = {f"layer{i:02d}.weight": Slice.split((rows, columns), rank, world) for i in range(MATRICES)}
    arrays = {name: np.full(part.shape, rank + 1, np.float32) for name, part in slices.items()}
    state = CheckpointState.from_arrays(arrays)
    nbytes = comm.allreduce(sum(a.nbytes for a in arrays.values()))
    comm.Barrier()
    start = time.perf_counter()
    save_sharded(state, directory, step=1, comm=comm, slices=slices, durable=False)
    comm.Barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"seconds": seconds, "bytes": nbytes}), flush=True)


def run_ranks(ranks: int, gib: float, directory: Path) -> tuple[float, int]:
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
    done = subprocess.run(
        [
            mpirun,
            "-n",
            str(ranks),
            "--oversubscribe",
            "--bind-to",
            "none",
            sys.executable,
            __file__,
            "--child",
            "--gib",
            str(gib),
            "--dir",
            str(directory),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{ranks} ranks failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["seconds"], result["bytes"]


def plain_write(nbytes: int, path: Path) -> float:
    block = np.ones(64 * 2**20 // 4, np.float32)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, block.nbytes)
            f.write(memoryview(block)[: n // 4] if n < block.nbytes else block)
            left -= n
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "out" / "sharded.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.gib, args.dir)
        return
    ranks = [int(r) for r in args.ranks.split(",")]
    base = Path(tempfile.mkdtemp(prefix="ortckpt-sharded-", dir=args.dir))
    nbytes = int(args.gib * GiB)
    runs = itertools.count()  # fresh target names

    def sharded(world: int) -> float:
        nonlocal nbytes
        target = base / f"{world}-{next(runs)}"
        seconds, nbytes = run_ranks(world, args.gib, target)
        shutil.rmtree(target)
        return seconds  # measured on rank 0, inside the job

    def baseline() -> float:
        target = base / f"write-{next(runs)}"
        seconds = plain_write(nbytes, target)
        target.unlink()
        return seconds

    contenders = {str(r): functools.partial(sharded, r) for r in ranks} | {"write()": baseline}
    try:
        times = time_rounds(contenders, args.rounds, f"sharded {args.gib}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    lines = [
        "| ranks | median s | range s | aggregate GiB/s | vs one write() of the same bytes |",
        "|---|---|---|---|---|",
    ]
    for name, ts in times.items():
        ratio = paired_ratio(ts, times["write()"])
        label = "write() (baseline)" if name == "write()" else name
        lines.append(
            f"| {label} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} | "
            f"{nbytes / GiB / statistics.median(ts):.2f} | {ratio:.2f} |"
        )
    text = (
        f"{args.gib:g} GiB float32 ({MATRICES} matrices split by rows), {args.rounds} shuffled rounds, "
        f"{os.cpu_count()} cores; `python benches/sharded_scaling.py --gib {args.gib:g} --rounds {args.rounds}`\n\n"
        + "\n".join(lines)
        + "\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
