"""The drop-in for ``onnxruntime.training.api.CheckpointState``.

Mirrors ONNX Runtime's ``checkpoint_state.py``: the same classes, mapping
behaviour, iteration and error messages, on ortckpt's Rust core. Loaded tensors
are NumPy views over the file's private (copy-on-write) mapping: nothing is
read until used, and writing into ``param.data`` changes the state, as in ONNX
Runtime, without ever touching the file.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from . import _boundary
from . import dtypes as _dt
from ._boundary import PropertyValue, TensorRecord, as_bytes
from .dtypes import PackedBits
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointStateError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    NotACheckpointStateError,
    UnsupportedDataTypeError,
    ValueOverflowError,
    name_file,
)

TensorValue = np.ndarray | PackedBits
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class _Tensor:
    """One tensor of a state: its type and shape, and where its values are.

    Values are either in hand (an array, a PackedBits or an object array of str)
    or, for a loaded tensor not yet used, a byte range of the loaded file.
    """

    __slots__ = ("_mapping", "_nbytes", "_offset", "_value", "code", "dims", "name")

    def __init__(self, name: str, code: int, dims: tuple[int, ...], value: TensorValue | None = None) -> None:
        # No value and no mapping: a tensor of a nominal checkpoint.
        self.name = name
        self.code = code
        self.dims = dims
        self._value = value
        self._mapping: Any = None
        self._offset = 0
        self._nbytes = 0

    @classmethod
    def from_file(cls, name: str, code: int, dims: tuple[int, ...], stored: Any, mappings: tuple[Any, Any]) -> _Tensor:
        """``stored`` as a load gives it (``_boundary.CoreTensor``); ``mappings``: (checkpoint, external data)."""
        tensor = cls(name, code, tuple(dims))
        if isinstance(stored, list):  # STRING: one str per element
            tensor._value = np.array(stored, dtype=object).reshape(tensor.dims)
        elif stored is not None:  # (offset, nbytes, in the external data file?)
            tensor._offset, tensor._nbytes, external = stored
            tensor._mapping = mappings[1] if external else mappings[0]
        return tensor  # stored is None: nominal, no values

    @classmethod
    def from_value(cls, name: str, value: Any) -> _Tensor:
        value = _intake(name, value)
        shape = value.shape if isinstance(value, PackedBits) else tuple(value.shape)
        return cls(name, _dt.code_of(value), shape, value)

    def grad(self) -> np.ndarray | None:
        """None: no training session computes one (see ``LiveTensor``, whose does)."""
        return None

    def value(self) -> TensorValue:
        """The values; a loaded tensor becomes a view over the mapping on first use."""
        if self._value is None:
            self._value = self._view()
        return self._value

    def _view(self) -> TensorValue:
        if self._mapping is None:
            raise CheckpointStateError(f"tensor {self.name} has no values (it is from a nominal checkpoint)")
        dtype = np.dtype(np.uint8) if self.code in _dt.SUB_BYTE_CODES else _dt.numpy_dtype(self.code)
        if self._nbytes == 0 and self.code not in _dt.SUB_BYTE_CODES:
            return np.zeros(self.dims, dtype)
        source, offset = self._mapping, self._offset
        read_range = getattr(source, "read_range", None)
        if read_range is not None:  # an object store's data file, read on first use (object_store.RemoteRanges)
            source, offset = read_range(offset, self._nbytes), 0
        values = np.frombuffer(source, dtype, self._nbytes // dtype.itemsize, offset)
        if self.code in _dt.SUB_BYTE_CODES:
            return PackedBits.of(values, self.dims, self.code)
        return values.reshape(self.dims)

    def assign(self, value: Any) -> None:
        """Copies ``value`` in, as ONNX Runtime's ``copy_from``: same shape and dtype required."""
        value = self.checked(value)
        current = self.value()
        target = current.packed if isinstance(current, PackedBits) else current
        source = value.packed if isinstance(value, PackedBits) else value
        if target.flags.writeable:
            np.copyto(target, source)
        else:  # e.g. a read-only array handed to from_arrays: keep our own copy instead
            self._value = value.copy()

    def checked(self, value: Any) -> TensorValue:
        """``value`` as this tensor's values, if it has its dtype and shape (else a
        ``CheckpointStateError`` naming the parameter)."""
        value = _intake(self.name, value)
        code = _dt.code_of(value)
        if code != self.code:
            raise CheckpointStateError(
                f"Parameter {self.name}: data type mismatch: expected {_dt.name_of(self.code)}, "
                f"got {_dt.name_of(code)} ({_dtype_text(value)})"
            )
        shape = value.shape if isinstance(value, PackedBits) else tuple(value.shape)
        if shape != self.dims:
            raise CheckpointStateError(f"Parameter {self.name}: shape mismatch: expected {self.dims}, got {shape}")
        return value

    def to_core(self, nominal: bool) -> tuple[str, int, tuple[int, ...], Any]:
        """(name, code, dims, values) as ``_boundary.save`` takes them."""
        if nominal:
            return self.name, self.code, self.dims, None
        value = self.value()
        if self.code == _dt.STRING:
            return self.name, self.code, self.dims, _strings_of(self.name, value)
        array = value.packed if isinstance(value, PackedBits) else value
        return self.name, self.code, self.dims, as_bytes(array)


def _intake(name: str, value: Any) -> TensorValue:
    """An array (or PackedBits) of a type the format holds; sub-byte arrays are packed."""
    if isinstance(value, PackedBits):
        return value
    array = np.asarray(value)
    try:
        code = _dt.code_of(array)
    except UnsupportedDataTypeError as e:
        raise UnsupportedDataTypeError(f"tensor {name}: {e}") from None
    if code in _dt.SUB_BYTE_CODES:
        return PackedBits.pack(array)
    if code == _dt.STRING:
        _strings_of(name, array)  # refused now, not at save, when not text
    return array


def _strings_of(name: str, value: Any) -> list[str]:
    """The elements of a STRING tensor as str: str as they are, bytes decoded from UTF-8.
    Anything else is refused rather than saved as its repr (``None`` as "None")."""
    out = []
    for i, element in enumerate(np.asarray(value).reshape(-1)):
        if isinstance(element, str):
            _boundary.check_text(element, f"tensor {name!r}: element {i}", tensor=name)
            out.append(str(element))
        elif isinstance(element, bytes):
            try:
                out.append(element.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise CheckpointStateError(
                    f"tensor {name}: element {i} is not UTF-8 text ({e.reason} at byte "
                    f"{e.start} of {bytes(element[:16])!r}): STRING tensors hold text"
                ) from None
        else:
            raise UnsupportedDataTypeError(
                f"tensor {name}: element {i} is a {type(element).__name__}, not a str: "
                "an object array is saved as a STRING tensor, which holds text only"
            )
    return out


def _dtype_text(value: TensorValue) -> str:
    return "packed int4" if isinstance(value, PackedBits) else str(value.dtype)


class Parameter:
    """A model parameter: its name, data, gradient and whether it is trained.

    Returned by :class:`CheckpointState`; not meant to be built directly. It holds its
    state and name only, and reads the state on each use (so it stays current when values
    are set): a pass over 16k parameters makes 16k of these and drops them, leaving
    nothing per tensor for the garbage collector to walk.
    """

    __slots__ = ("_name", "_state")

    def __init__(self, state: CheckpointState, name: str) -> None:
        self._state = state
        self._name = name

    @property
    def _tensor(self) -> _Tensor:
        return self._state._tensor(self._name)

    @property
    def name(self) -> str:
        """The name of the parameter"""
        return self._name

    @property
    def data(self) -> TensorValue:
        """The data of the parameter: a NumPy view of the checkpoint's bytes (writable,
        copy-on-write), or a :class:`PackedBits` for the sub-byte types (UINT4, INT4, FLOAT4E2M1,
        UINT2, INT2)."""
        state, name = self._state, self._name
        if type(state._tensors[name]) is tuple:  # (state._value inlined: a pass over 16k tensors comes here)
            view = state._views.get(name)
            if view is not None:
                return view
        return state._tensor(name).value()

    @data.setter
    def data(self, value: Any) -> None:
        """Copies ``value`` into the parameter (same shape and dtype required)."""
        self._tensor.assign(value)

    @property
    def grad(self) -> np.ndarray | None:
        """The gradient of the parameter: ONNX Runtime's, once a ``Module`` trains this state
        (None before its first training step), else None: no training session runs here."""
        entry = self._state._tensors[self._name]
        return entry.grad() if isinstance(entry, _Tensor) else None

    @property
    def requires_grad(self) -> bool:
        """Whether or not the parameter requires its gradient to be computed"""
        return self._name not in self._state._frozen

    @property
    def data_type(self) -> str:
        """ONNX's name for the element type (``"FLOAT"``, ``"BFLOAT16"``...)."""
        return _dt.name_of(self._tensor.code)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (for the sub-byte types too, whose ``data`` is packed)."""
        return self._tensor.dims

    def __repr__(self) -> str:
        return f"Parameter(name={self.name}, requires_grad={self.requires_grad})"


class Parameters:
    """All model parameters, by name, like ONNX Runtime's ``Parameters``.

    ``[name]`` gives a :class:`Parameter`, ``[name] = array`` copies values in,
    ``in`` and ``len`` work, and iteration yields ``(name, Parameter)`` sorted by name.
    """

    def __init__(self, state: CheckpointState) -> None:
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        state = self._state
        if name not in state._tensors:
            raise KeyError(f"Parameter {name} not found.")
        if state.is_nominal:
            raise CheckpointError(
                f"Cannot get parameter {name} from a nominal state. Please load the parameter states first."
            )
        return Parameter(state, name)

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self:
            raise KeyError(f"Parameter {name} not found.")
        if self._state.is_nominal:
            raise CheckpointError(
                f"Cannot set parameter {name} of a nominal state. Please load all the parameter states first."
            )
        self._state._tensor(name).assign(value)

    def names(self) -> list[str]:
        """The parameter names, sorted; unlike iteration, this works on nominal states too."""
        return sorted(self._state._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._state._tensors

    def __iter__(self) -> Iterator[tuple[str, Parameter]]:
        state = self._state
        if state.is_nominal:
            for name in state._sorted_names():
                yield name, self[name]  # (raises, as in ONNX Runtime)
            return
        state._make_views()  # (all at once, before the first is used)
        for name in state._sorted_names():
            yield name, Parameter(state, name)

    def __len__(self) -> int:
        return len(self._state._tensors)

    def __repr__(self) -> str:
        return f"Parameters({sorted(self._state._tensors)})"


class Properties:
    """User properties (int, float, str) by name, like ONNX Runtime's ``Properties``.

    As in ONNX Runtime, a bool is stored as an int and a float as float32.
    """

    def __init__(self, state: CheckpointState) -> None:
        self._state = state

    def __getitem__(self, name: str) -> PropertyValue:
        if name not in self:
            raise KeyError(f"Property {name} not found.")
        return self._state._properties[name]

    def __setitem__(self, name: str, value: PropertyValue) -> None:
        if not isinstance(name, str):
            raise TypeError(f"property names are str, got {type(name).__name__}")
        _boundary.check_text(name, "property name")
        self._state._properties[str(name)] = _property_value(name, value)  # (a NumPy str_ name too)

    def __contains__(self, name: object) -> bool:
        return name in self._state._properties

    def get(self, name: str, default: Any = None) -> PropertyValue | Any:
        """The property's value, or ``default`` when there is none (as ``dict.get``)."""
        return self._state._properties.get(name, default)

    def __iter__(self) -> Iterator[tuple[str, PropertyValue]]:
        for name in sorted(self._state._properties):
            yield name, self._state._properties[name]

    def __len__(self) -> int:
        return len(self._state._properties)

    def __repr__(self) -> str:
        return f"Properties({sorted(self._state._properties)})"


def _property_value(name: str, value: Any) -> PropertyValue:
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueOverflowError(f"Property {name!r}: {value} does not fit in int64")
        return value
    if isinstance(value, (float, np.floating)):
        # Stored as float32, so read back as ONNX Runtime does; a finite value past float32's
        # range is refused, not stored as an infinity (NaN and infinities are kept as they are).
        with np.errstate(over="ignore"):
            stored = float(np.float32(value))
        if math.isinf(stored) and math.isfinite(value):
            raise ValueOverflowError(f"Property {name!r}: {value} does not fit in float32 (at most {_FLOAT32_MAX:g})")
        return stored
    if isinstance(value, str):
        _boundary.check_text(value, f"property {name!r}: value")
        return str(value)  # a NumPy str_ as a plain str, as ONNX Runtime gives it back
    raise TypeError(f"Property {name}: properties hold int, float or str, got {type(value).__name__}")


@dataclass
class OptimizerGroup:
    """One optimizer parameter group (ONNX Runtime's AdamW and SGD use ``"group0"``).

    ``momentums`` maps a parameter name to its momentums by name: AdamW keeps
    ``momentum0`` (first moment) and ``momentum1`` (second moment), SGD ``momentum0``.
    Only the *initial* learning rate is stored, as in ONNX Runtime. In a nominal
    checkpoint the momentums have no values: they are ``None``.
    """

    step: int = 0
    initial_learning_rate: float = 0.0
    momentums: dict[str, dict[str, Any]] = field(default_factory=dict)


class CheckpointState:
    """The state of a training session: parameters, optimizer state and properties.

    Create one with :meth:`load_checkpoint` or :meth:`from_arrays`.
    """

    def __init__(self) -> None:
        # name -> tensor; sorted on output, as ONNX Runtime does. A loaded tensor stays the raw
        # entry the load gave until first used, so opening costs little per tensor.
        self._tensors: dict[str, _Tensor | _boundary.CoreTensor] = {}
        self._frozen: set[str] = set()
        self._properties: dict[str, PropertyValue] = {}
        self._groups: dict[str, OptimizerGroup] = {}
        # Optimizer groups of a loaded file, turned into arrays on first access.
        self._pending_groups: list[Any] | None = None
        # The loaded file's mappings (checkpoint, external data), which views keep alive.
        self._mappings: tuple[Any, Any] = (None, None)
        self._nominal = False
        # Views of loaded tensors still held as raw entries in _tensors, made all at once by
        # _make_views (plain arrays and strs: nothing the garbage collector walks); None where
        # the view is made on first use. Read only while the name's entry is raw: once it is a
        # _Tensor (which takes the view along), the _Tensor's value is the one.
        self._views: dict[str, np.ndarray | None] = {}
        self._views_made = False
        self._names: list[str] | None = None  # sorted, as iteration yields them
        # The format version read (1: ONNX Runtime 1.16's); saves always write version 2.
        self._version = _boundary.CHECKPOINT_VERSION
        self._parameters = Parameters(self)
        self._props_view = Properties(self)
        # ONNX Runtime's own state (onnxruntime.capi's CheckpointState) once this one is handed to
        # its Module, or adopted from it: then its values are ONNX Runtime's (see ortckpt.live).
        self._ort: Any = None

    @property
    def _state(self) -> Any:
        """ONNX Runtime's own state behind this one, as ONNX Runtime's ``Module`` and
        ``Optimizer`` take it (``state._state``): on first use, this state (optimizer state and
        properties included) is written into memory and loaded by ONNX Runtime; from then on
        ``parameters`` and ``properties`` are ONNX Runtime's, the values it trains. Needs
        onnxruntime-training."""
        if self._ort is None:
            from . import live

            live.bind(self)
        return self._ort

    def _go_live(self, ort_state: Any) -> None:
        """From now on, this state's parameters and properties are ``ort_state``'s, which ONNX
        Runtime loaded from this state: the names, types, shapes and frozen set stay this state's
        (ONNX Runtime's cannot tell them for a nominal state, nor the type of every tensor)."""

        records = self.tensor_records()
        self._tensors = {r.name: LiveTensor(ort_state, r.name, r.code, r.dims) for r in records}
        self._live_over(ort_state)

    def _live_over(self, ort_state: Any) -> None:
        """Properties and optimizer state: ``ort_state``'s from now on (its tensors are set by the caller)."""

        self._properties = LiveProperties(ort_state)  # type: ignore[assignment]
        self._groups, self._pending_groups = {}, None
        self._views, self._views_made, self._names = {}, True, None
        self._ort = ort_state  # (the loaded file's mappings stay: has_external_data still tells of them)

    @classmethod
    def _over_ort(cls, ort_state: Any) -> CheckpointState:
        """A state over ONNX Runtime's own (live); of a nominal one, a copy (it has no values to show)."""
        from . import live

        if live.is_nominal(ort_state):
            return ort_snapshot(ort_state, include_optimizer_state=True)
        state = cls()
        state._tensors = dict(live_tensors(ort_state))
        state._frozen = live.frozen_names(ort_state)
        state._live_over(ort_state)
        return state

    def _tensor(self, name: str) -> _Tensor:
        entry = self._tensors[name]
        if isinstance(entry, tuple):
            tensor = _Tensor.from_file(*entry, self._mappings)
            view = self._views.get(name)
            if view is not None:
                tensor._value = view
            self._tensors[name] = entry = tensor  # (published whole)
            self._views.pop(name, None)
        return entry

    def _value(self, name: str) -> TensorValue:
        """A parameter's values: ``_tensor(name).value()``, without making the _Tensor while
        the entry is raw and its view at hand (a pass over 16k tensors comes through here)."""
        if type(self._tensors[name]) is tuple:
            view = self._views.get(name)
            if view is not None:
                return view
        return self._tensor(name).value()

    def _sorted_names(self) -> list[str]:
        if self._names is None:
            self._names = sorted(self._tensors)
        return self._names

    def _make_views(self) -> None:
        """The views of every loaded tensor not used yet, made in one core call (which reads
        none of their bytes; an object store's data file is still read a tensor at a time, on
        first use). Once: a tensor used since has its own view."""
        if self._views_made:
            return
        self._views_made = True
        if not self._nominal:
            # (_Tensor entries, the tensors used already, come back None: as all the core leaves to Python)
            views = _boundary.views(list(self._tensors.values()), self._mappings)
            self._views = dict(zip(self._tensors, views, strict=True))

    @classmethod
    def load_checkpoint(
        cls,
        checkpoint_uri: str | os.PathLike[str] | BinaryIO,
        *,
        storage_options: Mapping[str, Any] | None = None,
        lazy: bool = True,
        verify: bool = False,
    ) -> CheckpointState:
        """Loads the checkpoint state from the checkpoint file (complete or nominal).

        The file is memory-mapped and verified; parameter data are views over it,
        read from disk only when used. A binary file object is read whole, then loaded as
        :meth:`from_bytes` loads a buffer. An ``s3://bucket/key`` URL is downloaded into memory
        (configured by ``storage_options``, the ``AWS_*`` variables and profile: see
        :mod:`ortckpt.object_store`); its external data file, if any, is read a tensor at a time
        by ranged GETs on first use, or downloaded whole when ``lazy`` is False.

        With ``verify`` (a path only), every byte of the file and its data file is first checked
        against the checksums ortckpt writes into every file (at about the speed of reading it;
        :class:`~ortckpt.CheckpointIntegrityError` names the file and tensor that differ). A
        file without checksums (ONNX Runtime's own, an older ortckpt's) loads as without
        ``verify``. Without it, opening reads nothing but the metadata.
        """
        from . import targets  # (on first use: `import ortckpt` stays small)

        target = targets.checkpoint(checkpoint_uri, storage_options)
        if verify and not isinstance(target, targets.LocalFile):
            raise InvalidArgumentError(
                "verify=True checks a checkpoint file at a path; check a step on object storage with ortckpt.verify",
                "verify",
            )
        if isinstance(target, targets.StreamFile):
            return cls.from_bytes(target.read())
        if isinstance(target, targets.ObjectFile):
            return cls._over(target.load(lazy=lazy))
        return open_checkpoint(target.path, verify=verify)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | Any) -> CheckpointState:
        """Loads a checkpoint held in memory (bytes, bytearray, memoryview, mmap: any
        contiguous buffer), as ONNX Runtime's ``LoadCheckpointFromBuffer`` does.

        Nothing is copied: parameter data are NumPy views over ``data``, which the state
        keeps alive (and, for a bytearray or mmap, keeps from being resized or closed). The
        views are writable exactly when ``data`` is, and writing them writes ``data``.
        A checkpoint whose values are in an external data file cannot be in one buffer.
        """
        view = memoryview(data)
        if not view.c_contiguous:
            raise CheckpointStateError("from_bytes needs a contiguous buffer")
        return cls._over(_boundary.load_buffer(view.cast("B") if (view.format, view.ndim) != ("B", 1) else view))

    def to_bytes(self, include_optimizer_state: bool = False) -> bytes:
        """The checkpoint file :meth:`save_checkpoint` would write, as ``bytes`` (each
        tensor's bytes copied once, into the result). Values must total under 2 GiB: in
        memory there is no external data file."""
        return _boundary.save_bytes(self.core_state(include_optimizer_state))

    def core_state(self, include_optimizer_state: bool) -> _boundary.CoreState:
        """The state as the core writes it: every value handed over as the array's own
        memory (never copied), for the writers (files, objects, streams) to save."""
        if self._ort is not None and include_optimizer_state:  # (the moments are ONNX Runtime's to save)
            return ort_snapshot(self._ort, include_optimizer_state=True).core_state(True)
        nominal = self.is_nominal
        self._make_views()
        trainable = [self._tensor(n).to_core(nominal) for n in self._tensors if n not in self._frozen]
        frozen = [self._tensor(n).to_core(nominal) for n in self._frozen]
        groups = self._groups_to_core() if include_optimizer_state else []
        return _boundary.CoreState(trainable, frozen, groups, self._properties, nominal)

    @property
    def format_version(self) -> int:
        """The format version of the file this state was loaded from: 2, or 1 for a file of
        ONNX Runtime 1.16 (which later releases refuse; saving writes version 2)."""
        return self._version

    @classmethod
    def _over(cls, loaded: _boundary.Loaded) -> CheckpointState:
        """A state over a loaded file or buffer; tensors are formed when first used."""
        state = cls()
        state._version = loaded.version
        state._mappings = loaded.mappings
        state._nominal = loaded.nominal
        state._tensors = {entry[0]: entry for entry in loaded.trainable}
        frozen = {entry[0]: entry for entry in loaded.frozen}
        state._tensors.update(frozen)
        state._frozen = set(frozen)
        state._pending_groups = loaded.optimizer_groups
        state._properties.update(loaded.properties)  # a repeated name: the last entry read wins, as in ORT
        return state

    @classmethod
    def save_checkpoint(
        cls,
        state: CheckpointState,
        checkpoint_uri: str | os.PathLike[str] | BinaryIO,
        include_optimizer_state: bool = False,
        *,
        external_data_threshold: int = _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD,
        durable: bool = False,
        progress: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        """Saves the checkpoint state to the checkpoint file, atomically.

        Args:
            state: The checkpoint state object.
            checkpoint_uri: The path to the checkpoint file, an ``s3://bucket/key`` URL, or a
                binary file object that receives :meth:`to_bytes`, every byte or an error (then
                nothing but ``include_optimizer_state`` applies).
            include_optimizer_state: If True, the optimizer state is also saved to the checkpoint file.
            external_data_threshold: When the tensor values (momentums included) total more bytes
                than this (1800 MiB by default, as in ONNX Runtime), they go to
                ``<checkpoint_uri>.data`` and the checkpoint records their offsets; tensors under
                64 bytes and strings stay inline. 0 forces external data.
            durable: fsync the file(s) and their directory before returning, so the new
                checkpoint survives a power cut (not only a crash of this process).
            progress: Show a progress bar (tqdm) while the files are written or uploaded, when
                that takes more than half a second. A bar never holds up or fails the save (a
                stderr nobody reads any more is left alone).
            lock_timeout: Seconds to wait (60 by default) for another save of the same path, in
                any process, to finish putting its files in place; past it,
                :class:`~ortckpt.CheckpointLockedError` names the lock file and its holder.
            storage_options: For an ``s3://bucket/key`` URL: the store's settings (see
                :mod:`ortckpt.object_store`). The checkpoint streams from the arrays to a
                multipart upload; it appears when the upload completes (``durable`` does not
                apply).
        """
        from . import interrupts, targets  # (on first use: `import ortckpt` stays small)

        state = adopt(state)  # (ONNX Runtime's own state saves as well)
        if not isinstance(state, CheckpointState):
            raise NotACheckpointStateError(f"Invalid argument for CheckpointState received {type(state)}", "state")
        if not (include_optimizer_state is None or isinstance(include_optimizer_state, (numbers.Number, np.bool_))):
            # ONNX Runtime's binding takes a number's truth (None is False) and refuses the rest: "False" is no flag.
            raise InvalidArgumentTypeError(
                f"include_optimizer_state must be a bool, got {type(include_optimizer_state).__name__}",
                "include_optimizer_state",
            )

        target = targets.checkpoint(checkpoint_uri, storage_options)
        targets.output(checkpoint_uri, "checkpoint_uri")  # (after a bare bucket URL is refused as one)
        # A Ctrl-C during a file's save: KeyboardInterrupt before the commit (nothing committed),
        # or, once it commits, as this returns (see ortckpt.interrupts): `hold` stays a local here.
        with interrupts.held(isinstance(target, targets.LocalFile)) as hold:  # noqa: F841
            if (
                state._ort is not None
                and include_optimizer_state
                and isinstance(target, targets.LocalFile)
                and external_data_threshold == _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD
                and not progress
            ):
                # The moments are ONNX Runtime's to save: its saver writes the staged files itself.
                from . import live

                if live.save_through_ort(state._ort, target.path, durable=durable, lock_timeout=lock_timeout):
                    return
            try:
                core = state.core_state(include_optimizer_state)
            except CheckpointError as e:  # (a value or name the file cannot hold: named with the file)
                name_file(e, target.name)
                raise
            if isinstance(target, targets.StreamFile):
                target.save(core, progress=progress)
            elif isinstance(target, targets.ObjectFile):
                target.save(core, external_data_threshold=external_data_threshold, progress=progress)
            else:
                target.save(
                    core,
                    external_data_threshold=external_data_threshold,
                    durable=durable,
                    progress=progress,
                    lock_timeout=lock_timeout,
                )

    @classmethod
    def from_arrays(
        cls,
        trainable: Mapping[str, Any],
        frozen: Mapping[str, Any] | None = None,
        properties: Mapping[str, PropertyValue] | None = None,
    ) -> CheckpointState:
        """A state from NumPy arrays, without a training session.

        The arrays are referenced, not copied: saving writes them straight to the file.
        """
        state = cls()
        for requires_grad, arrays in ((True, trainable), (False, frozen or {})):
            for name, value in arrays.items():
                if not isinstance(name, str):
                    raise TypeError(f"parameter names are str, got {name!r} ({type(name).__name__})")
                _boundary.check_text(name, "tensor name", tensor=name)
                if name in state._tensors:
                    raise CheckpointStateError(f"Parameter {name} is given as both trainable and frozen.")
                state._tensors[name] = _Tensor.from_value(name, value)
                if not requires_grad:
                    state._frozen.add(name)
        for name, value in (properties or {}).items():
            state.properties[name] = value
        return state

    @classmethod
    def from_onnx(
        cls,
        model: Any,
        requires_grad: Iterable[str] | None = None,
        frozen: Iterable[str] = (),
        *,
        base_dir: str | os.PathLike[str] | None = None,
    ) -> CheckpointState:
        """A state of an ONNX model's initializers (a ``ModelProto`` or a path; needs ``onnx``).

        ``requires_grad`` names the trainable parameters (the others are frozen); without it
        every initializer not in ``frozen`` is trainable. Initializers in ONNX external data
        are read from ``base_dir``, by default the model file's directory.
        """
        from ._onnx_tensors import initializers  # onnx is imported only when used

        trainable, frozen_values = initializers(model, requires_grad, frozen, base_dir)
        return cls.from_arrays(trainable, frozen_values)

    @property
    def parameters(self) -> Parameters:
        """Returns the model parameters from the checkpoint state"""
        return self._parameters

    @property
    def properties(self) -> Properties:
        """Returns the properties from the checkpoint state"""
        return self._props_view

    @property
    def optimizer_groups(self) -> dict[str, OptimizerGroup]:
        """Optimizer state by group name; edit it, or assign a new dict. Of a state ONNX Runtime
        trains: a copy of its optimizer's state now (ONNX Runtime saves it into memory), read only."""
        if self._ort is not None:
            return ort_snapshot(self._ort, include_optimizer_state=True).optimizer_groups
        if self._pending_groups is not None:
            pending, self._pending_groups = self._pending_groups, None
            # Every momentum's view in one core call, then handed out in the same order.
            entries = [m for _group, _step, _lr, states in pending for _param, moms in states for m in moms]
            views = iter(_boundary.views(entries, self._mappings))
            for group_name, step, lr, states in pending:
                momentums = {
                    param: {entry[0]: self._momentum(entry, next(views)) for entry in moms} for param, moms in states
                }
                self._groups[group_name] = OptimizerGroup(step, lr, momentums)
        return self._groups

    @optimizer_groups.setter
    def optimizer_groups(self, groups: Mapping[str, OptimizerGroup]) -> None:
        if self._ort is not None:
            raise CheckpointStateError(
                "the optimizer state of a state ONNX Runtime trains is its Optimizer's: set it before "
                "the state is handed to a Module (or load a checkpoint that has it)"
            )
        self._pending_groups = None
        self._groups = dict(groups)

    def _momentum(self, entry: _boundary.CoreTensor, view: np.ndarray | None) -> TensorValue | None:
        if entry[3] is None:  # nominal: no values
            return None
        return view if view is not None else _Tensor.from_file(*entry, self._mappings).value()

    @property
    def is_nominal(self) -> bool:
        """True for a nominal checkpoint: parameter names and types, no values.

        As in ONNX Runtime, its parameters cannot be read or set; saving it writes a nominal checkpoint.
        """
        return self._live_nominal()

    def _live_nominal(self) -> bool:
        """``is_nominal``; of a live nominal state, asked of ONNX Runtime until its Module has given
        it values (and shapes, which a nominal checkpoint may not hold: taken then)."""
        if self._ort is not None and self._nominal:
            from . import live

            self._nominal = live.is_nominal(self._ort)
            if not self._nominal:
                tensors = [self._tensor(name) for name in self._tensors]
                self._tensors = {t.name: LiveTensor(self._ort, t.name, t.code, tuple(t.value().shape)) for t in tensors}
        return self._nominal

    @property
    def has_external_data(self) -> bool:
        """True for a state loaded from a checkpoint with an external data file (``<uri>.data``):
        as in ONNX Runtime, exporting it for inference writes the model's weights as external data."""
        return self._mappings[1] is not None

    def _snapshot(
        self,
        *,
        copy_value: Callable[[tuple[str, ...], TensorValue], TensorValue] | None,
        include_optimizer_state: bool,
        properties: Mapping[str, PropertyValue],
    ) -> CheckpointState:
        """A state to save: this one's tensors and properties updated with ``properties``;
        this state is left unchanged.

        With ``copy_value(key, value)``, every value (but strings, copied here) is replaced by
        what it returns, so that the caller may change its arrays while the copy is written
        (the manager's async saves; keys: ("parameter", name) or ("momentum", group, param, m)).
        """
        if self._ort is not None and include_optimizer_state:
            # The moments are ONNX Runtime's to save: a copy of everything, taken now, in memory.

            frozen = ort_snapshot(self._ort, include_optimizer_state=True)
            return frozen._snapshot(copy_value=None, include_optimizer_state=True, properties=properties)
        other = CheckpointState()
        other._nominal = self.is_nominal
        other._frozen = set(self._frozen)
        self._make_views()
        for name in self._tensors:
            tensor = self._tensor(name)
            if tensor.code == _dt.STRING and not other._nominal:
                # Checked and copied here, in the caller's thread: an async save's background
                # thread then has nothing left to refuse.
                strings = np.array(_strings_of(name, tensor.value()), dtype=object).reshape(tensor.dims)
                tensor = _Tensor(name, tensor.code, tensor.dims, strings)
            elif copy_value is not None and not other._nominal:
                value = copy_value(("parameter", name), tensor.value())
                tensor = _Tensor(name, tensor.code, tensor.dims, value)
            other._tensors[name] = tensor
        other._properties = dict(self._properties)
        for name, prop in properties.items():
            other.properties[name] = prop
        if include_optimizer_state:
            for group_name, group in self.optimizer_groups.items():
                momentums = group.momentums
                if copy_value is not None:
                    momentums = {param: dict(moms) for param, moms in momentums.items()}
                    for param, moms in momentums.items():
                        for m, v in moms.items():
                            if v is not None:
                                moms[m] = copy_value(("momentum", group_name, param, m), _intake(f"{param}/{m}", v))
                other._groups[group_name] = OptimizerGroup(group.step, group.initial_learning_rate, momentums)
        return other

    def tensor_records(self) -> list[TensorRecord]:
        """Every parameter's name, ONNX type code, dims and ``requires_grad``, in the state's
        order (the file's, or as given), nominal states included: what other code reads of a
        state without its values."""
        self._live_nominal()  # (a state ONNX Runtime has just filled takes its shapes)
        records = []
        for name in self._tensors:
            tensor = self._tensor(name)
            records.append(TensorRecord(name, tensor.code, tensor.dims, name not in self._frozen))
        return records

    def tensor_value(self, name: str) -> TensorValue:
        """A parameter's values (a view over the file for a loaded state), without the
        nominal-state check of ``parameters[name].data``; ``KeyError`` for an unknown name."""
        return self._value(name)

    def _groups_to_core(self) -> list[Any]:
        out = []
        for group_name, group in self.optimizer_groups.items():
            if not isinstance(group, OptimizerGroup):
                raise TypeError(f"optimizer group {group_name}: expected OptimizerGroup, got {type(group).__name__}")
            for param, moms in group.momentums.items():
                for m, v in moms.items():
                    if v is None:
                        raise CheckpointStateError(
                            f"optimizer group {group_name}: {param}/{m} has no values (a nominal "
                            "checkpoint's momentums cannot be saved; save without the optimizer state)"
                        )
            states = [
                (param, [_Tensor.from_value(m, v).to_core(False) for m, v in moms.items()])
                for param, moms in group.momentums.items()
            ]
            out.append((group_name, int(group.step), float(group.initial_learning_rate), states))
        return out

    def __repr__(self) -> str:
        if self._ort is not None:  # (its optimizer groups cost a save to see)
            return f"CheckpointState(parameters={len(self._tensors)}, properties={len(self._properties)}, onnxruntime)"
        return (
            f"CheckpointState(parameters={len(self._tensors)}, properties={len(self._properties)}, "
            f"optimizer_groups={sorted(self.optimizer_groups)})"
        )


# --- States ONNX Runtime trains (see ortckpt.live): their tensors and properties are ONNX Runtime's.


class LiveTensor(_Tensor):
    """A parameter of an ORT state: its values are ONNX Runtime's buffer (a NumPy view, made
    anew on each use, as ONNX Runtime's ``Parameter.data`` does); setting values copies into it."""

    __slots__ = ("_ort_state",)

    def __init__(self, ort_state: Any, name: str, code: int, dims: tuple[int, ...]) -> None:
        super().__init__(name, code, dims)
        self._ort_state = ort_state

    def value(self) -> np.ndarray:
        values: np.ndarray = self._ort_state.get_parameter(self.name).data.numpy()
        return values

    def grad(self) -> np.ndarray | None:
        grad = self._ort_state.get_parameter(self.name).grad
        return grad.numpy() if grad.has_value() else None

    def assign(self, value: Any) -> None:
        """Copies ``value`` into ONNX Runtime's buffer: through the view where it is one (the CPU),
        else as ONNX Runtime's own ``Parameters.__setitem__`` does (its ``copy_parameter_from``)."""
        values = np.ascontiguousarray(self.checked(value))
        data = self._ort_state.get_parameter(self.name).data
        # Only the CPU's numpy() is a view ("Cpu" in 1.19): elsewhere it is a writable copy, and
        # copying into that would change nothing.
        if str(data.device_name()).lower() == "cpu":
            target = data.numpy()
            if target.flags.writeable:
                np.copyto(target, values)
                return
        from onnxruntime.capi.onnxruntime_inference_collection import OrtValue

        self._ort_state.copy_parameter_from(self.name, OrtValue.ortvalue_from_numpy(values)._ortvalue)


class LiveProperties(MutableMapping[str, "PropertyValue"]):
    """The properties of an ORT state, as ortckpt's state keeps its own (values already
    checked and rounded as a file holds them)."""

    def __init__(self, ort_state: Any) -> None:
        self._ort_state = ort_state

    def __getitem__(self, name: str) -> PropertyValue:
        if not self._ort_state.has_property(name):
            raise KeyError(name)
        value: PropertyValue = self._ort_state.get_property(name)
        return value

    def __setitem__(self, name: str, value: PropertyValue) -> None:
        self._ort_state.add_property(name, value)

    def __delitem__(self, name: str) -> None:
        raise CheckpointStateError(f"property {name}: ONNX Runtime's state cannot remove a property")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(self._ort_state.has_property(name))

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._ort_state.property_names()))

    def __len__(self) -> int:
        return len(self._ort_state.property_names())


def live_tensors(ort_state: Any) -> dict[str, LiveTensor]:
    """A :class:`LiveTensor` per parameter of ``ort_state``, in its order."""
    out = {}
    for name in ort_state.parameter_names():
        value = ort_state.get_parameter(name).data.numpy()
        out[name] = LiveTensor(ort_state, name, _dt.code_of(value), tuple(value.shape))
    return out


def adopt(value: Any) -> Any:
    """An ortckpt ``CheckpointState`` over ONNX Runtime's own state (live: its values are the
    ones ONNX Runtime trains); anything else as it is."""
    from . import live

    if not live.is_ort_state(value):
        return value
    return CheckpointState._over_ort(live.ort_state_of(value))


def ort_snapshot(ort_state: Any, include_optimizer_state: bool) -> CheckpointState:
    """A copy of everything ``ort_state`` (ONNX Runtime's) holds now, as ONNX Runtime saves it
    (into memory), opened by ortckpt: a state of its own that later training does not change."""
    from . import live

    with live.saved_by_ort(ort_state, include_optimizer_state) as path:
        return open_checkpoint(path)  # (mapped: the memory stays while the state does)


class TensorSource(Protocol):
    """What the other packages (the sharded writer, the converters) read of a checkpoint state:
    its records, values by name, groups and properties, never its internals. :class:`CheckpointState`
    is one; mypy holds the readers, annotated with this, to it."""

    @property
    def is_nominal(self) -> bool: ...

    @property
    def properties(self) -> Properties: ...

    @property
    def optimizer_groups(self) -> dict[str, OptimizerGroup]: ...

    def tensor_records(self) -> list[TensorRecord]: ...

    def tensor_value(self, name: str) -> TensorValue: ...


def open_checkpoint(
    checkpoint_uri: str | os.PathLike[str], *, follow_symlinks: bool = True, verify: bool = False
) -> CheckpointState:
    """:meth:`CheckpointState.load_checkpoint` of a path; without ``follow_symlinks``, a symlink
    at the path or its data file is refused (for files a document names, which stay in their
    directory)."""
    try:
        loaded = _boundary.load(checkpoint_uri, follow_symlinks=follow_symlinks, verify=verify)
    except IsADirectoryError:
        problem = legacy_layout_problem(checkpoint_uri)
        if problem is None:
            raise
        raise CheckpointFormatError(problem) from None
    return CheckpointState._over(loaded)


# Before ONNX Runtime 1.16 a checkpoint was a directory of these (see ortckpt.versions).
PBSEQ_SUFFIX = ".pbseq"


def legacy_layout_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read, when it is a directory in ONNX Runtime's pre-1.16 layout."""
    from . import safe_io  # only on this error path: `import ortckpt` stays small

    directory = Path(path)
    names = sorted(e.name for e in safe_io.entries(directory) if e.name.endswith(PBSEQ_SUFFIX))
    if not names:
        return None
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return (
        f"{directory}: a checkpoint directory of protobuf sequence files ({shown}), the layout of "
        "ONNX Runtime's training API before version 1.16. It predates the flatbuffers checkpoint "
        "format (ODTC) that ortckpt and ONNX Runtime >= 1.16 read, and ortckpt does not convert it: "
        "load its parameters with onnxruntime-training <= 1.15 and write them as a checkpoint "
        "(ortckpt.onnxblock.save_checkpoint or CheckpointState.from_arrays)"
    )
