"""Federated averaging of N checkpoints: ortckpt.average (streamed) against the loops people
write by hand (load each checkpoint with ortckpt and accumulate in NumPy; the same with
safetensors files) and against reading the same bytes: ``readinto()`` of every input file into
a buffer allocated and faulted in beforehand (the bound of any pass over the inputs). Each
contender runs in its own process, which times itself (peak RSS is its VmHWM), in a shuffled
order, with os.sync() between them; ratios are paired by round (medians and ranges).

    python benches/average_bench.py --count 8 --gib 1 [--repeat 2] [--out benches/out/average.md]
    python benches/average_bench.py --count 4 --gib 0.25 --external --dir /dev/shm --repeat 7  # issue 41
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
from measure import shuffled

READINTO = "readinto() of the inputs"
NUMPY = "ortckpt load + NumPy loop"

# Each body sees `paths`, `out` and `save` (the save options: the sources' layout, for the result).
CONTENDERS = {
    READINTO: """
        for name in files:
            with open(name, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
    """,
    "ortckpt.average (streamed)": """
        ortckpt.average(paths, out=out, **save)
    """,
    NUMPY: """
        acc = None
        for p in paths:
            state = CheckpointState.load_checkpoint(p)
            arrays = {n: param.data for n, param in state.parameters}
            if acc is None:
                acc = {n: a.astype(np.float64) for n, a in arrays.items()}
            else:
                for n, a in arrays.items():
                    acc[n] += a
        result = {n: (a / len(paths)).astype(np.float32) for n, a in acc.items()}
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(result), out, **save)
    """,
    "safetensors + NumPy loop": """
        acc = None
        for p in paths:
            arrays = load_file(p + ".safetensors")
            if acc is None:
                acc = {n: a.astype(np.float64) for n, a in arrays.items()}
            else:
                for n, a in arrays.items():
                    acc[n] += a
        save_file({n: (a / len(paths)).astype(np.float32) for n, a in acc.items()}, out + ".safetensors")
    """,
}

# What a contender does before its clock starts: its imports; readinto()'s buffer, allocated and faulted in.
SETUP = {
    READINTO: "buffer = memoryview(np.ones(max(os.path.getsize(f) for f in files), np.uint8)).cast('B')",
    "ortckpt.average (streamed)": "import ortckpt",
    NUMPY: "from ortckpt import CheckpointState",
    "safetensors + NumPy loop": "from safetensors.numpy import load_file, save_file",
}

RUNNER = """
import json, os, sys, time
import numpy as np
paths, out, save = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
files = [f for p in paths for f in (p, p + ".data") if os.path.exists(f)]
{setup}
start, cpu = time.perf_counter(), time.process_time()
{body}
# VmHWM, not ru_maxrss: the latter survives exec, so it would include the parent's peak.
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({{"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "peak_rss": peak}}))
"""


def make_inputs(directory: Path, count: int, nbytes: int, save: dict) -> list[str]:
    from ortckpt import CheckpointState
    from safetensors.numpy import save_file

    tensors = 16
    per = nbytes // 4 // tensors
    paths = []
    for i in range(count):
        rng = np.random.default_rng(i)
        arrays = {f"layer{j}.weight": rng.standard_normal(per, dtype=np.float32) for j in range(tensors)}
        path = directory / f"device{i}.ckpt"
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path, **save)
        save_file(arrays, f"{path}.safetensors")
        paths.append(str(path))
        del arrays
    return paths


def run(name: str, paths: list[str], out: Path, save: dict) -> dict:
    os.sync()
    code = RUNNER.format(setup=SETUP.get(name, ""), body=textwrap.dedent(CONTENDERS[name]))
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(paths), str(out), json.dumps(save)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr}")
    for leftover in (out, Path(f"{out}.data"), Path(f"{out}.safetensors")):
        leftover.unlink(missing_ok=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--gib", type=float, default=1.0, help="size of each checkpoint")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--external", action="store_true", help="checkpoints with external data (a .data file each)")
    parser.add_argument("--dir", default=None, help="where to write the inputs (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    save = {"external_data_threshold": 0} if args.external else {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        made = time.perf_counter()
        paths = make_inputs(directory, args.count, nbytes, save)
        print(f"inputs: {args.count} x {nbytes / 2**30:.2f} GiB in {time.perf_counter() - made:.0f} s", flush=True)
        results: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
        for r in range(args.repeat):
            for name in shuffled(CONTENDERS, f"average {r}"):
                results[name].append(run(name, paths, directory / "result.ckpt", save))
                print(f"  {name}: {results[name][-1]}", flush=True)
    total = args.count * nbytes / 2**30
    reads = [r["seconds"] for r in results[READINTO]]
    loops = [r["seconds"] for r in results[NUMPY]]
    layout = "external data" if args.external else "inline"
    lines = [
        f"Average of {args.count} checkpoints of {nbytes / 2**30:.2f} GiB (float32, 16 tensors each, {layout}) in "
        f"{args.dir or tempfile.gettempdir()}; {args.repeat} shuffled rounds, each contender in a fresh process; "
        "medians (ranges) over rounds, ratios paired by round; CPU s: the process's, every thread; peak RSS "
        "is the process's VmHWM.",
        "",
        "| contender | seconds | CPU s | input GiB/s | throughput vs readinto() | time vs NumPy loop | peak RSS |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        seconds = [r["seconds"] for r in runs]
        median = statistics.median(seconds)
        cpu = statistics.median(r["cpu"] for r in runs)
        rss = max(r["peak_rss"] for r in runs)
        throughput = spread([b / t for b, t in zip(reads, seconds, strict=True)])
        time_ratio = spread([t / b for t, b in zip(seconds, loops, strict=True)])
        lines.append(
            f"| {name} | {median:.3f} ({min(seconds):.3f}-{max(seconds):.3f}) | {cpu:.3f} | {total / median:.2f} | "
            f"{throughput}x "
            f"| {time_ratio}x | {rss / 2**20:,.0f} MiB |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
