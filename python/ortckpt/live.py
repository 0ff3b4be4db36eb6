"""ONNX Runtime's own training state (``onnxruntime.capi._pybind_state.CheckpointState``, "the
ORT state" below), as ortckpt's ``CheckpointState`` meets it in ONNX Runtime's training loop.

ONNX Runtime's ``Module`` and ``Optimizer`` take ``state._state``, the ORT state behind its
Python class, and train its tensors in place. ortckpt's state hands over one on first use: its
checkpoint is written into memory (memfds) and ONNX Runtime loads it (:func:`load_into_ort`),
optimizer state and properties included; from then on the ortckpt state reads and writes the ORT
state (:func:`parameter_data`, :func:`assign_parameter`, :class:`LiveProperties`). ONNX Runtime's
own state objects go through ortckpt's saves and the manager the same way.

The optimizer's moments are reachable from Python only through ONNX Runtime's
``save_checkpoint(state, path, True)``: :func:`saved` has it write into memory and opens that
with ortckpt's loader, a consistent copy of everything (the Module trains on meanwhile).

This module knows ONNX Runtime's objects and the memory files; ``checkpoint_state`` builds its
states on it. ONNX Runtime is imported here only, and only for a state that meets it: ortckpt
never depends on it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping
from typing import Any, NamedTuple

import numpy as np

from . import _boundary, safe_io
from . import dtypes as _dt
from .errors import CheckpointStateError

# One binding at a time: two threads handing one state to two Modules get the same ORT state.
BINDING = threading.Lock()

# Past this many bytes of values, a checkpoint handed to ONNX Runtime in memory has an external data
# file, as files do (ONNX Runtime reads `<checkpoint>.data`); a test lowers it to take that path.
EXTERNAL_DATA_THRESHOLD = _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD


def is_ort_state(value: Any) -> bool:
    """ONNX Runtime's ``CheckpointState`` (its Python class or the ORT state behind it),
    recognised without importing ONNX Runtime."""
    module = type(value).__module__ or ""
    return type(value).__name__ == "CheckpointState" and module.startswith("onnxruntime.")


def ort_state_of(value: Any) -> Any:
    """The ORT state of ONNX Runtime's Python ``CheckpointState``, or the ORT state itself."""
    inner = getattr(value, "_state", value)
    return inner if is_ort_state(inner) else value


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


def load_into_ort(core: _boundary.CoreState) -> Any:
    """An ORT state of ``core`` (what ``CheckpointState.core_state`` gives): written into memory as
    ortckpt saves it, each tensor's bytes copied once, then loaded by ONNX Runtime."""
    C = _training_api()
    main, external = _boundary.encode_segments(core, external_data_threshold=EXTERNAL_DATA_THRESHOLD)
    with safe_io.memory_checkpoint() as path:
        safe_io.write_memory_checkpoint(path, main, external)
        return C.load_checkpoint(str(path))


def saved(ort_state: Any, include_optimizer_state: bool) -> _boundary.Loaded:
    """Everything ``ort_state`` holds now, as ONNX Runtime saves it (into memory), opened by
    ortckpt's loader: a copy that later training does not change (mapped: the memory stays
    while its views do)."""
    C = _training_api()
    with safe_io.memory_checkpoint() as path:
        C.save_checkpoint(ort_state, str(path), include_optimizer_state)
        return _boundary.load(path)


class ParameterRecord(NamedTuple):
    name: str
    code: int
    dims: tuple[int, ...]
    requires_grad: bool


def parameter_records(ort_state: Any) -> list[ParameterRecord]:
    """Every parameter of ``ort_state`` (not nominal), in its order."""
    records = []
    for name in ort_state.parameter_names():
        parameter = ort_state.get_parameter(name)
        value = parameter.data.numpy()
        records.append(ParameterRecord(name, _dt.code_of(value), tuple(value.shape), bool(parameter.requires_grad)))
    return records


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


def parameter_data(ort_state: Any, name: str) -> np.ndarray:
    """The parameter's values: ONNX Runtime's buffer (a NumPy view on the CPU, made anew on each
    use, as ONNX Runtime's ``Parameter.data`` does)."""
    values: np.ndarray = ort_state.get_parameter(name).data.numpy()
    return values


def parameter_grad(ort_state: Any, name: str) -> np.ndarray | None:
    """ONNX Runtime's gradient of the parameter (None before a training step computed one)."""
    grad = ort_state.get_parameter(name).grad
    return grad.numpy() if grad.has_value() else None


def assign_parameter(ort_state: Any, name: str, values: np.ndarray) -> None:
    """Copies ``values`` (checked: the parameter's dtype and shape) into ONNX Runtime's buffer:
    through the view where it is one (the CPU), else as ONNX Runtime's own
    ``Parameters.__setitem__`` does (its ``copy_parameter_from``)."""
    values = np.ascontiguousarray(values)
    target = parameter_data(ort_state, name)
    if target.flags.writeable:
        np.copyto(target, values)
        return
    from onnxruntime.capi.onnxruntime_inference_collection import OrtValue

    ort_state.copy_parameter_from(name, OrtValue.ortvalue_from_numpy(values)._ortvalue)


class LiveProperties(MutableMapping[str, _boundary.PropertyValue]):
    """The properties of an ORT state, as ortckpt's state keeps its own (values already checked
    and rounded as a file holds them)."""

    def __init__(self, ort_state: Any) -> None:
        self._ort_state = ort_state

    def __getitem__(self, name: str) -> _boundary.PropertyValue:
        if not self._ort_state.has_property(name):
            raise KeyError(name)
        value: _boundary.PropertyValue = self._ort_state.get_property(name)
        return value

    def __setitem__(self, name: str, value: _boundary.PropertyValue) -> None:
        self._ort_state.add_property(name, value)

    def __delitem__(self, name: str) -> None:
        raise CheckpointStateError(f"property {name}: ONNX Runtime's state cannot remove a property")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(self._ort_state.has_property(name))

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._ort_state.property_names()))

    def __len__(self) -> int:
        return len(self._ort_state.property_names())
