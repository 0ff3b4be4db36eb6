"""Aggregating Flower replies: ortckpt.flower.FedAvg against Flower's own FedAvg
(flwr.serverapp.strategy.FedAvg.aggregate_train), and a plain copy of the replies' bytes (each
byte read once and written once: the floor of any aggregation that reads every reply).

Each run is a child process that builds the replies (seeded, the same in every run), then
times one aggregate_train; its peak extra memory is the growth of its peak RSS over the RSS
with the replies built (the heap trimmed and the peak reset first: malloc_trim,
/proc/self/clear_refs). Contenders run in a shuffled order each round; times are compared
round by round (paired ratios, medians).
Runs in flwr's venv (`make .venv-flower/.ok`, ortckpt from the source tree's build):

    PYTHONPATH=python .venv-flower/bin/python benches/flower_bench.py --replies 10 --mib 100 --tensors 25
    PYTHONPATH=python .venv-flower/bin/python benches/flower_bench.py --replies 10 --mib 100 --tensors 1000
    PYTHONPATH=python .venv-flower/bin/python benches/flower_bench.py --replies 3 --mib 1024 --tensors 1 --rounds 3

(the last: a model of one 1 GiB tensor, 3 replies: 10 would hold 10 GiB of replies, and Flower's
child about 13 GiB, more than a shared 24 GiB machine spares; ortckpt and the copy alone at 10:
``--replies 10 --mib 1024 --tensors 1 --rounds 3 --without-flower``, with 14 GiB free).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from measure import paired_ratio, shuffled

RUNNER = textwrap.dedent(
    """
    import json, resource, sys, time
    import numpy as np
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0

    contender, replies_n, mib, tensors = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    elements = int(mib * 2**20 / 4 / tensors)
    rng = np.random.default_rng(0)
    base = [rng.standard_normal(elements).astype(np.float32) for _ in range(tensors)]
    replies = []
    for node in range(replies_n):
        record = ArrayRecord({f"layer{i}.weight": Array(b + np.float32(node)) for i, b in enumerate(base)})
        content = RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": 10 + node})})
        out = Message(RecordDict({"arrays": record}), dst_node_id=node + 1, message_type="train")
        replies.append(Message(content, reply_to=out))
    del base

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    def hwm_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024

    if contender == "flower":
        from flwr.serverapp.strategy import FedAvg
        run = lambda: FedAvg().aggregate_train(1, replies)
    elif contender == "ortckpt":
        from ortckpt.flower import FedAvg
        run = lambda: FedAvg().aggregate_train(1, replies)
    else:  # a plain copy: every reply's bytes read once, into one reused buffer per tensor
        def run():
            records = [next(iter(r.content.array_records.values())) for r in replies]
            for key in records[0].keys():
                sink = np.empty(len(records[0][key].data), np.uint8)
                for record in records:
                    np.copyto(sink, np.frombuffer(record[key].data, np.uint8))
    # The heap's free memory (the replies' temporaries) handed back first, so that no contender
    # reuses resident pages that the baseline counts.
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the RSS now
    before = rss_mib()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_extra_mib": hwm_mib() - before}))
    """
)

CONTENDERS = {
    "flower": "Flower FedAvg.aggregate_train",
    "ortckpt": "ortckpt.flower FedAvg.aggregate_train",
    "copy": "plain copy of the replies' bytes",
}


def run_once(contender: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-c", RUNNER, contender, str(args.replies), str(args.mib), str(args.tensors)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, default=10)
    parser.add_argument("--mib", type=float, default=100.0, help="the model's size")
    parser.add_argument("--tensors", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--without-flower",
        action="store_true",
        help="ortckpt and the copy only (10 replies of 1 GiB: Flower's child needs about 13 GiB)",
    )
    args = parser.parse_args()
    contenders = {k: v for k, v in CONTENDERS.items() if not (args.without_flower and k == "flower")}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name in shuffled(contenders, f"flower {args.replies} {args.mib} {args.tensors} {r}"):
            results[name].append(run_once(name, args))
    times = {name: [run["seconds"] for run in runs] for name, runs in results.items()}
    lines = [
        f"{args.replies} replies of a {args.mib:g} MiB float32 model of {args.tensors} tensors, {args.rounds} rounds",
        "",
        "| aggregation | median s | Flower's time / this (paired) | this / the copy's time (paired) "
        "| peak extra MiB (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, label in contenders.items():
        peak = statistics.median(run["peak_extra_mib"] for run in results[name])
        versus_flower = f"{paired_ratio(times[name], times['flower']):.2f}" if "flower" in times else "not run"
        lines.append(
            f"| {label} | {statistics.median(times[name]):.3f} | {versus_flower} | "
            f"{1 / paired_ratio(times[name], times['copy']):.2f} | {peak:.0f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
