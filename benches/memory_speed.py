"""Memory speed on every path (issue 30): one workload per row of the issue's table, each against a
baseline measured in the same run, in shuffled rounds with ``os.sync()`` around every run
(``measure.time_rounds``) and reported as ``measure.paired_ratio`` (the baseline's time / this
time, per round: above 1, faster than the baseline)::

    python benches/memory_speed.py [--rounds 5] [--dir /path/on/the/disk] [--out benches/out/memory_speed.md]

Small defaults finish in a few minutes on a 2-core machine. The issue's sizes, for the record::

    python benches/memory_speed.py --mib 256 --sources 4 --counts 10,200 --source-mib 4 --tensors 16384 \\
        --save-mib 2048 --frozen-mib 1024 --trainable-mib 32 --steps 10

The rows:
  - ``average`` of --sources checkpoints of --mib MiB (float32, in /dev/shm, warm) against a plain
    ``readinto()`` of the inputs (a buffer allocated beforehand; ``read()`` into fresh memory too) and
    against the NumPy loop people write (load, sum in float64, save);
  - ``average``'s peak memory (VmHWM above the resident memory before the call, in a fresh process)
    for each of --counts sources of --source-mib MiB;
  - open + every tensor as a NumPy array for --tensors small tensors (in /dev/shm, warm) against
    safetensors' ``load_file``;
  - ``CheckpointManager.save`` against ``save_checkpoint``, both durable, --save-mib MiB in --dir;
  - ``ortckpt.verify`` of that step against ``readinto()`` of its files (and ``read()`` into fresh memory);
  - an async ``save()``: the time it blocks against a ``memcpy`` of the state into memory already
    allocated, and its time to completion against a synchronous save;
  - --steps manager steps of --frozen-mib frozen + --trainable-mib trainable (AdamW moments too),
    ``max_to_keep=4``: the disk used against one copy of the frozen bytes, and each later step's
    time against the first step's; every step written whole (``share_unchanged=False``, the
    baseline) and then sharing what is unchanged (the default). ``--only-steps``: these rows alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ortckpt
from measure import paired_ratio, report, time_rounds
from ortckpt import CheckpointManager, CheckpointState, OptimizerGroup

MiB = 2**20
# The "plain read()": into a buffer allocated beforehand, at the page cache's speed (its figures, 0.30x for
# average and 0.23x for verify, are what this baseline gives); a read() into fresh memory also pays its page faults.
READINTO = "readinto() a reused buffer"
READ = "read() into a fresh buffer"
SHM = "/dev/shm"


def float32_arrays(nbytes: int, tensors: int, seed: int) -> dict[str, np.ndarray]:
    per = max(1, nbytes // 4 // tensors)
    rng = np.random.default_rng(seed)
    return {f"layer{j}.weight": rng.standard_normal(per, dtype=np.float32) for j in range(tensors)}


def read_all(paths: list[Path]) -> int:
    """A plain ``read()`` of every file into a fresh buffer: the baseline of reading the bytes."""
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            total += len(f.read())
    return total


def read_into(paths: list[Path], buffer: memoryview) -> int:
    """``readinto()`` a buffer allocated (and faulted in) beforehand: reading at the page cache's speed, with no
    page faults of fresh memory."""
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def reused_buffer(paths: list[Path]) -> memoryview:
    buffer = np.ones(max(p.stat().st_size for p in paths) + 1, np.uint8)
    return memoryview(buffer).cast("B")


def step_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Table:
    def __init__(self) -> None:
        self.lines = [
            "| path | contender | median s | baseline | baseline median s | baseline's time / this (paired) |"
            " issue's goal (same form) |",
            "|---|---|---:|---|---:|---:|---|",
        ]

    def row(self, path: str, name: str, ts: list[float], base_name: str, base: list[float], goal: str) -> None:
        self.lines.append(
            f"| {path} | {name} | {statistics.median(ts):.4f} | {base_name} | {statistics.median(base):.4f} | "
            f"{paired_ratio(ts, base):.2f} | {goal} |"
        )


# --- average: time ------------------------------------------------------------------------------


def numpy_loop(paths: list[str], out: str) -> None:
    """The loop people write: load each with ortckpt, accumulate in float64, save."""
    acc: dict[str, np.ndarray] = {}
    for p in paths:
        state = CheckpointState.load_checkpoint(p)
        for n, param in state.parameters:
            if n in acc:
                acc[n] += param.data
            else:
                acc[n] = param.data.astype(np.float64)
    result = {n: (a / len(paths)).astype(np.float32) for n, a in acc.items()}
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(result), out)


def bench_average(args: argparse.Namespace, table: Table, shm: Path) -> None:
    paths = []
    for i in range(args.sources):
        path = shm / f"source{i}.ckpt"
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(float32_arrays(args.mib * MiB, 16, i)), path)
        paths.append(path)
    names = [str(p) for p in paths]
    out = shm / "average.ckpt"

    def removing(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            seconds = timed(fn)
            out.unlink(missing_ok=True)
            return seconds

        return run

    read_all(paths)  # warm
    buffer = reused_buffer(paths)
    times = time_rounds(
        {
            "read()": lambda: timed(lambda: read_all(paths)),
            "readinto()": lambda: timed(lambda: read_into(paths, buffer)),
            "NumPy loop": removing(lambda: numpy_loop(names, str(out))),
            "ortckpt.average": removing(lambda: ortckpt.average(names, out=out)),
        },
        args.rounds,
        "memory_speed average",
    )
    what = f"`average` of {args.sources} x {args.mib} MiB float32 (tmpfs, warm)"
    table.row(what, "ortckpt.average", times["ortckpt.average"], READINTO, times["readinto()"], ">= 0.4")
    table.row(what, "ortckpt.average", times["ortckpt.average"], READ, times["read()"], "")
    table.row(what, "ortckpt.average", times["ortckpt.average"], "NumPy loop", times["NumPy loop"], ">= 1.67")
    for p in paths:
        p.unlink()


# --- average: memory ----------------------------------------------------------------------------

PEAK_CHILD = """
import json, sys
import ortckpt

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

paths, out = json.loads(sys.argv[1]), sys.argv[2]
before = status("VmRSS")
ortckpt.average(paths, out=out)
# VmHWM, not ru_maxrss: the latter survives exec, so it would include the parent's peak.
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


def bench_average_memory(args: argparse.Namespace, shm: Path) -> list[str]:
    counts = [int(c) for c in args.counts.split(",")]
    lines = [
        "",
        f"`average` memory: {args.source_mib} MiB float32 sources (16 tensors each, tmpfs), each count in a fresh "
        "process; peak added is VmHWM minus VmRSS just before the call (after imports). Goal: independent of the "
        "number of sources.",
        "",
        "| sources | peak added MiB | peak MiB (VmHWM) |",
        "|---:|---:|---:|",
    ]
    template = shm / "memory0.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(float32_arrays(args.source_mib * MiB, 16, 0)), template)
    peaks = {}
    for count in counts:
        # The same bytes in every source (copies, so each is its own file): memory, not values, is measured.
        paths = [template] + [shm / f"memory{i}.ckpt" for i in range(1, count)]
        for p in paths[1:]:
            if not p.exists():
                shutil.copyfile(template, p)
        os.sync()
        out = shm / "memory-average.ckpt"
        done = subprocess.run(
            [sys.executable, "-c", PEAK_CHILD, json.dumps([str(p) for p in paths]), str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        out.unlink(missing_ok=True)
        if done.returncode:
            raise SystemExit(f"average of {count} failed:\n{done.stderr}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
        peaks[count] = (got["peak"] - got["before"]) / MiB
        lines.append(f"| {count} | {peaks[count]:,.0f} | {got['peak'] / MiB:,.0f} |")
    if len(counts) > 1:
        lo, hi = min(counts), max(counts)
        lines.append(
            f"\nGrowth: {(peaks[hi] - peaks[lo]) / (hi - lo):.2f} MiB per source from {lo} to {hi} sources "
            f"({args.source_mib} MiB each)."
        )
    for p in shm.glob("memory*.ckpt"):
        p.unlink()
    return lines


# --- many small tensors -------------------------------------------------------------------------


def bench_small_tensors(args: argparse.Namespace, table: Table, shm: Path) -> None:
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    per = max(1, args.tensor_bytes // 4)
    arrays = {f"block{i}.weight": rng.standard_normal(per, dtype=np.float32) for i in range(args.tensors)}
    path = shm / "small.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)
    save_file(arrays, str(shm / "small.safetensors"))
    del arrays

    def ortckpt_open() -> None:
        state = CheckpointState.load_checkpoint(path)
        _ = {n: param.data for n, param in state.parameters}

    times = time_rounds(
        {
            "safetensors load_file": lambda: timed(lambda: load_file(str(shm / "small.safetensors"))),
            "ortckpt open + every array": lambda: timed(ortckpt_open),
        },
        args.rounds,
        "memory_speed small",
    )
    table.row(
        f"open + every tensor as an array, {args.tensors} tensors of {per * 4} B (tmpfs, warm)",
        "load_checkpoint + .parameters[*].data",
        times["ortckpt open + every array"],
        "safetensors load_file",
        times["safetensors load_file"],
        ">= 2.86",
    )
    per_tensor = statistics.median(times["ortckpt open + every array"]) / args.tensors * 1e6
    table.lines.append(f"|  | (per tensor: {per_tensor:.2f} µs) |  |  |  |  |  |")
    path.unlink()
    (shm / "small.safetensors").unlink()


# --- the manager: save, verify, async -----------------------------------------------------------


def bench_manager(args: argparse.Namespace, table: Table, disk: Path) -> None:
    arrays = float32_arrays(args.save_mib * MiB, 8, 1)
    state = CheckpointState.from_arrays(arrays)
    counter = iter(range(1, 10**9))

    def plain() -> float:
        target = disk / "plain.ckpt"
        seconds = timed(lambda: CheckpointState.save_checkpoint(state, target, durable=True))
        target.unlink()
        return seconds

    def managed() -> float:
        folder = disk / f"manager{next(counter)}"
        manager = CheckpointManager(folder, max_to_keep=1)
        seconds = timed(lambda: manager.save(state, 1))
        manager.close()
        shutil.rmtree(folder)
        return seconds

    times = time_rounds(
        {"save_checkpoint(durable=True)": plain, "CheckpointManager.save": managed},
        args.rounds,
        "memory_speed manager",
    )
    table.row(
        f"`CheckpointManager.save` vs `save_checkpoint`, {args.save_mib} MiB, durable, on disk",
        "CheckpointManager.save",
        times["CheckpointManager.save"],
        "save_checkpoint(durable=True)",
        times["save_checkpoint(durable=True)"],
        ">= 0.9",
    )

    # verify of a step against read() of its bytes (both warm: the step was just written).
    manager = CheckpointManager(disk / "verify", max_to_keep=1)
    manager.save(state, 1)
    manager.close()
    folder = next(p.parent for p in (disk / "verify").rglob("metadata.json"))
    files = step_files(folder)
    read_all(files)
    buffer = reused_buffer(files)
    times = time_rounds(
        {
            "readinto()": lambda: timed(lambda: read_into(files, buffer)),
            "read()": lambda: timed(lambda: read_all(files)),
            "ortckpt.verify": lambda: timed(lambda: ortckpt.verify(folder)),
        },
        args.rounds,
        "memory_speed verify",
    )
    size = sum(p.stat().st_size for p in files) / MiB
    table.row(
        f"`verify` of a step ({size:.0f} MiB, warm) vs `read()` of its files",
        "ortckpt.verify",
        times["ortckpt.verify"],
        READINTO,
        times["readinto()"],
        ">= 0.5",
    )
    table.row(
        f"`verify` of a step ({size:.0f} MiB, warm) vs `read()` of its files",
        "ortckpt.verify",
        times["ortckpt.verify"],
        READ,
        times["read()"],
        "",
    )
    shutil.rmtree(disk / "verify")

    # async: the time save() blocks against a memcpy; its completion against a sync save.
    sources = list(arrays.values())
    targets = [np.empty_like(a) for a in sources]
    for t in targets:
        t.fill(0)  # mapped in before timing, as the manager's copy is after its first save
    async_manager = CheckpointManager(disk / "async", async_save=True, max_to_keep=1)
    sync_manager = CheckpointManager(disk / "sync", max_to_keep=1)
    async_manager.save(state, 0)  # the first save allocates the manager's copy of the state
    async_manager.wait()
    completion: list[float] = []
    steps = iter(range(1, 10**9))

    def memcpy() -> float:
        start = time.perf_counter()
        for t, a in zip(targets, sources, strict=True):
            np.copyto(t, a)
        return time.perf_counter() - start

    def asynchronous() -> float:
        start = time.perf_counter()
        async_manager.save(state, next(steps))
        blocked = time.perf_counter() - start
        async_manager.wait()
        completion.append(time.perf_counter() - start)
        return blocked

    def synchronous() -> float:
        return timed(lambda: sync_manager.save(state, next(steps)))

    times = time_rounds(
        {"memcpy": memcpy, "async save() blocks": asynchronous, "sync save": synchronous},
        args.rounds,
        "memory_speed async",
    )
    async_manager.close()
    sync_manager.close()
    what = f"async `save()`, {args.save_mib} MiB, durable, on disk"
    table.row(
        what, "save() blocks", times["async save() blocks"], "memcpy into allocated memory", times["memcpy"], ">= 0.67"
    )
    table.row(what, "save() to completion", completion, "sync save", times["sync save"], ">= 0.83")
    shutil.rmtree(disk / "async")
    shutil.rmtree(disk / "sync")


# --- steps with a large frozen part -------------------------------------------------------------


def disk_used(folder: Path) -> int:
    """Bytes allocated under ``folder``, each inode once (hard links share their blocks)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in folder.rglob("*"):
        st = p.lstat()
        if p.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def bench_steps(args: argparse.Namespace, disk: Path, *, share_unchanged: bool = True) -> list[str]:
    frozen = float32_arrays(args.frozen_mib * MiB, 16, 2)
    trainable = {f"head{k}": a for k, a in enumerate(float32_arrays(args.trainable_mib * MiB, 4, 3).values())}
    momentums = {n: {"momentum0": np.zeros_like(a), "momentum1": np.zeros_like(a)} for n, a in trainable.items()}
    state = CheckpointState.from_arrays(trainable, frozen)
    state.optimizer_groups["group0"] = OptimizerGroup(step=0, initial_learning_rate=1e-3, momentums=momentums)
    frozen_bytes = sum(a.nbytes for a in frozen.values())
    changing = 3 * sum(a.nbytes for a in trainable.values())
    folder = disk / "steps"
    manager = CheckpointManager(folder, max_to_keep=4, share_unchanged=share_unchanged)
    seconds = []
    for step in range(1, args.steps + 1):
        for n, a in trainable.items():  # a training step: the trainable part and its moments change
            np.add(a, 1.0, out=a)
            momentums[n]["momentum0"] += 0.5
            momentums[n]["momentum1"] += 0.25
        os.sync()
        seconds.append(timed(lambda step=step: manager.save(state, step)))
    manager.close()
    used = disk_used(folder)
    shutil.rmtree(folder)
    goal = frozen_bytes + 4 * changing
    later = statistics.median(seconds[1:]) if len(seconds) > 1 else float("nan")
    return [
        "",
        f"{args.steps} manager steps of {args.frozen_mib} MiB frozen + {args.trainable_mib} MiB trainable + AdamW "
        f"moments ({changing / MiB:.0f} MiB changing a step), `max_to_keep=4`, durable, on disk (one run), "
        f"`share_unchanged={share_unchanged}`{'' if share_unchanged else ' (every step written whole: the baseline)'}:",
        "",
        "| measure | value | issue's goal |",
        "|---|---:|---|",
        f"| disk used / one copy of the frozen bytes | {used / frozen_bytes:.2f}x | see the next row |",
        f"| disk used / (frozen + 4 x changing bytes) | {used / goal:.2f}x | <= 1.25x |",
        f"| step 1 s | {seconds[0]:.3f} |  |",
        f"| steps 2-{args.steps} median s (range) | {later:.3f} ({min(seconds[1:]):.3f}-{max(seconds[1:]):.3f}) |  |",
        f"| steps 2-{args.steps} median / step 1 | {later / seconds[0]:.2f}x | <= 0.25x |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64, help="size of each source of the timed average")
    parser.add_argument("--sources", type=int, default=4, help="sources of the timed average")
    parser.add_argument("--counts", default="10,100", help="source counts of the memory row")
    parser.add_argument("--source-mib", type=int, default=1, help="size of each source of the memory row")
    parser.add_argument("--tensors", type=int, default=16384, help="tensors of the many-small row")
    parser.add_argument("--tensor-bytes", type=int, default=256, help="bytes of each of those tensors")
    parser.add_argument("--save-mib", type=int, default=256, help="state of the save, verify and async rows")
    parser.add_argument("--frozen-mib", type=int, default=256)
    parser.add_argument("--trainable-mib", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk rows write (default: a temporary dir)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here (markdown)")
    parser.add_argument("--only-steps", action="store_true", help="only the manager steps rows (both ways)")
    args = parser.parse_args()

    shm = Path(tempfile.mkdtemp(prefix="ortckpt-memspeed-", dir=SHM))
    disk = Path(tempfile.mkdtemp(prefix="ortckpt-memspeed-", dir=args.dir))
    table = Table()
    memory: list[str] = []
    try:
        if not args.only_steps:
            bench_average(args, table, shm)
            bench_small_tensors(args, table, shm)
            bench_manager(args, table, disk)
            memory = bench_average_memory(args, shm)
        steps = bench_steps(args, disk, share_unchanged=False) + bench_steps(args, disk)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    header = [
        "# Memory speed on every path (issue 30)",
        "",
        f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores; "
        f"`python benches/memory_speed.py {' '.join(sys.argv[1:])}`; {args.rounds} shuffled rounds with os.sync() "
        "around every run. The ratio: median over rounds of (the baseline's time / this time), above 1 faster than "
        "the baseline; the goal column is the issue's goal in the same form.",
        "",
    ]
    report(header + table.lines + memory + steps, args.out)


if __name__ == "__main__":
    main()
