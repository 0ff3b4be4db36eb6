"""`make run`: save and load a realistic training state with ortckpt, check every
byte, and compare the speed with plain write()/read() of the same bytes.

The state is transformer-like: a frozen embedding, trainable layers, AdamW
momentums for every trainable tensor, step and learning rate, user properties.
Speeds on a shared disk swing between runs, so the baseline is measured in the
same run, interleaved with ortckpt, and the table shows medians and ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ortckpt
from ortckpt import CheckpointState, OptimizerGroup

GiB = 2**30
MiB = 2**20


def build_state(layers: int, width: int, vocab: int) -> tuple[dict, dict, dict]:
    rng = np.random.default_rng(0)

    def tensor(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    frozen = {"embed.weight": tensor(vocab, width), "rotary.inv_freq": tensor(width // 32)}
    trainable = {}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            trainable[p + f"attn.{name}.weight"] = tensor(width, width)
        trainable[p + "mlp.up.weight"] = tensor(4 * width, width)
        trainable[p + "mlp.down.weight"] = tensor(width, 4 * width)
        for norm in ("norm1", "norm2"):
            trainable[p + f"{norm}.weight"] = np.ones(width, np.float32)
            trainable[p + f"{norm}.bias"] = np.zeros(width, np.float32)
    trainable["head.weight"] = tensor(64, width)
    momentums = {n: {"momentum0": a * 0.1, "momentum1": a * a} for n, a in trainable.items()}
    return trainable, frozen, momentums


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plain_write(arrays: list[np.ndarray], path: Path) -> None:
    """The baseline: the same bytes, written once each to a new file."""
    with open(path, "wb") as f:
        for a in arrays:
            f.write(memoryview(a).cast("B"))


def plain_read(path: Path, size: int) -> np.ndarray:
    buf = np.empty(size, np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(buf))
    return buf


def checksum(array: np.ndarray) -> int:
    """XOR of all 8-byte words: reads every byte, cheaply, the same way for every contender."""
    return int(np.bitwise_xor.reduce(array.reshape(-1).view(np.uint64)))


def read_every_tensor(state: CheckpointState) -> int:
    tensors = [p.data for _, p in state.parameters]
    tensors += [m for ms in state.optimizer_groups["group0"].momentums.values() for m in ms.values()]
    return sum(checksum(t) for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    trainable, frozen, momentums = build_state(args.layers, args.width, args.vocab)
    state = CheckpointState.from_arrays(trainable, frozen, {"epoch": 3, "best_accuracy": 0.8125, "run": "demo"})
    state.optimizer_groups["group0"] = OptimizerGroup(step=1500, initial_learning_rate=3e-4, momentums=momentums)
    arrays = [*trainable.values(), *frozen.values(), *(m for ms in momentums.values() for m in ms.values())]
    total = sum(a.nbytes for a in arrays)
    n_tensors = len(arrays)
    print(f"ortckpt {ortckpt.__version__}: a transformer-like training state")
    print(
        f"  {len(trainable)} trainable + {len(frozen)} frozen float32 parameters, "
        f"{sum(a.nbytes for a in trainable.values()) / MiB:.0f} MiB + "
        f"{sum(a.nbytes for a in frozen.values()) / MiB:.0f} MiB"
    )
    print("  AdamW momentum0/momentum1 for every trainable tensor, step 1500, initial lr 3e-4")
    print("  properties: epoch=3, best_accuracy=0.8125, run='demo'")
    print(f"  {n_tensors} tensors, {total / MiB:.0f} MiB in all\n")

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt, base = Path(tmp) / "model.ckpt", Path(tmp) / "plain.bin"
        save_s, write_s, open_s, load_s, read_s = [], [], [], [], []

        def save():
            CheckpointState.save_checkpoint(state, ckpt, include_optimizer_state=True)

        def load():
            loaded = CheckpointState.load_checkpoint(ckpt)
            opened = time.perf_counter()
            read_every_tensor(loaded)
            return opened

        def timed_load():
            start = time.perf_counter()
            opened = load()
            open_s.append(opened - start)
            load_s.append(time.perf_counter() - start)

        writers = [(write_s, lambda: plain_write(arrays, base)), (save_s, save)]
        readers = [lambda: read_s.append(timed(lambda: checksum(plain_read(base, total)))), timed_load]
        for round_ in range(args.rounds):  # interleaved, alternating who goes first, new files each time
            order = 1 if round_ % 2 else -1
            for p in (ckpt, base):
                p.unlink(missing_ok=True)
            os.sync()
            for times, fn in writers[::order]:
                times.append(timed(fn))
            os.sync()  # both files written back before reading them through the page cache
            for read in readers[::order]:
                read()
        file_size = ckpt.stat().st_size

        # Every byte back, compared with what was saved.
        loaded = CheckpointState.load_checkpoint(ckpt)
        for name, a in {**trainable, **frozen}.items():
            assert loaded.parameters[name].data.tobytes() == a.tobytes(), name
        group = loaded.optimizer_groups["group0"]
        for name, ms in momentums.items():
            for m, a in ms.items():
                assert group.momentums[name][m].tobytes() == a.tobytes(), (name, m)
        assert (group.step, dict(loaded.properties)) == (1500, {"epoch": 3, "best_accuracy": 0.8125, "run": "demo"})
        print(
            f"saved {file_size / MiB:.0f} MiB to {ckpt.name}, loaded it back: all {n_tensors} tensors, "
            "optimizer state and properties identical, byte for byte\n"
        )

    def row(label, times, size=total):
        med = statistics.median(times)
        spread = f"{min(times):.3f}-{max(times):.3f}"
        return f"| {label:<44} | {med:8.3f} | {spread:>13} | {size / GiB / med:8.2f} |"

    print(f"medians of {args.rounds} interleaved rounds (new files each time, page cache):\n")
    print("| operation                                    | median s | range s       |    GiB/s |")
    print("|----------------------------------------------|----------|---------------|----------|")
    print(row("plain write() of the same bytes (baseline)", write_s))
    print(row("ortckpt save_checkpoint", save_s))
    print(row("plain read() + checksum (baseline)", read_s))
    print(row("ortckpt load_checkpoint + checksum", load_s))
    # Each round's pair ran back to back, so its ratio cancels most of the disk's swings.
    save_ratio = statistics.median(w / s for w, s in zip(write_s, save_s, strict=True))
    load_ratio = statistics.median(r / ld for r, ld in zip(read_s, load_s, strict=True))
    print(
        f"\nsave speed / plain write() speed: {save_ratio:.2f} (median of per-round ratios; fastest "
        f"round {min(write_s) / min(save_s):.2f})"
    )
    print(f"load speed / plain read() speed:  {load_ratio:.2f} (median of per-round ratios)")
    print(f"load_checkpoint alone (lazy open, O(metadata)): median {statistics.median(open_s) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
