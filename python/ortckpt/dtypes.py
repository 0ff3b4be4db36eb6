"""ONNX tensor data types <-> NumPy dtypes.

bfloat16 and the float8 types use ``ml_dtypes``. UINT4/INT4 tensors are stored
two values per byte; they surface as :class:`PackedInt4` (the packed bytes plus
the logical shape), which converts to and from ``ml_dtypes.int4``/``uint4`` arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .errors import UnsupportedDataTypeError

# ONNX TensorProto.DataType codes (ONNX Runtime's TensorDataType, plus 21/22).
UNDEFINED, FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, STRING, BOOL = range(10)
FLOAT16, DOUBLE, UINT32, UINT64, COMPLEX64, COMPLEX128, BFLOAT16 = range(10, 17)
FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ, UINT4, INT4 = range(17, 23)

NAMES = (
    "UNDEFINED FLOAT UINT8 INT8 UINT16 INT16 INT32 INT64 STRING BOOL FLOAT16 DOUBLE UINT32 UINT64 "
    "COMPLEX64 COMPLEX128 BFLOAT16 FLOAT8E4M3FN FLOAT8E4M3FNUZ FLOAT8E5M2 FLOAT8E5M2FNUZ UINT4 INT4"
).split()

_DTYPE_BY_CODE: dict[int, np.dtype] = {
    FLOAT: np.dtype(np.float32),
    UINT8: np.dtype(np.uint8),
    INT8: np.dtype(np.int8),
    UINT16: np.dtype(np.uint16),
    INT16: np.dtype(np.int16),
    INT32: np.dtype(np.int32),
    INT64: np.dtype(np.int64),
    BOOL: np.dtype(np.bool_),
    FLOAT16: np.dtype(np.float16),
    DOUBLE: np.dtype(np.float64),
    UINT32: np.dtype(np.uint32),
    UINT64: np.dtype(np.uint64),
    COMPLEX64: np.dtype(np.complex64),
    COMPLEX128: np.dtype(np.complex128),
    BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    FLOAT8E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    FLOAT8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    FLOAT8E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
}
# Compare little-endian forms: a big-endian float32 array is still FLOAT.
_CODE_BY_DTYPE: dict[np.dtype, int] = {dt.newbyteorder("<"): code for code, dt in _DTYPE_BY_CODE.items()}
_INT4_BY_CODE = {INT4: np.dtype(ml_dtypes.int4), UINT4: np.dtype(ml_dtypes.uint4)}


def name_of(code: int) -> str:
    """ONNX's name for a type code (``"FLOAT"``...)."""
    return NAMES[code] if 0 <= code < len(NAMES) else f"<unknown data type {code}>"


def numpy_dtype(code: int) -> np.dtype:
    """The NumPy dtype of a fixed-size ONNX type (not STRING, UINT4, INT4)."""
    try:
        return _DTYPE_BY_CODE[code]
    except KeyError:
        raise UnsupportedDataTypeError(f"ONNX data type {name_of(code)} has no NumPy dtype") from None


@dataclass(frozen=True)
class PackedInt4:
    """A UINT4/INT4 tensor: two values per byte, the first in the low nibble (ONNX's packing).

    ``packed`` is a flat uint8 array of ``ceil(prod(shape) / 2)`` bytes; ``shape``
    the logical shape; ``signed`` tells INT4 from UINT4.
    """

    packed: np.ndarray
    shape: tuple[int, ...]
    signed: bool

    @property
    def data_type(self) -> int:
        return INT4 if self.signed else UINT4

    @classmethod
    def pack(cls, values: Any) -> PackedInt4:
        """Packs an ``ml_dtypes.int4`` or ``uint4`` array."""
        values = np.asarray(values)
        if values.dtype not in (_INT4_BY_CODE[INT4], _INT4_BY_CODE[UINT4]):
            raise UnsupportedDataTypeError(f"expected an ml_dtypes int4/uint4 array, got {values.dtype}")
        nibbles = values.reshape(-1).view(np.uint8) & 0x0F
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        packed = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
        return cls(packed, tuple(values.shape), values.dtype == _INT4_BY_CODE[INT4])

    def unpack(self) -> np.ndarray:
        """The values as an ``ml_dtypes.int4``/``uint4`` array of ``shape``."""
        count = int(np.prod(self.shape, dtype=np.int64))
        nibbles = np.empty(self.packed.size * 2, np.uint8)
        nibbles[0::2] = self.packed & 0x0F
        nibbles[1::2] = self.packed >> 4
        nibbles = nibbles[:count]
        if self.signed:  # sign-extend the 4-bit values to int8, which int4 then narrows exactly
            return ((nibbles.astype(np.int8) << 4) >> 4).astype(_INT4_BY_CODE[INT4]).reshape(self.shape)
        return nibbles.astype(_INT4_BY_CODE[UINT4]).reshape(self.shape)


def code_of(value: Any) -> int:
    """The ONNX type code for an array (or PackedInt4)."""
    if isinstance(value, PackedInt4):
        return value.data_type
    dtype = value.dtype
    if dtype.kind in "UO" or dtype.kind == "S":
        return STRING
    if dtype in _INT4_BY_CODE.values():
        return INT4 if dtype == _INT4_BY_CODE[INT4] else UINT4
    try:
        return _CODE_BY_DTYPE[dtype.newbyteorder("<")]
    except KeyError:
        raise UnsupportedDataTypeError(f"NumPy dtype {dtype} has no ONNX tensor data type") from None
