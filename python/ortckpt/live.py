"""States that ONNX Runtime trains: the bridge between ortckpt's ``CheckpointState`` and ONNX
Runtime's own (``onnxruntime.capi._pybind_state.CheckpointState``, "the ORT state" below), on
ONNX Runtime's side: what ONNX Runtime loads and saves, in memory.

ONNX Runtime's ``Module`` and ``Optimizer`` take ``state._state``, the ORT state behind its
Python class, and train its tensors in place. So ortckpt's state hands over one on first use
(:func:`bind`): its checkpoint is written into memory (memfds) and ONNX Runtime loads it, optimizer
state and properties included. From then on the ortckpt state reads and writes the ORT state
(``checkpoint_state.LiveTensor`` and ``LiveProperties``): ``parameters`` are zero-copy views of
what the Module trains, ``properties`` are ONNX Runtime's. ONNX Runtime's own state objects go
through ortckpt's saves and the manager the same way (``checkpoint_state.adopt``).

The optimizer's moments are reachable from Python only through ONNX Runtime's
``save_checkpoint(state, path, True)``: :func:`saved_by_ort` has it write into memory, which
``checkpoint_state.ort_snapshot`` opens with ortckpt's loader, a consistent copy of everything
(the Module trains on meanwhile).

This module never imports the checkpoint state (which imports it, on first use): it takes
ortckpt's state as it comes. ONNX Runtime is imported here only, and only for a state that
meets it: ortckpt never depends on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import dtypes as _dt
from . import safe_io
from ._boundary import DEFAULT_EXTERNAL_DATA_THRESHOLD
from .errors import CheckpointStateError, UnsupportedDataTypeError


def is_ort_state(value: Any) -> bool:
    """ONNX Runtime's ``CheckpointState`` (its Python class or the ORT state behind it),
    recognised without importing ONNX Runtime."""
    module = type(value).__module__ or ""
    return type(value).__name__ == "CheckpointState" and module.startswith("onnxruntime.")


def ort_state_of(value: Any) -> Any:
    """The ORT state of ONNX Runtime's Python ``CheckpointState`` or of the ORT state itself."""
    inner = getattr(value, "_state", value)
    return inner if is_ort_state(inner) else value


def bind(state: Any) -> Any:
    """The ORT state for ``state`` (ortckpt's ``CheckpointState``): its checkpoint (parameters,
    optimizer state, properties) written into memory and loaded by ONNX Runtime. ``state`` is
    then live over it."""
    C = _training_api()
    with _binding:
        if state._ort is not None:  # (bound meanwhile, by another thread)
            return state._ort
        core = state.core_state(include_optimizer_state=True)
        with _memory_checkpoint() as files:
            files.write(core)
            try:
                ort_state = C.load_checkpoint(files.path)
            except RuntimeError as e:
                refused = _refused_type(core, str(e))
                if refused is None:
                    raise
                raise refused from None
        state._go_live(ort_state)
    return ort_state


def _refused_type(core: Any, message: str) -> UnsupportedDataTypeError | None:
    """ONNX Runtime's "Unsupported data type: N" (its loader takes fewer types than the format
    holds: no FLOAT16, BFLOAT16, FLOAT8, 4-bit or STRING tensors in 1.19), naming the tensor."""
    found = re.search(r"Unsupported data type: (\d+)", message)
    if found is None:
        return None
    code = int(found.group(1))
    tensors = [(name, c) for name, c, _dims, _values in [*core.trainable, *core.frozen]]
    for group, _step, _lr, states in core.groups:
        tensors += [(f"{param}/{m} (optimizer group {group})", c) for param, moms in states for m, c, *_ in moms]
    names = [name for name, c in tensors if c == code] or ["?"]
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return UnsupportedDataTypeError(
        f"tensor {names[0]}{more}: ONNX Runtime's Module cannot take {_dt.name_of(code)} tensors (its "
        "checkpoint loader refuses them); convert them to a type it loads before handing the state to a Module"
    )


# One binding at a time: two threads handing one state to two Modules get the same ORT state.
_binding = threading.Lock()

# Past this many bytes of values, a bound state's memory checkpoint has an external data file, as files
# do (ONNX Runtime reads `<checkpoint>.data`); a test lowers it to take that path with small states.
EXTERNAL_DATA_THRESHOLD = DEFAULT_EXTERNAL_DATA_THRESHOLD


@contextlib.contextmanager
def saved_by_ort(ort_state: Any, include_optimizer_state: bool) -> Iterator[str]:
    """The path of what ``ort_state`` holds now, as ONNX Runtime saves it (into memory), for the
    block: open it there (a mapping of it stays valid after)."""
    C = _training_api()
    with _memory_checkpoint() as files:
        C.save_checkpoint(ort_state, files.path, include_optimizer_state)
        yield files.path


def save_through_ort(
    ort_state: Any, path: str | os.PathLike[str], *, durable: bool = False, lock_timeout: float | None = None
) -> bool:
    """A full save (parameters and optimizer state) of ``ort_state`` to the file ``path``,
    ONNX Runtime's saver writing straight into the staged temporary files of ortckpt's one
    commit, which seals them (checksums over the page cache, pair trailers) and puts them in
    place: atomic, with nothing held in memory beyond what ONNX Runtime's own save holds (no
    serialised copy, no second pass through a writer). The file is ONNX Runtime's layout: an
    external data file when its state was loaded with one. False (nothing done) where ONNX
    Runtime cannot be given the staged files by descriptor (no ``/proc``)."""
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return False
    from . import _boundary

    C = _training_api()
    staging = _boundary.stage(Path(path), with_data=True)
    try:
        with safe_io.scratch_directory() as directory:
            files = _MemoryFiles(directory, linked=(staging.fileno(), staging.fileno(data=True)))
            try:
                C.save_checkpoint(ort_state, files.path, True)
            finally:
                files.close()
        staging.seal()
        staging.commit(durable=durable, lock_timeout=lock_timeout)
    except BaseException:
        staging.discard()  # (the previous checkpoint stands)
        raise
    return True


def _training_api() -> Any:
    """ONNX Runtime's training bindings (imported here only: ortckpt never depends on them)."""
    try:
        from onnxruntime.capi import _pybind_state as C
    except ImportError as e:
        raise ImportError(f"ONNX Runtime's Module and Optimizer need onnxruntime-training: {e}") from e
    if not hasattr(C, "load_checkpoint"):
        raise ImportError(
            "the onnxruntime installed has no training API (it is the inference package): ONNX Runtime's "
            "Module and Optimizer need onnxruntime-training (the last release: onnxruntime-training-cpu==1.19.2)"
        )
    return C


def is_nominal(ort_state: Any) -> bool:
    """Whether ``ort_state`` has no values (a nominal checkpoint a Module has not filled yet)."""
    names = ort_state.parameter_names()
    if not names:
        return False
    try:
        ort_state.get_parameter(names[0]).data.numpy()
    except RuntimeError:
        return True
    return False


def frozen_names(ort_state: Any) -> set[str]:
    return {name for name in ort_state.parameter_names() if not ort_state.get_parameter(name).requires_grad}


class _MemoryFiles:
    """A checkpoint and its external data file in memory (memfds), at a path ONNX Runtime can
    open (``<dir>/checkpoint`` and ``<dir>/checkpoint.data``, symlinks to the memfds in a
    private scratch directory, which a killed process leaves to the next to remove). Without
    memfds (not Linux): plain files in that directory.

    ONNX Runtime is given the directory through its descriptor (``/proc/<pid>/fd/N``), not its
    name: in a TMPDIR others may write, the directory renamed away and another put in its place
    changes nothing (ONNX Runtime would write the checkpoint wherever that one's symlinks lead).

    With ``linked`` (two open descriptors, not taken over): the two names lead to those files
    instead (a staged save's temporaries) rather than to memfds."""

    def __init__(self, directory: Path, linked: tuple[int, int] | None = None) -> None:
        self._fds: list[int] = []
        self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            made = os.fstat(self._dir_fd)
            if made.st_uid != os.getuid() or made.st_mode & 0o077:  # (not the one made for us)
                raise CheckpointStateError(f"{directory}: replaced as it was made (TMPDIR is writable by others)")
            memory = hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")
            by_descriptor = memory or linked is not None
            self.path = os.path.join(
                f"/proc/{os.getpid()}/fd/{self._dir_fd}" if by_descriptor else directory, "checkpoint"
            )
            for k, name in enumerate(("checkpoint", "checkpoint.data") if by_descriptor else ()):
                if linked is None:
                    fd = os.memfd_create("ortckpt-" + name, os.MFD_CLOEXEC)
                    self._fds.append(fd)
                else:
                    fd = linked[k]
                os.symlink(f"/proc/{os.getpid()}/fd/{fd}", name, dir_fd=self._dir_fd)
        except BaseException:
            self.close()
            raise

    def write(self, core: Any) -> None:
        """``core`` (a ``_boundary.CoreState``) as ortckpt saves it, each tensor's bytes copied once."""
        from . import _boundary

        main, external = _boundary.encode_segments(core, external_data_threshold=EXTERNAL_DATA_THRESHOLD)
        with open(self.path, "r+b" if self._fds else "wb") as out:
            for segment in main:
                out.write(segment)
        if external is not None:
            size, parts = external
            with open(self.path + ".data", "r+b" if self._fds else "wb") as out:
                out.truncate(size)
                for offset, segment in parts:
                    out.seek(offset)
                    out.write(segment)

    def close(self) -> None:
        for fd in [*self._fds, self._dir_fd]:
            os.close(fd)


@contextlib.contextmanager
def _memory_checkpoint() -> Iterator[_MemoryFiles]:
    with safe_io.scratch_directory() as directory:
        files = _MemoryFiles(directory)
        try:
            yield files
        finally:
            files.close()
