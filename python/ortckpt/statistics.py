r"""Per-tensor statistics and change figures: what a person looks at to debug training.

``tensor_stats(checkpoint)`` gives, for every tensor (parameters and optimizer momentums),
the min, max, mean, std (population, ddof=0) and L2 norm of its finite values and how many
values are NaN, +Inf and -Inf. ``tensor_changes(a, b)`` gives, for every tensor the two
checkpoints share with the same dtype and shape, how many elements changed, the L2 norm of
the difference, the relative change (that norm over ``a``'s L2 norm) and the largest absolute
difference (over the pairs where both values are finite; pairs with a NaN or an infinity
that changed are counted apart). ``histogram``
counts a tensor's finite values in equal bins.

Tensors are keyed by :class:`~ortckpt.TensorKey` (a parameter by its name, a momentum by its
group, parameter and momentum: a parameter named like a momentum is a tensor of its own); the
results are :class:`~ortckpt.tensor_keys.TensorTable`\ s, where a label (a parameter's name,
``group/parameter/momentum``) also finds the one tensor it names. Figures are Python floats
computed in double precision; a tensor with no finite values (or a string tensor) has ``None``
for them.

The figures are computed by the Rust core (``src/compute/stats.rs``) in one pass over each
tensor's bytes with the GIL released, every tensor of a checkpoint in one call (its figures
come back as columns): every numeric type ortckpt stores but the complex ones, that is float8
(the five ONNX types), float16, bfloat16, float32, float64, every integer type, bool, and the
packed sub-byte types (INT4, UINT4, FLOAT4E2M1, INT2, UINT2, unpacked in the kernels: no copy
of a tensor is made). A checkpoint loaded here from a file is read through its map and its
pages are dropped behind the pass, so a large checkpoint does not stay in memory. The NumPy
reference implementation kept here (``_stats_numpy``, ``_change_numpy``) is the tests' oracle;
only complex tensors still go through it.

The figures are of the values as the file holds them: a statistic does not check the
checksums ortckpt writes into a file (a flipped bit shows as the value it made);
``ortckpt verify`` does.

Float64 values near the type's limits: the core scales them by a power of two, so a figure
is infinite only where its true value is beyond float64 (the L2 norm of two values of 1e308
is 1.41e308, where NumPy's sum of squares overflows to inf; the std of values of 1e-300 is
not 0 as NumPy's underflowed squares make it).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import _boundary
from . import dtypes as _dt
from .checkpoint_state import CheckpointState, PackedBits
from .errors import CheckpointStateError, UnsupportedDataTypeError
from .tensor_keys import TensorKey, TensorTable

# The ONNX types of whole bytes the core's kernels compute (the packed sub-byte types too, see
# _kernel_input; complex tensors go through NumPy here).
_KERNEL_CODES = frozenset(
    {_dt.FLOAT, _dt.DOUBLE, _dt.FLOAT16, _dt.BFLOAT16, _dt.BOOL}
    | {_dt.FLOAT8E4M3FN, _dt.FLOAT8E4M3FNUZ, _dt.FLOAT8E5M2, _dt.FLOAT8E5M2FNUZ, _dt.FLOAT8E8M0}
    | {_dt.INT8, _dt.INT16, _dt.INT32, _dt.INT64, _dt.UINT8, _dt.UINT16, _dt.UINT32, _dt.UINT64}
)

Progress = Callable[[int], object]


@dataclass(frozen=True)
class TensorStats:
    name: str
    role: str  # "trainable", "frozen" or "momentum"
    dtype: str  # NumPy's name ("float32", "bfloat16", ...)
    shape: tuple[int, ...]
    elements: int
    nan: int
    posinf: int
    neginf: int
    min: float | None  # of the finite values; None when there are none
    max: float | None
    mean: float | None
    std: float | None
    l2: float | None
    # Which tensor (``name`` is its label, which a parameter named like a momentum shares).
    key: TensorKey | None = field(default=None, compare=False, repr=False, kw_only=True)

    @property
    def finite(self) -> int:
        return self.elements - self.nan - self.posinf - self.neginf

    @property
    def flagged(self) -> bool:
        """True when the tensor holds a NaN or an infinity."""
        return bool(self.nan or self.posinf or self.neginf)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape), "finite": self.finite, **_key_json(self.key)}


@dataclass(frozen=True)
class TensorChange:
    name: str
    elements: int
    changed: int  # elements that differ (NaN equals NaN)
    nonfinite: int  # of those, pairs where either side is NaN or infinite (left out of the figures)
    l2: float  # L2 norm of b - a over the pairs where both are finite
    relative: float | None  # l2 / L2 norm of a's finite values; None when those are all zero
    max_abs: float  # largest |b - a| over the pairs where both are finite
    key: TensorKey | None = field(default=None, compare=False, repr=False, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), **_key_json(self.key)}


def _key_json(key: TensorKey | None) -> dict[str, Any]:
    return {"key": None if key is None else key.to_json()}


def _numeric(value: Any) -> np.ndarray | None:
    """The values as a NumPy array the figures are computed over; None for strings."""
    if isinstance(value, PackedBits):
        return value.unpack().astype(np.float32 if value.data_type == _dt.FLOAT4E2M1 else np.int8)
    array = np.asarray(value)
    if array.dtype.kind == "c":
        return _components(array)
    return None if array.dtype == object or array.dtype.kind in "SU" else array


def _components(array: np.ndarray) -> np.ndarray:
    """A complex tensor's real and imaginary parts, side by side, as the floats its figures are
    computed over (a NaN or infinity in either part counts; the L2 norm is the tensor's own): a
    view where the tensor is contiguous and native."""
    part = np.dtype(array.dtype.char.lower()).newbyteorder("=")  # complex64 -> float32, complex128 -> float64
    return np.ascontiguousarray(array, array.dtype.newbyteorder("=")).reshape(-1).view(part)


def _dtype_name(value: Any) -> str:
    if isinstance(value, PackedBits):
        return _dt.name_of(value.data_type)
    dtype = np.asarray(value).dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # (as native: a big-endian float32 is "float32", not ">f4")
        name = _DTYPE_NAMES.setdefault(dtype, str(dtype.newbyteorder("=")))
    return name


_DTYPE_NAMES: dict[np.dtype, str] = {}


# The dtypes the kernels take as they are (no copy; little-endian): their ONNX codes.
_NATIVE_CODES = {_dt.numpy_dtype(code).newbyteorder("<"): code for code in _KERNEL_CODES}
# Their names, by code ("float32", "bfloat16", ...: NumPy's, as _dtype_name gives them).
_NATIVE_NAMES = {code: str(_dt.numpy_dtype(code)) for code in _KERNEL_CODES}

# A tensor as the kernels take it: (ONNX code, a C-contiguous buffer of its values, its element
# count; None: as many as the bytes hold).
_KernelInput = tuple[int, Any, int | None]


def _kernel_input(value: Any) -> _KernelInput | None:
    """``value`` as the core's kernels take it (a complex tensor as its two parts), or None for a
    string tensor."""
    if type(value) is np.ndarray:  # the common case: the array itself, no copy
        code = _NATIVE_CODES.get(value.dtype)
        if code is not None and value.flags.c_contiguous:
            return code, value, None
    elif isinstance(value, PackedBits):  # its packed bytes, unpacked in the kernel
        packed = value.packed
        if packed.dtype != np.uint8 or not packed.flags.c_contiguous:
            packed = np.ascontiguousarray(packed, np.uint8)
        return value.data_type, packed, math.prod(value.shape)
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "SU":
        return None
    if array.dtype.kind == "c":  # its two parts, as floats
        array = _components(array)
    try:
        code = _dt.code_of(array)
    except UnsupportedDataTypeError:
        return None
    if code not in _KERNEL_CODES:
        return None
    # A copy (not contiguous, big-endian) no longer lies in a map.
    return code, _boundary.as_bytes(array), None


def _columns(inputs: list[_KernelInput]) -> tuple[list[int], list[Any], list[int | None]]:
    return [i[0] for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs]


def _shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, np.ndarray):
        return value.shape
    return tuple(int(d) for d in (value.shape if isinstance(value, PackedBits) else np.shape(value)))


def _figures(key: TensorKey, value: Any, given: _KernelInput, figures: _boundary.StatsFigures) -> TensorStats:
    """The statistics of ``value``, which the kernels computed from ``given``."""
    nan, posinf, neginf, finite, low, high, mean, std, l2 = figures
    if given[1] is value:  # an array as it is: its name from its type code, its size its own
        dtype, shape, elements = _NATIVE_NAMES[given[0]], value.shape, value.size
    else:
        dtype, shape = _dtype_name(value), _shape(value)
        elements = math.prod(shape)
    # Made without the dataclass's __init__ (fourteen object.__setattr__ calls of a frozen one): the
    # fields stored into its own __dict__, in the order __init__ sets them, so that it stays a
    # dict sharing the class's keys (a third of the size of a dict given whole, made in half the
    # time), for each of 16k tensors.
    stats = _new_stats(TensorStats)
    fields = stats.__dict__
    fields["name"] = key.label
    fields["role"] = key.role
    fields["dtype"] = dtype
    fields["shape"] = shape
    fields["elements"] = elements
    fields["nan"] = nan
    fields["posinf"] = posinf
    fields["neginf"] = neginf
    finite_only = finite != 0
    fields["min"] = low if finite_only else None
    fields["max"] = high if finite_only else None
    fields["mean"] = mean if finite_only else None
    fields["std"] = std if finite_only else None
    fields["l2"] = l2 if finite_only else None
    fields["key"] = key
    return stats


_new_stats = object.__new__


def stats_of(name: str, role: str, value: Any) -> TensorStats:
    """The statistics of one tensor."""
    key = _key_of(name, role)
    kernel = _kernel_input(value)
    if kernel is None:
        return _stats_numpy(name, role, value, key)
    columns = _boundary.stats_columns(*_columns([kernel]), [], None)
    return _figures(key, value, kernel, next(zip(*columns, strict=True)))


def _key_of(name: str, role: str) -> TensorKey:
    """The key of a tensor named by a caller: a parameter's, or a momentum's from its
    ``group/parameter/momentum`` label (the parameter the part between the first and last ``/``)."""
    if role != "momentum":
        return TensorKey.of_parameter(name, role != "frozen")
    group, _, rest = name.partition("/")
    parameter, _, momentum = rest.rpartition("/")
    return TensorKey.of_momentum(group, parameter, momentum)


def _stats_numpy(name: str, role: str, value: Any, key: TensorKey | None = None) -> TensorStats:
    """The statistics of one tensor: the NumPy reference implementation (for the types the
    kernels leave out, and the tests' oracle)."""
    array = _numeric(value)
    shape = tuple(int(d) for d in np.shape(value.unpack() if isinstance(value, PackedBits) else value))
    elements = math.prod(shape)
    if array is None:
        return TensorStats(
            name, role, _dtype_name(value), shape, elements, 0, 0, 0, None, None, None, None, None, key=key
        )
    wide = array.astype(np.float64).ravel()
    nan = int(np.count_nonzero(np.isnan(wide)))
    posinf = int(np.count_nonzero(wide == np.inf))
    neginf = int(np.count_nonzero(wide == -np.inf))
    finite = wide[np.isfinite(wide)]
    if not finite.size:
        return TensorStats(name, role, _dtype_name(value), shape, elements, nan, posinf, neginf, *([None] * 5), key=key)
    return TensorStats(
        name,
        role,
        _dtype_name(value),
        shape,
        elements,
        nan,
        posinf,
        neginf,
        float(finite.min()),
        float(finite.max()),
        float(finite.mean()),
        float(finite.std()),
        float(np.sqrt(np.dot(finite, finite))),
        key=key,
    )


class _Opened:
    """A checkpoint to read: its state, and whether its maps are ours to drop pages of (a
    state loaded here from a path, which nobody else holds or wrote through)."""

    def __init__(self, checkpoint: CheckpointState | str | os.PathLike[str], *, drop_loaded: bool = True) -> None:
        if isinstance(checkpoint, CheckpointState):
            self.state, self.owned = checkpoint, False
        else:
            self.state, self.owned = CheckpointState.load_checkpoint(checkpoint), True
        # Keys and values apart, not as (key, value) pairs: 16k pairs kept alive through a pass are as
        # many more objects for the garbage collector to walk.
        self.keys: list[TensorKey] = []
        self.values: list[Any] = []
        for key, value in self.state.tensors():
            self.keys.append(key)
            self.values.append(value)
        # The maps the values lie in, (address, length) each, whose pages the kernels drop as they read.
        self.maps: list[tuple[int, int]] = []
        self._maps: list[Any] = []
        if self.owned:
            mappings, self._maps = _boundary.maps_of(self.values)
            self.maps = list({m for m in mappings if m is not None})
        if drop_loaded:  # (so that a second checkpoint's load does not add to this one's)
            self.release()

    def release(self) -> None:
        """Drops the pages loading touched (and those read since) from memory."""
        _boundary.release_all_of(self._maps)


def tensor_stats(
    checkpoint: CheckpointState | str | os.PathLike[str], *, on_bytes: Progress | None = None
) -> TensorTable[TensorStats]:
    """Key -> :class:`TensorStats` of every tensor of ``checkpoint`` (a state, or a
    checkpoint's path or ``s3://`` URL), in one pass over each tensor's values.
    ``on_bytes(n)`` is called as ``n`` more bytes of values are read."""
    with _collector_paused():
        # The pages the load mapped are left for the pass, which reads them and drops them behind
        # it: dropped first, they were only mapped again (for 16k tensors of 16 KiB, reading each
        # tensor's table maps the whole file, by the kernel's fault-around).
        opened = _Opened(checkpoint, drop_loaded=False)
        try:
            inputs = [_kernel_input(value) for value in opened.values]
            kernel = [i for i in inputs if i is not None]
            # Every tensor in one call, the figures back as columns: one row of them a tensor.
            rows = zip(*_boundary.stats_columns(*_columns(kernel), opened.maps, on_bytes), strict=True)
            found = [
                _stats_numpy(key.label, key.role, value, key)
                if given is None
                else _figures(key, value, given, next(rows))
                for key, value, given in zip(opened.keys, opened.values, inputs, strict=True)
            ]
            return TensorTable(zip(opened.keys, found, strict=True))  # (one call: no __setitem__ a tensor)
        finally:
            opened.release()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a pass makes its objects (a checkpoint of 16k
    tensors: keys, views and results, none of them garbage; its collections, walking them again
    and again, took a quarter of the time the kernels did). A collector someone paused stays so."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _change(key: TensorKey, elements: int, figures: tuple[int, int, float, float, float, float]) -> TensorChange:
    # (relative comes from the core's scaled sums: both norms may be inf where it is not)
    changed, nonfinite, l2, norm, max_abs, relative = figures
    return TensorChange(key.label, elements, changed, nonfinite, l2, relative if norm else None, max_abs, key=key)


def change_of(name: str, a: Any, b: Any) -> TensorChange:
    """The change from ``a`` to ``b`` (same shape), of the parameter ``name``."""
    ka, kb = _kernel_input(a), _kernel_input(b)
    key = TensorKey.of_parameter(name)
    if ka is None or kb is None or ka[0] != kb[0] or _shape(a) != _shape(b):
        return _change_numpy(name, a, b, key)
    columns = _boundary.changes_columns([ka[0]], [ka[1]], [kb[1]], [ka[2]], [], None)
    return _change(key, math.prod(_shape(a)), next(zip(*columns, strict=True)))


def _change_numpy(name: str, a: Any, b: Any, key: TensorKey | None = None) -> TensorChange:
    """The change from ``a`` to ``b``: the NumPy reference implementation."""
    xa, xb = _numeric(a), _numeric(b)
    if xa is None or xb is None:
        raise TypeError(f"{name}: change figures need numeric tensors")
    wa, wb = xa.astype(np.float64).ravel(), xb.astype(np.float64).ravel()
    with np.errstate(invalid="ignore", over="ignore"):
        same = (wa == wb) | (np.isnan(wa) & np.isnan(wb))
        both = np.isfinite(wa) & np.isfinite(wb)
        d = np.where(both, wb - wa, 0.0)
        fa = np.where(np.isfinite(wa), wa, 0.0)
        l2 = float(np.sqrt(np.dot(d, d)))
        norm = float(np.sqrt(np.dot(fa, fa)))
    return TensorChange(
        name,
        int(wa.size),
        int(np.count_nonzero(~same)),
        int(np.count_nonzero(~same & ~both)),
        l2,
        (l2 / norm) if norm else None,
        float(np.abs(d).max()) if d.size else 0.0,
        key=key,
    )


def tensor_changes(
    a: CheckpointState | str | os.PathLike[str],
    b: CheckpointState | str | os.PathLike[str],
    *,
    on_bytes: Progress | None = None,
) -> TensorTable[TensorChange]:
    """Key -> :class:`TensorChange` of every tensor ``a`` and ``b`` share with the same dtype
    and shape (numeric ones): those with changed NaNs or infinities first, then largest L2
    change first. ``on_bytes(n)`` is called as ``n`` more bytes of values (of both) are read."""
    with _collector_paused():
        opened_a = _Opened(a)
        try:
            opened_b = _Opened(b)
            for side, opened in (("a", opened_a), ("b", opened_b)):
                if opened.state.is_nominal:
                    opened_b.release()
                    raise CheckpointStateError(
                        f"{side} is a nominal checkpoint (names and types, no values): there are no changes to compute"
                    )
            try:
                found = _changes(opened_a, opened_b, on_bytes)
            finally:
                opened_b.release()
        finally:
            opened_a.release()
    found.sort(key=lambda c: (-c.nonfinite, -c.l2, c.name))
    return TensorTable((c.key, c) for c in found if c.key is not None)


def _changes(opened_a: _Opened, opened_b: _Opened, on_bytes: Progress | None) -> list[TensorChange]:
    ta = dict(zip(opened_a.keys, opened_a.values, strict=True))
    found, codes, a, b, elements, paired = [], [], [], [], [], []
    for key, vb in zip(opened_b.keys, opened_b.values, strict=True):
        va = ta.get(key)
        if va is None or _dtype_name(va) != _dtype_name(vb) or _shape(va) != _shape(vb):
            continue
        ka, kb = _kernel_input(va), _kernel_input(vb)
        if ka is not None and kb is not None:
            codes.append(ka[0])
            a.append(ka[1])
            b.append(kb[1])
            elements.append(ka[2])
            paired.append((key, math.prod(_shape(va))))
        elif _numeric(va) is not None and _numeric(vb) is not None:
            found.append(_change_numpy(key.label, va, vb, key))
    maps = opened_a.maps + opened_b.maps
    columns = _boundary.changes_columns(codes, a, b, elements, maps, on_bytes)
    found += [_change(key, n, f) for (key, n), f in zip(paired, zip(*columns, strict=True), strict=True)]
    return found


def histogram(value: Any, bins: int = 32, range: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)`` of ``value``'s finite values in ``bins`` equal bins over ``range``
    (default: their min and max), or in the bins between the increasing edges ``bins`` gives
    (``range`` then unused), as ``numpy.histogram``."""
    kernel = _kernel_input(value)
    if kernel is None:
        return _histogram_numpy(value, bins, range)
    if not isinstance(bins, (int, np.integer)):
        given = np.asarray(bins, dtype=np.float64)
        if given.ndim != 1 or given.size < 2:
            raise ValueError("`bins` must be 1d, when an array")
        if np.any(given[:-1] > given[1:]):
            raise ValueError("`bins` must increase monotonically, when an array")
        if not np.all(np.isfinite(given)):
            raise ValueError(f"`bins` must be finite edges, got {given.tolist()}")
        return np.array(_boundary.histogram(*kernel, given.tolist()), dtype=np.intp), given
    if range is None:
        _nan, _pos, _neg, (finite,), (lo,), (hi,), *_ = _boundary.stats_columns(*_columns([kernel]), [], None)
        range = (lo, hi) if finite else (0.0, 1.0)
    # NumPy's own edges (its checks, and the widening of an empty range by 0.5 each side).
    edges = np.histogram_bin_edges(np.empty(0, np.float64), bins=int(bins), range=range)
    if not np.isfinite(edges[-1] - edges[0]):
        np.histogram(np.empty(0, np.float64), bins=int(bins), range=range)  # NumPy's own error, no copy
    return np.array(_boundary.histogram(*kernel, edges.tolist()), dtype=np.intp), edges


def _histogram_numpy(value: Any, bins: Any, range: tuple[float, float] | None) -> tuple[np.ndarray, np.ndarray]:
    array = _numeric(value)
    if array is None:
        raise TypeError("a histogram needs a numeric tensor")
    wide = array.astype(np.float64).ravel()
    finite = wide[np.isfinite(wide)]
    counts, edges = np.histogram(finite, bins=bins, range=range)
    return counts, edges
