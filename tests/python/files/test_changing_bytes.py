"""Bytes that change under the decoder: a checkpoint file rewritten in place while it is mapped
(privately: untouched pages still show the file), or a shared mmap another process writes, must
load as a consistent checkpoint or fail with a typed error: never a Rust panic (InternalError),
never a crash.

A writer process keeps rewriting the file: another valid checkpoint over the whole of it, then
random bytes at random positions of its metadata (tensor values are only bytes to the decoder),
mostly put back at once, so that a load may verify the bytes in one state and read them in another.
A reader process loads it in a loop and touches everything loaded; it runs apart from pytest so
that a crash is a failed test, not a dead test run.

    python test_changing_bytes.py writer PATH SECONDS file|mmap SOURCE...
    python test_changing_bytes.py reader PATH SECONDS file|mmap
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ortckpt
import pytest
from ortckpt import CheckpointState

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "ort-vectors"
SECONDS = 2.0


def metadata_positions(data: bytes) -> list[int]:
    """Every byte position of a checkpoint that is not inside a tensor's values."""
    base = np.frombuffer(data, np.uint8).ctypes.data
    state = CheckpointState.from_bytes(data)
    arrays = [p.data for _, p in state.parameters]
    arrays += [m for g in state.optimizer_groups.values() for ms in g.momentums.values() for m in ms.values()]
    inside = np.zeros(len(data), bool)
    for a in arrays:
        if isinstance(a, np.ndarray) and a.dtype != object and a.nbytes:
            start = a.ctypes.data - base
            inside[start : start + a.nbytes] = True
    return [int(i) for i in np.flatnonzero(~inside)]


def write_loop(path: str, seconds: float, mode: str, sources: list[str]) -> None:
    contents = [Path(s).read_bytes() for s in sources]
    positions = [metadata_positions(c) for c in contents]
    rng = random.Random(os.getpid())
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if mode == "mmap" else None

        def put(at: int, data: bytes) -> None:
            if shared is not None:
                shared[at : at + len(data)] = data
            else:
                os.pwrite(f.fileno(), data, at)

        # Start once the reader reads (under load one process may start seconds after the other:
        # a reader that only ever saw the file after the writer had stopped saw nothing change).
        started = time.monotonic()
        while not os.path.exists(path + ".reading") and time.monotonic() < started + 60:
            time.sleep(0.001)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            # Another valid checkpoint over the file, in place: never truncated, so a mapping of
            # it never loses pages (the file starts as long as the longest source).
            which = rng.randrange(len(contents))
            put(0, contents[which])
            # Left whole for a moment: on a loaded machine a reader scheduled only while bytes were
            # changed saw no whole file in its seconds (CI: 3,305 loads, none whole), and the test
            # also asks that some load succeed.
            time.sleep(0.001)
            for _ in range(200):
                at = rng.sample(positions[which], rng.randint(1, 4))
                old = [contents[which][i : i + 1] for i in at]
                for i in at:
                    put(i, bytes([rng.randrange(256)]))
                if rng.random() < 0.95:  # mostly put back: valid, then not, then valid again
                    for i, b in zip(at, old, strict=True):
                        put(i, b)
        if shared is not None:
            shared.close()


def touch(state: CheckpointState) -> None:
    """Reads everything a loaded state holds, values included."""
    dict(state.properties)
    if state.is_nominal:  # names and types only: its parameters cannot be read
        state.parameters.names()
        return
    arrays = [p.data for _, p in state.parameters]
    for group in state.optimizer_groups.values():
        arrays += [m for ms in group.momentums.values() for m in ms.values()]
    for values in map(np.asarray, arrays):
        if values.dtype == object:
            [str(x) for x in values.ravel()]
        else:
            values.tobytes()


def read_loop(path: str, seconds: float, mode: str) -> dict[str, Any]:
    """Loads `path` until the time is up; returns how often each outcome happened."""
    outcomes: dict[str, int] = {}
    internal: list[str] = []
    unexpected: list[str] = []
    deadline = time.monotonic() + seconds
    report = time.monotonic()
    with open(path, "rb") as f:
        Path(path + ".reading").touch()  # (the writer starts changing the file now)
        while time.monotonic() < deadline:
            if time.monotonic() > report:  # so far, in case of a crash
                print(json.dumps({"outcomes": outcomes}), flush=True)
                report += 0.2
            shared = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ) if mode == "mmap" else None
            state = None
            try:
                state = CheckpointState.from_bytes(shared) if shared is not None else ortckpt.load_checkpoint(path)
                touch(state)
                outcome = "ok"
            except ortckpt.InternalError as e:
                outcome = "InternalError"
                internal.append(str(e))
            except ortckpt.CheckpointError as e:
                # (whether the decoder saw the bytes change after the verifier passed them)
                outcome = type(e).__name__ + (" (changed)" if "changed while it was being read" in str(e) else "")
            except Exception as e:
                outcome = f"unexpected {type(e).__name__}"
                unexpected.append(repr(e))
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            del state
            if shared is not None:
                with contextlib.suppress(BufferError):  # a failed load's traceback may hold an export
                    shared.close()
    return {"outcomes": outcomes, "internal": internal[:5], "unexpected": unexpected[:5]}


@pytest.mark.parametrize("mode", ["file", "mmap"])
def test_a_checkpoint_changing_while_it_loads_loads_or_fails_typed(tmp_path: Path, mode: str) -> None:
    strings = tmp_path / "strings.ckpt"
    CheckpointState.save_checkpoint(
        CheckpointState.from_arrays(
            {"words": np.array(["un", "deux", "trois"], dtype=object), "w": np.arange(6, dtype=np.float32)},
            properties={"note": "changing bytes", "n": 3, "lr": 0.5},
        ),
        strings,
    )
    sources = [GOLDEN / "trained_with_optimizer.ckpt", GOLDEN / "protos_properties.ckpt", strings]
    longest = max(sources, key=lambda s: s.stat().st_size)
    path = tmp_path / "changing.ckpt"
    path.write_bytes(longest.read_bytes())

    me = [sys.executable, __file__]
    writer = subprocess.Popen([*me, "writer", str(path), str(SECONDS), mode, *map(str, sources)])
    reader = subprocess.run([*me, "reader", str(path), str(SECONDS), mode], capture_output=True, text=True, check=False)
    assert writer.wait(timeout=60) == 0
    last = reader.stdout.strip().splitlines()[-1:]
    seen = json.loads(last[0]) if last else {"outcomes": {}}
    # A negative return code is a signal: the reader crashed.
    assert reader.returncode == 0, f"the reader died ({reader.returncode}) after {seen}:\n{reader.stderr[-1500:]}"
    print(mode, seen["outcomes"])
    assert seen["outcomes"].get("InternalError", 0) == 0, seen
    assert not seen["unexpected"], seen
    assert seen["outcomes"].get("ok", 0) > 0, seen
    assert sum(seen["outcomes"].values()) > seen["outcomes"]["ok"], f"the writer changed nothing: {seen}"


if __name__ == "__main__":
    role, file, duration, how, *rest = sys.argv[1:]
    if role == "writer":
        write_loop(file, float(duration), how, rest)
    else:
        print(json.dumps(read_loop(file, float(duration), how)))
