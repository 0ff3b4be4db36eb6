"""Steps that cost what changed (issue 41, item 2): 10 ``CheckpointManager`` steps of a model with a
large frozen part, steps 2-10 against step 1's time (the issue's row: 1 GiB frozen + 32 MiB trainable
+ AdamW moments, goal <= 0.15x; the ideal, writing only the 96 MiB that change, ~0.09x).

Two trainers, each in a fresh process of each build (an interpreter whose ``import ortckpt`` is that
build), in shuffled rounds with ``os.sync()`` before every step and between runs:

- ``arrays``: the frozen part in the trainer's own arrays (``CheckpointState.from_arrays``), as after
  a conversion: memory of the process's own, whose pages the manager's synchronous save watches
  (userfaultfd's asynchronous write protection: ``src/untouched.rs``), so a step compares only the
  part pages of the arrays none of whose pages was written since (before the watch: all of it);
- ``resumed``: the run resumed from its step 2 (``manager.restore(2)``, as after a preemption) and
  trained on from there: its frozen part is step 2's data file, mapped and never written, which a
  step shares without comparing (the head and its moments are written in place, as a trainer does).

Step 1 writes the whole state (inline: under the 1800 MiB threshold), step 2 finds the frozen part
unchanged with nothing to share from and writes it whole into ``checkpoint.data``, steps 3-10 share
that file: the median of steps 2-10 is over 9 steps, one of them a whole write. Ratio per run:
median(steps 2-10) / step 1 of the same run; reported: the median over rounds and the range::

    python benches/step_cost.py --baseline /work/main/.venv/bin/python --candidate .venv/bin/python \\
        --directory /path/on/the/disk [--rounds 3] [--frozen-mib 1024] [--trainable-mib 32]
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
from pathlib import Path

from measure import report, shuffled

# One run: prints the seconds of each step as JSON.
RUN = """
import json, os, sys, time
import numpy as np
from ortckpt import CheckpointManager, CheckpointState, OptimizerGroup
trainer, folder, frozen_mib, trainable_mib, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
MiB = 2**20
rng = np.random.default_rng(2)
frozen = {f"layer{k}": rng.random(frozen_mib * MiB // 64, dtype=np.float32) for k in range(16)}
trainable = {f"head{k}": rng.random(trainable_mib * MiB // 16, dtype=np.float32) for k in range(4)}
state = CheckpointState.from_arrays(trainable, frozen)
momentums = {n: {"momentum0": np.zeros_like(a), "momentum1": np.zeros_like(a)} for n, a in trainable.items()}
state.optimizer_groups["group0"] = OptimizerGroup(step=0, initial_learning_rate=1e-3, momentums=momentums)
manager = CheckpointManager(folder, max_to_keep=4)
seconds = []
for step in range(1, steps + 1):
    if trainer == "resumed" and step == 3:
        del state, frozen, trainable, momentums
        state = manager.restore(2)  # (untimed: the run resumed from its latest step)
    group = state.optimizer_groups["group0"]
    for name in sorted(group.momentums):  # a training step: the head and its moments change, in place
        head = state.parameters[name].data
        head += 1.0
        group.momentums[name]["momentum0"][...] += 0.5
        group.momentums[name]["momentum1"][...] += 0.25
    os.sync()
    start = time.perf_counter()
    manager.save(state, step)
    seconds.append(time.perf_counter() - start)
manager.close()
print(json.dumps(seconds))
"""

TRAINERS = ("arrays", "resumed")


def run(python: str, trainer: str, directory: Path, args: argparse.Namespace) -> list[float]:
    folder = Path(tempfile.mkdtemp(prefix="ortckpt-stepcost-", dir=directory))
    try:
        command = [python, "-c", RUN, trainer, str(folder / "run"), str(args.frozen_mib), str(args.trainable_mib)]
        out = subprocess.run([*command, str(args.steps)], check=True, capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="interpreter of the baseline build")
    parser.add_argument("--candidate", default=sys.executable, help="interpreter of the build measured")
    parser.add_argument("--directory", type=Path, default=None, help="where the steps are written (default: /tmp)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frozen-mib", type=int, default=1024)
    parser.add_argument("--trainable-mib", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = parser.parse_args()
    builds = {"baseline": args.baseline, "candidate": args.candidate}
    contenders = [f"{build} {trainer}" for build in builds for trainer in TRAINERS]
    runs: dict[str, list[list[float]]] = {c: [] for c in contenders}
    for r in range(args.rounds):
        for contender in shuffled(contenders, ("step_cost", r)):
            build, trainer = contender.split()
            runs[contender].append(run(builds[build], trainer, args.directory, args))
            print(f"round {r + 1}: {contender}: {[round(s, 3) for s in runs[contender][-1]]}", file=sys.stderr)
    changing = 3 * args.trainable_mib
    lines = [
        f"# Steps that cost what changed: {args.steps} manager steps, {args.frozen_mib} MiB frozen + "
        f"{args.trainable_mib} MiB trainable + AdamW ({changing} MiB changing a step)",
        "",
        f"`python benches/step_cost.py {' '.join(sys.argv[1:])}`; {args.rounds} shuffled rounds, each build and "
        "trainer in a fresh process, `max_to_keep=4`, durable, os.sync() before every step. Ratio: median(steps "
        f"2-{args.steps}) / step 1 of the same run; median over rounds (range). Ideal: "
        f"{changing / (args.frozen_mib + changing):.2f}x; the issue's goal <= 0.15x.",
        "",
        "| build | trainer | step 1 s, median (range) | steps 2-10 s, median (range) | steps 2-10 / step 1 (range) |",
        "|---|---|---:|---:|---:|",
    ]
    for contender in contenders:
        build, trainer = contender.split()
        firsts = [s[0] for s in runs[contender]]
        laters = [statistics.median(s[1:]) for s in runs[contender]]
        ratios = [later / first for later, first in zip(laters, firsts, strict=True)]
        lines.append(
            f"| {build} | {trainer} | {statistics.median(firsts):.3f} ({min(firsts):.3f}-{max(firsts):.3f}) | "
            f"{statistics.median(laters):.3f} ({min(laters):.3f}-{max(laters):.3f}) | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    report(lines, args.out)


if __name__ == "__main__":
    main()
