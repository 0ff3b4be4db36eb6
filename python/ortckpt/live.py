"""States that ONNX Runtime trains: the bridge between ortckpt's ``CheckpointState`` and ONNX
Runtime's own (``onnxruntime.capi._pybind_state.CheckpointState``, "the ORT state" below), on
ONNX Runtime's side: what ONNX Runtime loads and saves, in memory, and :class:`LiveBacking`, the
backing (``ortckpt.backings``) of a state whose values are ONNX Runtime's.

ONNX Runtime's ``Module`` and ``Optimizer`` take the ORT state behind its Python class (its
``_state`` attribute) and train its tensors in place. So ortckpt's state hands over one on first use:
:func:`bind` writes the state's backing into memory (memfds), ONNX Runtime loads it, optimizer
state and properties included, and the state replaces its backing with the :class:`LiveBacking`
returned. From then on ``parameters`` are zero-copy views of what the Module trains
(:class:`LiveTensor`) and ``properties`` are ONNX Runtime's (:class:`LiveProperties`). ONNX
Runtime's own state objects go through ortckpt's saves and the manager the same way
(:func:`adopt`).

The optimizer's moments are reachable from Python only through ONNX Runtime's
``save_checkpoint(state, path, True)``: :func:`saved_by_ort` has it write into memory, which
:func:`snapshot` opens with ortckpt's loader, a consistent copy of everything (the Module trains
on meanwhile).

This module never imports the checkpoint state (which imports it, on first use): it deals in
backings. ONNX Runtime is imported here only, and only for a state that meets it: ortckpt never
depends on it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np

from . import _boundary, safe_io
from . import dtypes as _dt
from ._boundary import DEFAULT_EXTERNAL_DATA_THRESHOLD, CoreState, PropertyValue, TensorRecord
from .backings import Backing
from .backings.arrays import ArraysBacking
from .backings.mapped import MappedBacking
from .backings.tensors import OptimizerGroup, Tensor
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


def bind(backing: Backing) -> LiveBacking:
    """ONNX Runtime's state loaded from ``backing`` (parameters, optimizer state, properties
    written into memory), as the backing that replaces it: names, types, shapes, the frozen set
    and what the file was stay ``backing``'s (ONNX Runtime's cannot tell them for a nominal
    state, nor the type of every tensor)."""
    C = _training_api()
    records = backing.records()
    core = backing.core_state(include_optimizer_state=True)
    with _memory_checkpoint() as files:
        files.write(core)
        try:
            ort_state = C.load_checkpoint(files.path)
        except RuntimeError as e:
            refused = _refused_type(core, str(e))
            if refused is None:
                raise
            raise refused from None
    return LiveBacking(
        ort_state,
        records,
        nominal=backing.is_nominal,
        has_external_data=backing.has_external_data,
        format_version=backing.format_version,
    )


def adopt(ort_state: Any) -> Backing:
    """A backing over ONNX Runtime's own state (live); of a nominal one, a copy (it has no values
    to show)."""
    if is_nominal(ort_state):
        return snapshot(ort_state, include_optimizer_state=True)
    records = []
    for name in ort_state.parameter_names():
        parameter = ort_state.get_parameter(name)
        value = parameter.data.numpy()
        records.append(TensorRecord(name, _dt.code_of(value), tuple(value.shape), bool(parameter.requires_grad)))
    return LiveBacking(ort_state, records)


def snapshot(ort_state: Any, include_optimizer_state: bool) -> MappedBacking:
    """A copy of everything ``ort_state`` holds now, as ONNX Runtime saves it (into memory),
    opened by ortckpt: a backing of its own that later training does not change."""
    with saved_by_ort(ort_state, include_optimizer_state) as path:
        return MappedBacking(_boundary.load(path))  # (mapped: the memory stays while the backing does)


@contextlib.contextmanager
def memory_files() -> Iterator[_MemoryFiles]:
    """A checkpoint and its data file in memory (memfds), for the block: what :func:`write_into`
    fills (in another process, a fork of this one) and :func:`opened` opens."""
    with _memory_checkpoint() as files:
        yield files


def write_into(ort_state: Any, files: _MemoryFiles, directory: Path) -> None:
    """ONNX Runtime's full save of ``ort_state`` written into ``files`` (made by
    :func:`memory_files`, here or in the process this one forked from), given to its saver by
    descriptor through the scratch ``directory``."""
    C = _training_api()
    linked = _MemoryFiles(directory, linked=files.descriptors())
    try:
        C.save_checkpoint(ort_state, linked.path, True)
    finally:
        linked.close()


def opened(files: _MemoryFiles) -> MappedBacking:
    """What :func:`write_into` wrote into ``files``, opened by ortckpt (as :func:`snapshot`)."""
    return MappedBacking(_boundary.load(files.path))


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
    staging = _boundary.stage(Path(path), with_data=True)
    try:
        write_staged(ort_state, staging)
        staging.seal()
        staging.commit(durable=durable, lock_timeout=lock_timeout)
    except BaseException:
        staging.discard()  # (the previous checkpoint stands)
        raise
    return True


def write_staged(ort_state: Any, staging: _boundary.Staging, directory: Path | None = None) -> None:
    """ONNX Runtime's full save of ``ort_state`` written into ``staging``'s temporary files
    (given to its saver by descriptor, through the scratch ``directory``: a new one by default),
    not sealed: what :func:`save_through_ort` and a forked save (:mod:`ortckpt.forked_save`, in
    its child) both have ONNX Runtime do."""
    C = _training_api()
    with contextlib.ExitStack() as scratch:
        if directory is None:
            directory = scratch.enter_context(safe_io.scratch_directory())
        files = _MemoryFiles(directory, linked=(staging.fileno(), staging.fileno(data=True)))
        try:
            C.save_checkpoint(ort_state, files.path, True)
        finally:
            files.close()


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

    def descriptors(self) -> tuple[int, int]:
        """The memfds of the checkpoint and its data file."""
        main, data = self._fds
        return main, data

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


class LiveTensor(Tensor):
    """A parameter of an ORT state: its values are ONNX Runtime's buffer (a NumPy view, made
    anew on each use, as ONNX Runtime's ``Parameter.data`` does); setting values copies into it."""

    __slots__ = ("ort_state",)

    def __init__(self, ort_state: Any, name: str, code: int, dims: tuple[int, ...]) -> None:
        super().__init__(name, code, dims)
        self.ort_state = ort_state

    def value(self) -> np.ndarray:
        values: np.ndarray = self.ort_state.get_parameter(self.name).data.numpy()
        return values

    def grad(self) -> np.ndarray | None:
        grad = self.ort_state.get_parameter(self.name).grad
        return grad.numpy() if grad.has_value() else None

    def assign(self, value: Any) -> None:
        """Copies ``value`` into ONNX Runtime's buffer: through the view where it is one (the CPU),
        else as ONNX Runtime's own ``Parameters.__setitem__`` does (its ``copy_parameter_from``)."""
        values = np.ascontiguousarray(self.checked(value))
        data = self.ort_state.get_parameter(self.name).data
        # Only the CPU's numpy() is a view ("Cpu" in 1.19): elsewhere it is a writable copy, and
        # copying into that would change nothing.
        if str(data.device_name()).lower() == "cpu":
            target = data.numpy()
            if target.flags.writeable:
                np.copyto(target, values)
                return
        from onnxruntime.capi.onnxruntime_inference_collection import OrtValue

        # (OrtValue's private _ortvalue: what ONNX Runtime's own Parameters.__setitem__ passes)
        self.ort_state.copy_parameter_from(self.name, OrtValue.ortvalue_from_numpy(values)._ortvalue)


class LiveProperties(MutableMapping[str, PropertyValue]):
    """The properties of an ORT state, as ortckpt's state keeps its own (values already
    checked and rounded as a file holds them)."""

    def __init__(self, ort_state: Any) -> None:
        self.ort_state = ort_state

    def __getitem__(self, name: str) -> PropertyValue:
        if not self.ort_state.has_property(name):
            raise KeyError(name)
        value: PropertyValue = self.ort_state.get_property(name)
        return value

    def __setitem__(self, name: str, value: PropertyValue) -> None:
        self.ort_state.add_property(name, value)

    def __delitem__(self, name: str) -> None:
        raise CheckpointStateError(f"property {name}: ONNX Runtime's state cannot remove a property")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(self.ort_state.has_property(name))

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.ort_state.property_names()))

    def __len__(self) -> int:
        return len(self.ort_state.property_names())


class LiveBacking(ArraysBacking):
    """The backing of a state ONNX Runtime trains: its tensors and properties are the ORT
    state's; its optimizer state is ONNX Runtime's Optimizer's, reachable only as a copy."""

    def __init__(
        self,
        ort_state: Any,
        records: list[TensorRecord],
        *,
        nominal: bool = False,
        has_external_data: bool = False,
        format_version: int = _boundary.CHECKPOINT_VERSION,
    ) -> None:
        tensors = {r.name: LiveTensor(ort_state, r.name, r.code, r.dims) for r in records}
        frozen = {r.name for r in records if not r.requires_grad}
        super().__init__(tensors, frozen, LiveProperties(ort_state), nominal)
        self.ort_state = ort_state
        self.format_version = format_version
        # (the loaded file's: exporting for inference writes external data as ONNX Runtime would)
        self._external_data = has_external_data

    @property
    def has_external_data(self) -> bool:  # type: ignore[override]
        return self._external_data

    @property
    def is_nominal(self) -> bool:
        """Of a nominal state, asked of ONNX Runtime until its Module has given it values (and
        shapes, which a nominal checkpoint may not hold: taken then)."""
        if self.nominal:
            self.nominal = is_nominal(self.ort_state)
            if not self.nominal:
                tensors = list(self.tensors.values())
                self.tensors = {
                    t.name: LiveTensor(self.ort_state, t.name, t.code, tuple(t.value().shape)) for t in tensors
                }
        return self.nominal

    def records(self) -> list[TensorRecord]:
        self.is_nominal  # noqa: B018 (a state ONNX Runtime has just filled takes its shapes)
        return super().records()

    @property
    def optimizer_groups(self) -> dict[str, OptimizerGroup]:
        """A copy of its optimizer's state now (ONNX Runtime saves it into memory)."""
        return snapshot(self.ort_state, include_optimizer_state=True).optimizer_groups

    def set_optimizer_groups(self, groups: Mapping[str, OptimizerGroup]) -> None:
        raise CheckpointStateError(
            "the optimizer state of a state ONNX Runtime trains is its Optimizer's: set it before "
            "the state is handed to a Module (or load a checkpoint that has it)"
        )

    def settled(self, include_optimizer_state: bool) -> Backing:
        """With the optimizer state, the moments are ONNX Runtime's to save: a copy of everything,
        taken now, in memory."""
        return snapshot(self.ort_state, include_optimizer_state=True) if include_optimizer_state else self

    def core_state(self, include_optimizer_state: bool) -> CoreState:
        if include_optimizer_state:
            return self.settled(True).core_state(True)
        return super().core_state(False)
