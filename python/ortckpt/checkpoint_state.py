"""The drop-in for ``onnxruntime.training.api.CheckpointState``.

Mirrors ONNX Runtime's ``checkpoint_state.py``: the same classes, mapping
behaviour, iteration and error messages, on ortckpt's Rust core. Loaded tensors
are NumPy views over the file's private (copy-on-write) mapping: nothing is
read until used, and writing into ``param.data`` changes the state, as in ONNX
Runtime, without ever touching the file.
"""

from __future__ import annotations

import itertools
import math
import numbers
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from . import _boundary
from . import dtypes as _dt
from ._boundary import PropertyValue, TensorRecord
from .backings import Backing
from .backings.arrays import ArraysBacking
from .backings.mapped import MappedBacking
from .backings.tensors import OptimizerGroup, Tensor, TensorValue, intake, strings_of
from .dtypes import PackedBits as PackedBits  # (re-exported: the readers of states take it from here)
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointStateError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    NotACheckpointStateError,
    ValueOverflowError,
    name_file,
)
from .tensor_keys import TensorKey

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)


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
    def name(self) -> str:
        """The name of the parameter"""
        return self._name

    @property
    def data(self) -> TensorValue:
        """The data of the parameter: a NumPy view of the checkpoint's bytes (writable,
        copy-on-write), or a :class:`PackedBits` for the sub-byte types (UINT4, INT4, FLOAT4E2M1,
        UINT2, INT2)."""
        return self._state._backing.value(self._name)

    @data.setter
    def data(self, value: Any) -> None:
        """Copies ``value`` into the parameter (same shape and dtype required)."""
        self._state._backing.assign(self._name, value)

    @property
    def grad(self) -> np.ndarray | None:
        """The gradient of the parameter: ONNX Runtime's, once a ``Module`` trains this state
        (None before its first training step), else None: no training session runs here."""
        return self._state._backing.grad(self._name)

    @property
    def requires_grad(self) -> bool:
        """Whether or not the parameter requires its gradient to be computed"""
        return self._name not in self._state._backing.frozen

    @property
    def data_type(self) -> str:
        """ONNX's name for the element type (``"FLOAT"``, ``"BFLOAT16"``...)."""
        return _dt.name_of(self._state._backing.record(self._name)[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (for the sub-byte types too, whose ``data`` is packed)."""
        return self._state._backing.record(self._name)[1]

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
        if name not in state._backing:
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
        self._state._backing.assign(name, value)

    def names(self) -> list[str]:
        """The parameter names, sorted; unlike iteration, this works on nominal states too."""
        return list(self._state._backing.sorted_names())

    def __contains__(self, name: object) -> bool:
        return name in self._state._backing

    def __iter__(self) -> Iterator[tuple[str, Parameter]]:
        state = self._state
        backing = state._backing
        if backing.is_nominal:
            return self._nominal()
        backing.prepare_values()  # (all at once, before the first is used)
        names = backing.sorted_names()
        # (zip and map, not a generator: a pass over 16k parameters resumes no frame per item)
        return zip(names, map(Parameter, itertools.repeat(state), names), strict=True)

    def _nominal(self) -> Iterator[tuple[str, Parameter]]:
        for name in self._state._backing.sorted_names():
            yield name, self[name]  # (raises, as in ONNX Runtime)

    def __len__(self) -> int:
        return len(self._state._backing)

    def __repr__(self) -> str:
        return f"Parameters({self._state._backing.sorted_names()})"


class Properties:
    """User properties (int, float, str) by name, like ONNX Runtime's ``Properties``.

    As in ONNX Runtime, a bool is stored as an int and a float as float32.
    """

    def __init__(self, state: CheckpointState) -> None:
        self._state = state

    def __getitem__(self, name: str) -> PropertyValue:
        if name not in self:
            raise KeyError(f"Property {name} not found.")
        return self._state._backing.properties[name]

    def __setitem__(self, name: str, value: PropertyValue) -> None:
        if not isinstance(name, str):
            raise TypeError(f"property names are str, got {type(name).__name__}")
        _boundary.check_text(name, "property name")
        self._state._backing.properties[str(name)] = _property_value(name, value)  # (a NumPy str_ name too)

    def __contains__(self, name: object) -> bool:
        return name in self._state._backing.properties

    def get(self, name: str, default: Any = None) -> PropertyValue | Any:
        """The property's value, or ``default`` when there is none (as ``dict.get``)."""
        return self._state._backing.properties.get(name, default)

    def __iter__(self) -> Iterator[tuple[str, PropertyValue]]:
        for name in sorted(self._state._backing.properties):
            yield name, self._state._backing.properties[name]

    def __len__(self) -> int:
        return len(self._state._backing.properties)

    def __repr__(self) -> str:
        return f"Properties({sorted(self._state._backing.properties)})"


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


class CheckpointState:
    """The state of a training session: parameters, optimizer state and properties.

    Create one with :meth:`load_checkpoint` or :meth:`from_arrays`.
    """

    def __init__(self, backing: Backing | None = None) -> None:
        # Where the tensors, properties and optimizer state are (ortckpt.backings): arrays, a loaded
        # file, or ONNX Runtime's own state once this one is handed to its Module (replaced then).
        self._backing: Backing = ArraysBacking() if backing is None else backing
        # (no view of itself kept: a state is no reference cycle, and goes, with the memory its values
        # map, as its last reference does: a manager's async snapshot, written, not at the next
        # collection of the cycles)

    @property
    def _state(self) -> Any:
        """ONNX Runtime's own state behind this one, as ONNX Runtime's ``Module`` and
        ``Optimizer`` take it (``state._state``): on first use, this state (optimizer state and
        properties included) is written into memory and loaded by ONNX Runtime; from then on
        ``parameters`` and ``properties`` are ONNX Runtime's, the values it trains. Needs
        onnxruntime-training."""
        if self._backing.ort_state is None:
            from . import live

            with _binding:  # (bound meanwhile by another thread: the same ORT state)
                if self._backing.ort_state is None:
                    self._backing = live.bind(self._backing)
        return self._backing.ort_state

    @property
    def bound_ort_state(self) -> Any:
        """ONNX Runtime's state behind this one once it has been handed to ONNX Runtime (the one
        its Module trains), else None; asking binds nothing (unlike ``_state``)."""
        return self._backing.ort_state

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
        return self._backing.core_state(include_optimizer_state)

    @property
    def format_version(self) -> int:
        """The format version of the file this state was loaded from: 2, or 1 for a file of
        ONNX Runtime 1.16 (which later releases refuse; saving writes version 2)."""
        return self._backing.format_version

    @classmethod
    def _over(cls, loaded: _boundary.Loaded) -> CheckpointState:
        """A state over a loaded file or buffer; tensors are formed when first used."""
        return cls(MappedBacking(loaded))

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
                state._backing.ort_state is not None
                and include_optimizer_state
                and isinstance(target, targets.LocalFile)
                and external_data_threshold == _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD
                and not progress
            ):
                # The moments are ONNX Runtime's to save: its saver writes the staged files itself,
                # in a forked child where it can (its buffer grown in place there), else here.
                from . import forked_save, live

                ort_state = state._backing.ort_state
                if forked_save.save(
                    ort_state,
                    target.path,
                    checkpoint_bytes=3 * state._parameter_bytes(),
                    durable=durable,
                    lock_timeout=lock_timeout,
                ) or live.save_through_ort(ort_state, target.path, durable=durable, lock_timeout=lock_timeout):
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
        backing = ArraysBacking()
        for requires_grad, arrays in ((True, trainable), (False, frozen or {})):
            for name, value in arrays.items():
                if not isinstance(name, str):
                    raise TypeError(f"parameter names are str, got {name!r} ({type(name).__name__})")
                _boundary.check_text(name, "tensor name", tensor=name)
                backing.add(Tensor.from_value(name, value), requires_grad)
        state = cls(backing)
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
        return Parameters(self)

    @property
    def properties(self) -> Properties:
        """Returns the properties from the checkpoint state"""
        return Properties(self)

    @property
    def optimizer_groups(self) -> dict[str, OptimizerGroup]:
        """Optimizer state by group name; edit it, or assign a new dict. Of a state ONNX Runtime
        trains: a copy of its optimizer's state now (ONNX Runtime saves it into memory), read only."""
        return self._backing.optimizer_groups

    @optimizer_groups.setter
    def optimizer_groups(self, groups: Mapping[str, OptimizerGroup]) -> None:
        self._backing.set_optimizer_groups(groups)

    @property
    def is_nominal(self) -> bool:
        """True for a nominal checkpoint: parameter names and types, no values.

        As in ONNX Runtime, its parameters cannot be read or set; saving it writes a nominal checkpoint.
        """
        return self._backing.is_nominal

    @property
    def has_external_data(self) -> bool:
        """True for a state loaded from a checkpoint with an external data file (``<uri>.data``):
        as in ONNX Runtime, exporting it for inference writes the model's weights as external data."""
        return self._backing.has_external_data

    def tensors(self, *, include_optimizer_state: bool = True) -> Iterator[tuple[TensorKey, TensorValue]]:
        """Every tensor with its :class:`~ortckpt.TensorKey`: the parameters sorted by name (none
        for a nominal state, which has no values), then each optimizer group's momentums (those
        with values). The one way every reader of tensors (arithmetic, statistics, the report, the
        command line, snapshots) goes through a state: a parameter named like a momentum
        (``group0/w/momentum0``) is a key of its own."""
        return _tensors_of(self._backing, include_optimizer_state)

    def snapshot(
        self,
        *,
        copy_value: Callable[[TensorKey, TensorValue], TensorValue] | None = None,
        include_optimizer_state: bool,
        properties: Mapping[str, PropertyValue] | None = None,
    ) -> CheckpointState:
        """A state to save (a manager's step): this one's tensors and properties updated with
        ``properties``; this state is left unchanged.

        With ``copy_value(key, value)``, every value (but strings, copied here) is replaced by
        what it returns, so that the caller may change its arrays while the copy is written
        (the manager's async saves). Of a state ONNX Runtime trains, with the optimizer state,
        every value is of one moment (a copy ONNX Runtime saves, in memory).
        """
        source: Backing | None = None
        ort_state = self._backing.ort_state
        if ort_state is not None and include_optimizer_state:
            # The moments are ONNX Runtime's to copy: its saver, in a forked child where it can
            # (its buffer grown in place there), writes everything into memory; else here.
            from . import forked_save

            source = forked_save.snapshot(ort_state, checkpoint_bytes=3 * self._parameter_bytes())
        if source is None:
            source = self._backing.settled(include_optimizer_state)
        if source is not self._backing:
            copy_value = None  # (a copy of its own already, taken now: nothing else can change it)
        nominal = source.is_nominal
        backing = ArraysBacking(frozen=set(source.frozen), nominal=nominal)
        values = {} if nominal else dict(_tensors_of(source, include_optimizer_state=False))
        for name, code, dims, requires_grad in source.records():
            key = TensorKey.of_parameter(name, requires_grad)
            value = values.get(key)
            if code == _dt.STRING and value is not None:
                # Checked and copied here, in the caller's thread: an async save's background
                # thread then has nothing left to refuse.
                value = np.array(strings_of(name, value), dtype=object).reshape(dims)
            elif copy_value is not None and value is not None:
                value = copy_value(key, value)
            backing.tensors[name] = Tensor(name, code, dims, value)
        state = CheckpointState(backing)
        backing.properties.update(source.properties)
        for name, prop in (properties or {}).items():
            state.properties[name] = prop
        if include_optimizer_state:
            for group_name, group in source.optimizer_groups.items():
                momentums = group.momentums
                if copy_value is not None:
                    momentums = {param: dict(moms) for param, moms in momentums.items()}
                    for param, moms in momentums.items():
                        for m, v in moms.items():
                            if v is not None:
                                key = TensorKey.of_momentum(group_name, param, m)
                                moms[m] = copy_value(key, intake(f"{param}/{m}", v))
                backing.groups[group_name] = OptimizerGroup(group.step, group.initial_learning_rate, momentums)
        return state

    def _parameter_bytes(self) -> int:
        """The bytes of the parameters' values (0 for a nominal state): what sizes a deadline."""
        if self.is_nominal:
            return 0
        return sum(int(getattr(p.data, "nbytes", 0)) for _, p in self.parameters)

    def tensor_records(self) -> list[TensorRecord]:
        """Every parameter's name, ONNX type code, dims and ``requires_grad``, in the state's
        order (the file's, or as given), nominal states included: what other code reads of a
        state without its values."""
        return self._backing.records()

    def tensor_value(self, name: str) -> TensorValue:
        """A parameter's values (a view over the file for a loaded state), without the
        nominal-state check of ``parameters[name].data``; ``KeyError`` for an unknown name."""
        return self._backing.value(name)

    def __repr__(self) -> str:
        backing = self._backing
        counts = f"parameters={len(backing)}, properties={len(backing.properties)}"
        if backing.ort_state is not None:  # (its optimizer groups cost a save to see)
            return f"CheckpointState({counts}, onnxruntime)"
        return f"CheckpointState({counts}, optimizer_groups={sorted(self.optimizer_groups)})"


def _tensors_of(backing: Backing, include_optimizer_state: bool) -> Iterator[tuple[TensorKey, TensorValue]]:
    if not backing.is_nominal:
        backing.prepare_values()  # (all at once, before the first is used)
        frozen, value_of, key_of = backing.frozen, backing.value, TensorKey.of_parameter  # (16k tensors: bound once)
        for name in backing.sorted_names():
            yield key_of(name, name not in frozen), value_of(name)
    if include_optimizer_state:
        for group_name, group in backing.optimizer_groups.items():
            for param, momentums in group.momentums.items():
                for momentum, value in momentums.items():
                    if value is not None:
                        yield TensorKey.of_momentum(group_name, param, momentum), value


def adopt(value: Any) -> Any:
    """An ortckpt ``CheckpointState`` over ONNX Runtime's own state (live: its values are the
    ones ONNX Runtime trains); anything else as it is."""
    from . import live

    if not live.is_ort_state(value):
        return value
    return CheckpointState(live.adopt(live.ort_state_of(value)))


# One binding at a time: two threads handing one state to two Modules get the same ORT state.
_binding = threading.Lock()


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
        problem = legacy_layout_problem(checkpoint_uri) or step_folder_problem(checkpoint_uri)
        if problem is None:
            raise
        raise CheckpointFormatError(problem) from None
    return CheckpointState._over(loaded)


# Before ONNX Runtime 1.16 a checkpoint was a directory of these (see ortckpt.versions).
PBSEQ_SUFFIX = ".pbseq"


def step_folder_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read here, when it is a directory that holds a step's documents:
    ``ortckpt.load_checkpoint`` reads a step folder (this class's method stays ONNX Runtime's: a file)."""
    from . import steps  # only on this error path

    if not any(os.path.lexists(Path(path) / name) for name in steps.COMMIT_DOCUMENTS):
        return None
    return (
        f"{os.fspath(path)}: a CheckpointManager step folder, not a checkpoint file: load it with "
        f"ortckpt.load_checkpoint({os.fspath(path)!r}) (which reads a step folder as the command line does), or "
        "the manager's restore(step)"
    )


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
