"""The benchmark suite (`make bench`): ortckpt against same-run baselines and its peers.

For each workload (a model shape, a size, a dtype) every contender saves the same
tensors to a new file and loads them back, in rounds whose order is shuffled, so the
disk's swings hit everyone alike. Results are medians with their spread, and ratios
to the baselines measured in the same round: plain write() of the same bytes, plain
read() into a fresh buffer, and memcpy. Peak RSS is measured in a fresh interpreter
per contender (ru_maxrss growth during the operation).

Writes benches/out/results.{json,md} and benches/out/throughput.png.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import ortckpt
import pure_python_saver
from measure import median_seconds, paired_ratio, peak_mib, shuffled, xor_all
from ortckpt import CheckpointState, OptimizerGroup

HERE = Path(__file__).resolve().parent

GiB = 2**30
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


# --- workloads -----------------------------------------------------------------------------------


@dataclass
class Workload:
    shape: str
    gib: float
    dtype: str
    trainable: dict[str, np.ndarray] = field(default_factory=dict)
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    momentums: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.shape} {self.gib:g} GiB {self.dtype}"

    def arrays(self) -> dict[str, np.ndarray]:
        """Every tensor under a unique name (what peers without optimizer state are given)."""
        out = {**self.trainable, **self.frozen}
        for param, moms in self.momentums.items():
            out.update({f"{param}.{m}": a for m, a in moms.items()})
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())

    def state(self) -> CheckpointState:
        state = CheckpointState.from_arrays(self.trainable, self.frozen, {"epoch": 3})
        if self.momentums:
            state.optimizer_groups["group0"] = OptimizerGroup(
                step=100, initial_learning_rate=1e-3, momentums=self.momentums
            )
        return state


def make_workload(shape: str, gib: float, dtype_name: str) -> Workload:
    """Tensors are views into one buffer of random bytes (valid values of every dtype we use)."""
    dtype = DTYPES[dtype_name]
    total = int(gib * GiB) // 4096 * 4096
    block = np.random.default_rng(0).standard_normal(2**18).astype(np.float32).view(np.uint8)  # 1 MiB
    pool = np.resize(block, total)
    if dtype == DTYPES["bfloat16"]:  # keep the bytes valid bfloat16 too
        pool = pool.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint8)
        pool = np.resize(pool, total)
    pool = pool.view(dtype)
    work = Workload(shape, gib, dtype_name)
    at = 0

    def take(count: int, dims: tuple[int, ...]) -> np.ndarray:
        nonlocal at
        array = pool[at : at + count].reshape(dims)
        at += count
        return array

    elements = total // dtype.itemsize
    if shape == "many-small":  # 64 KiB tensors
        per = 64 * 1024 // dtype.itemsize
        for i in range(elements // per):
            work.trainable[f"block{i // 8}.w{i % 8}"] = take(per, (per // 64, 64))
    elif shape == "huge":  # four large tensors
        rows = elements // 4 // 4096
        for i in range(4):
            work.trainable[f"huge{i}"] = take(rows * 4096, (rows, 4096))
    elif shape == "transformer":  # a third parameters (a frozen embedding among them), two thirds AdamW
        params = elements // 3
        width = 1024  # smaller for small smoke-test sizes, so that a few layers fit
        while width > 64 and 2 * 12 * width * width > params * 4 // 5:
            width //= 2
        embed = params // 5 // width * width
        work.frozen["embed.weight"] = take(embed, (embed // width, width))
        left, layer = params - embed, 0
        sizes = [
            ("attn.qkv", 3 * width * width),
            ("attn.o", width * width),
            ("mlp.up", 4 * width * width),
            ("mlp.down", 4 * width * width),
            ("norm.w", width),
            ("norm.b", width),
        ]
        while left >= sum(s for _, s in sizes):
            for name, size in sizes:
                work.trainable[f"layers.{layer}.{name}"] = take(
                    size, (size // width, width) if size > width else (size,)
                )
                left -= size
            layer += 1
        for name, array in work.trainable.items():
            work.momentums[name] = {
                "momentum0": take(array.size, array.shape),
                "momentum1": take(array.size, array.shape),
            }
    else:
        raise ValueError(shape)
    return work


# --- contenders -------------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_write(work: Workload, path: Path, durable: bool = False) -> None:
    with open(path, "wb") as f:
        for a in work.arrays().values():
            f.write(memoryview(a.reshape(-1).view(np.uint8)))
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if durable:
        fsync_dir(path)


def plain_read(path: Path) -> None:
    buf = np.empty(path.stat().st_size, np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(buf))
    xor_all([buf])


def plain_mmap(path: Path) -> None:
    """The fair peer of a mapped load: the same bytes, mapped and read once, no decoding (a plain
    read() pays a fresh buffer's page faults and a copy that a mapping never does)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, np.uint8)
        xor_all([view])
        del view


def ortckpt_load(path: Path) -> None:
    state = CheckpointState.load_checkpoint(path)
    tensors = [p.data for _, p in state.parameters]
    tensors += [m for g in state.optimizer_groups.values() for ms in g.momentums.values() for m in ms.values()]
    xor_all(tensors)


def have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def savers(
    work: Workload,
    state: CheckpointState,
    ort_python: str | None,
    pure_python: bool,
    ort_protos: bool,
    torch_python: str | None,
):
    """name -> fn(path) that saves the workload there and returns the seconds it took."""
    out: dict[str, Callable[[Path], float | None]] = {}

    def timed(fn):
        def run(path):
            start = time.perf_counter()
            fn(path)
            return time.perf_counter() - start

        return run

    out["write() (baseline)"] = timed(lambda p: plain_write(work, p))
    out["write()+fsync (baseline)"] = timed(lambda p: plain_write(work, p, durable=True))
    out["ortckpt"] = timed(lambda p: CheckpointState.save_checkpoint(state, p, include_optimizer_state=True))
    out["ortckpt durable"] = timed(
        lambda p: CheckpointState.save_checkpoint(state, p, include_optimizer_state=True, durable=True)
    )
    if have("safetensors"):
        from safetensors.numpy import save_file

        out["safetensors"] = timed(lambda p: save_file(work.arrays(), str(p)))

    def savez(path):
        with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a name
            np.savez(f, **work.arrays())

    out["numpy savez"] = timed(savez)
    if pure_python:
        out["pure-Python flatbuffers"] = timed(
            lambda p: pure_python_saver.save(
                str(p), work.trainable, work.frozen, work.momentums, 100, 1e-3, {"epoch": 3}
            )
        )
    if ort_python and work.dtype == "float32":  # ONNX Runtime 1.19.2 cannot load bfloat16
        out["ONNX Runtime state path"] = lambda p: ort_state_save(ort_python, state, p)
        if ort_protos:
            out["ONNX Runtime TensorProto path"] = lambda p: ort_protos_save(ort_python, work, p)
    if torch_python:
        out["torch.save"] = lambda p: torch_save(torch_python, work, p)
    return out


PEER_RSS: dict[str, float] = {}  # peak RSS growth that peers timed in a subprocess report


def peer_run(python: str, script: str, *args) -> dict:
    done = subprocess.run([python, str(HERE / script), *map(str, args)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def ort_run(ort_python: str, *args) -> dict:
    return peer_run(ort_python, "ort_bench.py", *args)


def raw_with_manifest(work: Workload, path: Path) -> tuple[Path, Path]:
    """The workload's bytes in one file and a JSON of where each tensor lies in it: how a peer
    in another virtualenv gets the same tensors."""
    raw, manifest = path.with_name("peer_raw.bin"), path.with_name("peer_manifest.json")
    plain_write(work, raw)
    layout, at = [], 0
    trainable = set(work.trainable) | {f"{p}.{m}" for p, ms in work.momentums.items() for m in ms}
    for name, a in work.arrays().items():
        layout.append(
            {
                "name": name,
                "offset": at,
                "nbytes": a.nbytes,
                "dtype": str(a.dtype),
                "shape": list(a.shape),
                "trainable": name in trainable,
            }
        )
        at += a.nbytes
    manifest.write_text(json.dumps({"parameters": layout}))
    return raw, manifest


def ort_state_save(ort_python: str, state: CheckpointState, path: Path) -> float:
    src = path.with_name("ort_source.ckpt")
    CheckpointState.save_checkpoint(state, src, include_optimizer_state=True)
    try:
        result = ort_run(ort_python, "state_save", src, path)
    finally:
        for f in (src, Path(f"{src}.data")):
            f.unlink(missing_ok=True)
    PEER_RSS["ONNX Runtime state path"] = result["peak_growth_mib"]
    return result["seconds"]


def ort_protos_save(ort_python: str, work: Workload, path: Path) -> float:
    raw, manifest = raw_with_manifest(work, path)
    try:
        result = ort_run(ort_python, "protos_save", raw, manifest, path)
    finally:
        raw.unlink(missing_ok=True)
        manifest.unlink(missing_ok=True)
    PEER_RSS["ONNX Runtime TensorProto path"] = result["peak_growth_mib"]
    return result["seconds"]


def torch_save(torch_python: str, work: Workload, path: Path) -> float:
    raw, manifest = raw_with_manifest(work, path)
    try:
        result = peer_run(torch_python, "torch_bench.py", "save", raw, manifest, path)
    finally:
        raw.unlink(missing_ok=True)
        manifest.unlink(missing_ok=True)
    PEER_RSS["torch.save"] = result["peak_growth_mib"]
    return result["seconds"]


Loader = Callable[[Path], "float | None"]  # reads every byte; returns its own timing when it measured one


def loaders(ort_python: str | None, torch_python: str | None) -> dict[str, list[tuple[str, Loader]]]:
    """saver name -> [(loader name, fn(the file that saver wrote))]."""
    out: dict[str, list[tuple[str, Loader]]] = {
        "write() (baseline)": [("read() (baseline)", plain_read), ("mmap (baseline)", plain_mmap)],
        "ortckpt": [("ortckpt", ortckpt_load)],
    }
    if have("safetensors"):
        from safetensors.numpy import load_file

        out["safetensors"] = [("safetensors", lambda p: xor_all(load_file(str(p)).values()))]
    out["numpy savez"] = [("numpy load", lambda p: xor_all(v for _, v in np.load(p).items()))]
    if ort_python:  # ONNX Runtime loading the file it wrote itself
        out["ONNX Runtime state path"] = [("ONNX Runtime", lambda p: ort_run(ort_python, "load", p)["seconds"])]
    if torch_python:
        out["torch.save"] = [
            ("torch.load", lambda p: peer_run(torch_python, "torch_bench.py", "load", p)["seconds"]),
            ("torch.load mmap=True", lambda p: peer_run(torch_python, "torch_bench.py", "load", p, "mmap")["seconds"]),
        ]
    return out


def open_latency(work: Workload, name: str, path: Path, torch_python: str | None) -> tuple[float, float]:
    """Seconds to open, and to open and read the first tensor: medians of 5."""

    first = next(iter(sorted(work.trainable)))
    if name == "ortckpt":
        return (
            median_seconds(lambda: CheckpointState.load_checkpoint(path)),
            median_seconds(lambda: xor_all([CheckpointState.load_checkpoint(path).parameters[first].data])),
        )
    if name == "torch.save":
        result = peer_run(torch_python, "torch_bench.py", "open", path, first)
        return result["open_seconds"], result["first_seconds"]
    from safetensors import safe_open

    def st_open():
        with safe_open(str(path), "np"):
            pass

    def st_first():
        with safe_open(str(path), "np") as f:
            xor_all([f.get_tensor(first)])

    return median_seconds(st_open), median_seconds(st_first)


# --- peak memory, in a fresh interpreter ----------------------------------------------------------------


def child_peak(args) -> None:
    """Runs one operation after building the workload; prints peak RSS growth in MiB."""
    work = make_workload(args.shape, args.gib, args.dtype)
    state = work.state()
    path = Path(args.path)
    if args.child == "load":
        CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
        del state, work
        gc.collect()
    before = peak_mib()
    if args.child == "save":
        CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    else:
        ortckpt_load(path)
    print(json.dumps({"growth_mib": peak_mib() - before}))


def peak_growth(work: Workload, op: str, directory: Path) -> float:
    path = directory / f"peak_{op}.ckpt"
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            op,
            "--shape",
            work.shape,
            "--gib",
            str(work.gib),
            "--dtype",
            work.dtype,
            "--path",
            str(path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    for f in (path, Path(f"{path}.data")):
        f.unlink(missing_ok=True)
    return json.loads(done.stdout)["growth_mib"]


# --- running and reporting ---------------------------------------------------------------------------------


def clear(directory: Path) -> None:
    for f in directory.iterdir():
        f.unlink()
    os.sync()


def run_workload(
    work: Workload,
    directory: Path,
    rounds: int,
    ort_python: str | None,
    pure_python: bool,
    ort_protos: bool,
    torch_python: str | None,
) -> dict:
    """Each round, in a shuffled order, each contender saves, the matching loader reads that file
    back, and the file is deleted: one checkpoint's worth of page cache at a time, so no
    contender pays for another's dirty pages."""
    state = work.state()
    save_fns = savers(work, state, ort_python, pure_python, ort_protos, torch_python)
    load_fns = loaders(ort_python, torch_python)
    arrays = list(work.arrays().values())
    save_times: dict[str, list[float]] = {k: [] for k in save_fns}
    load_times: dict[str, list[float]] = {"memcpy (baseline)": []}
    sizes: dict[str, int] = {}
    latency: dict[str, tuple[float, float]] = {}
    failed: dict[str, str] = {}  # contenders that cannot handle this workload (e.g. a dtype), and why

    def attempt(name: str, fn):
        try:
            return fn()
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:120]}"
            return None

    for r in range(rounds):
        clear(directory)
        names = shuffled((n for n in save_fns if n not in failed), f"{work.name} {r}")
        for name in names:
            path = directory / name.replace(" ", "_").replace("/", "_").replace("(", "").replace(")", "")
            seconds = attempt(name, lambda name=name, path=path: save_fns[name](path))
            if seconds is None:
                save_times.pop(name, None)
                continue
            os.sync()  # written back before anything else runs
            save_times[name].append(seconds)
            sizes[name] = sum(f.stat().st_size for f in directory.iterdir() if f.name.startswith(path.name))
            for load_name, load in load_fns.get(name, []):
                if f"load: {load_name}" in failed:
                    continue
                start = time.perf_counter()
                reported = attempt(f"load: {load_name}", lambda load=load, path=path: load(path))
                seconds = reported if isinstance(reported, float) else time.perf_counter() - start
                if f"load: {load_name}" not in failed:
                    load_times.setdefault(load_name, []).append(seconds)
            if r == rounds - 1 and name in ("ortckpt", "safetensors", "torch.save"):
                latency[name] = attempt(
                    f"open: {name}", lambda name=name, path=path: open_latency(work, name, path, torch_python)
                )
            clear(directory)
        start = time.perf_counter()
        for a in arrays:
            np.copyto(np.empty_like(a), a)
        load_times["memcpy (baseline)"].append(time.perf_counter() - start)
    peaks = {"ortckpt save": peak_growth(work, "save", directory), "ortckpt load": peak_growth(work, "load", directory)}
    peaks.update({f"{k} save": v for k, v in PEER_RSS.items()})
    return {
        "workload": work.name,
        "tensors": len(work.arrays()),
        "bytes": work.nbytes,
        "save": save_times,
        "load": load_times,
        "file_bytes": sizes,
        "open": latency,
        "peak_growth_mib": peaks,
        "failed": failed,
    }


def summary(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "gib_s": nbytes / GiB / med}


def report(results: list[dict], meta: dict, out: Path) -> str:
    lines = [
        "# ortckpt benchmark results\n",
        f"{meta['date']}, {meta['machine']}; `{meta['command']}`; medians of {meta['rounds']} rounds "
        f"({meta['method']}; new files, page cache); ratios are medians of per-round ratios to the "
        "baseline measured in the same round.\n",
    ]
    lines += goals_table(results)
    for r in results:
        n = r["bytes"]
        lines.append(f"\n## {r['workload']} ({r['tensors']} tensors, {n / GiB:.2f} GiB)\n")
        lines.append("| save | median s | range s | GiB/s | vs write() | peak RSS growth MiB |")
        lines.append("|---|---|---|---|---|---|")
        base = r["save"]["write() (baseline)"]
        for name, times in r["save"].items():
            s = summary(times, n)
            peak = r["peak_growth_mib"].get(f"{name} save", "")
            peak = f"{peak:.0f}" if isinstance(peak, float) else ""
            lines.append(
                f"| {name} | {s['median_s']:.3f} | {s['min_s']:.3f}-{s['max_s']:.3f} | {s['gib_s']:.2f} | "
                f"{paired_ratio(times, base):.2f} | {peak} |"
            )
        lines.append(
            "\n| eager load (every byte read) | median s | range s | GiB/s | vs read() | vs mmap | vs memcpy |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        rbase, mbase = r["load"]["read() (baseline)"], r["load"]["memcpy (baseline)"]
        mapped = r["load"]["mmap (baseline)"]
        for name, times in r["load"].items():
            s = summary(times, n)
            lines.append(
                f"| {name} | {s['median_s']:.3f} | {s['min_s']:.3f}-{s['max_s']:.3f} | {s['gib_s']:.2f} | "
                f"{paired_ratio(times, rbase):.2f} | {paired_ratio(times, mapped):.2f} | "
                f"{paired_ratio(times, mbase):.2f} |"
            )
        lines.append("\n| open | lazy open ms | open + first tensor ms |")
        lines.append("|---|---|---|")
        for opened, (lazy, first) in ((n, t) for n, t in r["open"].items() if t):
            shown = {"torch.save": "torch.load mmap=True"}.get(opened, opened)
            lines.append(f"| {shown} | {lazy * 1e3:.2f} | {first * 1e3:.2f} |")
        ort = r["load"].get("ONNX Runtime")
        if ort:
            lines.append(
                f"\nONNX Runtime's load_checkpoint (eager, it has no lazy open): median "
                f"{statistics.median(ort) * 1e3:.0f} ms including reading every parameter."
            )
        for name, why in r["failed"].items():
            lines.append(f"\n{name}: could not run this workload ({why}).")
        lines.append(
            f"\nPeak RSS growth, ortckpt: save {r['peak_growth_mib']['ortckpt save']:.1f} MiB, "
            f"load (every byte read) {r['peak_growth_mib']['ortckpt load']:.1f} MiB."
        )
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, out / "throughput.png")
    return text


def goals_table(results: list[dict]) -> list[str]:
    """One row per workload: where ortckpt stands against each of the suite's goals."""
    peers = (
        "safetensors",
        "numpy savez",
        "pure-Python flatbuffers",
        "ONNX Runtime state path",
        "ONNX Runtime TensorProto path",
        "torch.save",
    )
    lines = [
        "\n## Summary\n",
        "| workload | tensors | ortckpt save GiB/s | save vs write() | vs fastest peer | x ONNX Runtime's saver "
        "| durable vs write()+fsync | eager load GiB/s | load vs read() | load vs mmap | x safetensors load "
        "| lazy open ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        save, load, n = r["save"], r["load"], r["bytes"]
        ours = save["ortckpt"]
        ran = [p for p in peers if p in save]
        fastest = min(ran, key=lambda p: statistics.median(save[p])) if ran else None
        vs_peer = f"{paired_ratio(ours, save[fastest]):.2f} ({fastest})" if fastest else "n/a"
        ort = save.get("ONNX Runtime state path")
        why = r["failed"].get("ONNX Runtime state path", "")
        x_ort = (
            f"{paired_ratio(ours, ort):.1f}" if ort else ("fails (2 GiB)" if "2GB" in why or "addOb" in why else "n/a")
        )
        safetensors_load = load.get("safetensors")
        x_st = f"{paired_ratio(load['ortckpt'], safetensors_load):.2f}" if safetensors_load else "n/a"
        lines.append(
            f"| {r['workload']} | {r['tensors']} | {summary(ours, n)['gib_s']:.2f} "
            f"| {paired_ratio(ours, save['write() (baseline)']):.2f} | {vs_peer} | {x_ort} "
            f"| {paired_ratio(save['ortckpt durable'], save['write()+fsync (baseline)']):.2f} "
            f"| {summary(load['ortckpt'], n)['gib_s']:.2f} "
            f"| {paired_ratio(load['ortckpt'], load['read() (baseline)']):.2f} "
            f"| {paired_ratio(load['ortckpt'], load['mmap (baseline)']):.2f} "
            f"| {x_st} | {r['open']['ortckpt'][0] * 1e3:.2f} |"
        )
    lines.append(
        "\nRatios are medians over rounds of (other's time / ortckpt's time) within the same round: above 1, "
        "ortckpt is faster. Goals: save >= 0.9x write() and ahead of every peer, >= 3x ONNX Runtime's saver; "
        "durable <= write()+fsync (ratio >= 1); eager load >= 0.9x read() and >= 2x safetensors; "
        "a mapped file read once (mmap) is the fair bound of a zero-copy load."
    )
    return lines


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(2, 1, figsize=(15, 9))
    for ax, kind, title in ((axes[0], "save", "save throughput"), (axes[1], "load", "eager load throughput")):
        names = sorted({n for r in results for n in r[kind]}, key=lambda n: (n != "ortckpt", n))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs, ys, errs = [], [], []
            for j, r in enumerate(results):
                if name in r[kind]:
                    s = summary(r[kind][name], r["bytes"])
                    xs.append(j + i * width)
                    ys.append(s["gib_s"])
                    errs.append(
                        [[s["gib_s"] - r["bytes"] / GiB / s["max_s"]], [r["bytes"] / GiB / s["min_s"] - s["gib_s"]]]
                    )
            err = np.array(errs).reshape(len(errs), 2).T if errs else None
            ax.bar(xs, ys, width, yerr=err, label=name, capsize=2)
        labels = [r["workload"].replace(" GiB ", " GiB\n") for r in results]
        ax.set_xticks([j + 0.4 for j in range(len(results))], labels, fontsize=7)
        ax.set_ylabel("GiB/s (median, range)")
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description="ortckpt benchmark suite")
    parser.add_argument("--shapes", default="many-small,transformer,huge")
    parser.add_argument("--sizes", default="1,4", help="GiB, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where files go (default: a temp dir on /tmp)")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--ort-python", default=os.environ.get("ORTCKPT_ORT_PYTHON"))
    parser.add_argument(
        "--torch-python",
        default=os.environ.get("ORTCKPT_TORCH_PYTHON"),
        help="an interpreter with torch installed (torch.save/torch.load are timed through it)",
    )
    parser.add_argument(
        "--pure-python-max-gib",
        type=float,
        default=1.0,
        help="the pure-Python saver only up to here (slow, and its builder stops at 2 GiB)",
    )
    parser.add_argument(
        "--ort-protos-max-gib",
        type=float,
        default=2.0,
        help="ONNX Runtime's TensorProto path only up to here (it holds about 4 copies in RAM)",
    )
    parser.add_argument("--child", choices=["save", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--gib", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite results.md and the plot from the results.json in --out, measuring nothing",
    )
    args = parser.parse_args()
    if args.child:
        return child_peak(args)
    if args.report_only:
        saved = json.loads((args.out / "results.json").read_text())
        print(report(saved["results"], saved["meta"], args.out))
        return None

    ort_python = args.ort_python if args.ort_python and Path(args.ort_python).exists() else None
    torch_python = args.torch_python if args.torch_python and Path(args.torch_python).exists() else None
    args.out.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="ortckpt-bench-", dir=args.dir))
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM, {platform.system()}",
        "command": "python benches/suite.py " + " ".join(sys.argv[1:]),
        "rounds": args.rounds,
        "method": "per round, in a shuffled order: save, os.sync(), read that file back, delete it",
        "ortckpt": ortckpt.__version__,
        "peers": {"safetensors": have("safetensors"), "torch": bool(torch_python), "onnxruntime": bool(ort_python)},
    }
    results = []
    try:
        for gib in (float(s) for s in args.sizes.split(",")):
            for shape in args.shapes.split(","):
                for dtype in args.dtypes.split(","):
                    work = make_workload(shape, gib, dtype)
                    print(f"{work.name}: {len(work.arrays())} tensors", file=sys.stderr, flush=True)
                    PEER_RSS.clear()
                    results.append(
                        run_workload(
                            work,
                            directory,
                            args.rounds,
                            ort_python,
                            pure_python=gib <= args.pure_python_max_gib,
                            ort_protos=gib <= args.ort_protos_max_gib,
                            torch_python=torch_python,
                        )
                    )
                    del work
                    gc.collect()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(report(results, meta, args.out))


if __name__ == "__main__":
    main()
