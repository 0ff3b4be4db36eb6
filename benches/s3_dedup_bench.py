"""Steps of a mostly frozen model on ``s3://`` (issue 41, item 6): the bytes each step uploads,
and its time, when steps share their unchanged values (a checkpoint object reading the rest from
a data object of the run's shared folder: ``ortckpt.stepstore.shared``) against the same steps
each uploaded whole (the baseline: ``SHARE_MIN_BYTES`` past the model, as every step went before),
to a local S3 server (SeaweedFS ``weed mini``, started here, its data on disk).

A frozen part, a trainable part and its AdamW moments (both changed at every step), ``--steps``
manager saves keeping 2. Bytes are counted where the store PUTs them (``object_store.bytes_put``,
documents included); the contenders alternate in shuffled order each round, ``os.sync()`` between.
``resumed``: the shared steps, their writer replaced half way by a new manager (a resumed process:
no digests of its own) that restores the latest step first, as after a preemption; its restore is
timed against a reader's restore of the same step (what the writer's hashing of the values costs).
``--ranks N`` (N > 1): sharded manager steps instead (``comm=``, ranks as threads of this process,
each holding 1/N of every part as tensors of its own), shared against whole; the bytes are every
rank's together, counted by rank 0 from before its save to after it (a rank uploads only once rank 0
entered the save, and rank 0's save returns once every rank's upload is done).

    python benches/s3_dedup_bench.py --frozen-mib 1024 --trainable-mib 32 --steps 10 --rounds 2
    python benches/s3_dedup_bench.py --frozen-mib 256 --trainable-mib 8 --steps 6 --rounds 1 --ranks 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "python" / "helpers"))  # the tests' S3 server, shared

from measure import report, shuffled  # noqa: E402

MiB = 1 << 20


def model(frozen_mib: int, trainable_mib: int, ranks: int = 1, rank: int = 0) -> tuple[object, dict, dict]:
    """The state (of ``rank``'s share of every part, as tensors of its own, when ``ranks`` > 1)."""
    from ortckpt import CheckpointState, OptimizerGroup

    rng = np.random.default_rng(rank)
    size = frozen_mib * MiB // 16 // 4 // ranks
    frozen = {f"layer{i}.weight.{rank}": rng.standard_normal(size, dtype=np.float32) for i in range(16)}
    per = trainable_mib * MiB // 4 // 4 // ranks
    trainable = {f"head{i}.weight.{rank}": rng.standard_normal(per, dtype=np.float32) for i in range(4)}
    momentums = {n: {"momentum0": np.zeros_like(a), "momentum1": np.zeros_like(a)} for n, a in trainable.items()}
    state = CheckpointState.from_arrays(trainable, frozen)
    state.optimizer_groups["group0"] = OptimizerGroup(step=0, initial_learning_rate=1e-3, momentums=momentums)
    return state, trainable, momentums


def run(
    url: str, options: dict, state, trainable: dict, momentums: dict, steps: int, share: bool, resume: bool
) -> dict:
    """One contender's run of ``steps`` saves: bytes uploaded and seconds, by step (with
    ``resume``, the writer replaced before step ``steps // 2 + 1``: its restore's seconds too)."""
    from ortckpt import CheckpointManager, object_store
    from ortckpt.stepstore import shared

    shared.SHARE_MIN_BYTES = (64 * MiB) if share else (1 << 62)
    uploaded, seconds, restores = [], [], {}
    manager = CheckpointManager(url, storage_options=options, max_to_keep=2)
    try:
        for step in range(1, steps + 1):
            if resume and step == steps // 2 + 1:  # a new process's writer, as after a preemption
                manager.close()
                with CheckpointManager(url, storage_options=options, read_only=True) as reader:
                    restores["reader"] = timed(reader.restore)
                manager = CheckpointManager(url, storage_options=options, max_to_keep=2)
                restores["writer"] = timed(manager.restore)
            train_step(trainable, momentums)
            os.sync()
            before, began = object_store.bytes_put(), time.perf_counter()
            manager.save(state, step)
            seconds.append(time.perf_counter() - began)
            uploaded.append(object_store.bytes_put() - before)
        restored = manager.restore(steps)  # (the last step, whole: its values are the arrays')
        for n, a in trainable.items():
            np.testing.assert_array_equal(restored.parameters[n].data, a)
        for step in manager.all_steps():
            manager.delete(step)
    finally:
        manager.close()  # (the one writing now: the first, or the resumed one)
    if not share:  # (the baseline really uploads every step whole)
        assert all(b > 0.9 * uploaded[0] for b in uploaded), uploaded
    return {"bytes": uploaded, "seconds": seconds, "restores": restores}


def run_sharded(url: str, options: dict, args: argparse.Namespace, share: bool, resume: bool) -> dict:
    """One contender's run of ``args.steps`` sharded saves on ``args.ranks`` threads: rank 0's
    count of the bytes every rank uploaded, and its seconds, by step (with ``resume``, every rank's
    manager replaced before step ``steps // 2 + 1`` by a new one that restores its part of the
    latest step first, as a job resumed after a preemption: rank 0's restore's seconds too)."""
    import threading

    from distributed_model import ThreadWorld
    from ortckpt import CheckpointManager, object_store
    from ortckpt.stepstore import shared

    shared.SHARE_MIN_BYTES = (64 * MiB) if share else (1 << 62)
    world = ThreadWorld(args.ranks, timeout=600)  # (a whole step of a big model: past 30 s)
    out: dict = {"bytes": [], "seconds": [], "restores": {}}
    failures: list[BaseException] = []

    def rank(number: int) -> None:
        comm = world.comm(number)
        state, trainable, momentums = model(args.frozen_mib, args.trainable_mib, args.ranks, number)
        try:
            manager = CheckpointManager(url, comm=comm, storage_options=options, max_to_keep=2)
            try:
                for step in range(1, args.steps + 1):
                    if resume and step == args.steps // 2 + 1:  # a new job's managers, as after a preemption
                        manager.close()
                        comm.barrier()
                        manager = CheckpointManager(url, comm=comm, storage_options=options, max_to_keep=2)
                        began = time.perf_counter()
                        manager.restore_sharded()
                        if number == 0:
                            out["restores"]["writer"] = time.perf_counter() - began
                    train_step(trainable, momentums)
                    comm.barrier()
                    before, began = object_store.bytes_put(), time.perf_counter()
                    manager.save(state, step)
                    if number == 0:
                        out["seconds"].append(time.perf_counter() - began)
                        out["bytes"].append(object_store.bytes_put() - before)
                restored, _ = manager.restore_sharded(args.steps)  # (the last step: its values are the arrays')
                for n, a in trainable.items():
                    np.testing.assert_array_equal(restored.parameters[n].data, a)
                if number == 0:
                    for step in manager.all_steps():
                        manager.delete(step)
            finally:
                manager.close()
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=rank, args=(n,)) for n in range(args.ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    if not share:
        assert all(b > 0.9 * out["bytes"][0] for b in out["bytes"]), out["bytes"]
    return out


def train_step(trainable: dict, momentums: dict) -> None:
    """A training step: the trainable part and its moments change (the frozen part does not)."""
    for n, a in trainable.items():
        np.add(a, 1.0, out=a)
        momentums[n]["momentum0"] += 0.5
        momentums[n]["momentum1"] += 0.25


def timed(call) -> float:
    os.sync()
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frozen-mib", type=int, default=1024)
    parser.add_argument("--trainable-mib", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1, help="sharded manager steps on this many ranks (threads)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from s3_server import BUCKET, S3Server

    server = S3Server()
    try:
        options = server.storage_options()
        state, trainable, momentums = model(args.frozen_mib, args.trainable_mib) if args.ranks == 1 else (None, {}, {})
        results: dict[str, list[dict]] = {"shared": [], "whole": [], "resumed": []}
        for round_ in range(args.rounds):
            for name in shuffled(results, ("s3_dedup", round_)):
                url = f"s3://{BUCKET}/dedup-{name}-{round_}"
                share, resume = name != "whole", name == "resumed"
                os.sync()
                if args.ranks > 1:
                    results[name].append(run_sharded(url, options, args, share, resume))
                else:
                    results[name].append(run(url, options, state, trainable, momentums, args.steps, share, resume))
    finally:
        server.stop(keep_data=False)
    sharded = f", sharded on {args.ranks} ranks" if args.ranks > 1 else ""
    lines = [
        f"## {args.steps} manager steps{sharded} to s3:// (SeaweedFS): {args.frozen_mib} MiB frozen + "
        f"{args.trainable_mib} MiB trainable + AdamW moments, {args.rounds} rounds",
        "",
        "| contender | step 1 MiB | steps 2-N MiB each (max) | bytes 2-N each / step 1 (max) | "
        "time 2-N / step 1 (median of steps, rounds' range) |",
        "|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        first = runs[0]["bytes"][0]
        later = max(b for r in runs for b in r["bytes"][1:])
        times = [statistics.median(r["seconds"][1:]) / r["seconds"][0] for r in runs]
        lines.append(
            f"| {name} | {first / MiB:.1f} | {later / MiB:.1f} | {later / first:.3f} | "
            f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) |"
        )
    whole = statistics.median(statistics.median(r["seconds"][1:]) for r in results["whole"])
    shared = statistics.median(statistics.median(r["seconds"][1:]) for r in results["shared"])
    lines += ["", f"steps 2-N, seconds per step (median): shared {shared:.2f}, whole {whole:.2f}"]
    if "resumed" not in results:
        report(lines, args.out)
        return
    first_resumed = args.steps // 2  # (index of the resumed writer's first step)
    resumed = [r["bytes"][first_resumed] / r["bytes"][0] for r in results["resumed"]]
    writer = statistics.median(r["restores"]["writer"] for r in results["resumed"])
    restores = f"writer {writer:.2f} (hashing the shared values)"
    if args.ranks == 1:  # (a reader's restore of the same step beside it)
        reader = statistics.median(r["restores"]["reader"] for r in results["resumed"])
        restores += f", reader {reader:.2f}, ratio {writer / reader:.2f}"
    lines += [
        f"resumed writer's first step (step {first_resumed + 1}): "
        f"{max(r['bytes'][first_resumed] for r in results['resumed']) / MiB:.1f} MiB (max), "
        f"{max(resumed):.3f} of step 1 (max of rounds); restore seconds (median, rank 0's when sharded): {restores}",
    ]
    report(lines, args.out)


if __name__ == "__main__":
    main()
