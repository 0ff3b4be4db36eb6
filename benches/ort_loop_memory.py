"""The memory a save of the state ONNX Runtime's Module trains takes: ortckpt's saves against
ONNX Runtime's own ``save_checkpoint`` in the same run. Runs in ONNX Runtime's interpreter with
ortckpt installed (as ``ort_loop_bench.py``, whose model this is)::

    python benches/ort_loop_memory.py [--rounds 3] [--layers 4] [--features 2048] [--out FILE]

The peak is the process's anonymous memory plus the size of its memfds, above what it was before
the save, sampled every ~0.3 ms by a separate process: ONNX Runtime's saver holds the GIL (a thread
would not sample), and VmHWM does not count memfd pages not mapped yet (the memfd ONNX Runtime writes
its serialisation into). Neither counts the page cache of the file written. While the process has
a child (a forked save's), the anonymous memory of both is counted as their proportional shares
(``Pss_Anon``): a page the two still share counts once, a page copied on write twice. Contenders
alternate, each round in a new order; the median peak per contender is reported.

The forked save is also measured with the trainer training on while the child writes (--train
steps right after save() returns: each rewrites every parameter and moment, so every page of the
state the child still holds is copied), beside the async save that copies in the trainer's
thread and the same steps with no save (what training alone adds).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numpy as np  # noqa: E402
from measure import report  # noqa: E402
from ort_loop_bench import trained_state  # noqa: E402

MiB = 2**20

# The sampler: the peak of (anonymous memory + memfd sizes) of PID and its children (but the
# sampler), written to OUT each time RESET appears.
SAMPLER = """
import os, sys, time
pid, out = int(sys.argv[1]), sys.argv[2]
def children():
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            found += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            pass
    return [c for c in found if c != os.getpid()]
def anonymous(p, shared):
    key, where = ("Pss_Anon:", "smaps_rollup") if shared else ("RssAnon:", "status")
    for line in open(f"/proc/{p}/{where}"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0
def sample():
    others = children()
    total = anonymous(pid, bool(others))
    for child in others:
        try:
            total += anonymous(child, True)
        except OSError:
            pass
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_size
        except OSError:
            pass
    return total
top = 0
while os.path.exists(f"/proc/{pid}"):
    try:
        top = max(top, sample())
    except (OSError, ValueError):
        pass
    if os.path.exists(out + ".reset"):
        with open(out + ".tmp", "w") as f:
            f.write(str(top))
        os.replace(out + ".tmp", out)
        top = 0
        os.unlink(out + ".reset")
    time.sleep(0.0003)
"""


class PeakSampler:
    def __init__(self, work: Path) -> None:
        self.out = str(work / "peak")
        self.process = subprocess.Popen(
            [sys.executable, "-c", SAMPLER, str(os.getpid()), self.out],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _reset(self) -> int:
        """The peak since the last reset (and a new start)."""
        Path(self.out + ".reset").touch()
        while os.path.exists(self.out + ".reset"):
            time.sleep(0.001)
        return int(Path(self.out).read_text())

    def added_mib(self, run: Callable[[], object]) -> float:
        time.sleep(0.05)
        self._reset()
        before = self._reset()  # (the level before, with nothing running)
        run()
        time.sleep(0.05)
        return (self._reset() - before) / MiB

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--train", type=int, default=5, help="training steps taken while a save writes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import ortckpt
    from onnxruntime.capi import _pybind_state as C

    work = Path(tempfile.mkdtemp(prefix="ortckpt-bench-memory-"))
    sampler = PeakSampler(work)
    try:
        state, model, optimizer = trained_state(work, args.layers, args.features)  # (kept alive: they train it)
        inner = state._state
        total = 3 * sum(p.data.nbytes for _, p in state.parameters)  # (AdamW: two moments per parameter)
        out = work / "saves"
        out.mkdir()
        manager = ortckpt.CheckpointManager(work / "run", async_save=True, max_to_keep=1, durable=False)
        forking = ortckpt.CheckpointManager(work / "forked", async_save="fork", max_to_keep=1, durable=False)
        steps = iter(range(1, 10**6))
        rng = np.random.default_rng(2)
        batch = [rng.standard_normal((2, args.features)).astype(np.float32) for _ in range(2)]

        def train() -> None:
            for _ in range(args.train):
                model(*batch)
                optimizer.step()
                model.lazy_reset_grad()

        def manager_save(include_optimizer_state: bool, which: object = manager, training: bool = False) -> None:
            which.save(state, next(steps), include_optimizer_state=include_optimizer_state)
            if training:
                train()
            which.wait()

        contenders: dict[str, Callable[[], object]] = {
            "ONNX Runtime save_checkpoint(state, path, True)": lambda: C.save_checkpoint(
                inner, str(out / "ort.ckpt"), True
            ),
            "ortckpt save_checkpoint(state, path, include_optimizer_state=True)": lambda: (
                ortckpt.CheckpointState.save_checkpoint(state, out / "ortckpt.ckpt", include_optimizer_state=True)
            ),
            "the previous path (ONNX Runtime into a memfd, ortckpt's writer)": lambda: (
                ortckpt.CheckpointState.save_checkpoint(
                    state,
                    out / "memfd.ckpt",
                    include_optimizer_state=True,
                    external_data_threshold=ortckpt._boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD - 1,
                )
            ),
            "CheckpointManager(async_save=True).save(state, step), to completion": lambda: manager_save(True),
            'CheckpointManager(async_save="fork").save(state, step), to completion': lambda: manager_save(
                True, forking
            ),
            f"training alone ({args.train} steps, no save)": train,
            f"async_save=True, {args.train} training steps while it writes": lambda: manager_save(True, training=True),
            f'async_save="fork", {args.train} training steps while the child writes': lambda: manager_save(
                True, forking, training=True
            ),
            "ONNX Runtime save_checkpoint(state, path) (params only)": lambda: C.save_checkpoint(
                inner, str(out / "ort_params.ckpt"), False
            ),
            "ortckpt save_checkpoint(state, path) (params only)": lambda: ortckpt.CheckpointState.save_checkpoint(
                state, out / "ortckpt_params.ckpt"
            ),
            "CheckpointManager(async_save=True).save(..., include_optimizer_state=False)": lambda: manager_save(False),
        }
        peaks: dict[str, list[float]] = {name: [] for name in contenders}
        order = list(contenders)
        shuffle = random.Random(31)
        for _round in range(args.rounds):
            shuffle.shuffle(order)
            for name in order:
                peaks[name].append(sampler.added_mib(contenders[name]))
        manager.close()
        forking.close()

        lines = [
            f"# Memory of a save in ONNX Runtime's training loop ({args.layers} x MatMul "
            f"{args.features}x{args.features} float32, AdamW: a {total / MiB:.0f} MiB checkpoint; "
            f"onnxruntime-training {__import__('onnxruntime').__version__}, {args.rounds} rounds)",
            "",
            "| contender | peak added, MiB (median) | range | x the checkpoint |",
            "|---|---:|---:|---:|",
        ]
        for name, values in peaks.items():
            median = statistics.median(values)
            spread = f"{min(values):.0f}-{max(values):.0f}"
            lines.append(f"| {name} | {median:.0f} | {spread} | {median * MiB / total:.2f} |")
        report(lines, args.out)
    finally:
        sampler.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
