"""One rank of a sharded-checkpoint test job, started by mpirun (engine ``mpi``) or torchrun
(engine ``torch``). Prints one JSON line: this rank's findings (an empty list when all is well).

    worker.py ENGINE MODE DIRECTORY STEP [SAVED_WORLD]

Modes: ``save`` (this rank's part of the test model at STEP), ``load`` (the latest step,
checked against the model saved by SAVED_WORLD ranks), ``die`` (rank 1 kills itself with
SIGKILL while its shard is being written), ``resume`` (load the latest, then save STEP),
``manager`` (a CheckpointManager with comm= saving steps STEP and 2*STEP, then restoring).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "helpers"))
from distributed_model import check_part, rank_state
from ortckpt import CheckpointManager
from ortckpt.distributed import Slice, latest_step, load_sharded, save_sharded
from ortckpt.distributed import sharded as sharded_module


def connect(engine: str):
    if engine == "mpi":
        from mpi4py import MPI

        return MPI.COMM_WORLD
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.group.WORLD


def kill_while_writing(rank: int) -> None:
    """Makes this rank die (SIGKILL) as soon as its shard's file appears, mid-write."""
    real = sharded_module._write_own_shard

    def write_and_die(store, attempt, state, names, rank_, world, *args):  # type: ignore[no-untyped-def]
        prefix = f"shard-{rank:05d}"

        def watch() -> None:
            while not any(prefix in p.name for p in Path(attempt.folder).iterdir()):
                time.sleep(0.0005)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
        real(store, attempt, state, names, rank_, world, *args)
        time.sleep(5)  # the watcher fires first; never report success
        os.kill(os.getpid(), signal.SIGKILL)

    sharded_module._write_own_shard = write_and_die


def main(engine: str, mode: str, directory: str, step: int, saved_world: int) -> None:
    comm = connect(engine)
    if engine == "mpi":
        rank, world = comm.Get_rank(), comm.Get_size()
    else:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
    problems: list[str] = []
    if mode in ("save", "die"):
        dying = mode == "die" and rank == 1
        # 256 MiB more on the dying rank, so that the kill lands while bytes are being written.
        extra = {"big": np.ones(64 * 2**20, np.float32)} if dying else {}
        state, slices = rank_state(step, rank, world, extra_frozen=extra)
        if dying:
            kill_while_writing(rank)
        # comm=None: ortckpt finds the engine running (mpirun's environment, torch's default group).
        save_sharded(state, directory, step=step, comm=None, slices=slices)
    elif mode == "load":
        problems = check_part(*load_sharded(directory, comm=comm), step, saved_world)
        problems += resharded_as_expected(directory, comm, rank, world)
    elif mode == "resume":
        problems = check_part(*load_sharded(directory, comm=comm), latest_step(directory), world)
        state, slices = rank_state(step, rank, world)
        save_sharded(state, directory, step=step, comm=comm, slices=slices)
    elif mode == "manager":
        with CheckpointManager(directory, comm=comm, max_to_keep=1) as manager:
            for s in (step, 2 * step):
                state, slices = rank_state(s, rank, world)
                manager.save(state, s, slices=slices)
            problems = check_part(*manager.restore_sharded(), 2 * step, world)
            if manager.all_steps() != [2 * step]:
                problems.append(f"steps kept: {manager.all_steps()}")
    print(json.dumps({"rank": rank, "world": world, "problems": problems}), flush=True)
    if engine == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()  # else gloo's threads may abort the process at exit


def resharded_as_expected(directory: str, comm, rank: int, world: int) -> list[str]:
    _, slices = load_sharded(directory, comm=comm)
    problems = []
    for name, dim in (("embedding", 0), ("proj", 1)):
        if slices[name] != Slice.split(slices[name].global_shape, rank, world, dim):
            problems.append(f"{name}: {slices[name]}")
    return problems


if __name__ == "__main__":
    engine, mode, directory, step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    main(engine, mode, directory, step, int(sys.argv[5]) if len(sys.argv) > 5 else 0)
