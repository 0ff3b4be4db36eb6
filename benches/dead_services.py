"""What a dead service costs a training loop: seconds, per build, where a service beside the save
has gone away (issue 29). Each case runs in a fresh process of the build's interpreter, killed at
``--cap`` seconds (reported as "> cap"):

- ``track="mlflow"`` with its server gone (a closed port): the manager's start, each of three
  saves, and its close;
- three saves with ``progress=True`` whose stderr reader has exited (``python train.py 2>&1 | head``).

    python benches/dead_services.py [--baseline OLD/python] [--cap 120] [--out benches/out/dead_services.md]

``--baseline`` also runs the cases on another checkout's Python package (its ``python/`` folder,
with a built ``_core`` copied in), first: the same-run baseline of an older build.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

# Saves reported to MLflow at a closed port: prints "<phase> <seconds>" as each phase ends.
DEAD_TRACKER = """
import sys, time
import numpy as np
from ortckpt import CheckpointManager, CheckpointState
from ortckpt.manager.tracking import MlflowTracker
where, uri = sys.argv[1], sys.argv[2]
state = CheckpointState.from_arrays({"w": np.ones(1 << 20, np.float32)})
began = time.perf_counter()
manager = CheckpointManager(where, track=MlflowTracker(uri, experiment="dead"))
print("start", time.perf_counter() - began, flush=True)
for step in (1, 2, 3):
    began = time.perf_counter()
    manager.save(state, step, metrics={"loss": 1.0 / step})
    print(f"save {step}", time.perf_counter() - began, flush=True)
began = time.perf_counter()
manager.close()
print("close", time.perf_counter() - began, flush=True)
"""

# Saves with a progress bar once stderr's reader is gone.
BROKEN_STDERR = """
import os, sys, time
import numpy as np
from ortckpt import CheckpointState, progress
progress.DELAY_SECONDS = 0
state = CheckpointState.from_arrays({"w": np.ones(64 << 18, np.float32)})
for step in (1, 2, 3):
    began = time.perf_counter()
    CheckpointState.save_checkpoint(state, os.path.join(sys.argv[1], "ck"), progress=True)
    print(f"save {step}", time.perf_counter() - began, flush=True)
os._exit(0)
"""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket closes


def run_case(script: str, args: list[str], env: dict[str, str], cap: float, close_stderr: bool) -> dict[str, str]:
    """Runs one case; its phases' seconds as printed; for the phases it never reached, "> cap"
    when it was killed there, "failed (exit N)" when it ended there."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if close_stderr else subprocess.DEVNULL,
        env=env,
        text=True,
    )
    if close_stderr and child.stderr is not None:
        child.stderr.close()  # the log reader goes away before the first bar
    try:
        out, _ = child.communicate(timeout=cap)
        missing = f"failed (exit {child.returncode})"
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        missing = f"> {cap:g}"
    phases: dict[str, str] = collections.defaultdict(lambda: missing)
    for line in out.splitlines():
        name, _, seconds = line.rpartition(" ")
        phases[name] = f"{float(seconds):.1f}"
    return phases


def cases(env: dict[str, str], cap: float) -> list[tuple[str, str]]:
    """(case, seconds) for one build."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"http://127.0.0.1:{closed_port()}"
        tracker = run_case(DEAD_TRACKER, [str(Path(tmp) / "run"), uri], env, cap, close_stderr=False)
        for phase in ("start", "save 1", "save 2", "save 3", "close"):
            rows.append((f"MLflow at a closed port: {phase}", tracker[phase]))
        bars = run_case(BROKEN_STDERR, [tmp], env, cap, close_stderr=True)
        for phase in ("save 1", "save 2", "save 3"):
            rows.append((f"progress=True, stderr's reader gone: {phase}", bars[phase]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=None, help="Another checkout's python/ folder.")
    parser.add_argument("--cap", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    builds = {}
    if args.baseline is not None:
        builds[f"baseline ({args.baseline})"] = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
    builds["this build"] = dict(os.environ)
    results = {build: cases(env, args.cap) for build, env in builds.items()}
    names = [case for case, _ in next(iter(results.values()))]
    lines = [f"python {sys.version.split()[0]}; seconds; each case killed at {args.cap:g} s", ""]
    lines += ["| case | " + " | ".join(builds) + " |", "|---|" + "---:|" * len(builds)]
    for i, case in enumerate(names):
        lines.append(f"| {case} | " + " | ".join(results[build][i][1] for build in builds) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
