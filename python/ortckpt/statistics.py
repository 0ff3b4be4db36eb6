"""Per-tensor statistics and change figures: what a person looks at to debug training.

``tensor_stats(checkpoint)`` gives, for every tensor (parameters and optimizer momentums),
the min, max, mean, std (population, ddof=0) and L2 norm of its finite values and how many
values are NaN, +Inf and -Inf. ``tensor_changes(a, b)`` gives, for every tensor the two
checkpoints share with the same dtype and shape, how many elements changed, the L2 norm of
the difference, the relative change (that norm over ``a``'s L2 norm) and the largest absolute
difference (over the pairs where both values are finite; pairs with a NaN or an infinity
that changed are counted apart). ``histogram``
counts a tensor's finite values in equal bins.

Tensors are named as ``ortckpt diff`` names them: parameters by name, momentums as
``group/parameter/momentum``. Figures are Python floats computed in double precision; a
tensor with no finite values (or a string tensor) has ``None`` for them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import dtypes as _dt
from .checkpoint_state import CheckpointState, PackedBits


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

    @property
    def finite(self) -> int:
        return self.elements - self.nan - self.posinf - self.neginf

    @property
    def flagged(self) -> bool:
        """True when the tensor holds a NaN or an infinity."""
        return bool(self.nan or self.posinf or self.neginf)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape), "finite": self.finite}


@dataclass(frozen=True)
class TensorChange:
    name: str
    elements: int
    changed: int  # elements that differ (NaN equals NaN)
    nonfinite: int  # of those, pairs where either side is NaN or infinite (left out of the figures)
    l2: float  # L2 norm of b - a over the pairs where both are finite
    relative: float | None  # l2 / L2 norm of a's finite values; None when those are all zero
    max_abs: float  # largest |b - a| over the pairs where both are finite

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def tensors(state: CheckpointState) -> Iterator[tuple[str, str, Any]]:
    """``(name, role, value)`` of every tensor: parameters, then momentums."""
    if not state.is_nominal:
        for name, parameter in state.parameters:
            yield name, ("trainable" if parameter.requires_grad else "frozen"), parameter.data
    for group_name, group in state.optimizer_groups.items():
        for param, momentums in group.momentums.items():
            for momentum, value in momentums.items():
                yield f"{group_name}/{param}/{momentum}", "momentum", value


def _numeric(value: Any) -> np.ndarray | None:
    """The values as a NumPy array the figures are computed over; None for strings."""
    if isinstance(value, PackedBits):
        return value.unpack().astype(np.float32 if value.data_type == _dt.FLOAT4E2M1 else np.int8)
    array = np.asarray(value)
    return None if array.dtype == object or array.dtype.kind in "SU" else array


def _dtype_name(value: Any) -> str:
    if isinstance(value, PackedBits):
        return _dt.name_of(value.data_type)
    return str(np.asarray(value).dtype)


def stats_of(name: str, role: str, value: Any) -> TensorStats:
    """The statistics of one tensor (NumPy reference implementation)."""
    array = _numeric(value)
    shape = tuple(int(d) for d in np.shape(value.unpack() if isinstance(value, PackedBits) else value))
    elements = math.prod(shape)
    if array is None:
        return TensorStats(name, role, _dtype_name(value), shape, elements, 0, 0, 0, None, None, None, None, None)
    wide = array.astype(np.float64).ravel()
    nan = int(np.count_nonzero(np.isnan(wide)))
    posinf = int(np.count_nonzero(wide == np.inf))
    neginf = int(np.count_nonzero(wide == -np.inf))
    finite = wide[np.isfinite(wide)]
    if not finite.size:
        return TensorStats(name, role, _dtype_name(value), shape, elements, nan, posinf, neginf, *([None] * 5))
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
    )


def _state(checkpoint: CheckpointState | str | os.PathLike[str]) -> CheckpointState:
    if isinstance(checkpoint, CheckpointState):
        return checkpoint
    return CheckpointState.load_checkpoint(checkpoint)


def tensor_stats(checkpoint: CheckpointState | str | os.PathLike[str]) -> dict[str, TensorStats]:
    """Name -> :class:`TensorStats` of every tensor of ``checkpoint`` (a state, or a
    checkpoint's path or ``s3://`` URL)."""
    return {name: stats_of(name, role, value) for name, role, value in tensors(_state(checkpoint))}


def change_of(name: str, a: Any, b: Any) -> TensorChange:
    """The change from ``a`` to ``b`` (same shape; NumPy reference implementation)."""
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
    )


def tensor_changes(
    a: CheckpointState | str | os.PathLike[str], b: CheckpointState | str | os.PathLike[str]
) -> dict[str, TensorChange]:
    """Name -> :class:`TensorChange` of every tensor ``a`` and ``b`` share with the same dtype
    and shape (numeric ones): those with changed NaNs or infinities first, then largest L2
    change first."""
    ta = {name: value for name, _role, value in tensors(_state(a))}
    found = []
    for name, _role, vb in tensors(_state(b)):
        va = ta.get(name)
        if va is None:
            continue
        xa, xb = _numeric(va), _numeric(vb)
        if xa is None or xb is None or xa.dtype != xb.dtype or xa.shape != xb.shape:
            continue
        found.append(change_of(name, va, vb))
    found.sort(key=lambda c: (-c.nonfinite, -c.l2, c.name))
    return {c.name: c for c in found}


def histogram(value: Any, bins: int = 32, range: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)`` of ``value``'s finite values in ``bins`` equal bins over ``range``
    (default: their min and max), as ``numpy.histogram``."""
    array = _numeric(value)
    if array is None:
        raise TypeError("a histogram needs a numeric tensor")
    wide = array.astype(np.float64).ravel()
    finite = wide[np.isfinite(wide)]
    counts, edges = np.histogram(finite, bins=bins, range=range)
    return counts, edges
