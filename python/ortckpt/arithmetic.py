"""Checkpoint arithmetic: federated averaging, deltas, interpolation (model merging).

What ONNX Runtime's on-device training leaves to the server: FedAvg of the checkpoints that
devices trained, the "what changed" a device uploads, and applying it.

Rules, the same for every function:

- The checkpoints must have the same parameters (names, trainable or frozen, data types,
  shapes); anything else is refused, naming the tensor.
- Only floating-point tensors are combined (float16/32/64, bfloat16, the float8 types). Integer,
  bool, string and sub-byte tensors are never averaged: they must be equal in every source and
  are copied (a step counter that differs is an error, not a mean).
- Frozen parameters are not trained, so they must be equal in every source (``frozen="first"``
  takes the first source's instead); a delta holds them as they are in ``a``.
- Arithmetic runs in float64 for float32/float64 tensors and in float32 for the narrower
  floats (float16, bfloat16, float8), then rounds once to the tensor's type.
- Properties come from the first source; an average sums ``num_samples`` when every source
  has it. Optimizer state is left out unless asked for.

Streaming: with ``out=PATH``, sources given as paths are read through their memory maps a
chunk at a time (pages dropped once used) and the result is written into the new file chunk
by chunk, so the memory used is a few chunks, not N checkpoints nor even one.

Object storage: sources and ``out`` may be ``s3://`` URLs (configured by the ``AWS_*``
variables, or ``storage_options=`` among the save options for ``out``). A source is then
downloaded (its external data read by ranged GETs a chunk at a time); an ``out`` URL gets the
result built in memory (one checkpoint's worth) and streamed up.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from . import _boundary, safe_io, targets
from . import dtypes as _dt
from .checkpoint_state import CheckpointState, OptimizerGroup
from .dtypes import PackedBits
from .errors import CheckpointStateError

Source = CheckpointState | str | os.PathLike

# Elements combined at a time: bounds the memory a pass uses whatever the tensor sizes.
CHUNK = 1 << 20
# The narrow floats, combined in float32 (NumPy's own kinds "f" are combined in float64).
_NARROW_FLOATS = {
    np.dtype(t)
    for t in (
        np.float16,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float8_e8m0fnu,
    )
}

# How one output chunk is made from the sources' chunks (each a float array).
Combine = Callable[[list[np.ndarray]], np.ndarray]


def average(
    sources: Sequence[Source],
    weights: Sequence[float] | None = None,
    *,
    include_optimizer_state: bool = False,
    frozen: str = "equal",
    out: str | os.PathLike[str] | None = None,
    **save_options: Any,
) -> CheckpointState:
    """The weighted mean of checkpoints (paths or states): FedAvg.

    ``weights`` default to every source's ``num_samples`` property when all have one, else
    equal weights; they need not sum to 1. The mean is ``sum(w_i * x_i) / sum(w_i)``, summed
    in source order (NumPy's ``np.average`` of the stacked tensors, bit for bit). With
    ``include_optimizer_state`` the momentums are averaged with the same weights, and each
    group's step is the largest of the sources' (the learning rate must agree). With ``out``,
    the result is written there as it is computed and returned loaded from it
    (``save_options``: :meth:`CheckpointState.save_checkpoint`'s ``external_data_threshold``
    and ``durable``).
    """
    states = _open_all(sources)
    if weights is None:
        counts = [s.properties.get("num_samples", None) for s in states]
        weights = (
            [float(c) for c in counts] if all(isinstance(c, (int, float)) for c in counts) else [1.0] * len(states)
        )
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(states),):
        raise CheckpointStateError(f"{len(w)} weights for {len(states)} checkpoints")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise CheckpointStateError(f"weights must be finite, non-negative and not all 0, got {list(weights)}")
    total = w.sum()

    def mean(chunks: list[np.ndarray]) -> np.ndarray:
        acc = np.multiply(chunks[0], w[0].astype(chunks[0].dtype))
        for chunk, weight in zip(chunks[1:], w[1:], strict=True):
            acc += chunk * weight.astype(chunk.dtype)
        return acc / total.astype(acc.dtype)

    properties = dict(states[0].properties)
    if all("num_samples" in s.properties for s in states):
        properties["num_samples"] = sum(s.properties["num_samples"] for s in states)  # type: ignore[misc]
    return _combine(states, mean, properties, include_optimizer_state, frozen, out, "average", save_options)


def delta(a: Source, b: Source, *, out: str | os.PathLike[str] | None = None, **save_options: Any) -> CheckpointState:
    """``a - b``: a checkpoint of the differences of the trainable float parameters (frozen
    and other tensors as they are in ``a``, and ``a``'s properties): what a device uploads."""
    return _combine(_open_all([a, b]), lambda c: c[0] - c[1], None, False, "first", out, "delta", save_options)


def apply(
    base: Source, delta: Source, scale: float = 1.0, *, out: str | os.PathLike[str] | None = None, **save_options: Any
) -> CheckpointState:
    """``base + scale * delta``: a server update from a device's delta (``scale`` a learning
    rate); frozen and other tensors, and the properties, as they are in ``base``."""
    s = float(scale)
    return _combine(
        _open_all([base, delta]),
        lambda c: c[0] + c[1] * np.asarray(s, c[1].dtype),
        None,
        False,
        "first",
        out,
        "apply",
        save_options,
    )


def interpolate(
    a: Source, b: Source, t: float, *, out: str | os.PathLike[str] | None = None, **save_options: Any
) -> CheckpointState:
    """``(1 - t) * a + t * b``: model merging (``t=0`` gives ``a``'s values, ``t=1`` ``b``'s)."""
    tt = float(t)
    return _combine(
        _open_all([a, b]),
        lambda c: c[0] * np.asarray(1 - tt, c[0].dtype) + c[1] * np.asarray(tt, c[1].dtype),
        None,
        False,
        "equal",
        out,
        "interpolate",
        save_options,
    )


def _open_all(sources: Sequence[Source]) -> list[_Opened]:
    if len(sources) == 0:
        raise CheckpointStateError("no checkpoints given")
    return [_Opened(s, i) for i, s in enumerate(sources)]


class _Opened:
    """A source: its state, a label for errors, and whether its maps are ours to drop pages of."""

    def __init__(self, source: Source, index: int) -> None:
        if isinstance(source, CheckpointState):
            self.state, self.label, self.owned = source, f"checkpoint #{index}", False
        else:
            self.state = CheckpointState.load_checkpoint(source)
            self.label, self.owned = f"checkpoint #{index} ({os.fspath(source)})", True
        if self.state.is_nominal:
            raise CheckpointStateError(f"{self.label} is nominal: it holds no values")

    @property
    def properties(self) -> Any:
        return self.state.properties

    def done_with(self, value: Any) -> None:
        """Drops the pages of ``value`` (a view over one of our own maps) from memory."""
        if self.owned:
            _boundary.release_pages(value)


def _is_combined(value: Any) -> bool:
    return isinstance(value, np.ndarray) and (value.dtype.kind == "f" or value.dtype in _NARROW_FLOATS)


def _work_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype in _NARROW_FLOATS else np.dtype(np.float64)


class _Plan:
    """The result's tensors: for each, either a value copied from the first source or a
    combination computed chunk by chunk."""

    def __init__(self) -> None:
        self.copied: dict[tuple[str, ...], Any] = {}
        self.combined: dict[tuple[str, ...], tuple[np.dtype, tuple[int, ...], list[Any]]] = {}


def _tensors(opened: _Opened, include_optimizer_state: bool) -> Iterator[tuple[tuple[str, ...], Any, bool]]:
    """(key, value, frozen) for every parameter and, when asked, every momentum."""
    state = opened.state
    for name in state.parameters.names():
        parameter = state.parameters[name]
        yield ("parameter", name), parameter.data, not parameter.requires_grad
    if include_optimizer_state:
        for group_name, group in sorted(state.optimizer_groups.items()):
            for param, moms in sorted(group.momentums.items()):
                for m, value in sorted(moms.items()):
                    yield ("momentum", group_name, param, m), value, False


def _describe(key: tuple[str, ...]) -> str:
    return f"tensor {key[1]}" if key[0] == "parameter" else f"momentum {'/'.join(key[1:])}"


def _signature(value: Any) -> tuple[int, tuple[int, ...]]:
    if isinstance(value, PackedBits):
        return value.data_type, value.shape
    return _dt.code_of(np.asarray(value)), tuple(np.shape(value))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, PackedBits):
        return bool(np.array_equal(a.packed, b.packed))
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == object:
        return bool(np.array_equal(a, b))
    return bool(
        np.array_equal(
            a.view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8),
            b.view(np.uint8) if b.ndim else b.reshape(1).view(np.uint8),
        )
    )


def _plan(sources: list[_Opened], include_optimizer_state: bool, frozen: str, what: str) -> _Plan:
    if frozen not in ("equal", "first"):
        raise ValueError(f"frozen must be 'equal' or 'first', got {frozen!r}")
    first = sources[0]
    every = [
        {key: (value, is_frozen) for key, value, is_frozen in _tensors(s, include_optimizer_state)} for s in sources
    ]
    layout = every[0]
    plan = _Plan()
    for other, keys in zip(sources[1:], every[1:], strict=True):
        if keys.keys() != layout.keys():
            extra = sorted(set(keys) ^ set(layout))[:3]
            raise CheckpointStateError(
                f"{what}: {other.label} does not hold the same tensors as {first.label} "
                f"(differing: {', '.join(_describe(k) for k in extra)})"
            )
        for key, (value, is_frozen) in keys.items():
            if is_frozen != layout[key][1]:
                raise CheckpointStateError(
                    f"{what}: {_describe(key)} is frozen in one checkpoint and trainable in another"
                )
            if _signature(value) != _signature(layout[key][0]):
                (c1, s1), (c2, s2) = _signature(layout[key][0]), _signature(value)
                raise CheckpointStateError(
                    f"{what}: {_describe(key)} is {_dt.name_of(c1)} {list(s1)} in {first.label} "
                    f"but {_dt.name_of(c2)} {list(s2)} in {other.label}"
                )
    for key, (value, is_frozen) in layout.items():
        values = [tensors[key][0] for tensors in every]
        if _is_combined(value) and not is_frozen:
            plan.combined[key] = (value.dtype, tuple(value.shape), values)
            continue
        # delta and apply keep the first checkpoint's (the second is a difference, not a peer)
        if not (is_frozen and frozen == "first") and what not in ("delta", "apply"):
            for other, v in zip(sources[1:], values[1:], strict=True):
                if not _equal(v, value):
                    kind = "frozen parameter" if is_frozen else f"{_dt.name_of(_signature(value)[0])} tensor"
                    hint = " (frozen='first' takes the first checkpoint's)" if is_frozen else ""
                    raise CheckpointStateError(
                        f"{what}: {_describe(key)} differs between {first.label} and {other.label}: a {kind} is "
                        f"never combined, it must be equal in every checkpoint{hint}"
                    )
        plan.copied[key] = value
    return plan


def _groups(sources: list[_Opened], what: str) -> dict[str, tuple[int, float]]:
    """Each optimizer group's step (the largest) and initial learning rate (which must agree)."""
    out: dict[str, tuple[int, float]] = {}
    for name, group in sources[0].state.optimizer_groups.items():
        steps = []
        for s in sources:
            other = s.state.optimizer_groups.get(name)
            if other is None or other.initial_learning_rate != group.initial_learning_rate:
                raise CheckpointStateError(
                    f"{what}: optimizer group {name} is missing or has another initial learning rate in {s.label}"
                )
            steps.append(other.step)
        out[name] = (max(steps), group.initial_learning_rate)
    return out


def _combine(
    sources: list[_Opened],
    combine: Combine,
    properties: dict[str, Any] | None,
    include_optimizer_state: bool,
    frozen: str,
    out: str | os.PathLike[str] | None,
    what: str,
    save_options: dict[str, Any],
) -> CheckpointState:
    plan = _plan(sources, include_optimizer_state, frozen, what)
    groups = _groups(sources, what) if include_optimizer_state else {}
    if properties is None:
        properties = dict(sources[0].properties)

    def chunks(key: tuple[str, ...]) -> Iterator[tuple[int, np.ndarray]]:
        """(first element, result) for each chunk of a combined tensor, in order."""
        dtype, _, values = plan.combined[key]
        flats = [np.asarray(v).reshape(-1) for v in values]
        work = _work_dtype(dtype)
        for start in range(0, flats[0].size, CHUNK):
            parts = [f[start : start + CHUNK] for f in flats]
            result = combine([p.astype(work) for p in parts]).astype(dtype)
            for source, part in zip(sources, parts, strict=True):
                source.done_with(part)
            yield start, result

    if out is None or targets.is_object_url(out):
        arrays: dict[tuple[str, ...], Any] = dict(plan.copied)
        for key, (dtype, shape, _) in plan.combined.items():
            result = np.empty(shape, dtype)
            flat = result.reshape(-1)
            for start, part in chunks(key):
                flat[start : start + part.size] = part
            arrays[key] = result
        state = _state_of(sources[0].state, arrays, properties, groups)
        if out is not None:  # an object has no place to fill in: the result, in memory, streams up
            CheckpointState.save_checkpoint(state, out, include_optimizer_state=bool(groups), **save_options)
        return state

    # Streaming: the result's files staged by the core with zeros where combined values go
    # (zeros from calloc cost no memory), filled in place chunk by chunk, then put in place by
    # the core's one commit (the same as every save's).
    options = dict(save_options)
    durable = bool(options.pop("durable", False))
    threshold = options.pop("external_data_threshold", _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD)
    if options:
        raise TypeError(f"{what}() got unexpected save options: {', '.join(sorted(options))}")
    template = dict(plan.copied)
    for key, (dtype, shape, _) in plan.combined.items():
        template[key] = np.zeros(shape, dtype)
    path = Path(out)
    core = _state_of(sources[0].state, template, properties, groups).core_state(bool(groups))
    staging, placed = _boundary.save_staged(path, core, external_data_threshold=threshold)
    try:
        # Where each combined tensor's zeros went: found by the address of its template array.
        where = {
            key: placed[template[key].__array_interface__["data"][0]] for key in plan.combined if template[key].nbytes
        }
        del core, template
        for external in (False, True):
            keys = [key for key in where if where[key][1] == external]
            if keys:  # every chunk of the file's tensors written in turn
                writes = (
                    (where[key][0] + start * plan.combined[key][0].itemsize, part.view(np.uint8))
                    for key in keys
                    for start, part in chunks(key)
                )
                safe_io.pwrite_all(staging.fileno(data=external), writes, Path(f"{path}.data") if external else path)
        staging.commit(durable=durable)
    finally:
        staging.discard()
    return CheckpointState.load_checkpoint(path)


def _state_of(
    like: CheckpointState,
    arrays: dict[tuple[str, ...], Any],
    properties: dict[str, Any],
    groups: dict[str, tuple[int, float]],
) -> CheckpointState:
    trainable = {k[1]: v for k, v in arrays.items() if k[0] == "parameter" and like.parameters[k[1]].requires_grad}
    frozen = {k[1]: v for k, v in arrays.items() if k[0] == "parameter" and not like.parameters[k[1]].requires_grad}
    state = CheckpointState.from_arrays(trainable, frozen, properties)
    result: dict[str, OptimizerGroup] = {name: OptimizerGroup(step, lr) for name, (step, lr) in groups.items()}
    for key, value in arrays.items():
        if key[0] == "momentum":
            result[key[1]].momentums.setdefault(key[2], {})[key[3]] = value
    state.optimizer_groups = result
    return state


__all__ = ["apply", "average", "delta", "interpolate"]
