"""Differences between two checkpoint states (``ortckpt diff`` prints them; the report lists them).

Tensors are matched by key (:class:`~ortckpt.TensorKey`: parameters by name, momentums by group,
parameter and momentum; a parameter named like a momentum is never matched with it); for each pair
the role, dtype and shape are compared, then the values: the largest
absolute and relative difference and how many elements differ beyond ``atol + rtol * |b|``
(NumPy's ``isclose``; NaNs equal each other). The defaults ask for identical values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import dtypes as _dt
from .checkpoint_state import CheckpointState, PackedBits
from .tensor_keys import TensorKey


@dataclass
class TensorDiff:
    key: TensorKey
    problem: str  # "role", "dtype", "shape" or "values"
    a: Any = None
    b: Any = None
    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int | None = None
    elements: int | None = None

    @property
    def name(self) -> str:
        return self.key.label

    def to_json(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if k != "key"}
        return {"name": self.name, **fields, "key": self.key.to_json()}


@dataclass
class Diff:
    only_in_a: list[TensorKey] = field(default_factory=list)
    only_in_b: list[TensorKey] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    properties: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # name -> (a, b); None: absent
    optimizer: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # "group0.step" -> (a, b)
    compared: int = 0  # tensor pairs compared
    # Sides that are nominal checkpoints ("a", "b"): their tensors have names and types, no values,
    # so values are not compared (and a nominal side never equals one that holds values).
    nominal: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.differing()

    def differing(self) -> list[str]:
        """What differs, in words (for the verdict line): empty when identical."""
        parts = []
        if self.only_in_a or self.only_in_b:
            parts.append("tensors only one side has")
        if self.tensors:
            parts.append(f"{len(self.tensors)} tensor{'' if len(self.tensors) == 1 else 's'}")
        if self.optimizer:
            parts.append("optimizer state")
        if self.properties:
            parts.append("properties")
        if len(self.nominal) == 1:
            parts.append(f"values ({self.nominal[0].upper()} is nominal: names and types, no values)")
        return parts

    def to_json(self) -> dict[str, Any]:
        """Tensors by label (``only_in_*``), with their keys beside (``only_in_*_keys``)."""
        return {
            "only_in_a": [key.label for key in self.only_in_a],
            "only_in_b": [key.label for key in self.only_in_b],
            "only_in_a_keys": [key.to_json() for key in self.only_in_a],
            "only_in_b_keys": [key.to_json() for key in self.only_in_b],
            "tensors": [t.to_json() for t in self.tensors],
            "properties": self.properties,
            "optimizer": self.optimizer,
            "compared": self.compared,
            "nominal": self.nominal,
            "identical": self.identical,
        }


def _tensors(state: CheckpointState) -> dict[TensorKey, tuple[TensorKey, Any]]:
    """Key -> (the state's own key, which has its role; value) of every tensor."""
    return {key: (key, value) for key, value in state.tensors()}


def _typed(state: CheckpointState) -> dict[TensorKey, tuple[TensorKey, str]]:
    """A state's parameters by key, with their dtype names: all a nominal checkpoint has (no
    values, no optimizer state)."""
    out = {}
    for record in state.tensor_records():
        key = TensorKey.of_parameter(record.name, record.requires_grad)
        out[key] = (key, _dt.name_of(record.code))
    return out


def _comparable(value: Any) -> np.ndarray:
    if isinstance(value, PackedBits):
        return value.unpack().astype(np.float32 if value.data_type == _dt.FLOAT4E2M1 else np.int8)
    return np.asarray(value)


def _values(key: TensorKey, a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> TensorDiff | None:
    if a.dtype == object or a.dtype.kind == "b":
        mismatched = int(np.count_nonzero(a != b))
        return TensorDiff(key, "values", mismatched=mismatched, elements=a.size) if mismatched else None
    # Every numeric type (bfloat16 and float8 included) in double precision for the
    # tolerances; equality itself is checked in the original type, so integers stay exact.
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    a64, b64 = a.astype(wide), b.astype(wide)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        close = (a == b) | np.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)
        mismatched = int(a.size - np.count_nonzero(close))
        if not mismatched:
            return None
        diff = np.where(close, 0.0, np.abs(a64 - b64))  # equal infinities and NaN pairs count as 0
        rel = diff / np.abs(b64)
    return TensorDiff(
        key,
        "values",
        max_abs=float(np.nanmax(diff)),
        max_rel=float(np.nanmax(rel)),
        mismatched=mismatched,
        elements=a.size,
    )


def compare(
    a: CheckpointState,
    b: CheckpointState,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    on_bytes: Callable[[int], object] | None = None,
) -> Diff:
    """What differs between ``a`` and ``b`` (see the module's docstring); ``on_bytes(n)`` after
    each pair of tensors (a progress bar's update)."""
    diff = Diff()
    diff.nominal = [side for side, state in (("a", a), ("b", b)) if state.is_nominal]
    if diff.nominal:  # (names, roles and types: there are no values to compare)
        for key, dtype_a, dtype_b in _shared(diff, _typed(a), _typed(b)):
            if dtype_a != dtype_b:
                diff.tensors.append(TensorDiff(key, "dtype", dtype_a, dtype_b))
        _compare_the_rest(diff, a, b)
        return diff
    for key, va, vb in _shared(diff, _tensors(a), _tensors(b)):
        xa, xb = _comparable(va), _comparable(vb)
        if xa.dtype != xb.dtype:
            diff.tensors.append(TensorDiff(key, "dtype", str(xa.dtype), str(xb.dtype)))
        elif xa.shape != xb.shape:
            diff.tensors.append(TensorDiff(key, "shape", list(xa.shape), list(xb.shape)))
        elif (found := _values(key, xa, xb, rtol, atol)) is not None:
            diff.tensors.append(found)
        if on_bytes is not None:
            on_bytes(xa.nbytes + xb.nbytes)
    _compare_the_rest(diff, a, b)
    return diff


def _shared(
    diff: Diff, ta: dict[TensorKey, tuple[TensorKey, Any]], tb: dict[TensorKey, tuple[TensorKey, Any]]
) -> Iterator[tuple[TensorKey, Any, Any]]:
    """Records the tensors only one side has; yields (a's key, a's, b's) of each tensor both
    have in the same role (one whose role differs is recorded as such), counting every pair."""
    diff.only_in_a = sorted(set(ta) - set(tb))
    diff.only_in_b = sorted(set(tb) - set(ta))
    for key in sorted(set(ta) & set(tb)):
        (key_a, va), (key_b, vb) = ta[key], tb[key]
        diff.compared += 1
        if key_a.role != key_b.role:
            diff.tensors.append(TensorDiff(key_a, "role", key_a.role, key_b.role))
        else:
            yield key_a, va, vb


def beyond_tensors(a: CheckpointState, b: CheckpointState) -> Diff:
    """What differs between ``a`` and ``b`` besides their tensors: optimizer steps and learning
    rates (``Diff.optimizer``) and properties (``Diff.properties``)."""
    diff = Diff()
    _compare_the_rest(diff, a, b)
    return diff


def _compare_the_rest(diff: Diff, a: CheckpointState, b: CheckpointState) -> None:
    """Properties, optimizer steps and learning rates."""
    pa, pb = dict(a.properties), dict(b.properties)
    for name in sorted(set(pa) | set(pb)):
        if pa.get(name) != pb.get(name) or type(pa.get(name)) is not type(pb.get(name)):
            diff.properties[name] = (pa.get(name), pb.get(name))
    ga, gb = a.optimizer_groups, b.optimizer_groups
    for group in sorted(set(ga) | set(gb)):
        for attr in ("step", "initial_learning_rate"):
            va = getattr(ga[group], attr) if group in ga else None
            vb = getattr(gb[group], attr) if group in gb else None
            if va != vb:
                diff.optimizer[f"{group}.{attr}"] = (va, vb)
