"""Sharded steps that cost what changed (issue 41, item 6): ``CheckpointManager(comm=...)`` steps of a
model with a large frozen part, under ``mpirun``, with ``share_unchanged`` (each rank's shard shares its
shard of the previous step) against every step written whole (``share_unchanged=False``).

Each rank holds its rows of every frozen and trainable matrix (split as tensor parallelism splits
them) and AdamW moments for the trainable ones; every step changes the trainable part and its moments
in place. A save is timed on rank 0 from a barrier before it to a barrier after it; the bytes a step
wrote are those of its files that are not (by inode) files of the previous step. Step 1 writes the
whole state (inline: under the threshold), step 2 finds it mostly unchanged with nothing to share from
and writes its values into each shard's data file, steps 3-N share those. Ratios per run: median(steps
2-N) / step 1 of the same run; reported: median over shuffled rounds (range), os.sync() between runs::

    python benches/sharded_step_cost.py [--ranks 2] [--rounds 3] [--frozen-mib 512] [--trainable-mib 16]
        [--steps 6] [--directory /path/on/the/disk] [--out table.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from measure import report, shuffled

MiB = 2**20
CONTENDERS = ("shared", "whole")


def child(args: argparse.Namespace) -> None:
    """One rank of a run (under mpirun): prints, on rank 0, each step's seconds and bytes written."""
    from mpi4py import MPI
    from ortckpt import CheckpointManager, CheckpointState, OptimizerGroup
    from ortckpt.distributed import Slice

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    columns = 1024
    shapes = {f"frozen{k:02d}": (args.frozen_mib * MiB // (16 * columns * 4), columns) for k in range(16)}
    shapes |= {f"head{k}": (args.trainable_mib * MiB // (4 * columns * 4), columns) for k in range(4)}
    slices = {name: Slice.split(shape, rank, world) for name, shape in shapes.items()}
    rng = np.random.default_rng(rank)
    arrays = {name: rng.random(part.shape, dtype=np.float32) for name, part in slices.items()}
    trainable = {n: a for n, a in arrays.items() if n.startswith("head")}
    state = CheckpointState.from_arrays(trainable, {n: a for n, a in arrays.items() if n not in trainable})
    momentums = {n: {"momentum0": np.zeros_like(a), "momentum1": np.zeros_like(a)} for n, a in trainable.items()}
    state.optimizer_groups["group0"] = OptimizerGroup(step=0, initial_learning_rate=1e-3, momentums=momentums)
    share = args.contender == "shared"
    seconds, written = [], []
    with CheckpointManager(args.dir, comm=comm, max_to_keep=4, share_unchanged=share) as manager:
        for step in range(1, args.steps + 1):
            for name, moms in momentums.items():  # a training step: the head and its moments change
                trainable[name] += 1.0
                moms["momentum0"] += 0.5
                moms["momentum1"] += 0.25
            if rank == 0:
                os.sync()
            comm.Barrier()
            start = time.perf_counter()
            manager.save(state, step, slices=slices)
            comm.Barrier()
            seconds.append(time.perf_counter() - start)
            if rank == 0:
                written.append(new_bytes(manager, step))
    if rank == 0:
        print(json.dumps({"seconds": seconds, "bytes": written}))


def new_bytes(manager: Any, step: int) -> int:
    """Bytes of the step's files that are not (by inode) files of the step before it."""
    folder = Path(manager.directory) / f"step_{step:08d}"
    before = Path(manager.directory) / f"step_{step - 1:08d}"
    old = {p.stat().st_ino for p in before.iterdir()} if before.exists() else set()
    return sum(p.stat().st_size for p in folder.iterdir() if p.stat().st_ino not in old)


def run(contender: str, args: argparse.Namespace) -> dict[str, list[float]]:
    folder = Path(tempfile.mkdtemp(prefix="ortckpt-shardedstep-", dir=args.directory))
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
    command = [mpirun, "-n", str(args.ranks), "--oversubscribe", "--bind-to", "none", sys.executable, __file__]
    options = ["--frozen-mib", str(args.frozen_mib), "--trainable-mib", str(args.trainable_mib)]
    options += ["--steps", str(args.steps), "--child", contender, "--dir", str(folder / "run")]
    try:
        done = subprocess.run([*command, *options], capture_output=True, text=True, timeout=1800, env=env, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{contender} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.sync()


def summary(values: list[list[float]]) -> tuple[str, str, str]:
    """Step 1, the median of steps 2-N, and their ratio, each as median (range) over rounds."""
    firsts = [v[0] for v in values]
    laters = [statistics.median(v[1:]) for v in values]
    ratios = [later / first for later, first in zip(laters, firsts, strict=True)]

    def cell(xs: list[float], digits: int = 3, unit: str = "") -> str:
        return f"{statistics.median(xs):.{digits}f}{unit} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"

    return cell(firsts), cell(laters), cell(ratios, 2, "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frozen-mib", type=int, default=512, help="frozen values, all ranks together")
    parser.add_argument("--trainable-mib", type=int, default=16, help="trainable values (moments: twice more)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--directory", type=Path, default=None, help="where the steps are written (default: /tmp)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    parser.add_argument("--child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.contender = args.child
        child(args)
        return
    runs: dict[str, list[dict[str, list[float]]]] = {c: [] for c in CONTENDERS}
    for r in range(args.rounds):
        for contender in shuffled(CONTENDERS, ("sharded_step_cost", r)):
            runs[contender].append(run(contender, args))
            seconds = [round(s, 3) for s in runs[contender][-1]["seconds"]]
            print(f"round {r + 1}: {contender}: {seconds} s", file=sys.stderr)
    changing = 3 * args.trainable_mib
    lines = [
        f"# Sharded steps that cost what changed: {args.steps} manager steps on {args.ranks} ranks, "
        f"{args.frozen_mib} MiB frozen + {args.trainable_mib} MiB trainable + AdamW ({changing} MiB changing a step)",
        "",
        f"`python benches/sharded_step_cost.py {' '.join(sys.argv[1:])}`; {args.rounds} shuffled rounds, each a "
        "fresh mpirun, `max_to_keep=4`, durable, os.sync() before every step. Ratio: median(steps "
        f"2-{args.steps}) / step 1 of the same run; median over rounds (range). Ideal (bytes): "
        f"{changing / (args.frozen_mib + changing):.2f}x.",
        "",
        "| steps | step 1 s | steps 2-N s | time: 2-N / 1 | step 1 MiB | steps 2-N MiB | bytes: 2-N / 1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for contender in CONTENDERS:
        first, later, ratio = summary([r["seconds"] for r in runs[contender]])
        written = [[b / MiB for b in r["bytes"]] for r in runs[contender]]
        first_b, later_b, ratio_b = summary(written)
        lines.append(f"| {contender} | {first} | {later} | {ratio} | {first_b} | {later_b} | {ratio_b} |")
    report(lines, args.out)


if __name__ == "__main__":
    main()
