"""Federated averaging of N checkpoints: ortckpt.average (streamed) against the loops people
write by hand: load each checkpoint with ortckpt and accumulate in NumPy, and the same with
safetensors files. Each contender runs in its own process (peak RSS is its VmHWM), in a
shuffled order, with os.sync() between them.

    python benches/average_bench.py --count 8 --gib 1 [--repeat 2] [--out benches/out/average.md]
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
from measure import paired_ratio, shuffled

CONTENDERS = {
    "ortckpt.average (streamed)": """
        import ortckpt
        ortckpt.average(paths, out=out)
    """,
    "ortckpt load + NumPy loop": """
        import numpy as np
        from ortckpt import CheckpointState
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
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(result), out)
    """,
    "safetensors + NumPy loop": """
        import numpy as np
        from safetensors.numpy import load_file, save_file
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

RUNNER = """
import json, sys, time
paths, out = json.loads(sys.argv[1]), sys.argv[2]
start = time.perf_counter()
{body}
# VmHWM, not ru_maxrss: the latter survives exec, so it would include the parent's peak.
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({{"seconds": time.perf_counter() - start, "peak_rss": peak}}))
"""


def make_inputs(directory: Path, count: int, nbytes: int) -> list[str]:
    from ortckpt import CheckpointState
    from safetensors.numpy import save_file

    tensors = 16
    per = nbytes // 4 // tensors
    paths = []
    for i in range(count):
        rng = np.random.default_rng(i)
        arrays = {f"layer{j}.weight": rng.standard_normal(per, dtype=np.float32) for j in range(tensors)}
        path = directory / f"device{i}.ckpt"
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)
        save_file(arrays, f"{path}.safetensors")
        paths.append(str(path))
        del arrays
    return paths


def run(name: str, paths: list[str], out: Path) -> dict:
    os.sync()
    code = RUNNER.format(body=textwrap.dedent(CONTENDERS[name]))
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(paths), str(out)], capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr}")
    for leftover in (out, Path(f"{out}.safetensors")):
        leftover.unlink(missing_ok=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--gib", type=float, default=1.0, help="size of each checkpoint")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write the inputs (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        made = time.perf_counter()
        paths = make_inputs(directory, args.count, nbytes)
        print(f"inputs: {args.count} x {nbytes / 2**30:.2f} GiB in {time.perf_counter() - made:.0f} s", flush=True)
        results: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
        for r in range(args.repeat):
            for name in shuffled(CONTENDERS, f"average {r}"):
                results[name].append(run(name, paths, directory / "result.ckpt"))
                print(f"  {name}: {results[name][-1]}", flush=True)
    total = args.count * nbytes / 2**30
    baseline = [r["seconds"] for r in results["ortckpt load + NumPy loop"]]
    lines = [
        f"Average of {args.count} checkpoints of {nbytes / 2**30:.2f} GiB (float32, 16 tensors each); medians of "
        f"{args.repeat} shuffled rounds; peak RSS is the process's VmHWM.",
        "",
        "| contender | seconds | input GiB/s | vs NumPy loop (paired) | peak RSS |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        seconds = [r["seconds"] for r in runs]
        median = statistics.median(seconds)
        rss = max(r["peak_rss"] for r in runs)
        ratio = paired_ratio(seconds, baseline)
        lines.append(f"| {name} | {median:.2f} | {total / median:.2f} | {ratio:.2f}x | {rss / 2**20:,.0f} MiB |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
