"""Between ortckpt's :class:`~ortckpt.CheckpointState` and Flower's ``ArrayRecord``.

An ``ArrayRecord`` is an ordered ``name -> Array(dtype, shape, stype, data)``, ``data`` the
``.npy`` bytes of the array. The keys here are ONNX Runtime's parameter names; ``Array.dtype``
is NumPy's name of the type (``str(ndarray.dtype)``, as Flower writes it: ``"bfloat16"`` and
the float8 types are ml_dtypes' names, whose ``.npy`` header says only ``"<V2"``/``"|V1"``).

Conventions (an ``ArrayRecord`` has no place for them in its arrays):

- Trainable or frozen: ``from_arrayrecord(record, like=state)`` takes the split (and the
  properties) from ``like``; without ``like`` every parameter is trainable.
- Optimizer state (``include_optimizer_state=True``): under keys that start with
  :data:`OPTIMIZER_PREFIX` followed by ``group/param/momentum`` for a momentum, and by
  ``group/step`` (an int64 scalar) and ``group/initial_learning_rate`` (a float64 scalar) for
  the group, each part percent-escaped (``urllib.parse.quote(part, safe="")``: a ``/`` in a
  name is ``%2F``), e.g. ``ortckpt:optimizer/group0/fc.weight/momentum0``. A parameter whose
  name starts with the prefix is refused, so the two can never be confused.
- Refused, naming the tensor: nominal states (no values), string tensors and the sub-byte
  types (INT4, UINT4, FLOAT4E2M1, INT2, UINT2), which ``.npy`` cannot hold.

Copies: ``to_arrayrecord`` copies each tensor once, into its ``.npy`` bytes (``Array.data`` must
be ``bytes``: the header and the values in one object); ``from_arrayrecord`` copies nothing: each
parameter is a read-only view of its ``Array``'s bytes after the header (a byte-swapped or
Fortran-ordered ``.npy``, which Flower never writes, is converted: a copy).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote

import ml_dtypes
import numpy as np

from ..checkpoint_state import CheckpointState, OptimizerGroup
from ..dtypes import PackedBits, name_of, numpy_dtype
from ..errors import ArrayRecordError, UnsupportedDataTypeError
from ..extras import require

flwr_app: Any = require("flwr.app", "ortckpt.flower")

# Flower's serialization type of a .npy payload (flwr.common.constant.SType.NUMPY).
NUMPY_STYPE = "numpy.ndarray"
# Optimizer state keys begin so: no parameter may (to_arrayrecord refuses one that does).
OPTIMIZER_PREFIX = "ortckpt:optimizer/"
_MAGIC = b"\x93NUMPY"
# The longest .npy header read (NumPy's own default limit for untrusted files).
_MAX_HEADER = 10_000


def dtype_named(name: str, key: str) -> np.dtype:
    """NumPy's dtype of ``Array.dtype`` (NumPy's names and ml_dtypes' bfloat16/float8 names)."""
    kind = getattr(ml_dtypes, name, None)
    if isinstance(kind, type) and name in _ML_NAMES:
        return np.dtype(kind)
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ArrayRecordError(f"{key}: unknown dtype {name!r}", key) from None
    if dtype.kind in "OUSVMm" or dtype.hasobject:
        raise ArrayRecordError(f"{key}: dtype {name!r} is no tensor type a checkpoint holds", key)
    return dtype.newbyteorder("<") if dtype.byteorder != "|" else dtype  # (a checkpoint is little-endian)


_ML_NAMES = {
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
}


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array of ``dtype`` and ``shape``."""
    import io

    descr = np.lib.format.dtype_to_descr(dtype)
    try:
        np.lib.format.descr_to_dtype(descr)
    except (TypeError, ValueError):  # the float8 types' "<f1": void of their size, as bfloat16's "<V2"
        descr = np.lib.format.dtype_to_descr(np.dtype(f"V{dtype.itemsize}"))
    d = {"descr": descr, "fortran_order": False, "shape": tuple(shape)}
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, d)
    except ValueError:  # a header past 64 KiB: version 2.0, as np.save then writes
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, d)
    return buffer.getvalue()


def array_of(value: np.ndarray) -> Any:
    """A Flower ``Array`` of ``value``: its ``.npy`` bytes (the one copy), Flower's dtype name."""
    if not value.flags.c_contiguous:
        value = value.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    header = npy_header(value.dtype, value.shape)
    data = b"".join((header, value.reshape(-1).view(np.uint8).data))
    return flwr_app.Array(
        dtype=str(value.dtype), shape=tuple(int(n) for n in value.shape), stype=NUMPY_STYPE, data=data
    )


def parse(array: Any, key: str) -> tuple[np.dtype, tuple[int, ...], int, np.dtype, bool]:
    """(dtype, shape, offset of the values in ``array.data``, the header's dtype, Fortran order)
    of a Flower ``Array``, its metadata checked against its ``.npy`` header."""
    if array.stype != NUMPY_STYPE:
        raise ArrayRecordError(f"{key}: serialization {array.stype!r} is not {NUMPY_STYPE!r} (.npy)", key)
    dtype = dtype_named(array.dtype, key)
    data = memoryview(array.data)
    if len(data) < 10 or bytes(data[:6]) != _MAGIC:
        raise ArrayRecordError(f"{key}: the data is not .npy bytes (no magic string)", key)
    major = data[6]
    if major == 1:
        length, start = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        length, start = int.from_bytes(data[8:12], "little"), 12
    else:
        raise ArrayRecordError(f"{key}: .npy format version {major} is not known", key)
    if length > _MAX_HEADER or start + length > len(data):
        raise ArrayRecordError(f"{key}: the .npy header is {length} bytes long, past the data or the limit", key)
    try:
        header = ast.literal_eval(bytes(data[start : start + length]).decode("latin1" if major < 3 else "utf8"))
        stored = _stored_dtype(header["descr"], dtype)
        fortran, shape = bool(header["fortran_order"]), tuple(int(n) for n in header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise ArrayRecordError(f"{key}: the .npy header cannot be read: {e}", key) from None
    if shape != tuple(array.shape):
        raise ArrayRecordError(f"{key}: Array.shape {tuple(array.shape)} but the .npy header says {shape}", key)
    # (bfloat16 and the float8 types are written as void of their size: "<V2", "|V1")
    if stored.itemsize != dtype.itemsize or (stored.kind != "V" and stored.newbyteorder("<") != dtype):
        raise ArrayRecordError(f"{key}: Array.dtype {array.dtype!r} but the .npy header says {stored.str!r}", key)
    offset = start + length
    expected = dtype.itemsize * math.prod(shape)
    if len(data) - offset != expected:
        raise ArrayRecordError(
            f"{key}: {len(data) - offset} bytes of values for {expected} ({array.dtype} {shape})", key
        )
    return dtype, shape, offset, (dtype if stored.kind == "V" else stored), fortran


def _stored_dtype(descr: Any, dtype: np.dtype) -> np.dtype:
    """The dtype a .npy header's ``descr`` names; NumPy cannot read the one np.save writes for
    some ml_dtypes types (float8_e5m2's "<f1"): for those, one of the Array's dtype's size."""
    try:
        return np.lib.format.descr_to_dtype(descr)
    except (TypeError, ValueError):
        if dtype.name in _ML_NAMES and isinstance(descr, str) and descr[1:] == f"f{dtype.itemsize}":
            return np.dtype(f"V{dtype.itemsize}")
        raise


def values_of(array: Any, key: str) -> np.ndarray:
    """The values of a Flower ``Array``: a read-only view of its bytes (a copy only where the
    ``.npy`` is byte-swapped or Fortran-ordered, which Flower never writes)."""
    dtype, shape, offset, stored, fortran = parse(array, key)
    values = np.frombuffer(array.data, dtype=np.uint8, offset=offset).view(stored)
    if fortran:
        return np.ascontiguousarray(values.reshape(shape, order="F"), dtype=dtype)
    if stored != dtype:
        return values.astype(dtype).reshape(shape)
    return values.reshape(shape)


def _checked_value(name: str, value: Any) -> np.ndarray:
    if isinstance(value, PackedBits):
        raise ArrayRecordError(f"{name}: a sub-byte tensor ({value.bits}-bit) has no .npy form for Flower", name)
    if value is None:
        raise ArrayRecordError(f"{name}: no values (a nominal checkpoint): load the parameters first", name)
    array = np.asarray(value)
    if array.dtype.kind in "OUS":
        raise ArrayRecordError(f"{name}: a string tensor has no .npy form Flower can carry (allow_pickle=False)", name)
    return array


def optimizer_key(*parts: str) -> str:
    """The ``ArrayRecord`` key of an optimizer entry (``group, "step"``, ``group, param, momentum``...)."""
    return OPTIMIZER_PREFIX + "/".join(quote(part, safe="") for part in parts)


def to_arrayrecord(
    state: CheckpointState, *, trainable_only: bool = False, include_optimizer_state: bool = False
) -> Any:
    """A Flower ``ArrayRecord`` of ``state``'s parameters, by ONNX Runtime's names, in the
    state's order (and its optimizer groups', under :data:`OPTIMIZER_PREFIX` keys, when asked).

    ``trainable_only`` leaves the frozen parameters out (what a client trains and sends back).
    A nominal state, a string or sub-byte tensor, or a parameter named with the optimizer
    prefix is refused (:class:`ArrayRecordError`, naming it).
    """
    if state.is_nominal:
        raise ArrayRecordError("a nominal state has no values to send: load the parameters into it first")
    record = flwr_app.ArrayRecord()
    for entry in state.tensor_records():
        if entry.name.startswith(OPTIMIZER_PREFIX):
            raise ArrayRecordError(
                f"{entry.name}: a parameter name may not start with {OPTIMIZER_PREFIX!r} (optimizer state's keys)",
                entry.name,
            )
        if trainable_only and not entry.requires_grad:
            continue
        record[entry.name] = array_of(_checked_value(entry.name, state.tensor_value(entry.name)))
    if include_optimizer_state:
        for group_name, group in state.optimizer_groups.items():
            record[optimizer_key(group_name, "step")] = array_of(np.array(group.step, np.int64))
            lr = np.array(group.initial_learning_rate, np.float64)
            record[optimizer_key(group_name, "initial_learning_rate")] = array_of(lr)
            for param, momentums in group.momentums.items():
                for momentum, value in momentums.items():
                    key = optimizer_key(group_name, param, momentum)
                    record[key] = array_of(_checked_value(f"{param}/{momentum}", value))
    return record


def from_arrayrecord(record: Mapping[str, Any], like: CheckpointState | None = None) -> CheckpointState:
    """A :class:`~ortckpt.CheckpointState` of a Flower ``ArrayRecord``: each parameter a
    read-only view of its ``Array``'s bytes (no copy), optimizer state from its
    :data:`OPTIMIZER_PREFIX` keys.

    With ``like``, the split into trainable and frozen parameters and the properties are
    ``like``'s: parameters ``like`` has and the record lacks (the frozen ones a client did not
    send back) are taken from ``like``; a parameter ``like`` does not have, or one whose type
    or shape differ from ``like``'s, is refused. ``like`` may be nominal (ONNX Runtime's
    on-device flow: the record then gives every value; shapes are not checked, a nominal
    checkpoint has none). Without ``like``, every parameter is trainable.
    """
    trainable: dict[str, np.ndarray] = {}
    frozen: dict[str, np.ndarray] = {}
    groups: dict[str, dict[str, Any]] = {}
    expected = {entry.name: entry for entry in like.tensor_records()} if like is not None else None
    nominal = like is not None and like.is_nominal
    for key, array in record.items():
        if key.startswith(OPTIMIZER_PREFIX):
            _optimizer_entry(groups, key, values_of(array, key))
            continue
        value = values_of(array, key)
        if expected is None:
            trainable[key] = value
            continue
        entry = expected.get(key)
        if entry is None:
            raise ArrayRecordError(f"{key}: not a parameter of the state given as like", key)
        wanted = _dtype_of(entry.code)  # (from the records: a nominal like works too)
        # (a nominal like holds no shapes, ONNX Runtime's: its types are checked)
        if wanted != value.dtype or (not nominal and tuple(entry.dims) != value.shape):
            raise ArrayRecordError(
                f"{key}: {value.dtype} {value.shape} in the record, {wanted} {tuple(entry.dims)} "
                "in the state given as like",
                key,
            )
        (trainable if entry.requires_grad else frozen)[key] = value
    properties: dict[str, Any] = {}
    if like is not None and expected is not None:
        for name, entry in expected.items():
            if name not in trainable and name not in frozen:
                if nominal:
                    raise ArrayRecordError(f"{name}: not in the record, and the nominal like has no values", name)
                (trainable if entry.requires_grad else frozen)[name] = _checked_value(name, like.tensor_value(name))
        order = list(expected)
        trainable = {n: trainable[n] for n in order if n in trainable}
        frozen = {n: frozen[n] for n in order if n in frozen}
        properties = dict(like.properties)
    state = CheckpointState.from_arrays(trainable, frozen, properties)
    if groups:
        state.optimizer_groups = {
            name: OptimizerGroup(int(g.get("step", 0)), float(g.get("initial_learning_rate", 0.0)), g["momentums"])
            for name, g in groups.items()
        }
    return state


def _dtype_of(code: int) -> np.dtype | str:
    try:
        return numpy_dtype(code)
    except UnsupportedDataTypeError:
        return name_of(code)  # (a string or sub-byte parameter: no Array matches it)


def _optimizer_entry(groups: dict[str, dict[str, Any]], key: str, value: np.ndarray) -> None:
    parts = [unquote(part, errors="strict") if part else part for part in key[len(OPTIMIZER_PREFIX) :].split("/")]
    if len(parts) not in (2, 3):
        raise ArrayRecordError(f"{key}: an optimizer key is its prefix and group/param/momentum or group/step", key)
    group = groups.setdefault(parts[0], {"momentums": {}})
    if len(parts) == 3:
        group["momentums"].setdefault(parts[1], {})[parts[2]] = value
    elif parts[1] in ("step", "initial_learning_rate") and value.shape == ():
        group[parts[1]] = value.item()
    else:
        raise ArrayRecordError(f"{key}: a group's entry is 'step' or 'initial_learning_rate', a scalar", key)
