"""A tensor of a state held by ortckpt (its type, shape and where its values are), the checks
every value goes through on its way in, and an optimizer group: what the backings share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _boundary
from .. import dtypes as _dt
from .._boundary import as_bytes
from ..dtypes import PackedBits
from ..errors import CheckpointStateError, UnsupportedDataTypeError

TensorValue = np.ndarray | PackedBits


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


class Tensor:
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
    def from_file(
        cls,
        name: str,
        code: int,
        dims: tuple[int, ...],
        stored: Any,
        mappings: tuple[Any, Any],
        view: TensorValue | None = None,
    ) -> Tensor:
        """``stored`` as a load gives it (``_boundary.CoreTensor``); ``mappings``: (checkpoint, external
        data); ``view``: its values already made (by ``_boundary.views``), if they were."""
        tensor = cls(name, code, tuple(dims))
        if isinstance(stored, list):  # STRING: one str per element
            tensor._value = np.array(stored, dtype=object).reshape(tensor.dims)
        elif stored is not None:  # (offset, nbytes, in the external data file?)
            tensor._offset, tensor._nbytes, external = stored
            tensor._mapping = mappings[1] if external else mappings[0]
            tensor._value = view
        return tensor  # stored is None: nominal, no values

    @classmethod
    def from_value(cls, name: str, value: Any) -> Tensor:
        value = intake(name, value)
        shape = value.shape if isinstance(value, PackedBits) else tuple(value.shape)
        return cls(name, _dt.code_of(value), shape, value)

    def grad(self) -> np.ndarray | None:
        """None: no training session computes one (see ``live.LiveTensor``, whose does)."""
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
        value = intake(self.name, value)
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
            return self.name, self.code, self.dims, strings_of(self.name, value)
        array = value.packed if isinstance(value, PackedBits) else value
        return self.name, self.code, self.dims, as_bytes(array)


def intake(name: str, value: Any) -> TensorValue:
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
        strings_of(name, array)  # refused now, not at save, when not text
    return array


def strings_of(name: str, value: Any) -> list[str]:
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
