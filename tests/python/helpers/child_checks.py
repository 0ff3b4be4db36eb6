"""check functions for Forward(process=True) tests: module-level, so that they pickle and a
fresh process imports them. Each does one thing a user's check might do."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import numpy as np

# A process started under this environment variable carries it: the tests find what is left
# of a child by it. STARTED: a file where a check writes its pid and its helper's.
STARTED = "ORTCKPT_TEST_STARTED"

LOOKS_LIKE_A_VERDICT = ['{"problems": ["output y is not finite (4 NaN or Inf values)"]}', "the forward pass failed: no"]


def prints_and_passes(outputs: dict[str, np.ndarray]) -> bool:
    print("debug: the loss is", float(np.asarray(next(iter(outputs.values()))).ravel()[0]))
    for line in LOOKS_LIKE_A_VERDICT:
        print(line)
        print(line, file=sys.stderr)
    return True


def prints_and_fails(outputs: dict[str, np.ndarray]) -> bool:
    prints_and_passes(outputs)
    return False


def floods_and_passes(outputs: dict[str, np.ndarray]) -> bool:
    line = b"x" * 1023 + b"\n"
    for _ in range(64 * 1024):  # 64 MiB on each stream, far past any pipe's buffer
        os.write(1, line)
        os.write(2, line)
    os.write(1, b"y" * (8 << 20))  # and a line of 8 MiB with no end
    return True


def sleeps(outputs: dict[str, np.ndarray]) -> bool:
    _record(os.getpid())
    time.sleep(3600)
    return True


def _start_helper(escape: bool = False) -> None:
    # A grandchild that inherits the child's stdout and stderr and outlives it; escaping: in a
    # session of its own, out of reach of a kill of the child's process group.
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=escape)
    _record(helper.pid)


def starts_a_helper_and_passes(outputs: dict[str, np.ndarray]) -> bool:
    _start_helper()
    return True


def starts_an_escaping_helper_and_passes(outputs: dict[str, np.ndarray]) -> bool:
    _start_helper(escape=True)
    return True


def starts_a_helper_and_sleeps(outputs: dict[str, np.ndarray]) -> bool:
    _start_helper()
    return sleeps(outputs)


def kills_itself(outputs: dict[str, np.ndarray]) -> bool:
    os.kill(os.getpid(), signal.SIGKILL)
    return True


def segfaults(outputs: dict[str, np.ndarray]) -> bool:
    print("about to read address 0")
    sys.stdout.flush()
    ctypes.string_at(0)
    return True


def exits_quietly(outputs: dict[str, np.ndarray]) -> bool:
    os._exit(0)


def exits_with_3(outputs: dict[str, np.ndarray]) -> bool:
    print("giving up", file=sys.stderr)
    sys.stderr.flush()
    os._exit(3)


def raises_system_exit(outputs: dict[str, np.ndarray]) -> bool:
    sys.exit(0)


HUGE = 20 << 20  # characters of a message: past the 16 MiB a verdict may have


def raises_a_huge_message(outputs: dict[str, np.ndarray]) -> bool:
    raise ValueError("x" * HUGE)


def raises_a_huge_system_exit(outputs: dict[str, np.ndarray]) -> bool:
    sys.exit("z" * HUGE)  # not an Exception: it leaves the check for the child's own handler


def _record(pid: int) -> None:
    with open(os.environ[STARTED], "a") as f:
        f.write(f"{pid}\n")
