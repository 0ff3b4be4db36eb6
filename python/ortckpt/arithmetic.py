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
- A result is finite wherever its inputs are: one that does not fit the tensor's type
  (``apply`` of float16 60000 + 60000) is a :class:`~ortckpt.ValueOverflowError` naming the
  tensor, the element and the checkpoints, and nothing is written. Values that are already
  NaN or infinite are the user's: they pass through as the arithmetic makes them.
- Arguments (weights, ``scale``, ``t``, ``frozen``, ``out``, save options) are checked before
  any checkpoint is read: :class:`~ortckpt.InvalidArgumentError` (or its TypeError,
  :class:`~ortckpt.InvalidArgumentTypeError`) naming the argument.
- Properties come from the first source; an average sums ``num_samples`` when every source
  has it (each a finite number of 0 or more, the sum within what a property holds), and has
  none otherwise. Optimizer state is left out unless asked for.

Kernels: float16, bfloat16, float32, float64 and float8 (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ)
tensors are computed by the core (``_core.combine``, src/compute) in one pass with the GIL
released: for each chunk of a result, the sources are added one after the other into one
accumulator, the result is rounded once and its bytes go out once. E8M0 tensors, and arrays
not stored little-endian, are combined here by NumPy a chunk at a time, with the same arithmetic.

Streaming: with ``out=PATH``, sources given as paths are read through their memory maps a
chunk at a time (pages dropped once used, and after loading) and the result is written into
the new file's places for it (left as holes until then) chunk by chunk, so the memory used is a
few chunks, not N checkpoints nor even one, whatever the number of sources. The kernel sums
(XXH3) each result as it writes it, and the file's checksum block is written from those sums:
the output is not read back (the few tensors NumPy computes are).

Object storage: sources and ``out`` may be ``s3://`` URLs (configured by the ``AWS_*``
variables, or ``storage_options=`` among the save options for ``out``). A source is then
downloaded (its external data read by ranged GETs a chunk at a time); an ``out`` URL gets the
result built in memory (one checkpoint's worth) and streamed up.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from . import _boundary, arguments, safe_io, targets
from . import dtypes as _dt
from .checkpoint_state import CheckpointState, OptimizerGroup
from .dtypes import PackedBits
from .errors import CheckpointStateError, InvalidArgumentError, InvalidArgumentTypeError, ValueOverflowError
from .progress import Bar, Hidden, maybe_bar
from .tensor_keys import TensorKey

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

# The tensor types the core's kernels compute (ONNX codes), little-endian as stored; the others
# (float8 E8M0, arrays of another byte order) are combined here by NumPy, chunk by chunk.
_KERNEL_CODES = {
    np.dtype("<f4"): 1,
    np.dtype("<f8"): 11,
    np.dtype("<f2"): 10,
    np.dtype(ml_dtypes.bfloat16): 16,
    np.dtype(ml_dtypes.float8_e4m3fn): 17,
    np.dtype(ml_dtypes.float8_e4m3fnuz): 18,
    np.dtype(ml_dtypes.float8_e5m2): 19,
    np.dtype(ml_dtypes.float8_e5m2fnuz): 20,
}


class _Operation:
    """An operation twice: as the core's kernel computes it (its name and coefficients, see
    ``_core.combine``) and as NumPy does (``combine``), the same arithmetic step by step."""

    def __init__(self, name: str, coefficients: list[float], combine: Combine) -> None:
        self.name, self.coefficients, self.combine = name, coefficients, combine


def average(
    sources: Sequence[Source],
    weights: Sequence[float] | None = None,
    *,
    include_optimizer_state: bool = False,
    frozen: str = "equal",
    out: str | os.PathLike[str] | None = None,
    progress: bool = False,
    **save_options: Any,
) -> CheckpointState:
    """The weighted mean of checkpoints (paths or states): FedAvg.

    ``weights`` (finite numbers, none negative, not all 0) default to every source's
    ``num_samples`` property when all have one, else equal weights; they need not sum to 1.
    The mean is ``sum(w_i * x_i) / sum(w_i)``, summed in source order, with the weights first
    scaled by a power of two so that the largest is in [0.5, 1): exact, so the result is
    NumPy's ``np.average`` of the stacked tensors bit for bit wherever that neither overflows
    nor underflows, and weights such as ``[1e308, 1e308]`` give the equal mean. Where the sum
    overflows the type it is computed in (float64 values near its largest), the mean is
    computed there from each weight's share instead: a mean of finite values is finite. With
    ``include_optimizer_state`` the momentums are averaged with the same weights, and each
    group's step is the largest of the sources' (the learning rate must agree). The result's
    ``num_samples`` is the sources' sum when all have one (none otherwise). With ``out``, the
    result is written there as it is computed and returned loaded from it (``save_options``:
    :meth:`CheckpointState.save_checkpoint`'s ``external_data_threshold`` and ``durable``).
    ``progress``: a bar (tqdm) over the bytes computed, as every function here takes.
    """
    _check_arguments(sources, include_optimizer_state, frozen, out, save_options, "average", progress)
    given = None if weights is None else _weights(weights, len(sources))
    states = _open_all(sources)
    samples = _num_samples(states)
    w = _weights_used(given, samples, len(states))
    # Scaled by a power of two (exact), the largest weight in [0.5, 1): their sum cannot overflow.
    w = np.ldexp(w, -np.frexp(w.max())[1])
    total = w.sum()

    def mean(chunks: list[np.ndarray]) -> np.ndarray:
        acc = np.multiply(chunks[0], w[0].astype(chunks[0].dtype))
        for chunk, weight in zip(chunks[1:], w[1:], strict=True):
            acc += chunk * weight.astype(chunk.dtype)
        result = acc / total.astype(acc.dtype)
        overflowed = np.isinf(acc)
        if overflowed.any():  # each weight's share of each input: at most the largest input
            shares = (w / total).astype(acc.dtype)
            result[overflowed] = sum(share * chunk[overflowed] for share, chunk in zip(shares, chunks, strict=True))
        return result

    properties = dict(states[0].properties)
    properties.pop("num_samples", None)
    if samples is not None:
        properties["num_samples"] = _sum_of_samples(samples, states)
    operation = _Operation("average", [*map(float, w), float(total)], mean)
    return _combine(
        states, operation, properties, include_optimizer_state, frozen, out, "average", save_options, progress
    )


def average_weights(sources: Sequence[Source], weights: Sequence[float] | None = None) -> list[float]:
    """The weights :func:`average` gives ``sources`` (as given, else their ``num_samples``, else
    equal), unscaled: what ``ortckpt average --json`` reports. Reads the sources' properties only."""
    given = None if weights is None else _weights(weights, len(sources))
    return [float(x) for x in _weights_used(given, _num_samples(_open_all(sources)), len(sources))]


def _weights_used(given: np.ndarray | None, samples: list[float | int] | None, count: int) -> np.ndarray:
    if given is not None:
        return given
    if samples is not None:
        return _weights(samples, count, "the checkpoints' num_samples")
    return np.ones(count)


def delta(
    a: Source, b: Source, *, out: str | os.PathLike[str] | None = None, progress: bool = False, **save_options: Any
) -> CheckpointState:
    """``a - b``: a checkpoint of the differences of the trainable float parameters (frozen
    and other tensors as they are in ``a``, and ``a``'s properties): what a device uploads."""
    _check_arguments([a, b], False, "first", out, save_options, "delta", progress)
    operation = _Operation("delta", [], lambda c: c[0] - c[1])
    return _combine(_open_all([a, b]), operation, None, False, "first", out, "delta", save_options, progress)


def apply(
    base: Source,
    delta: Source,
    scale: float = 1.0,
    *,
    out: str | os.PathLike[str] | None = None,
    progress: bool = False,
    **save_options: Any,
) -> CheckpointState:
    """``base + scale * delta``: a server update from a device's delta (``scale``, a finite
    number, a learning rate); frozen and other tensors, and the properties, as they are in
    ``base``."""
    s = arguments.finite("scale", scale)
    _check_arguments([base, delta], False, "first", out, save_options, "apply", progress)
    return _combine(
        _open_all([base, delta]),
        _Operation("apply", [s], lambda c: c[0] + c[1] * np.asarray(s, c[1].dtype)),
        None,
        False,
        "first",
        out,
        "apply",
        save_options,
        progress,
    )


def interpolate(
    a: Source,
    b: Source,
    t: float,
    *,
    out: str | os.PathLike[str] | None = None,
    progress: bool = False,
    **save_options: Any,
) -> CheckpointState:
    """``(1 - t) * a + t * b``: model merging (``t``, a finite number: 0 gives ``a``'s values,
    1 ``b``'s; past them, extrapolation)."""
    tt = arguments.finite("t", t)
    _check_arguments([a, b], False, "equal", out, save_options, "interpolate", progress)
    return _combine(
        _open_all([a, b]),
        _Operation(
            "interpolate",
            [1 - tt, tt],
            lambda c: c[0] * np.asarray(1 - tt, c[0].dtype) + c[1] * np.asarray(tt, c[1].dtype),
        ),
        None,
        False,
        "equal",
        out,
        "interpolate",
        save_options,
        progress,
    )


# The save options each kind of ``out`` takes: a local file is written in place (streamed); an
# object gets the result saved by CheckpointState.save_checkpoint.
_FILE_OPTIONS = {"durable", "external_data_threshold"}
_OBJECT_OPTIONS = {"durable", "external_data_threshold", "storage_options"}


def _check_arguments(
    sources: Sequence[Source],
    include_optimizer_state: Any,
    frozen: Any,
    out: Any,
    save_options: dict[str, Any],
    what: str,
    progress: Any,
) -> None:
    """The arguments every function takes, refused before any checkpoint is read."""
    arguments.flag("progress", progress)
    if isinstance(sources, (str, bytes, os.PathLike)) or not isinstance(sources, Sequence):
        raise InvalidArgumentTypeError(
            f"{what}: sources is a list of checkpoints (paths or states), got {type(sources).__name__}", "sources"
        )
    if len(sources) == 0:
        raise InvalidArgumentError(f"{what}: no checkpoints given (sources is empty)", "sources")
    for i, source in enumerate(sources):
        if not isinstance(source, (CheckpointState, str, os.PathLike)):
            raise InvalidArgumentTypeError(
                f"{what}: sources[{i}] is of type {type(source).__name__}, not a path nor a CheckpointState", "sources"
            )
    arguments.flag("include_optimizer_state", include_optimizer_state)
    if frozen not in ("equal", "first") or not isinstance(frozen, str):
        raise InvalidArgumentError(f"frozen must be 'equal' or 'first', got {frozen!r}", "frozen")
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise InvalidArgumentTypeError(
            f"{what}: out is a path or an {targets.SCHEME} URL, got {type(out).__name__}", "out"
        )
    targets.output(out, "out")
    allowed = _FILE_OPTIONS if out is not None and not targets.is_object_url(out) else _OBJECT_OPTIONS
    unknown = sorted(set(save_options) - allowed) if out is not None else sorted(save_options)
    if unknown:
        raise InvalidArgumentTypeError(
            f"{what}() got unexpected save options: {', '.join(unknown)}"
            + ("" if out is not None else " (save options are for out=)"),
            unknown[0],
        )
    if "external_data_threshold" in save_options:
        arguments.count("external_data_threshold", save_options["external_data_threshold"], 0, arguments.MAX_BYTES)
    if "durable" in save_options:
        arguments.flag("durable", save_options["durable"])


def _weights(weights: Any, expected: int, name: str = "weights") -> np.ndarray:
    """The weights as float64: finite numbers (not bools), none negative, not all 0, one a
    checkpoint."""
    if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Iterable):
        raise InvalidArgumentTypeError(f"{name} is a list of numbers, got {weights!r}", "weights")
    values = list(weights)
    if len(values) != expected:
        raise InvalidArgumentError(f"{len(values)} {name} for {expected} checkpoints", "weights")
    w = np.array([arguments.finite(f"{name}[{i}]", v, "weights") for i, v in enumerate(values)], dtype=np.float64)
    if np.any(w < 0) or not np.any(w > 0):
        raise InvalidArgumentError(f"{name} must be finite, non-negative and not all 0, got {values}", "weights")
    return w


def _num_samples(states: list[_Opened]) -> list[float | int] | None:
    """Every source's ``num_samples`` when all have one (each a number of samples, or a
    typed error naming the checkpoint), else None."""
    counts = []
    for s in states:
        count = s.properties.get("num_samples")
        if count is None:
            return None
        if not isinstance(count, (int, float)) or not math.isfinite(count) or count < 0:
            error = CheckpointStateError(
                f"{s.label}: property num_samples is {count!r}, not a number of samples (a finite number, 0 or more)"
            )
            error.filename = s.path
            raise error
        counts.append(count)
    return counts


def _sum_of_samples(samples: list[float | int], states: list[_Opened]) -> float | int:
    """The result's ``num_samples``: a property holds an int64 or a float32."""
    total = sum(samples)
    limit = 2**63 - 1 if isinstance(total, int) else float(np.finfo(np.float32).max)
    if total > limit:
        raise ValueOverflowError(
            f"the num_samples of {', '.join(s.label for s in states)} sum to {total}, more than a property "
            f"holds ({limit:g})"
        )
    return total


def _open_all(sources: Sequence[Source]) -> list[_Opened]:
    return [_Opened(s, i) for i, s in enumerate(sources)]


class _Opened:
    """A source: its state, a label for errors, and whether its maps are ours to drop pages of."""

    def __init__(self, source: Source, index: int) -> None:
        self.path: str | None = None
        if isinstance(source, CheckpointState):
            self.state, self.label, self.owned = source, f"checkpoint #{index}", False
        else:
            self.state = CheckpointState.load_checkpoint(source)
            self.path = os.fspath(source)
            self.label, self.owned = f"checkpoint #{index} ({self.path})", True
        if self.state.is_nominal:
            raise CheckpointStateError(f"{self.label} is nominal: it holds no values")
        self.release_all()

    @property
    def properties(self) -> Any:
        return self.state.properties

    def mapping(self, value: Any) -> tuple[int, int] | None:
        """The map ``value`` is a view over when its pages may be dropped once used: one of our
        own (nobody else holds this state, so nobody wrote through it)."""
        return _boundary.mapping_of(value) if self.owned else None

    def release_all(self) -> None:
        """Drops every page of our own maps: what loading and checking touched, and the pages
        the kernel maps around those (a source's pages, not its values, would otherwise stay
        counted in the process's memory while the others are read)."""
        if self.owned:
            _boundary.release_maps(value for _, value in _tensors(self, True))

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
        self.copied: dict[TensorKey, Any] = {}
        self.combined: dict[TensorKey, tuple[np.dtype, tuple[int, ...], list[Any]]] = {}


def _tensors(opened: _Opened, include_optimizer_state: bool) -> list[tuple[TensorKey, Any]]:
    """(key, value) for every parameter and, when asked, every momentum, in the keys' order."""
    return sorted(opened.state.tensors(include_optimizer_state=include_optimizer_state), key=lambda kv: kv[0])


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
    first = sources[0]
    every = [
        {key: (value, key.role == "frozen") for key, value in _tensors(s, include_optimizer_state)} for s in sources
    ]
    layout = every[0]
    plan = _Plan()
    for other, keys in zip(sources[1:], every[1:], strict=True):
        if keys.keys() != layout.keys():
            extra = sorted(set(keys) ^ set(layout))[:3]
            raise CheckpointStateError(
                f"{what}: {other.label} does not hold the same tensors as {first.label} "
                f"(differing: {', '.join(k.describe() for k in extra)})"
            )
        for key, (value, is_frozen) in keys.items():
            if is_frozen != layout[key][1]:
                raise CheckpointStateError(
                    f"{what}: {key.describe()} is frozen in one checkpoint and trainable in another"
                )
            if _signature(value) != _signature(layout[key][0]):
                (c1, s1), (c2, s2) = _signature(layout[key][0]), _signature(value)
                raise CheckpointStateError(
                    f"{what}: {key.describe()} is {_dt.name_of(c1)} {list(s1)} in {first.label} "
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
                equal = _equal(v, value)
                other.done_with(v)
                if not equal:
                    kind = "frozen parameter" if is_frozen else f"{_dt.name_of(_signature(value)[0])} tensor"
                    hint = " (frozen='first' takes the first checkpoint's)" if is_frozen else ""
                    raise CheckpointStateError(
                        f"{what}: {key.describe()} differs between {first.label} and {other.label}: a {kind} is "
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
    operation: _Operation,
    properties: dict[str, Any] | None,
    include_optimizer_state: bool,
    frozen: str,
    out: str | os.PathLike[str] | None,
    what: str,
    save_options: dict[str, Any],
    progress: bool,
) -> CheckpointState:
    plan = _plan(sources, include_optimizer_state, frozen, what)
    sources[0].release_all()
    computed = sum(dtype.itemsize * math.prod(shape) for dtype, shape, _ in plan.combined.values())
    with maybe_bar(progress, what, computed) as bar:
        return _computed(sources, plan, operation, properties, include_optimizer_state, out, what, save_options, bar)


def _computed(
    sources: list[_Opened],
    plan: _Plan,
    operation: _Operation,
    properties: dict[str, Any] | None,
    include_optimizer_state: bool,
    out: str | os.PathLike[str] | None,
    what: str,
    save_options: dict[str, Any],
    bar: Bar | Hidden,
) -> CheckpointState:
    groups = _groups(sources, what) if include_optimizer_state else {}
    if properties is None:
        properties = dict(sources[0].properties)
    # The core's kernels compute the tensors of the types they cover, in one pass with the GIL
    # released; NumPy, below, the others.
    kernel = [key for key, (dtype, _, _) in plan.combined.items() if dtype in _KERNEL_CODES]
    by_numpy = [key for key in plan.combined if key not in set(kernel)]

    def run_kernel(sinks: list[Any]) -> list[int | None]:
        """The kernel's tensors into their sinks (writable memory or (fd, offset, path)): the
        checksum of each one's values written to a file (None for memory)."""
        jobs = []
        for key, sink in zip(kernel, sinks, strict=True):
            dtype, _, values = plan.combined[key]
            flats = [np.ascontiguousarray(v).reshape(-1).view(np.uint8) for v in values]
            maps = [s.mapping(v) for s, v in zip(sources, values, strict=True)]
            jobs.append((_KERNEL_CODES[dtype], flats, maps, sink))
        callback = None if isinstance(bar, Hidden) else bar.update
        overflow, sums = _boundary.combine(operation.name, operation.coefficients, jobs, callback)
        for source in sources:
            source.release_all()
        if overflow is not None:
            index, element, exact = overflow
            key = kernel[index]
            raise _overflow_error(key, plan.combined[key][0], element, exact, sources, out, what)
        return sums

    def chunk(key: TensorKey, raw: list[np.ndarray], start: int) -> np.ndarray:
        """One chunk of a combined tensor's result (its work arrays freed on return)."""
        dtype = plan.combined[key][0]
        parts = [r.astype(_work_dtype(dtype)) for r in raw]
        with np.errstate(over="ignore", invalid="ignore"):  # (what overflows is refused just below)
            exact = operation.combine(parts)
            result = exact.astype(dtype)
        if not np.isfinite(result).all():
            _refuse_overflow(key, dtype, exact, result, parts, start, sources, out, what)
        return result

    def chunks(key: TensorKey) -> Iterator[tuple[int, np.ndarray]]:
        """(first element, result) for each chunk of a combined tensor, in order."""
        flats = [np.asarray(v).reshape(-1) for v in plan.combined[key][2]]
        for start in range(0, flats[0].size, CHUNK):
            raw = [f[start : start + CHUNK] for f in flats]
            result = chunk(key, raw, start)
            for source, part in zip(sources, raw, strict=True):
                source.done_with(part)
            bar.update(result.nbytes)
            yield start, result

    if out is None or targets.is_object_url(out):
        arrays: dict[TensorKey, Any] = dict(plan.copied)
        for key, (dtype, shape, _) in plan.combined.items():
            arrays[key] = np.empty(shape, dtype)
        run_kernel([arrays[key].reshape(-1).view(np.uint8) for key in kernel])
        for key in by_numpy:
            flat = arrays[key].reshape(-1)
            for start, part in chunks(key):
                flat[start : start + part.size] = part
        state = _state_of(arrays, properties, groups)
        if out is not None:  # an object has no place to fill in: the result, in memory, streams up
            CheckpointState.save_checkpoint(state, out, include_optimizer_state=bool(groups), **save_options)
        return state

    # Streaming: the result's files staged by the core with holes where combined values go
    # (their placeholders, zeros from calloc, cost no memory and are never written), filled in
    # place once each, then put in place by the core's one commit (the same as every save's).
    durable = bool(save_options.get("durable", False))
    threshold = save_options.get("external_data_threshold", _boundary.DEFAULT_EXTERNAL_DATA_THRESHOLD)
    template = dict(plan.copied)
    for key, (dtype, shape, _) in plan.combined.items():
        template[key] = np.zeros(shape, dtype)
    holes = [template[key].__array_interface__["data"][0] for key in plan.combined if template[key].nbytes]
    path = Path(out)
    core = _state_of(template, properties, groups).core_state(bool(groups))
    staging, placed = _boundary.save_staged(path, core, external_data_threshold=threshold, holes=holes)
    try:
        # Where each combined tensor's values go: found by the address of its placeholder.
        where = {
            key: placed[template[key].__array_interface__["data"][0]] for key in plan.combined if template[key].nbytes
        }
        del core, template

        def file_of(key: TensorKey) -> tuple[int, Path]:
            external = where[key][1]
            return staging.fileno(data=external), Path(f"{path}.data") if external else path

        sums = run_kernel(
            [(file_of(key)[0], where[key][0], os.fspath(file_of(key)[1])) if key in where else _EMPTY for key in kernel]
        )
        # The kernel summed its values as it wrote them; NumPy's are read back to be summed.
        summed = dict(zip(kernel, sums, strict=True))
        for external in (False, True):
            keys = [key for key in by_numpy if key in where and where[key][1] == external]
            if keys:  # every chunk of the file's tensors written in turn
                writes = (
                    (where[key][0] + start * plan.combined[key][0].itemsize, part.view(np.uint8))
                    for key in keys
                    for start, part in chunks(key)
                )
                safe_io.pwrite_all(staging.fileno(data=external), writes, Path(f"{path}.data") if external else path)
        staging.reseal([(external, offset, summed.get(key)) for key, (offset, external) in where.items()])
        staging.commit(durable=durable)
    finally:
        staging.discard()
    return CheckpointState.load_checkpoint(path)


# The sink of an empty tensor (it has no place in the file): nothing goes there.
_EMPTY = np.empty(0, np.uint8)


def _refuse_overflow(
    key: TensorKey,
    dtype: np.dtype,
    exact: np.ndarray,
    result: np.ndarray,
    parts: list[np.ndarray],
    start: int,
    sources: list[_Opened],
    out: str | os.PathLike[str] | None,
    what: str,
) -> None:
    """Refuses a result that is not finite where every input is (inputs that are not finite
    are the user's: they pass as they are), naming the tensor, the element and the checkpoints."""
    bad = ~np.isfinite(result)
    for part in parts:
        bad &= np.isfinite(part)
    if not bad.any():
        return
    i = int(np.flatnonzero(bad)[0])
    raise _overflow_error(key, dtype, start + i, float(exact[i]), sources, out, what)


def _overflow_error(
    key: TensorKey,
    dtype: np.dtype,
    element: int,
    exact: float,
    sources: list[_Opened],
    out: str | os.PathLike[str] | None,
    what: str,
) -> ValueOverflowError:
    """The error for element ``element`` of a result, ``exact`` before rounding to ``dtype``."""
    names = " and ".join(s.label for s in sources)
    error = ValueOverflowError(
        f"{what}: {key.describe()}: element {element} of the result ({exact:g}) does not fit {dtype} "
        f"(at most {float(ml_dtypes.finfo(dtype).max):g}), from the finite values of {names}"
        + (f"; nothing was written to {os.fspath(out)}" if out is not None else "")
    )
    error.tensor = key.label
    error.filename = os.fspath(out) if out is not None else sources[0].path
    return error


def _state_of(
    arrays: dict[TensorKey, Any],
    properties: dict[str, Any],
    groups: dict[str, tuple[int, float]],
) -> CheckpointState:
    trainable = {k.parameter: v for k, v in arrays.items() if k.role == "trainable"}
    frozen = {k.parameter: v for k, v in arrays.items() if k.role == "frozen"}
    state = CheckpointState.from_arrays(trainable, frozen, properties)
    result: dict[str, OptimizerGroup] = {name: OptimizerGroup(step, lr) for name, (step, lr) in groups.items()}
    for key, value in arrays.items():
        if key.group is not None and key.momentum is not None:
            result[key.group].momentums.setdefault(key.parameter, {})[key.momentum] = value
    state.optimizer_groups = result
    return state


__all__ = ["apply", "average", "delta", "interpolate"]
