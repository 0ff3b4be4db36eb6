"""`make run`, part 1: a training run killed mid-way resumes from its latest checkpoint and
ends with weights bit-identical to a run that was never interrupted.

A small classifier (two layers, NumPy) trains with AdamW, its state in ONNX Runtime's
layout (parameters, momentum0/momentum1 in "group0", step and learning rate), under a
CheckpointManager: a checkpoint every 20 steps, the 3 newest and the best by loss kept,
saved asynchronously, the random generator's state saved with each. The demo runs:

  1. the reference: the whole run, uninterrupted;
  2. the same run, SIGKILLed at a random moment past its halfway point;
  3. the same command again, which finds the checkpoints and resumes from the latest;
and compares the final weights of 1 and 3 byte for byte.

    python benches/resume_demo.py              (the demo)
    python benches/resume_demo.py --train DIR  (one training process; what the demo runs)
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from ortckpt import CheckpointManager, CheckpointState, OptimizerGroup, capture_rng_state, restore_rng_state

STEPS, SAVE_EVERY, BATCH = 400, 20, 64
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.999), 1e-8, 1e-2


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """4,096 points in 64 dimensions, labelled by a random teacher network (fixed seed)."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((4096, 64), dtype=np.float32)
    teacher = rng.standard_normal((64, 10), dtype=np.float32)
    return x, np.argmax(np.tanh(x @ teacher) + 0.1 * rng.standard_normal((4096, 10)), axis=1)


def initial_state(rng: np.random.Generator) -> CheckpointState:
    params = {
        "fc1.weight": rng.standard_normal((64, 256), dtype=np.float32) * np.float32(0.125),
        "fc1.bias": np.zeros(256, np.float32),
        "fc2.weight": rng.standard_normal((256, 10), dtype=np.float32) * np.float32(0.0625),
        "fc2.bias": np.zeros(10, np.float32),
    }
    state = CheckpointState.from_arrays(params, properties={"model": "mlp-64-256-10"})
    state.optimizer_groups["group0"] = OptimizerGroup(
        step=0,
        initial_learning_rate=LR,
        momentums={n: {"momentum0": np.zeros_like(p), "momentum1": np.zeros_like(p)} for n, p in params.items()},
    )
    return state


def train_step(state: CheckpointState, x: np.ndarray, y: np.ndarray) -> float:
    """Forward, backward (softmax cross-entropy) and an AdamW update, in place, in float32."""
    p = {name: param.data for name, param in state.parameters}
    h_pre = x @ p["fc1.weight"] + p["fc1.bias"]
    h = np.maximum(h_pre, 0)
    logits = h @ p["fc2.weight"] + p["fc2.bias"]
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.log(probs[np.arange(len(y)), y] + np.float32(1e-12)).mean())
    d_logits = probs
    d_logits[np.arange(len(y)), y] -= 1
    d_logits /= np.float32(len(y))
    d_h = (d_logits @ p["fc2.weight"].T) * (h_pre > 0)
    grads = {"fc2.weight": h.T @ d_logits, "fc2.bias": d_logits.sum(0), "fc1.weight": x.T @ d_h, "fc1.bias": d_h.sum(0)}
    group = state.optimizer_groups["group0"]
    group.step += 1
    b1, b2 = BETAS
    for name, g in grads.items():
        m, v = group.momentums[name]["momentum0"], group.momentums[name]["momentum1"]
        m *= np.float32(b1)
        m += np.float32(1 - b1) * g
        v *= np.float32(b2)
        v += np.float32(1 - b2) * g * g
        m_hat = m / np.float32(1 - b1**group.step)
        v_hat = v / np.float32(1 - b2**group.step)
        p[name] -= np.float32(LR) * (m_hat / (np.sqrt(v_hat) + np.float32(EPS)) + np.float32(WEIGHT_DECAY) * p[name])
    return loss


def train(directory: Path, final: Path) -> None:
    """One training process: resumes from the latest checkpoint in `directory` when there is one."""
    from tqdm import tqdm

    x, y = dataset()
    rng = np.random.default_rng(42)  # batch order: its state is saved with every checkpoint
    with CheckpointManager(
        directory,
        save_every=SAVE_EVERY,
        max_to_keep=3,
        keep_best=("loss", "min", 1),
        async_save=True,
        config={"lr": LR, "batch": BATCH, "steps": STEPS},
    ) as manager:
        latest = manager.latest()
        if latest is None:
            state, start = initial_state(rng), 0
        else:
            state, start = manager.restore(), latest.step
            restore_rng_state(latest.rng_state, rng)
            print(f"resumed from step {start} ({latest.directory.name}, loss {latest.metrics['loss']:.4f})", flush=True)
        for step in tqdm(range(start + 1, STEPS + 1), initial=start, total=STEPS, desc="training", leave=False):
            batch = rng.choice(len(x), BATCH, replace=False)
            loss = train_step(state, x[batch], y[batch])
            if manager.should_save(step):
                manager.save(
                    state, step, epoch=step * BATCH // len(x), metrics={"loss": loss}, rng_state=capture_rng_state(rng)
                )
                print(f"saved {step}", flush=True)
    CheckpointState.save_checkpoint(state, final, include_optimizer_state=True)


def run(directory: Path, final: Path, kill_after: int | None = None) -> list[str]:
    """Runs a training process; with kill_after, SIGKILLs it a random moment after that step's save."""
    command = [sys.executable, __file__, "--train", str(directory), "--final", str(final)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # the same arithmetic in every run
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in child.stdout:
        lines.append(line.strip())
        if kill_after is not None and line.strip() == f"saved {kill_after}":
            # Somewhere in the next save interval: inside a step, or inside the next save.
            deadline = random.uniform(0, 0.02)
            try:
                child.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                child.send_signal(signal.SIGKILL)
            break
    code = child.wait()
    if kill_after is None and code != 0:
        raise SystemExit(f"training failed with exit code {code}")
    return lines


def every_tensor(path: Path) -> list[np.ndarray]:
    """Parameters, then momentums, in the file's (sorted) order."""
    state = CheckpointState.load_checkpoint(path)
    momentums = state.optimizer_groups["group0"].momentums.values()
    return [p.data for _, p in state.parameters] + [m for ms in momentums for m in ms.values()]


def same_weights(a: Path, b: Path) -> bool:
    return all(
        np.array_equal(p.view(np.uint8), q.view(np.uint8))
        for p, q in zip(every_tensor(a), every_tensor(b), strict=True)
    )


def demo() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        print(f"training a 64-256-10 classifier for {STEPS} steps (AdamW), a checkpoint every {SAVE_EVERY} steps\n")
        run(tmp / "reference", tmp / "reference.ckpt")
        print("1. uninterrupted run: done, final state in reference.ckpt")
        kill_after = random.randrange(STEPS // 2, STEPS - 2 * SAVE_EVERY, SAVE_EVERY)
        killed = run(tmp / "run", tmp / "resumed.ckpt", kill_after=kill_after)
        print(f"2. second run: SIGKILLed after the save of step {kill_after} ({killed[-1]!r} was its last word)")
        manager = CheckpointManager(tmp / "run", read_only=True)  # a reader: the resumed run below writes
        checked = manager.verify()
        print(
            f"   on disk: steps {manager.all_steps()} (3 newest + best loss kept); latest, step {checked.step}, "
            f"verified: {checked.tensors} tensors, SHA-256 {checked.files['checkpoint'][:16]}..."
        )
        resumed = run(tmp / "run", tmp / "resumed.ckpt")
        print(f"3. same command again: {resumed[0]}, trained to step {STEPS}")
        identical = same_weights(tmp / "reference.ckpt", tmp / "resumed.ckpt")
        print(f"\nfinal weights and AdamW state of runs 1 and 3 bit-identical: {identical}")
        best = CheckpointManager(tmp / "run", read_only=True).best("loss", "min")
        print(
            f"best checkpoint by loss: step {best.step}, loss {best.metrics['loss']:.4f}; "
            f"each step directory holds an ONNX Runtime checkpoint and metadata.json\n"
        )
        if not identical:
            raise SystemExit("the resumed run diverged from the uninterrupted one")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, help="run one training process with its checkpoints here")
    parser.add_argument("--final", type=Path, help="where the training process saves its final state")
    args = parser.parse_args()
    if args.train:
        train(args.train, args.final)
    else:
        demo()


if __name__ == "__main__":
    main()
