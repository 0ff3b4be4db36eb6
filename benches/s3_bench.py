"""Checkpoints to and from S3: ortckpt's streamed save and its loads against boto3's
``upload_file``/``download_file`` of the same bytes (the baseline) and against saving locally
then uploading, on a local S3 server (SeaweedFS ``weed mini``, started here, its data on disk).

Each contender runs in a fresh child process, which builds the arrays, then measures its own
seconds and its peak memory (VmHWM) above what it held when it started timing: the child processes share
nothing. Shuffled rounds, ``os.sync()`` between contenders, ratios paired by round.

    python benches/s3_bench.py --sizes 1 4 --rounds 3 --out benches/out/s3.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "python" / "helpers"))  # the tests' S3 server, shared

from measure import current_mib, paired_ratio, report, shuffled  # noqa: E402

TENSORS = 16


def arrays(gib: float) -> dict[str, np.ndarray]:
    per = int(gib * 2**30) // TENSORS // 4
    rng = np.random.default_rng(0)
    block = rng.standard_normal(1 << 20, dtype=np.float32)
    return {f"layer{i}.weight": np.resize(block + i, per) for i in range(TENSORS)}


def peak_bytes() -> int:
    """This process's peak resident memory (VmHWM): unlike ru_maxrss, which a child inherits from
    the parent it was forked from, it starts afresh at exec."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def resident_bytes() -> int:
    return int(current_mib() * 2**20)


# --- what one child process does -----------------------------------------------------------------


def child(op: str, gib: float, url: str, options: dict, scratch: str) -> dict:
    import boto3
    import ortckpt
    from ortckpt import object_store, targets

    bucket, _, key = url[len("s3://") :].partition("/")
    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        aws_access_key_id=options["access_key_id"],
        aws_secret_access_key=options["secret_access_key"],
        region_name="us-east-1",
    )
    local = Path(scratch) / "ckpt"
    state = ortckpt.CheckpointState.from_arrays(arrays(gib)) if op.startswith("save") else None
    if op == "save: boto3 upload_file":  # the checkpoint's bytes, written beforehand (not timed)
        assert state is not None
        ortckpt.save_checkpoint(state, local)
    before = resident_bytes()  # now, not the peak so far (boto3's import peaks higher, then frees)
    start = time.perf_counter()
    touched = 0
    if op == "save: boto3 upload_file":
        for path in sorted(Path(scratch).iterdir()):
            client.upload_file(str(path), bucket, key + path.name[len("ckpt") :])
    elif op == "save: ortckpt to s3://":
        ortckpt.save_checkpoint(state, url, storage_options=options)
    elif op == "save: ortckpt CheckpointManager on s3:// (SHA-256s, conditional commit)":
        with ortckpt.CheckpointManager(url, storage_options=options) as manager:
            manager.save(state, 1)
    elif op == "save: ortckpt locally, then upload_file":
        ortckpt.save_checkpoint(state, local)
        for path in sorted(Path(scratch).iterdir()):
            client.upload_file(str(path), bucket, key + path.name[len("ckpt") :])
    elif op == "load: boto3 download_file":
        for suffix in ("", ".data"):
            if object_store.head(targets.object_location(url + suffix, options)) is not None:
                client.download_file(bucket, key + suffix, str(local) + suffix)
    elif op.startswith("load: ortckpt"):
        lazy = "lazy" in op
        state = ortckpt.load_checkpoint(url, storage_options=options, lazy=lazy)
        names = state.parameters.names()
        for name in names[:1] if "one tensor" in op else names:
            touched += int(np.asarray(state.parameters[name].data).view(np.uint8)[-1])
    else:
        raise ValueError(op)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "added": max(0, peak_bytes() - before)}


def run_child(op: str, gib: float, url: str, options: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="ortckpt-s3-bench-", dir=os.environ.get("BENCH_DIR")) as scratch:
        done = subprocess.run(
            [sys.executable, __file__, "--child", op, str(gib), url, json.dumps(options), scratch],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the bench -----------------------------------------------------------------------------------

SAVES = [
    "save: boto3 upload_file",
    "save: ortckpt to s3://",
    "save: ortckpt CheckpointManager on s3:// (SHA-256s, conditional commit)",
    "save: ortckpt locally, then upload_file",
]
LOADS = [
    "load: boto3 download_file",
    "load: ortckpt, downloaded (lazy=False), every tensor read",
    "load: ortckpt, lazy, every tensor read",
    "load: ortckpt, lazy, one tensor read",
]


def bench(server, gib: float, rounds: int) -> list[str]:
    import ortckpt
    from ortckpt import object_store, targets

    options = server.storage_options()
    url = f"s3://ckpt/bench-{gib}"
    # The object the loads read: ortckpt's own save (external data above 1800 MiB, as ONNX Runtime's).
    ortckpt.save_checkpoint(ortckpt.CheckpointState.from_arrays(arrays(gib)), url, storage_options=options)
    layout = "external data" if object_store.head(targets.object_location(url + ".data", options)) else "inline"
    results: dict[str, list[dict]] = {op: [] for op in SAVES + LOADS}
    for r in range(rounds):
        for op in shuffled(SAVES + LOADS, f"s3 {gib} {r}"):
            # A key of its own per save (on SeaweedFS, a key once a folder of the manager's
            # objects stays a folder: a later object of that name fails to complete).
            target = url if op.startswith("load") else f"s3://ckpt/bench-save-{gib}-{r}-{SAVES.index(op)}"
            os.sync()
            results[op].append(run_child(op, gib, target, options))
            if op.startswith("save"):  # the object and its data object, or the manager's prefix
                location = targets.object_location(target, options)
                under = [location.child(key) for key, _ in object_store.list_keys(location)]
                object_store.remove([location, location.sibling(".data"), *under])
            os.sync()
            print(f"{gib} GiB round {r}: {op}: {results[op][-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    lines = [f"### {gib:g} GiB ({TENSORS} float32 tensors; the checkpoint has {layout}), {rounds} rounds", ""]
    lines += ["| | median s | GiB/s | baseline's time / this (paired) | peak memory added, MiB (max) |"]
    lines += ["|---|---:|---:|---:|---:|"]
    for group in (SAVES, LOADS):
        base = [x["seconds"] for x in results[group[0]]]
        for op in group:
            ts = [x["seconds"] for x in results[op]]
            added = max(x["added"] for x in results[op]) / 2**20
            label = f"{op} (baseline)" if op == group[0] else op
            lines.append(
                f"| {label} | {statistics.median(ts):.2f} | {gib / statistics.median(ts):.2f} | "
                f"{paired_ratio(ts, base):.2f} | {added:.0f} |"
            )
    object_store.remove([targets.object_location(url, options), targets.object_location(url + ".data", options)])
    return [*lines, ""]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        op, gib, url, options, scratch = sys.argv[2:7]
        print(json.dumps(child(op, float(gib), url, json.loads(options), scratch)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4], help="GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from s3_server import S3Server

    server = S3Server()
    try:
        lines = ["## Checkpoints to and from S3 (benches/s3_bench.py)", ""]
        for gib in args.sizes:
            lines += bench(server, gib, args.rounds)
    finally:
        server.stop(keep_data=False)
    report(lines, args.out)


if __name__ == "__main__":
    main()
