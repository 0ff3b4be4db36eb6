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
sys.path.insert(0, str(HERE.parent / "python" / "helpers"))
from warm_python import WarmPython, close_all, warm  # noqa: E402

ARTIFACTS = HERE.parent / "data" / "ort-vectors" / "artifacts"
STEPS = 200
GRACE = 20.0
DEADLINE = 300.0  # (a run's longest wait for a line or its end: ort_loop.py's own ends it at 290 s)


def _command(directory: Path, async_save: str) -> list[str]:
    return [
        str(HERE / "ort_loop.py"),
        "preempt_run",
        str(ARTIFACTS),
        str(directory),
        str(STEPS),
        async_save,
        str(GRACE),
    ]


def loop_environment() -> dict[str, str]:
    """ort_loop.py's: the torch stand-in on PYTHONPATH (onnxruntime.training imports torch)."""
    return dict(os.environ, PYTHONPATH=str(HERE / "torch_stub"), PYTHONWARNINGS="ignore")


# What every ort_loop.py command imports, imported once by a warm interpreter (helpers/warm_python.py):
# each command runs in a child it forks, a process no earlier command touched, signals and all.
LOOP_PRELOAD = ("numpy", "ortckpt", "onnxruntime.capi._pybind_state", "onnxruntime.training.api")


def loop_interpreter(python: str) -> WarmPython:
    return warm(python, LOOP_PRELOAD, loop_environment())


def run_to_end(python: str, directory: Path, async_save: str = "1") -> dict:
    done = loop_interpreter(python).run(_command(directory, async_save), env=loop_environment(), timeout=DEADLINE)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Run:
    """A started run whose stderr a thread reads: waits for its lines with deadlines; a run that
    misses one is made to print its threads' stacks (SIGABRT: ort_loop.py enables faulthandler),
    killed, and reported with its stderr."""

    def __init__(self, python: str, directory: Path, async_save: str) -> None:
        self.process = loop_interpreter(python).popen(
            _command(directory, async_save),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=loop_environment(),
        )
        self.errors: list[str] = []
        self._out: list[str] = []
        self._seen: dict[str, threading.Event] = {"ready": threading.Event(), "trained": threading.Event()}
        self._readers = [threading.Thread(target=self._read), threading.Thread(target=self._read_out)]
        for reader in self._readers:
            reader.daemon = True
            reader.start()

    def _read_out(self) -> None:
        assert self.process.stdout is not None
        self._out.append(self.process.stdout.read())

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.errors.append(line)
            if line.strip() in self._seen:
                self._seen[line.strip()].set()
        for event in self._seen.values():  # (it ended: nobody waits for what it will not print)
            event.set()

    def seen(self, line: str) -> bool:
        return self._seen[line].is_set() and line in (e.strip() for e in self.errors)

    def wait_for(self, line: str, timeout: float = DEADLINE) -> None:
        if not self._seen[line].wait(timeout):
            self.fail(f'printed no "{line}" within {timeout:g} s')
        if not self.seen(line):
            self.finish(timeout)
            self.fail(f'ended (status {self.process.returncode}) without printing "{line}"')

    def finish(self, timeout: float = DEADLINE) -> tuple[int, str]:
        """Waits for the run's end: (its status, its stdout)."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"still running after {timeout:g} s")
        self._join()
        return self.process.returncode, "".join(self._out)

    def _join(self) -> None:
        for reader in self._readers:
            reader.join(timeout=10)

    def fail(self, why: str) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGABRT)  # (its stacks, into stderr)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._join()
        raise AssertionError(f"the run {why}; its stderr:\n{''.join(self.errors)[-6000:]}")


def interrupted(
    python: str, directory: Path, delay: float, signals: list[tuple[float, int]], async_save: str = "1"
) -> tuple[int, dict | None, bool]:
    """Starts a run, waits until it trains (its "ready"), then ``delay`` seconds, then sends
    each (gap, signal): (its exit status, its result if it printed one, whether it had finished
    training, its "trained", before the first signal was sent: a signal then may find the
    manager closed and SIGTERM's default action back)."""
    run = _Run(python, directory, async_save)
    run.wait_for("ready")
    time.sleep(delay)
    late = run.seen("trained")
    for gap, signum in signals:
        time.sleep(gap)
        if run.process.poll() is None:
            run.process.send_signal(signum)
    status, out = run.finish(GRACE + 60)
    lines = out.strip().splitlines()
    return status, (json.loads(lines[-1]) if lines else None), late


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
    run = _Run(python, directory, async_save)
    run.wait_for("ready")
    began = time.monotonic()
    run.wait_for("trained")
    trained = time.monotonic() - began
    status, _ = run.finish()
    assert status == 0, "".join(run.errors)[-3000:]
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
    try:
        main()
    finally:
        close_all()
