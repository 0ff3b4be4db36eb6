"""A process of the concurrency tests: saves, loads or manages checkpoints in a loop and prints
one JSON line of what it saw. Every save writes values that name the save, in the checkpoint file
(a tiny inline tensor and a property) and in the external data file (the large tensor and its
momentum), so a reader can tell a consistent checkpoint from a mix of two saves.

    python concurrency_worker.py save-loop PATH COUNT WRITER_ID
    python concurrency_worker.py save-for PATH SECONDS WRITER_ID
    python concurrency_worker.py load-loop PATH STOP_FILE
    python concurrency_worker.py manager DIR SECONDS WORKER_ID

Warnings are errors here: a reader that skips a step as damaged is a finding too.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import ortckpt
from ortckpt import CheckpointManager, CheckpointState, OptimizerGroup


def state_of(save_id: int) -> CheckpointState:
    """A state whose every tensor and property holds ``save_id``."""
    big = np.full(2048, save_id, np.float64)  # external with threshold 0
    state = CheckpointState.from_arrays({"big": big, "tiny": np.full(2, save_id, np.int64)}, properties={"id": save_id})
    state.optimizer_groups["group0"] = OptimizerGroup(save_id, 0.1, {"big": {"momentum0": big + 0.5}})
    return state


def save_id_of(state: CheckpointState) -> int:
    """The id every part of a loaded state holds; raises AssertionError for a mix of saves."""
    ids = {
        int(state.properties["id"]),
        int(state.parameters["tiny"].data[0]),
        int(state.parameters["big"].data[0]),
        int(state.parameters["big"].data[-1]),
        int(state.optimizer_groups["group0"].momentums["big"]["momentum0"][-1] - 0.5),
        int(state.optimizer_groups["group0"].step),
    }
    assert len(ids) == 1, f"a mix of saves {sorted(ids)}"
    return ids.pop()


def save_loop(path: str, count: int, writer: int) -> dict:
    for i in range(count):
        CheckpointState.save_checkpoint(state_of(writer * 1_000_000 + i), path, True, external_data_threshold=0)
    return {"saves": count}


def save_for(path: str, seconds: float, writer: int) -> dict:
    deadline, count = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        CheckpointState.save_checkpoint(state_of(writer * 1_000_000 + count), path, True, external_data_threshold=0)
        count += 1
    return {"saves": count, "last": writer * 1_000_000 + count - 1}


def load_loop(path: str, stop_file: str) -> dict:
    loads, errors = 0, []
    while not os.path.exists(stop_file) or loads == 0:
        try:
            save_id_of(CheckpointState.load_checkpoint(path))
            loads += 1
        except FileNotFoundError:
            if loads:  # before the first save there is nothing to load
                errors.append("FileNotFoundError after the first save")
        except (ortckpt.CheckpointError, AssertionError, OSError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    return {"loads": loads, "errors": errors[:20], "error_count": len(errors)}


def manager_loop(directory: str, seconds: float, worker: int) -> dict:
    """Alternates between writing (when the directory's writer lock is free) and reading (when it is
    held): a writer saves a few steps, each one newer than the latest; a reader restores the latest
    and verifies it. Reports the steps it committed and every error."""
    from ortckpt import CheckpointDirectoryInUseError

    deadline = time.monotonic() + seconds
    committed, restores, busy, errors = [], 0, 0, []
    while time.monotonic() < deadline:
        try:
            with CheckpointManager(directory, max_to_keep=3, durable=False, external_data_threshold=0) as manager:
                for _ in range(3):
                    step = (manager.latest_step() or 0) + 1
                    manager.save(state_of(step), step, metrics={"worker": worker})
                    committed.append(step)
                    time.sleep(0.01)  # let the others try the lock mid-run
        except CheckpointDirectoryInUseError:
            busy += 1
            try:
                reader = CheckpointManager(directory, read_only=True)
                if reader.latest() is not None:
                    state = reader.restore()
                    step = save_id_of(state)
                    assert state.properties["step"] == step, (state.properties["step"], step)
                    restores += 1
            except Exception as e:
                errors.append(f"reader: {type(e).__name__}: {e}")
        except Exception as e:
            errors.append(f"writer: {type(e).__name__}: {e}")
    return {"committed": committed, "restores": restores, "busy": busy, "errors": errors}


def main() -> None:
    warnings.simplefilter("error")
    mode, *args = sys.argv[1:]
    if mode == "save-loop":
        out = save_loop(args[0], int(args[1]), int(args[2]))
    elif mode == "save-for":
        out = save_for(args[0], float(args[1]), int(args[2]))
    elif mode == "load-loop":
        out = load_loop(args[0], args[1])
    elif mode == "manager":
        out = manager_loop(args[0], float(args[1]), int(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
