"""ONNX tensor data types <-> NumPy dtypes.

bfloat16 and the float8 types use ``ml_dtypes``. Sub-byte tensors are stored packed,
the first value in the lowest bits: UINT4, INT4 and FLOAT4E2M1 two per byte, UINT2 and
INT2 four per byte. They surface as :class:`PackedBits` (:class:`PackedInt4` for the
4-bit integers): the packed bytes plus the logical shape, converting to and from the
``ml_dtypes`` arrays (``int4``, ``uint4``, ``float4_e2m1fn``, ``int2``, ``uint2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .errors import UnsupportedDataTypeError

# ONNX TensorProto.DataType codes (ONNX Runtime's TensorDataType, plus 21/22 that its
# saver writes, and 23-26 that ONNX added after ONNX Runtime 1.19.2).
UNDEFINED, FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, STRING, BOOL = range(10)
FLOAT16, DOUBLE, UINT32, UINT64, COMPLEX64, COMPLEX128, BFLOAT16 = range(10, 17)
FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ, UINT4, INT4 = range(17, 23)
FLOAT4E2M1, FLOAT8E8M0, UINT2, INT2 = range(23, 27)

NAMES = [
    "UNDEFINED",
    "FLOAT",
    "UINT8",
    "INT8",
    "UINT16",
    "INT16",
    "INT32",
    "INT64",
    "STRING",
    "BOOL",
    "FLOAT16",
    "DOUBLE",
    "UINT32",
    "UINT64",
    "COMPLEX64",
    "COMPLEX128",
    "BFLOAT16",
    "FLOAT8E4M3FN",
    "FLOAT8E4M3FNUZ",
    "FLOAT8E5M2",
    "FLOAT8E5M2FNUZ",
    "UINT4",
    "INT4",
    "FLOAT4E2M1",
    "FLOAT8E8M0",
    "UINT2",
    "INT2",
]

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
    FLOAT8E8M0: np.dtype(ml_dtypes.float8_e8m0fnu),
}
# Compare little-endian forms: a big-endian float32 array is still FLOAT.
_CODE_BY_DTYPE: dict[np.dtype, int] = {dt.newbyteorder("<"): code for code, dt in _DTYPE_BY_CODE.items()}
# Sub-byte types: code -> (ml_dtypes dtype, bits per value).
_PACKED_BY_CODE: dict[int, tuple[np.dtype, int]] = {
    UINT4: (np.dtype(ml_dtypes.uint4), 4),
    INT4: (np.dtype(ml_dtypes.int4), 4),
    FLOAT4E2M1: (np.dtype(ml_dtypes.float4_e2m1fn), 4),
    UINT2: (np.dtype(ml_dtypes.uint2), 2),
    INT2: (np.dtype(ml_dtypes.int2), 2),
}
_PACKED_CODE_BY_DTYPE = {dtype: code for code, (dtype, _) in _PACKED_BY_CODE.items()}
SUB_BYTE_CODES = frozenset(_PACKED_BY_CODE)


def name_of(code: int) -> str:
    """ONNX's name for a type code (``"FLOAT"``...)."""
    return NAMES[code] if 0 <= code < len(NAMES) else f"<unknown data type {code}>"


def numpy_dtype(code: int) -> np.dtype:
    """The NumPy dtype of a fixed-size ONNX type (not STRING nor the packed sub-byte types)."""
    try:
        return _DTYPE_BY_CODE[code]
    except KeyError:
        raise UnsupportedDataTypeError(f"ONNX data type {name_of(code)} has no NumPy dtype") from None


def fixed_size_dtypes() -> list[np.dtype | None]:
    """The NumPy dtype of every fixed-size ONNX type, indexed by type code; None for the
    others (STRING, the packed sub-byte types, unknown codes)."""
    return [_DTYPE_BY_CODE.get(code) for code in range(len(NAMES))]


@dataclass(frozen=True)
class PackedBits:
    """A sub-byte tensor (UINT4, INT4, FLOAT4E2M1, UINT2, INT2) as the format stores it:
    ``packed`` is a flat uint8 array, the first value in the lowest bits of the first byte
    (ONNX's packing); ``shape`` is the logical shape; ``data_type`` the ONNX type code.
    """

    packed: np.ndarray
    shape: tuple[int, ...]
    data_type: int

    @property
    def signed(self) -> bool:
        return self.data_type in (INT4, INT2)

    def copy(self) -> PackedBits:
        """An independent copy (the packed bytes copied), as ``ndarray.copy`` is for arrays."""
        return PackedBits.of(self.packed.copy(), self.shape, self.data_type)

    @property
    def bits(self) -> int:
        return _PACKED_BY_CODE[self.data_type][1]

    @classmethod
    def of(cls, packed: np.ndarray, shape: tuple[int, ...], data_type: int) -> PackedBits:
        """The packed tensor of ``data_type``: a :class:`PackedInt4` for UINT4/INT4."""
        if data_type in (INT4, UINT4):
            return PackedInt4(packed, shape, data_type == INT4)
        if data_type not in _PACKED_BY_CODE:
            raise UnsupportedDataTypeError(f"{name_of(data_type)} is not a packed sub-byte type")
        return cls(packed, shape, data_type)

    @classmethod
    def pack(cls, values: Any) -> PackedBits:
        """Packs an ``ml_dtypes`` array of a sub-byte type (``int4``, ``uint4``,
        ``float4_e2m1fn``, ``int2``, ``uint2``)."""
        values = np.asarray(values)
        code = _PACKED_CODE_BY_DTYPE.get(values.dtype)
        if code is None or (cls is PackedInt4 and code not in (INT4, UINT4)):
            expected = "int4/uint4" if cls is PackedInt4 else "sub-byte (int4, uint4, float4_e2m1fn, int2, uint2)"
            raise UnsupportedDataTypeError(f"expected an ml_dtypes {expected} array, got {values.dtype}")
        bits = _PACKED_BY_CODE[code][1]
        per_byte = 8 // bits
        fields = values.reshape(-1).view(np.uint8) & ((1 << bits) - 1)
        if fields.size % per_byte:
            fields = np.append(fields, np.zeros(per_byte - fields.size % per_byte, np.uint8))
        packed = np.zeros(fields.size // per_byte, np.uint8)
        for i in range(per_byte):
            packed |= fields[i::per_byte] << (i * bits)
        return cls.of(packed, tuple(values.shape), code)

    def unpack(self) -> np.ndarray:
        """The values as an ``ml_dtypes`` array of ``shape``."""
        dtype, bits = _PACKED_BY_CODE[self.data_type]
        per_byte = 8 // bits
        count = int(np.prod(self.shape, dtype=np.int64))
        fields = np.empty(self.packed.size * per_byte, np.uint8)
        for i in range(per_byte):
            fields[i::per_byte] = (self.packed >> (i * bits)) & ((1 << bits) - 1)
        fields = fields[:count]
        if self.signed:  # sign-extend the fields to int8, which the narrow type then holds exactly
            shift = 8 - bits
            return ((fields.astype(np.int8) << shift) >> shift).astype(dtype).reshape(self.shape)
        return fields.view(dtype).reshape(self.shape)


class PackedInt4(PackedBits):
    """A UINT4/INT4 tensor: two values per byte, the first in the low nibble (ONNX's packing).

    ``packed`` is a flat uint8 array of ``ceil(prod(shape) / 2)`` bytes; ``shape``
    the logical shape; ``signed`` tells INT4 from UINT4.
    """

    def __init__(self, packed: np.ndarray, shape: tuple[int, ...], signed: bool) -> None:
        super().__init__(packed, tuple(shape), INT4 if signed else UINT4)


def code_of(value: Any) -> int:
    """The ONNX type code for an array (or PackedInt4)."""
    if isinstance(value, PackedBits):
        return value.data_type
    dtype = value.dtype
    if dtype.kind in "UO" or dtype.kind == "S":
        return STRING
    if dtype in _PACKED_CODE_BY_DTYPE:
        return _PACKED_CODE_BY_DTYPE[dtype]
    try:
        return _CODE_BY_DTYPE[dtype.newbyteorder("<")]
    except KeyError:
        raise UnsupportedDataTypeError(f"NumPy dtype {dtype} has no ONNX tensor data type") from None
