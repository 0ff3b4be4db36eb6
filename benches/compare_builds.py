"""Two builds of ortckpt side by side: did a change make the paths users time slower?

Each build is an interpreter whose ``import ortckpt`` is that build (a venv of an older checkout, built
with ``maturin develop --release``). Every operation runs in a fresh process of that interpreter,
which times itself; builds alternate in shuffled rounds with ``os.sync()`` around each run
(``measure.time_rounds``), and the ratio is ``measure.paired_ratio`` (the baseline's time over the
candidate's, per round: above 1, the candidate is faster)::

    python benches/compare_builds.py --baseline ../old/.venv/bin/python --candidate .venv/bin/python \\
        --directory /path/on/the/disk [--s3 '{"endpoint_url": ..., ...}'] [--rounds 5] [--mib 1024]

The operations: ``save_checkpoint`` (plain, and ``durable=True``) and a ``CheckpointManager`` save (durable,
hashed, committed) of eight float32 tensors, in ``--directory`` and in /dev/shm; with ``--s3``, an
``s3://`` save and an ``s3://`` manager save of half the size. With ``--small N`` instead, the paths over
many small tensors (N of 256 B, in /dev/shm, warm; the median of 5 in each process): ``load_checkpoint``
and every tensor as an array (``.parameters[*].data``), and ``tensor_stats`` (every tensor, momentums
included, through the state's one iteration).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from measure import paired_ratio, time_rounds

# What one run over many small tensors does: saves them (AdamW moments for a tenth), then prints the
# median seconds of 5 runs of the operation.
SMALL = """
import statistics, sys, time
import numpy as np
import ortckpt
kind, where, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
arrays = {f"block{i}.weight": np.full(64, i, np.float32) for i in range(count)}
state = ortckpt.CheckpointState.from_arrays(arrays)
moments = {n: {"momentum0": v, "momentum1": v} for n, v in list(arrays.items())[: count // 10]}
state.optimizer_groups = {"group0": ortckpt.OptimizerGroup(1, 0.5, moments)}
ortckpt.save_checkpoint(state, where, include_optimizer_state=True)
del state, arrays, moments

def views():
    loaded = ortckpt.CheckpointState.load_checkpoint(where)
    return {n: p.data for n, p in loaded.parameters}

operation = views if kind == "views" else lambda: ortckpt.tensor_stats(where)
times = []
for _ in range(5):
    started = time.perf_counter()
    operation()
    times.append(time.perf_counter() - started)
print(statistics.median(times))
"""

# What one run does, in the build's own interpreter: prints the seconds of the operation alone.
ONE = """
import json, sys, time
import numpy as np
import ortckpt
kind, where, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
n = (mib << 20) // 4 // 8
state = ortckpt.CheckpointState.from_arrays({f"w{i}": np.full(n, i, np.float32) for i in range(8)})
started = time.perf_counter()
if kind == "manager":
    manager = ortckpt.CheckpointManager(where, storage_options=options)
    started = time.perf_counter()
    manager.save(state, 1)
    seconds = time.perf_counter() - started
    manager.close()
else:
    ortckpt.save_checkpoint(state, where, durable=kind == "durable", storage_options=options)
    seconds = time.perf_counter() - started
print(seconds)
"""


def run(python: str, kind: str, base: str, mib: int, options: dict | None) -> float:
    """One operation in a fresh process of ``python``: the seconds it reported."""
    scratch = None
    if base.startswith("s3://"):
        where = f"{base}/{uuid.uuid4().hex}" + ("" if kind == "manager" else "/checkpoint")
    else:
        scratch = tempfile.mkdtemp(dir=base)
        where = str(Path(scratch) / ("run" if kind == "manager" else "checkpoint"))
    try:
        script = SMALL if kind in ("views", "stats") else ONE
        args = [python, "-c", script, kind, where, str(mib), *([json.dumps(options)] if options else [])]
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"{python} {kind}: {done.stderr[-2000:]}")
        return float(done.stdout.strip())
    finally:
        if scratch is not None:
            shutil.rmtree(scratch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the interpreter of the build compared against")
    parser.add_argument("--candidate", default=sys.executable, help="the interpreter of the build measured")
    parser.add_argument("--directory", help="a directory on the disk to save in")
    parser.add_argument("--small", type=int, help="time the paths over this many small tensors instead")
    parser.add_argument("--s3", help="storage_options (JSON) of an S3 server, to time s3:// saves too")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    if args.small:
        cases = [(kind, "/dev/shm", args.small, None) for kind in ("views", "stats")]
    elif args.directory is None:
        raise SystemExit("--directory (or --small) is needed")
    else:
        cases = [
            (kind, base, args.mib, None)
            for kind in ("save", "durable", "manager")
            for base in (args.directory, "/dev/shm")
        ]
    if args.s3 and not args.small:
        options = json.loads(args.s3)
        cases += [(kind, "s3://ckpt/compare-builds", args.mib // 2, options) for kind in ("save", "manager")]
    size = "tensors" if args.small else "MiB"
    print(f"| operation | where | {size} | baseline median s | candidate median s | baseline/candidate (paired) |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        kind, base, mib, _ = case
        builds = {
            name: (lambda python=python, case=case: run(python, *case))
            for name, python in (("baseline", args.baseline), ("candidate", args.candidate))
        }
        times = time_rounds(builds, args.rounds, seed=f"{kind} {base}")
        median = {name: statistics.median(t) for name, t in times.items()}
        ratio = paired_ratio(times["candidate"], times["baseline"])
        where = "s3://" if base.startswith("s3://") else base
        row = [kind, where, mib, f"{median['baseline']:.3f}", f"{median['candidate']:.3f}", f"{ratio:.2f}"]
        print("| " + " | ".join(map(str, row)) + " |", flush=True)


if __name__ == "__main__":
    main()
