"""What sharded checkpoints need from a distributed engine, and adapters to the engines users run.

A sharded save needs only this rank's number, the world size, and small collective
messages (each rank's list of tensors, a verdict): the tensor bytes never travel between
ranks, each rank writes its own file. So the interface is four operations, implemented
over mpi4py (Open MPI, MPICH) and torch.distributed (gloo, NCCL), and by a single process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from ..errors import ShardedCheckpointError

Local = TypeVar("Local")
Decision = TypeVar("Decision")


@runtime_checkable
class Communicator(Protocol):
    """The collective operations of a group of ranks; every rank calls each one, in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def barrier(self) -> None: ...

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` (picklable, small), in rank order, on ``root``; None elsewhere."""
        ...

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank."""
        ...


class SingleProcess:
    """A world of one: what ``comm=None`` means when no distributed engine is running."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return obj


class MPICommunicator:
    """An mpi4py communicator (``MPI.COMM_WORLD`` or any sub-communicator)."""

    def __init__(self, comm: Any = None) -> None:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.comm = comm

    @property
    def rank(self) -> int:
        return int(self.comm.Get_rank())

    @property
    def world_size(self) -> int:
        return int(self.comm.Get_size())

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.comm.gather(obj, root=root)

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)


class TorchCommunicator:
    """torch.distributed's default process group, or ``group``; it must be initialised
    (``torch.distributed.init_process_group``). Objects travel as torch's pickled object
    collectives do: on CPU for gloo, on the current CUDA device for NCCL."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first")
        self._dist = dist
        self.group = group

    @property
    def rank(self) -> int:
        return int(self._dist.get_rank(self.group))

    @property
    def world_size(self) -> int:
        return int(self._dist.get_world_size(self.group))

    def _global(self, rank: int) -> int:
        return rank if self.group is None else int(self._dist.get_global_rank(self.group, rank))

    def barrier(self) -> None:
        self._dist.barrier(self.group)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == root else None
        self._dist.gather_object(obj, out, dst=self._global(root), group=self.group)
        return out

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._global(root), group=self.group)
        return box[0]


def communicator(comm: Any = None) -> Communicator:
    """The :class:`Communicator` for ``comm``: one already, an mpi4py communicator, a torch
    process group, or None. None picks the engine that is running: torch.distributed when
    initialised, else MPI when this process was started by an MPI launcher (or mpi4py is
    already imported), else a single process."""
    if comm is None:
        torch_dist = sys.modules.get("torch.distributed")
        if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
            return TorchCommunicator()
        if "mpi4py.MPI" in sys.modules or _launched_by_mpi():
            try:
                return MPICommunicator()
            except ImportError:
                raise RuntimeError(
                    "this process was started by an MPI launcher, but mpi4py is not installed: "
                    "pip install mpi4py, or pass comm="
                ) from None
        return SingleProcess()
    if isinstance(comm, (SingleProcess, MPICommunicator, TorchCommunicator)):
        return comm
    module = type(comm).__module__
    if module.startswith("mpi4py"):
        return MPICommunicator(comm)
    if module.startswith("torch"):
        return TorchCommunicator(comm)
    if isinstance(comm, Communicator):
        return comm
    raise TypeError(
        f"comm: expected an mpi4py communicator, a torch process group or a Communicator, got {type(comm).__name__}"
    )


def _launched_by_mpi() -> bool:
    # Open MPI and MPICH/Hydra set these in every rank they start; a world of one needs no MPI.
    return any(os.environ.get(v, "1") != "1" for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))


def gather_decide_broadcast(
    comm: Communicator,
    what: str,
    local: Callable[[], Local],
    decide: Callable[[list[Local]], Decision],
    *,
    deciding: str,
    on_failure: Callable[[list[Local]], None] | None = None,
) -> Decision:
    """One collective round, as torch.distributed.checkpoint's ``_DistWrapper`` runs them: every
    rank runs ``local()``; rank 0 gathers the results in rank order and, when no rank failed,
    runs ``decide()`` on them; every rank returns what it decided. A failure anywhere raises a
    :class:`ShardedCheckpointError` naming each failed rank on every rank (chained to the rank's
    own error), so no rank is left waiting in a collective the others skipped. ``on_failure``
    runs on rank 0 first, with the results of the ranks that succeeded (to remove what the round
    left); ``deciding`` names rank 0's part."""
    failure: BaseException | None = None  # this rank's own error, chained to what it raises
    mine: tuple[bool, Any]
    try:
        mine = (True, local())
    except Exception as e:
        failure, mine = e, (False, one_line(e))
    gathered = comm.gather(mine)
    verdict: tuple[bool, Any] | None = None
    if comm.rank == 0:
        assert gathered is not None
        failures = {r: msg for r, (ok, msg) in enumerate(gathered) if not ok}
        if not failures:
            try:
                verdict = (True, decide([value for _, value in gathered]))
            except Exception as e:
                failure, failures = e, {0: f"{deciding}: {one_line(e)}"}
        if failures:
            verdict = (False, failures)
            if on_failure is not None:
                on_failure([value for ok, value in gathered if ok])
    verdict = comm.broadcast(verdict)
    assert verdict is not None
    if not verdict[0]:
        raise ShardedCheckpointError(what, verdict[1]) from failure
    return verdict[1]  # type: ignore[no-any-return]


def root_decides(comm: Communicator, what: str, decide: Callable[[], Decision]) -> Decision:
    """Rank 0 runs ``decide()`` alone and every rank gets the result. When it fails, rank 0
    raises its own error and the other ranks a :class:`ShardedCheckpointError` naming it."""
    failure: BaseException | None = None
    verdict: tuple[bool, Any] | None = None
    if comm.rank == 0:
        try:
            verdict = (True, decide())
        except Exception as e:
            failure, verdict = e, (False, one_line(e))
    verdict = comm.broadcast(verdict)
    assert verdict is not None
    if not verdict[0]:
        if failure is not None:
            raise failure
        raise ShardedCheckpointError(what, {0: verdict[1]})
    return verdict[1]  # type: ignore[no-any-return]


def one_line(e: BaseException) -> str:
    """An error as one line of text: what travels between ranks."""
    return f"{type(e).__name__}: {e}".strip().replace("\n", " | ")
