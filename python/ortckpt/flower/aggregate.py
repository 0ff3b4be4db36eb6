"""FedAvg of Flower replies in ortckpt's Rust kernels, straight from the replies' ``.npy`` bytes.

Each reply is screened first, alone: one ``ArrayRecord`` and one ``MetricRecord``, a finite
weight of 0 or more under the weighting key, the same keys as the global model, each ``Array``
of the global model's dtype and shape with ``.npy`` bytes that say so. A reply that fails is
dropped from the round with its reason; the others are averaged. Then NaN and infinities: a
NaN or an infinity in any reply makes the average's element NaN or infinite (even with weight
0), and a mean of finite values is finite, so the average is checked (one model, not N); where
it is not finite, the replies' tensors there are, and those that hold one are dropped and the
average made again. So one client's NaN never reaches the global model, and a round without
one reads each reply once.

The float16, bfloat16, float32, float64 and float8 tensors are averaged by ``_core.combine`` (the
kernels of :func:`ortckpt.average`: float64 accumulation for float32/float64, float32 for the
narrower ones, rounded once), each reply's values read in place from its ``Array.data`` (a
view past the ``.npy`` header): memory does not grow with the number of replies. The kernel
writes each tensor's result straight into the ``bytes`` its ``Array`` holds (after the header),
made as CPython's C API makes a bytes object it fills (:func:`_new_bytes`): the result is the
one model of extra memory, with no copy of it. The float8 types but E8M0 go through the same
kernel (float32, rounded once as ml_dtypes rounds); E8M0 is averaged by NumPy with the same
arithmetic; integer and bool tensors are not averaged: the first accepted reply's are taken.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .. import _boundary
from ..errors import ArrayRecordError
from .convert import dtype_named, flwr_app, npy_header, parse

# The types the core's kernels average (ONNX codes).
KERNEL_CODES = {
    np.dtype("<f4"): 1,
    np.dtype("<f8"): 11,
    np.dtype("<f2"): 10,
    np.dtype(ml_dtypes.bfloat16): 16,
    np.dtype(ml_dtypes.float8_e4m3fn): 17,
    np.dtype(ml_dtypes.float8_e4m3fnuz): 18,
    np.dtype(ml_dtypes.float8_e5m2): 19,
    np.dtype(ml_dtypes.float8_e5m2fnuz): 20,
}

# key -> (dtype, shape): what every reply must hold.
Layout = dict[str, tuple[np.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class Failure:
    """A reply dropped from a round: the node that sent it and why."""

    node_id: int
    reason: str


def layout_of(record: Any) -> Layout:
    """The dtype and shape of each of an ``ArrayRecord``'s arrays, in order."""
    layout: Layout = {}
    for key, array in record.items():
        dtype, shape, *_ = parse(array, key)
        layout[key] = (dtype, shape)
    return layout


@functools.lru_cache(maxsize=4096)
def _header(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[bytes, str, int]:
    """(the .npy header, Flower's dtype name, the values' length) of an array of ``dtype`` and ``shape``."""
    return npy_header(dtype, shape), str(dtype), dtype.itemsize * _count(shape)


def _as_expected(array: Any, dtype: np.dtype, shape: tuple[int, ...]) -> int | None:
    """The offset of an ``Array``'s values when it is exactly what ``np.save`` writes for
    ``dtype`` and ``shape`` (Flower's ``Array(ndarray)``: the common case, checked without
    parsing), else None (then parsed, and checked, in full)."""
    header, name, length = _header(dtype, shape)
    data = array.data
    if (
        array.stype == "numpy.ndarray"
        and array.dtype == name
        and tuple(array.shape) == shape
        and len(data) == len(header) + length
        and data.startswith(header)
    ):
        return len(header)
    return None


# CPython's C API for a bytes object filled after it is made (PyBytes_FromStringAndSize(NULL, n)).
_bytes_of_size = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_of_size.restype, _bytes_of_size.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
_contents_of = ctypes.pythonapi.PyBytes_AsString
_contents_of.restype, _contents_of.argtypes = ctypes.c_void_p, [ctypes.py_object]


def _new_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``size`` bytes (uninitialised) and a writable view of them: the C
    API's way to build a bytes object in place, valid while the object is new and held here only
    (not hashed, not shared). Flower's ``Array`` takes ``bytes`` alone, so this spares the copy of
    the whole result that ``bytes(bytearray)`` costs. Every byte must be written before it is used."""
    if size < 2:  # (CPython shares its empty and one-byte objects)
        return bytes(size), memoryview(bytearray(size))
    data = _bytes_of_size(None, size)
    contents = (ctypes.c_char * size).from_address(_contents_of(data))
    contents.owner = data  # type: ignore[attr-defined]  # (the view keeps the bytes alive)
    return data, memoryview(contents).cast("B")


def _declared(array: Any, key: str) -> tuple[np.dtype, tuple[int, ...]] | None:
    """The dtype and shape an ``Array`` says it holds, or None where they name none (then its
    header is parsed, which says why)."""
    try:
        return dtype_named(array.dtype, key), tuple(int(n) for n in array.shape)
    except (ArrayRecordError, TypeError, ValueError):
        return None


def _count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)  # (exact: Python ints; np.prod costs microseconds a call)


def _is_float(dtype: np.dtype) -> bool:
    return dtype in KERNEL_CODES or dtype.kind == "f" or dtype.name.startswith("float8")


def screen(content: Any, layout: Layout | None, weight_key: str) -> tuple[float, Any, dict[str, int], Layout]:
    """(weight, ArrayRecord, offset of each array's values, their layout) of a reply's content,
    or an ArrayRecordError saying why it cannot be averaged. ``layout`` None: any consistent one."""
    if len(content.array_records) != 1:
        raise ArrayRecordError(f"{len(content.array_records)} ArrayRecords in the reply, not one")
    if len(content.metric_records) != 1:
        raise ArrayRecordError(f"{len(content.metric_records)} MetricRecords in the reply, not one")
    metrics = next(iter(content.metric_records.values()))
    weight = metrics.get(weight_key)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ArrayRecordError(f"the MetricRecord has no number under {weight_key!r} (got {weight!r})")
    if not math.isfinite(weight) or weight < 0:
        raise ArrayRecordError(f"the weight {weight_key!r} is {weight}: a finite number of 0 or more is needed")
    record = next(iter(content.array_records.values()))
    if layout is not None and list(record.keys()) != list(layout):
        missing = [k for k in layout if k not in record]
        extra = [k for k in record if k not in layout]
        raise ArrayRecordError(f"the arrays differ from the global model's: missing {missing}, unexpected {extra}")
    offsets: dict[str, int] = {}
    found: Layout = {}
    for key, array in record.items():
        # The global model's type and shape, or (the first reply, without one) the Array's own.
        want = layout[key] if layout is not None else _declared(array, key)
        offset = _as_expected(array, *want) if want is not None else None
        if want is not None and offset is not None:  # (np.save's header for that type and shape)
            dtype = want[0]
            if layout is None:
                found[key] = want
        else:
            dtype, shape, offset, stored, fortran = parse(array, key)
            if layout is not None and (dtype, shape) != layout[key]:
                want = layout[key]
                raise ArrayRecordError(f"{key}: {dtype} {shape}, the global model's is {want[0]} {want[1]}", key)
            if stored != dtype or fortran:
                raise ArrayRecordError(f"{key}: the .npy bytes are not C-ordered little-endian", key)
            found[key] = (dtype, shape)
        offsets[key] = offset
        if _is_float(dtype) and dtype not in KERNEL_CODES:  # (the kernel's types: see nonfinite)
            values = np.frombuffer(array.data, np.uint8, offset=offset).view(dtype)
            if not _all_finite(values, np.float32):
                raise ArrayRecordError(f"{key}: NaN or infinite values", key)
    return float(weight), record, offsets, layout if layout is not None else found


def nonfinite(record: Any, offsets: dict[str, int] | None, keys: Sequence[str], layout: Layout) -> str | None:
    """Why the kernel's tensors ``keys`` of ``record`` are not all finite ("key: n NaN, ..."),
    or None when they are: counted by the core's statistics kernel in one pass each.
    ``offsets`` None: those of ``record``'s own arrays (a result's)."""
    tensors: list[_boundary.StatsTensor] = []
    for key in keys:
        offset = offsets[key] if offsets is not None else parse(record[key], key)[2]
        tensors.append((KERNEL_CODES[layout[key][0]], np.frombuffer(record[key].data, np.uint8, offset=offset), None))
    for key, figures in zip(keys, _boundary.tensor_stats(tensors, None), strict=True):
        nan, posinf, neginf = figures[:3]
        if nan or posinf or neginf:
            return f"{key}: {nan} NaN, {posinf} +inf, {neginf} -inf values"
    return None


def nonfinite_keys(result: Any, layout: Layout) -> list[str]:
    """The kernel's tensors of an average that hold a NaN or an infinity: where some reply did
    (a mean of finite values is finite: the kernel computes one that overflows from shares)."""
    keys = []
    for key, (dtype, shape) in layout.items():
        if dtype in KERNEL_CODES and _count(shape):
            values = np.frombuffer(
                result[key].data, np.uint8, offset=len(result[key].data) - dtype.itemsize * _count(shape)
            )
            if not _all_finite(values.view(dtype)):
                keys.append(key)
    return keys


# Elements per np.isfinite call: its bool temporary stays at 8 MiB (a 1 GiB tensor's would be 256 MiB).
_FINITE_CHUNK = 1 << 23


def _all_finite(values: np.ndarray, as_type: Any = None) -> bool:
    """Whether every value is finite (checked ``as_type`` where NumPy's isfinite needs a wider type)."""
    for start in range(0, values.size, _FINITE_CHUNK):
        chunk = values[start : start + _FINITE_CHUNK]
        if not np.isfinite(chunk if as_type is None else chunk.astype(as_type)).all():
            return False
    return True


def average(records: Sequence[Any], offsets: Sequence[dict[str, int]], weights: Sequence[float], layout: Layout) -> Any:
    """The weighted mean of screened ``ArrayRecord``s (see the module's docstring), an ``ArrayRecord``."""
    w = np.asarray(weights, np.float64)
    # Scaled by a power of two (exact), the largest weight in [0.5, 1): their sum cannot overflow.
    w = np.ldexp(w, -np.frexp(w.max())[1])
    total = w.sum()
    headers = {key: _header(dtype, shape)[0] for key, (dtype, shape) in layout.items()}
    held = [dict(record.items()) for record in records]  # (a plain dict's lookups: 1,000s a round)
    sinks: dict[str, bytes] = {}
    jobs = []
    kernel_keys = []
    for key, (dtype, shape) in layout.items():
        size = dtype.itemsize * _count(shape)
        if dtype not in KERNEL_CODES or size == 0:
            continue
        sinks[key], view = _new_bytes(len(headers[key]) + size)
        view[: len(headers[key])] = headers[key]
        inputs = [memoryview(r[key].data)[o[key] :] for r, o in zip(held, offsets, strict=True)]
        jobs.append((KERNEL_CODES[dtype], inputs, [None] * len(inputs), view[len(headers[key]) :]))
        kernel_keys.append(key)
    if jobs:
        overflow, _ = _boundary.combine("average", [*map(float, w), float(total)], jobs, None)
        for job in jobs:
            job[3].release()  # (the kernel wrote every value: the bytes are whole now)
        del jobs
        if overflow is not None:  # (a mean of finite values fits its type: the kernel's own guard)
            raise ArrayRecordError(f"{kernel_keys[overflow[0]]}: the average does not fit its type")
    result = flwr_app.ArrayRecord()
    for key, (dtype, shape) in layout.items():
        if key in sinks:
            data = sinks.pop(key)
        elif _is_float(dtype) and _count(shape):
            pairs = zip(records, offsets, strict=True)
            parts = [np.frombuffer(r[key].data, np.uint8, offset=o[key]).view(dtype) for r, o in pairs]
            acc = np.zeros(parts[0].shape, np.float32)
            for part, weight in zip(parts, w, strict=True):
                acc += part.astype(np.float32) * np.float32(weight)
            data = headers[key] + (acc / np.float32(total)).astype(dtype).tobytes()
        elif _count(shape) == 0:
            data = headers[key]
        else:  # integers and bool are not averaged: the first accepted reply's
            result[key] = records[0][key]
            continue
        result[key] = flwr_app.Array(dtype=str(dtype), shape=shape, stype="numpy.ndarray", data=data)
    return result
