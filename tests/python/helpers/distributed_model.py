"""A small model split across ranks, shared by the in-process and the MPI/torch tests of
sharded checkpoints: every rank can compute the whole tensors, so each checks its own part.

- ``embedding`` (13, 4) float32, split by rows; ``proj`` (3, 10) float32, split by columns;
  both trainable, with AdamW momentums split alike.
- ``bias`` (4,) float32, trainable, replicated on every rank (written once).
- ``scale_<r>`` () float64, frozen, held by rank r only.
- properties: epoch and a name; group0 with the step and learning rate.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from ortckpt import CheckpointState, OptimizerGroup
from ortckpt.distributed import Slice, save_sharded

SPLIT = {"embedding": ((13, 4), 0), "proj": ((3, 10), 1)}


def whole_tensors(step: int, world_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    out = {name: rng.standard_normal(shape).astype(np.float32) for name, (shape, _) in SPLIT.items()}
    out["bias"] = rng.standard_normal(4).astype(np.float32)
    for r in range(world_size):
        out[f"scale_{r}"] = np.array(r + step / 1000, dtype=np.float64)
    for name, (shape, _) in SPLIT.items():
        out[f"{name}/momentum0"] = rng.standard_normal(shape).astype(np.float32)
        out[f"{name}/momentum1"] = rng.random(shape).astype(np.float32)
    out["bias/momentum0"] = rng.standard_normal(4).astype(np.float32)
    out["bias/momentum1"] = rng.random(4).astype(np.float32)
    return out


def rank_state(
    step: int, rank: int, world_size: int, extra_frozen: dict[str, np.ndarray] | None = None
) -> tuple[CheckpointState, dict[str, Slice]]:
    """What ``rank`` holds at ``step``: its parts of the split tensors, the bias, its scale
    (and ``extra_frozen``)."""
    whole = whole_tensors(step, world_size)
    slices = {name: Slice.split(shape, rank, world_size, dim) for name, (shape, dim) in SPLIT.items()}
    trainable = {name: whole[name][s.index].copy() for name, s in slices.items()}
    trainable["bias"] = whole["bias"]
    state = CheckpointState.from_arrays(
        trainable,
        {f"scale_{rank}": whole[f"scale_{rank}"], **(extra_frozen or {})},
        {"epoch": step // 10, "run": "sharded-test"},
    )
    momentums = {
        name: {
            m: whole[f"{name}/{m}"][slices[name].index].copy() if name in slices else whole[f"{name}/{m}"]
            for m in ("momentum0", "momentum1")
        }
        for name in trainable
    }
    state.optimizer_groups["group0"] = OptimizerGroup(step=step, initial_learning_rate=1e-3, momentums=momentums)
    return state, slices


def check_part(state: CheckpointState, slices: dict[str, Slice], step: int, saved_world: int) -> list[str]:
    """Problems found comparing a loaded part with the whole tensors it is a part of ([] when none)."""
    whole = whole_tensors(step, saved_world)
    problems = []
    if set(slices) != set(state.parameters.names()):
        problems.append(f"slices for {sorted(slices)}, parameters {sorted(state.parameters.names())}")
    for name, part in slices.items():
        expected = whole[name][part.index]
        got = state.parameters[name].data
        if got.dtype != expected.dtype or not np.array_equal(got, expected):
            problems.append(f"{name}{part.index}: values differ")
        trainable = not name.startswith("scale_")
        if state.parameters[name].requires_grad != trainable:
            problems.append(f"{name}: requires_grad {state.parameters[name].requires_grad}")
        if trainable:
            moms = state.optimizer_groups["group0"].momentums.get(name, {})
            for m in ("momentum0", "momentum1"):
                if m not in moms or not np.array_equal(moms[m], whole[f"{name}/{m}"][part.index]):
                    problems.append(f"{name}/{m}{part.index}: values differ")
    group = state.optimizer_groups["group0"]
    if group.step != step or not np.isclose(group.initial_learning_rate, 1e-3, rtol=1e-6):
        problems.append(f"group0: step {group.step}, learning rate {group.initial_learning_rate}")
    properties = dict(state.properties)
    properties.pop("step", None)  # what a CheckpointManager adds
    if properties != {"epoch": step // 10, "run": "sharded-test"}:
        problems.append(f"properties {dict(state.properties)}")
    return problems


# --- ranks as threads of one process (the in-process tests) ---------------------------------------


class ThreadWorld:
    """Ranks as threads: collectives meet at a barrier; objects are pickled on the way, as MPI does."""

    def __init__(self, size: int, timeout: float = 30) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Any] = [None] * size

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.size

    def barrier(self) -> None:
        self.world._barrier.wait()

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        self.world._slots[self.rank] = pickle.dumps(obj)
        self.barrier()
        out = [pickle.loads(b) for b in self.world._slots] if self.rank == root else None
        self.barrier()
        return out

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        if self.rank == root:
            self.world._slots[root] = pickle.dumps(obj)
        self.barrier()
        out = pickle.loads(self.world._slots[root])
        self.barrier()
        return out


def on_ranks(size: int, work: Callable[[ThreadComm], Any]) -> list[Any]:
    """Runs ``work(comm)`` on every rank; returns each rank's result or the exception it raised."""
    world = ThreadWorld(size)
    results: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = work(world.comm(rank))
        except BaseException as e:
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in a collective"
    return results


def save_model(directory: Path, step: int, world: int) -> list[Any]:
    def work(comm: ThreadComm) -> Any:
        state, slices = rank_state(step, comm.rank, world)
        return save_sharded(state, directory, step=step, comm=comm, slices=slices, durable=False)

    results = on_ranks(world, work)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
