"""Sharded checkpoints across the ranks of a distributed job (MPI or torch.distributed).

Every rank writes the part of the state it holds, in parallel, as an ordinary ONNX Runtime
checkpoint; rank 0 commits the step with an index once every rank has finished::

    from mpi4py import MPI
    from ortckpt.distributed import Slice, save_sharded, load_sharded, merge

    rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    part = Slice.split(embedding_shape, rank, world)          # this rank's rows
    state = CheckpointState.from_arrays({"embedding": embedding_rows, "bias": bias})
    save_sharded(state, "ckpts", step=100, slices={"embedding": part})

    state, slices = load_sharded("ckpts")                     # the latest step; any world size
    merge("ckpts", "model.ckpt")                              # one file ONNX Runtime loads
"""

from .comm import (
    Communicator,
    MPICommunicator,
    ShardedCheckpointError,
    SingleProcess,
    TorchCommunicator,
    communicator,
)
from .layout import INDEX_NAME, Slice, shard_file_name
from .sharded import (
    committed_steps,
    latest_step,
    load_sharded,
    merge,
    remove_leftovers,
    save_sharded,
    step_directory,
)

__all__ = [
    "INDEX_NAME",
    "Communicator",
    "MPICommunicator",
    "ShardedCheckpointError",
    "SingleProcess",
    "Slice",
    "TorchCommunicator",
    "committed_steps",
    "communicator",
    "latest_step",
    "load_sharded",
    "merge",
    "remove_leftovers",
    "save_sharded",
    "shard_file_name",
    "step_directory",
]
