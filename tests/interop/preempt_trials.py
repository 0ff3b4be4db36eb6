"""SIGTERM at random moments of ONNX Runtime's training loop (``ort_loop.py preempt_run``: a
Module and Optimizer with async manager saves and ``preemption=True``): each trial must exit 0,
with the step it was at committed, and, resumed to the end, give a final checkpoint file
byte-identical to an uninterrupted run's. Used by test_ort_loop.py (a few trials) and run by
hand for many::

    ORTCKPT_ORT_LOOP_PYTHON=target/ort-loop-venv/bin/python \\
        .venv/bin/python tests/interop/preempt_trials.py --count 100 [--async-save fork]

(``--async-save fork``: the saves are ``async_save="fork"``'s, taken by a forked child.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARTIFACTS = HERE.parent / "data" / "ort-vectors" / "artifacts"
STEPS = 200
GRACE = 20.0


def _command(python: str, directory: Path, async_save: str) -> list[str]:
    return [
        python,
        str(HERE / "ort_loop.py"),
        "preempt_run",
        str(ARTIFACTS),
        str(directory),
        str(STEPS),
        async_save,
        str(GRACE),
    ]


def _environment() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(HERE / "torch_stub"), PYTHONWARNINGS="ignore")


def run_to_end(python: str, directory: Path, async_save: str = "1") -> dict:
    done = subprocess.run(
        _command(python, directory, async_save),
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def interrupted(
    python: str, directory: Path, delay: float, signals: list[tuple[float, int]], async_save: str = "1"
) -> tuple[int, dict | None, bool]:
    """Starts a run, waits until it trains (its "ready"), then ``delay`` seconds, then sends
    each (gap, signal): (its exit status, its result if it printed one, whether it had finished
    training, its "trained", before the first signal was sent: a signal then may find the
    manager closed and SIGTERM's default action back)."""
    process = subprocess.Popen(
        _command(python, directory, async_save),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
    )
    assert process.stderr is not None
    for line in process.stderr:
        if line.strip() == "ready":
            break
    trained = threading.Event()
    errors: list[str] = []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            errors.append(line)
            if line.strip() == "trained":
                trained.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(delay)
    late = trained.is_set()
    for gap, signum in signals:
        time.sleep(gap)
        if process.poll() is None:
            process.send_signal(signum)
    out = process.stdout.read() if process.stdout is not None else ""
    process.wait(timeout=GRACE + 60)
    reader.join(timeout=10)
    lines = out.strip().splitlines()
    return process.returncode, (json.loads(lines[-1]) if lines else None), late


def trial(
    python: str,
    directory: Path,
    reference: tuple[bytes, float],
    rng: random.Random,
    *,
    second: bool = False,
    async_save: str = "1",
) -> dict:
    """One trial: interrupted at a random moment of its training (a second SIGTERM soon after,
    with ``second``), checked, resumed to the end and compared with the uninterrupted run's
    final file (``reference``: its bytes, and how long that run trained)."""
    signals = [(0.0, signal.SIGTERM)] + ([(rng.uniform(0, 0.05), signal.SIGTERM)] if second else [])
    status, result, late = interrupted(python, directory, rng.uniform(0, 0.8 * reference[1]), signals, async_save)
    if late:  # (the run had trained to its end: the signal may come after its close)
        assert status in (0, -signal.SIGTERM), status
    elif second:
        # Either the preemption save ran (exit 0: the second signal was noted during it), or the
        # second came before the loop reached it (the default action ended the process).
        assert status in (0, -signal.SIGTERM), status
    else:
        assert status == 0, status
    if status == 0:
        assert result is not None
        assert result["latest"] == result["trained_to"], result  # no step of work lost
    resumed = run_to_end(python, directory, async_save)
    assert (directory / "final.ckpt").read_bytes() == reference[0], "the resumed run's final file differs"
    stopped_at = None if result is None else result["trained_to"]
    return {"status": status, "stopped_at": stopped_at, "late": late, "resumed": resumed}


def reference_run(python: str, directory: Path, async_save: str = "1") -> tuple[bytes, float]:
    """The uninterrupted run: its final file, and how long it trained (from "ready" to "trained")."""
    process = subprocess.Popen(
        _command(python, directory, async_save),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
    )
    assert process.stderr is not None
    for line in process.stderr:
        if line.strip() == "ready":
            break
    began = time.monotonic()
    for line in process.stderr:
        if line.strip() == "trained":
            break
    trained = time.monotonic() - began
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return (directory / "final.ckpt").read_bytes(), trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--async-save", choices=("1", "fork"), default="1", help='"fork": async_save="fork"')
    args = parser.parse_args()
    python = os.environ["ORTCKPT_ORT_LOOP_PYTHON"]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        reference = reference_run(python, Path(scratch) / "reference", args.async_save)
        stops, late, killed = [], 0, 0
        for n in range(args.count):
            second = n % 5 == 4
            result = trial(
                python, Path(scratch) / f"trial{n}", reference, rng, second=second, async_save=args.async_save
            )
            stops.append(result["stopped_at"])
            late += result["late"]
            killed += result["status"] != 0
            print(
                f"trial {n}: status {result['status']}, second signal {second}, stopped at "
                f"{result['stopped_at']}, after training {result['late']}",
                flush=True,
            )
    print(
        f"{args.count} trials ({args.count // 5} with a second SIGTERM; {late} signalled once training was over; "
        f"{killed} ended by a second signal before the save): each exited 0 with the step it was at committed, "
        f"or as allowed, and resumed to a final file byte-identical to the uninterrupted run's. Stopped at steps "
        f"{sorted(s for s in stops if s is not None)}"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
