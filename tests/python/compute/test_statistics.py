"""Per-tensor statistics, change figures and histograms (ortckpt.statistics on the core's
kernels), against the NumPy reference implementation kept as the oracle; the extremes against
exact figures; files, hostile files, memory, and the CLI's inspect --stats and diff figures."""

from __future__ import annotations

import json
import math
import statistics as exact
import subprocess
import sys
import textwrap
import threading
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from ortckpt import CheckpointState, OptimizerGroup, TensorChange, TensorStats, tensor_changes, tensor_stats
from ortckpt import dtypes as _dt
from ortckpt import statistics as st
from ortckpt.cli import DIFFERENT, OK, run
from ortckpt.dtypes import PackedBits
from ortckpt.errors import CheckpointFormatError

KERNEL_DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
]
# Sizes around the kernel's piece (16,384 elements): empty, one, a piece, a piece and a bit, many.
SIZES = [0, 1, 7, 16384, 16385, 100_003]
RTOL = 1e-12


def values(dtype, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    x = (rng.standard_normal(n) * 30 + 5).astype(dtype)
    if n > 10:  # NaN and both infinities among them
        x[3], x[n // 2], x[-2], x[-1] = np.nan, np.inf, -np.inf, np.nan
    return x


def assert_stats_equal(got: TensorStats, want: TensorStats) -> None:
    """Counts, min and max exactly; mean, std and L2 within RTOL (the sums' order differs)."""
    assert (got.name, got.role, got.dtype, got.shape, got.elements) == (
        want.name,
        want.role,
        want.dtype,
        want.shape,
        want.elements,
    )
    counts = ("nan", "posinf", "neginf", "min", "max")
    assert [getattr(got, k) for k in counts] == [getattr(want, k) for k in counts]
    for field in ("mean", "std", "l2"):
        g, w = getattr(got, field), getattr(want, field)
        assert (g is None) == (w is None), field
        if w is not None:
            assert math.isclose(g, w, rel_tol=RTOL, abs_tol=1e-300), (field, g, w)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_every_kernel_type_matches_the_numpy_oracle(dtype, n):
    x = values(dtype, n)
    assert_stats_equal(st.stats_of("t", "frozen", x), st._stats_numpy("t", "frozen", x))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_scalars_strided_and_big_endian_arrays(dtype):
    scalar = np.array(values(dtype, 5)[1])
    got = st.stats_of("s", "frozen", scalar)
    assert got.shape == () and got.elements == 1
    assert_stats_equal(got, st._stats_numpy("s", "frozen", scalar))
    strided = values(dtype, 1000).reshape(40, 25)[::3, ::2]
    assert_stats_equal(st.stats_of("v", "frozen", strided), st._stats_numpy("v", "frozen", strided))
    if np.dtype(dtype).itemsize > 1 and np.dtype(dtype).byteorder != "|" and dtype is not ml_dtypes.bfloat16:
        big = values(dtype, 1000).astype(np.dtype(dtype).newbyteorder(">"))
        assert_stats_equal(st.stats_of("b", "frozen", big), st._stats_numpy("b", "frozen", big))


def test_a_big_endian_momentum_is_named_float32_and_compared_with_a_little_endian_one():
    """A momentum set from a big-endian array (a view, strided) was dtype ">f4": its change
    against the same values little-endian was left out as "dtype differs"."""
    weights = {"w": np.arange(20, dtype=np.float32).reshape(4, 5)}
    big = np.arange(40, dtype=">f4").reshape(4, 10)[:, ::2]
    a, b = CheckpointState.from_arrays(weights), CheckpointState.from_arrays(weights)
    a.optimizer_groups["g"] = OptimizerGroup(1, 0.1, {"w": {"m": big}})
    b.optimizer_groups["g"] = OptimizerGroup(1, 0.1, {"w": {"m": np.ascontiguousarray(big, "<f4") + 1}})
    assert tensor_stats(a)["g/w/m"].dtype == "float32"
    change = tensor_changes(a, b)["g/w/m"]
    assert (change.changed, change.max_abs, change.l2) == (20, 1.0, math.sqrt(20))


def test_all_nan_empty_and_infinite_tensors_have_counts_and_no_figures():
    nan = st.stats_of("n", "trainable", np.full(5, np.nan, np.float32))
    assert (nan.nan, nan.finite, nan.flagged, nan.min, nan.mean, nan.l2) == (5, 0, True, None, None, None)
    inf = st.stats_of("i", "trainable", np.array([np.inf, -np.inf, np.inf], np.float64))
    assert (inf.posinf, inf.neginf, inf.finite, inf.std) == (2, 1, 0, None)
    empty = st.stats_of("e", "trainable", np.zeros((0, 3), np.float16))
    assert (empty.elements, empty.shape, empty.flagged, empty.max) == (0, (0, 3), False, None)


def test_std_of_a_large_offset_plus_small_noise_does_not_collapse():
    rng = np.random.default_rng(1)
    x = 1e8 + rng.standard_normal(300_001) * 1e-3
    got = st.stats_of("x", "trainable", x)
    # statistics.pstdev and fmean compute exactly (fractions), then round once.
    assert math.isclose(got.std, exact.pstdev(x.tolist()), rel_tol=1e-13)  # NumPy's: 3e-11 off
    assert math.isclose(got.mean, exact.fmean(x.tolist()), rel_tol=1e-15)
    ones = st.stats_of("c", "trainable", np.full(100_000, 0.1, np.float32))
    assert ones.std == 0.0 and ones.mean == ones.min == ones.max  # constant: no rounding spread


def exact_sqrt(value: Fraction) -> float:
    """The square root of an exact value, correctly rounded enough (inf beyond float64)."""
    scale = 2**1200  # enough bits below the point for values down to 1e-308 squared
    root = Fraction(math.isqrt(int(value * scale * scale)), scale)
    try:
        return float(root)
    except OverflowError:
        return math.inf


@pytest.mark.parametrize(
    "x",
    [
        [1.7e308, 1.0e308, -1.5e308],
        [1e300] * 3 + [-1e300],
        [1e-300, -1e-300, 3e-300],
        [5e-324, 1e-320, 0.0],
        [1e308, 1e-308, 1.0],
        [1e8 + 1e-7, 1e8 - 3e-7, 1e8],
    ],
    ids=["near max", "large", "tiny", "subnormal", "mixed", "offset"],
)
def test_float64_near_its_limits_is_scaled_not_overflowed(x):
    """NumPy's sums overflow (inf) or underflow (0) here; the kernel scales by powers of two:
    a figure is infinite only where its true value is beyond float64. Exact figures from
    fractions."""
    got = st.stats_of("x", "trainable", np.array(x, np.float64))
    exact_mean = sum(Fraction(v) for v in x) / len(x)
    variance = sum((Fraction(v) - exact_mean) ** 2 for v in x) / len(x)
    assert math.isclose(got.mean, float(exact_mean), rel_tol=1e-15, abs_tol=1e-323)
    assert math.isclose(got.std, exact_sqrt(variance), rel_tol=1e-14, abs_tol=1e-323), (got.std, exact_sqrt(variance))
    l2 = exact_sqrt(sum(Fraction(v) ** 2 for v in x))
    assert got.l2 == l2 if math.isinf(l2) else math.isclose(got.l2, l2, rel_tol=1e-14, abs_tol=1e-323)
    beyond = st.stats_of("x", "trainable", np.full(4, 1.7e308))
    assert beyond.mean == 1.7e308 and beyond.std == 0.0 and beyond.l2 == math.inf  # 3.4e308 is beyond float64


def test_relative_change_near_float64s_limits_is_the_ratio_not_inf_over_inf():
    """The L2 norms of the change and of ``a`` are beyond float64 here (inf) where their ratio
    is not: the relative change comes from the scaled sums (it was NaN: inf / inf, or 0:
    a finite L2 over an infinite norm). Exact from fractions."""

    def exact_relative(a: list[float], b: list[float]) -> float:
        squares = sum((Fraction(y) - Fraction(x)) ** 2 for x, y in zip(a, b, strict=True))
        return exact_sqrt(squares / sum(Fraction(x) ** 2 for x in a))

    cases = [([1e308] * 4, [0.0] * 4), ([1.7e308] * 2, [1e308] * 2), ([3e-320, 5e-324], [1e-320, 0.0])]
    for a, b in cases:
        change = st.change_of("x", np.array(a), np.array(b))
        assert math.isclose(change.relative, exact_relative(a, b), rel_tol=1e-14), (a, b, change)
    assert st.change_of("x", np.array([1e308] * 4), np.zeros(4)).l2 == math.inf  # 2e308: beyond float64
    both = CheckpointState.from_arrays({"x": np.array([1e308] * 4)}), CheckpointState.from_arrays({"x": np.zeros(4)})
    assert st.tensor_changes(*both)["x"].relative == 1.0
    # A difference itself beyond float64 (1.7e308 to -1.7e308): inf, never NaN.
    assert st.change_of("x", np.array([1.7e308]), np.array([-1.7e308])).relative == math.inf


# The packed sub-byte types (ONNX's INT4, UINT4, FLOAT4E2M1, INT2, UINT2) and the one-byte float types
# whose values the kernels look up in a table (every bit pattern of them, NaN and infinities included).
PACKED_DTYPES = [ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float4_e2m1fn, ml_dtypes.int2, ml_dtypes.uint2]
BYTE_TABLE_DTYPES = [
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e8m0fnu,
]


def sub_byte(dtype, n: int, seed: int = 0) -> np.ndarray:
    """``n`` values of a sub-byte type, every field pattern among them."""
    bits = 2 if dtype in (ml_dtypes.int2, ml_dtypes.uint2) else 4
    fields = np.random.default_rng(seed).integers(0, 1 << bits, n, dtype=np.uint8)
    fields[: min(n, 1 << bits)] = np.arange(min(n, 1 << bits), dtype=np.uint8)
    if dtype in (ml_dtypes.int4, ml_dtypes.int2):  # sign-extended, as the type holds them
        return ((fields.astype(np.int8) << (8 - bits)) >> (8 - bits)).astype(dtype)
    return fields.view(dtype)


@pytest.mark.parametrize("dtype", PACKED_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [*SIZES, 3, 5, 32769])
def test_every_packed_type_matches_the_numpy_oracle_odd_counts_included(dtype, n):
    packed = PackedBits.pack(sub_byte(dtype, n).reshape(n, 1) if n % 2 else sub_byte(dtype, n))
    got = st.stats_of("p", "frozen", packed)
    assert_stats_equal(got, st._stats_numpy("p", "frozen", packed))
    assert got.dtype == _dt.name_of(packed.data_type) and got.elements == n


def test_packed_values_are_read_low_nibble_first_and_the_padding_is_not_a_value():
    # 0x78: INT4 -8 (low nibble 8) then 7; 0xf3: 3, then a padding nibble 0xf (-1) that is no value.
    packed = PackedBits.of(np.array([0x78, 0xF3], np.uint8), (3,), _dt.INT4)
    got = st.stats_of("p", "frozen", packed)
    assert (got.min, got.max, got.elements, got.finite) == (-8.0, 7.0, 3, 3)
    assert math.isclose(got.mean, 2 / 3, rel_tol=1e-15)
    fp4 = PackedBits.of(np.array([0x97, 0x82], np.uint8), (4,), _dt.FLOAT4E2M1)  # 6, -0.5, 1, -0
    assert (st.stats_of("f", "frozen", fp4).min, st.stats_of("f", "frozen", fp4).max) == (-0.5, 6.0)
    crumbs = PackedBits.of(np.array([0b1111_0110], np.uint8), (3,), _dt.INT2)  # -2, 1, -1, padding
    assert (st.stats_of("c", "frozen", crumbs).min, st.stats_of("c", "frozen", crumbs).l2) == (-2.0, math.sqrt(6))


@pytest.mark.parametrize("dtype", BYTE_TABLE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_bit_pattern_of_the_one_byte_floats_matches_the_numpy_oracle(dtype):
    x = np.random.default_rng(4).integers(0, 256, 40_000, dtype=np.uint8)
    x[:256] = np.arange(256, dtype=np.uint8)
    x = x.view(dtype)
    got = st.stats_of("f", "frozen", x)
    assert_stats_equal(got, st._stats_numpy("f", "frozen", x))
    assert got.nan == np.count_nonzero(np.isnan(x.astype(np.float64)))


@pytest.mark.parametrize("dtype", PACKED_DTYPES + BYTE_TABLE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 16_385, 40_001])
def test_packed_and_one_byte_change_figures_and_histograms_match_the_numpy_oracle(dtype, n):
    if dtype in PACKED_DTYPES:
        x, y = sub_byte(dtype, n, 1), sub_byte(dtype, n, 2)
        y[::3] = x[::3]  # some unchanged
        a, b = PackedBits.pack(x), PackedBits.pack(y)
    else:
        a = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8).view(dtype)
        b = a.copy()
        b[::5] = np.random.default_rng(2).integers(0, 256, len(b[::5]), dtype=np.uint8).view(dtype)
    got, want = st.change_of("t", a, b), st._change_numpy("t", a, b)
    assert (got.elements, got.changed, got.nonfinite, got.max_abs) == (
        want.elements,
        want.changed,
        want.nonfinite,
        want.max_abs,
    )
    assert math.isclose(got.l2, want.l2, rel_tol=RTOL) and (got.relative is None) == (want.relative is None)
    if want.relative is not None:
        assert math.isclose(got.relative, want.relative, rel_tol=RTOL)
    for bins, range_ in [(32, None), (7, (-3.0, 5.0)), (3, (1.0, 1.0))]:
        got_counts, got_edges = st.histogram(a, bins, range_)
        want_counts, want_edges = st._histogram_numpy(a, bins, range_)
        assert np.array_equal(got_edges, want_edges) and np.array_equal(got_counts, want_counts)


def test_no_stored_type_goes_through_the_numpy_fallback_but_strings(monkeypatch, tmp_path):
    """Every numeric type ortckpt stores is computed by the kernels (the NumPy oracle widened a
    whole tensor to float64): a state with all of them, from memory and from its file."""
    arrays = {np.dtype(d).name: values(d, 3001, seed=i) for i, d in enumerate(KERNEL_DTYPES)}
    arrays |= {np.dtype(d).name: sub_byte(d, 3001) for d in PACKED_DTYPES}
    arrays |= {np.dtype(d).name: np.arange(3001, dtype=np.uint8).view(d) for d in BYTE_TABLE_DTYPES}
    state = CheckpointState.from_arrays(arrays)
    path = tmp_path / "all.ckpt"
    CheckpointState.save_checkpoint(state, path, external_data_threshold=2048)
    oracle = {key: st._stats_numpy(key.label, key.role, value, key) for key, value in state.tensors()}

    def widened(*args, **kwargs):
        raise AssertionError(f"the NumPy fallback for {args[0]}")

    for fallback in ("_stats_numpy", "_change_numpy", "_histogram_numpy"):
        monkeypatch.setattr(st, fallback, widened)
    told: list[int] = []
    for found in (tensor_stats(state), tensor_stats(path, on_bytes=told.append)):
        assert list(found) == list(oracle)
        for key, want in oracle.items():
            assert_stats_equal(found[key], want)
    assert sum(told) == sum(v.packed.nbytes if isinstance(v, PackedBits) else v.nbytes for _, v in state.tensors())
    changes = tensor_changes(path, state)
    assert len(changes) == len(arrays) and not any(c.changed for c in changes.values())
    for _key, value in state.tensors():
        assert st.histogram(value, 4)[0].sum() == st.stats_of("v", "frozen", value).finite


def state_with_everything() -> CheckpointState:
    arrays = {np.dtype(d).name: values(d, 20_000, seed=i) for i, d in enumerate(KERNEL_DTYPES)}
    frozen = {"f8": np.array([1, 2, 3], ml_dtypes.float8_e5m2), "words": np.array(["x", "yz"], dtype=object)}
    state = CheckpointState.from_arrays(arrays, frozen, {"epoch": 1})
    state.optimizer_groups["g"] = OptimizerGroup(
        3, 0.1, {"float32": {"momentum0": values(np.float32, 20_000, 9), "momentum1": np.zeros(7, np.float32)}}
    )
    return state


def test_a_checkpoint_file_matches_its_state_and_counts_every_byte(tmp_path):
    state = state_with_everything()
    path = tmp_path / "c.ckpt"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True, external_data_threshold=4096)
    told: list[int] = []
    from_file = tensor_stats(path, on_bytes=told.append)
    loaded = CheckpointState.load_checkpoint(path)
    oracle = {key: st._stats_numpy(key.label, key.role, value, key) for key, value in loaded.tensors()}
    assert list(from_file) == list(oracle) and "g/float32/momentum0" in from_file
    for name in oracle:
        assert_stats_equal(from_file[name], oracle[name])
    assert from_file == tensor_stats(state)  # the same figures from the state in memory
    # (every tensor but the strings goes through the kernels, float8 included)
    kernel_bytes = sum(np.asarray(v).nbytes for k, v in loaded.tensors() if k.label != "words")
    assert sum(told) == kernel_bytes
    assert from_file["uint8"].to_json()["finite"] == 20_000


def test_a_progress_callback_that_raises_stops_the_pass(tmp_path):
    def boom(n: int) -> None:
        raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt, match="stop"):
        tensor_stats(CheckpointState.from_arrays({"w": np.zeros(1 << 23, np.float32)}), on_bytes=boom)


def test_hostile_and_truncated_files_are_typed_errors_naming_the_file(tmp_path):
    state = CheckpointState.from_arrays({"w": np.ones(100_000, np.float32), "b": np.ones(3, np.float32)})
    CheckpointState.save_checkpoint(state, tmp_path / "e.ckpt", external_data_threshold=100)
    data = tmp_path / "e.ckpt.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointFormatError, match=r"e\.ckpt\.data: tensor 'w'.*beyond the end") as e:
        tensor_stats(tmp_path / "e.ckpt")
    assert e.value.filename is None or "e.ckpt" in str(e.value.filename)
    CheckpointState.save_checkpoint(state, tmp_path / "t.ckpt")
    raw = (tmp_path / "t.ckpt").read_bytes()
    (tmp_path / "t.ckpt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointFormatError, match=r"t\.ckpt"):
        tensor_stats(tmp_path / "t.ckpt")
    (tmp_path / "junk.ckpt").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointFormatError, match=r"junk\.ckpt"):
        tensor_stats(tmp_path / "junk.ckpt")


def test_the_kernels_refuse_ragged_buffers_counts_that_do_not_fit_and_unknown_types():
    from ortckpt import _boundary
    from ortckpt.errors import CheckpointError

    x = np.zeros(16, np.float32)
    with pytest.raises(CheckpointError, match="not whole"):
        _boundary.tensor_stats([(1, x.view(np.uint8)[:7], None)], None)
    with pytest.raises(CheckpointError, match="no kernel"):
        _boundary.tensor_stats([(8, x.view(np.uint8), None)], None)
    with pytest.raises(CheckpointError, match="no kernel"):  # complex: its parts go to the kernels as floats
        _boundary.stats_columns([14], [x], [None], [], None)
    packed = np.zeros(3, np.uint8)
    for elements in (None, 4, 7, 3, 0):  # 3 bytes of INT4 hold 5 or 6 elements; None: for whole bytes only
        with pytest.raises(CheckpointError, match="not whole"):
            _boundary.stats_columns([_dt.INT4], [packed], [elements], [], None)
    assert _boundary.stats_columns([_dt.INT4], [packed], [5], [], None)[3] == [5]
    with pytest.raises(CheckpointError, match="not whole"):  # b shorter than the count a and b share
        _boundary.changes_columns([_dt.INT4], [packed], [packed[:2]], [5], [], None)
    with pytest.raises(CheckpointError, match="2 codes, 1 values"):
        _boundary.stats_columns([1, 1], [x], [None], [], None)
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        _boundary.stats_columns([1], [x.reshape(4, 4)[:, ::2]], [None], [], None)
    assert _boundary.stats_columns([1, 1], [x, x[:0]], [None, None], [], None)[3] == [16, 0]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_change_figures_match_the_numpy_oracle(dtype):
    a = values(dtype, 40_000, seed=1)
    b = a.copy()
    b[::7] = values(dtype, len(b[::7]), seed=2)
    if np.dtype(dtype).kind == "f" or dtype is ml_dtypes.bfloat16:
        b[5], b[6], a[7], b[7] = np.nan, np.inf, np.inf, np.inf  # changes to NaN and Inf; an Inf kept
    got, want = st.change_of("t", a, b), st._change_numpy("t", a, b)
    assert (got.name, got.elements, got.changed, got.nonfinite, got.max_abs) == (
        want.name,
        want.elements,
        want.changed,
        want.nonfinite,
        want.max_abs,
    )
    assert math.isclose(got.l2, want.l2, rel_tol=RTOL)
    assert (got.relative is None) == (want.relative is None)
    if want.relative is not None:
        assert math.isclose(got.relative, want.relative, rel_tol=RTOL)


def test_change_figures_of_two_checkpoints_largest_first_identical_ones_included(tmp_path):
    a = CheckpointState.from_arrays(
        {
            "small": np.ones(10, np.float32),
            "big": np.ones(10, np.float64),
            "same": np.arange(5, dtype=np.int32),
            "nan": np.array([1.0, 2.0]),
        },
        {"f8": np.array([1, 2], ml_dtypes.float8_e4m3fn), "words": np.array(["a"], dtype=object)},
    )
    b = CheckpointState.from_arrays(
        {
            "small": np.full(10, 1.5, np.float32),
            "big": np.full(10, 4.0, np.float64),
            "same": np.arange(5, dtype=np.int32),
            "nan": np.array([1.0, np.nan]),
        },
        {"f8": np.array([1, 4], ml_dtypes.float8_e4m3fn), "words": np.array(["b"], dtype=object)},
    )
    b.parameters["nan"] = np.array([1.0, np.nan])
    a.parameters["nan"] = np.array([1.0, 2.0])
    CheckpointState.save_checkpoint(a, tmp_path / "a.ckpt")
    found = tensor_changes(tmp_path / "a.ckpt", b)
    assert list(found.labels()) == ["nan", "big", "f8", "small", "same"]  # NaN changes first, then by L2
    assert found["big"] == TensorChange("big", 10, 10, 0, math.sqrt(90), 3.0, 3.0)
    assert found["same"] == TensorChange("same", 5, 0, 0, 0.0, 0.0, 0.0)
    assert (found["nan"].changed, found["nan"].nonfinite, found["nan"].l2) == (1, 1, 0.0)
    assert found["f8"] == st._change_numpy("f8", a.parameters["f8"].data, b.parameters["f8"].data)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int16, np.uint8])
@pytest.mark.parametrize("bins,range_", [(32, None), (1, None), (7, (-20.0, 20.0)), (5, (3.0, 3.0)), (10, (0, 255))])
def test_histogram_counts_as_numpy_histogram(dtype, bins, range_):
    x = values(dtype, 50_000, seed=3)
    got_counts, got_edges = st.histogram(x, bins, range_)
    want_counts, want_edges = st._histogram_numpy(x, bins, range_)
    assert np.array_equal(got_edges, want_edges) and np.array_equal(got_counts, want_counts)
    assert got_counts.dtype == want_counts.dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int16])
def test_histogram_of_given_edges_runs_in_the_kernel_as_numpy_counts(dtype, monkeypatch):
    """Edges of any widths (repeated ones too, values on them, outside them) counted by the kernel
    exactly as numpy.histogram counts them: no whole-tensor widening for any dtype."""
    x = values(dtype, 20_000, seed=5)
    wide = np.asarray(x, np.float64)
    finite = wide[np.isfinite(wide)]
    picked = np.sort(np.random.default_rng(1).choice(finite, 6, replace=False))
    edges = [float(finite.min()) - 1.0, *picked.tolist(), float(picked[-1]), float(finite.max())]
    want_counts, want_edges = np.histogram(finite, bins=np.asarray(edges))

    def widened(*args, **kwargs):
        raise AssertionError("the NumPy fallback")

    monkeypatch.setattr(st, "_histogram_numpy", widened)
    got_counts, got_edges = st.histogram(x, edges, (0.0, 1.0))  # (a range beside edges is unused, as NumPy's)
    assert np.array_equal(got_counts, want_counts) and np.array_equal(got_edges, want_edges)
    for bad in ([1.0, 0.0], [0.0], [[0.0, 1.0]], [0.0, np.inf]):
        with pytest.raises(ValueError):
            st.histogram(x, bad)


def test_histogram_edges_exactly_and_edge_cases():
    x = np.array([0.0, 0.1, 0.2, 0.3, 1.0, 1.0, np.nan, np.inf, -0.5, 2.0], np.float64)
    counts, _ = st.histogram(x, 10, (0.0, 1.0))
    assert np.array_equal(counts, np.histogram(x[np.isfinite(x)], 10, (0.0, 1.0))[0])
    assert counts[-1] == 2  # values equal to the last edge are in the last bin
    counts, _ = st.histogram(np.full(3, np.nan, np.float32))
    assert counts.sum() == 0
    with pytest.raises(ValueError):
        st.histogram(x, 4, (1.0, 0.0))
    big = np.array([-1.7e308, 1.7e308])  # the range's width is beyond float64: NumPy's own path and error
    for compute in (st.histogram, st._histogram_numpy):
        with pytest.raises(ValueError, match="finite-sized bins"), np.errstate(all="ignore"):
            compute(big, 2, None)


def test_another_thread_runs_while_the_kernels_read(tmp_path):
    """The GIL is released for the whole pass (a ticker thread keeps ticking)."""
    state = CheckpointState.from_arrays({"w": np.ones(64 * 2**20, np.float32)})  # 256 MiB, one tensor
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            stop.wait(0.0005)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        before = len(ticks)
        found = tensor_stats(state)
        during = len(ticks) - before
    finally:
        stop.set()
        thread.join()
    assert found["w"].l2 == 8192.0
    # With the GIL held for the whole pass the ticker could not run at all.
    assert during >= 3, during


MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    import ortckpt

    def status(key):
        return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

    before = status("VmRSS")
    stats = ortckpt.tensor_stats(sys.argv[1])
    print(json.dumps({"grew": status("VmHWM") - before, "mean": stats["w1"].mean, "max": stats["w0"].max}))
    """
)


def test_a_file_is_read_through_its_map_and_its_pages_dropped_behind(tmp_path):
    """256 MiB of tensors: the peak grows by a few windows of 2 MiB a thread, not by the file
    (nor by the quarter of it that stayed mapped when only 64 KiB around each piece was
    dropped: Linux maps a file's pages in by whole folios)."""
    path = tmp_path / "big.ckpt"
    arrays = {f"w{i}": np.full(1 << 25, i + 0.5, np.float32) for i in range(2)}  # 2 x 128 MiB
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)
    del arrays
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(path)], capture_output=True, text=True, timeout=300, check=True
    )
    found = json.loads(done.stdout)
    assert (found["mean"], found["max"]) == (1.5, 0.5)
    assert found["grew"] < 40 << 20, found


def cli(capsys, *args) -> tuple[int, str]:
    code = run([str(a) for a in args])
    return code, capsys.readouterr().out


@pytest.fixture
def flagged(tmp_path):
    state = CheckpointState.from_arrays(
        {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "bad": np.array([1, np.nan, np.inf, 2], np.float32)},
        {"ids": np.arange(10, dtype=np.int64)},
    )
    state.optimizer_groups["g"] = OptimizerGroup(2, 0.1, {"w": {"momentum0": np.full((3, 4), -0.25, np.float32)}})
    path = tmp_path / "a.ckpt"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    return path


def test_inspect_stats_table_flags_nan_and_inf_rows(capsys, flagged):
    code, out = cli(capsys, "inspect", "--stats", flagged)
    assert code == OK
    rows = {line[2:].split()[0]: line for line in out.splitlines() if line[2:].startswith(("w", "bad", "ids"))}
    assert rows["bad"].startswith("! ") and rows["w"].startswith("  ")
    assert rows["w"].split()[-7:] == ["0", "11", "5.5", "3.452", "22.49", "0", "0"]
    assert rows["bad"].split()[-7:] == ["1", "2", "1.5", "0.5", "2.236", "1", "1"]
    assert rows["w/momentum0"].split()[-7:] == ["-0.25", "-0.25", "-0.25", "0", "0.866", "0", "0"]
    assert "! 1 tensor holds NaN or Inf: bad" in out
    code, out = cli(capsys, "inspect", flagged)
    assert "NaN" not in out and "L2" not in out  # without --stats: the header alone, as before


def test_inspect_stats_json_adds_a_stats_object_per_tensor(capsys, flagged):
    code, out = cli(capsys, "inspect", "--stats", "--json", flagged)
    info = json.loads(out)
    assert code == OK and info["totals"]["flagged"] == 1
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name["bad"]["stats"] == tensor_stats(flagged)["bad"].to_json()
    assert by_name["w/momentum0"]["stats"]["name"] == "g/w/momentum0"
    assert by_name["ids"]["stats"]["l2"] == math.sqrt(285) and by_name["ids"]["stats"]["finite"] == 10
    code, out = cli(capsys, "inspect", "--json", flagged)
    assert "stats" not in json.loads(out)["tensors"][0] and "flagged" not in json.loads(out)["totals"]


def test_json_output_is_json_where_a_figure_is_beyond_float64(capsys, tmp_path):
    """An L2 norm or a difference beyond float64 is inf: Python's json wrote it as a bare
    Infinity, which is not JSON (jq and JSON.parse refuse the whole document). Written as the
    string "inf" (as float() reads it back)."""

    def strict(text: str):
        def refuse(constant: str):
            raise ValueError(f"not JSON: {constant}")

        return json.loads(text, parse_constant=refuse)

    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"w": np.full(4, 1.7e308)}), a)
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"w": np.full(4, -1.7e308)}), b)
    code, out = cli(capsys, "inspect", "--stats", "--json", str(a))
    assert code == OK and strict(out)["tensors"][0]["stats"]["l2"] == "inf"
    code, out = cli(capsys, "diff", "--json", str(a), str(b))
    [change] = strict(out)["changes"]
    assert code == DIFFERENT and (change["l2"], change["max_abs"]) == ("inf", "inf")


def test_inspect_stats_reads_other_formats_through_their_converters(capsys, flagged, tmp_path):
    assert cli(capsys, "convert", flagged, tmp_path / "m.safetensors")[0] == OK
    code, out = cli(capsys, "inspect", "--stats", "--json", tmp_path / "m.safetensors")
    by_name = {t["name"]: t["stats"] for t in json.loads(out)["tensors"]}
    assert code == OK and by_name["bad"]["nan"] == 1 and by_name["w"]["max"] == 11.0


def test_diff_prints_change_figures_largest_first_and_lists_every_tensor_in_json(capsys, flagged, tmp_path):
    state = CheckpointState.load_checkpoint(flagged)
    state.parameters["w"] = state.parameters["w"].data * 2
    state.parameters["ids"] = np.arange(10, dtype=np.int64) + np.array([0] * 9 + [1])
    CheckpointState.save_checkpoint(state, tmp_path / "b.ckpt", include_optimizer_state=True)
    code, out = cli(capsys, "diff", flagged, tmp_path / "b.ckpt")
    assert code == DIFFERENT
    lines = out.splitlines()
    at = lines.index("changes, largest first (2 of 4 shared tensors changed):")
    assert lines[at + 1] == "  w: 11 of 12 changed, L2 22.49 (relative 1), max abs 11"
    assert lines[at + 2] == "  ids: 1 of 10 changed, L2 1 (relative 0.0592), max abs 1"
    assert lines[-1] == "4 tensors compared: differ in 2 tensors"
    code, out = cli(capsys, "diff", "--json", flagged, tmp_path / "b.ckpt")
    report = json.loads(out)
    assert code == DIFFERENT and report["tensors"] and report["only_in_a"] == []  # the keys it had
    assert [c["name"] for c in report["changes"]] == ["w", "ids", "bad", "g/w/momentum0"]
    assert report["changes"][2] == {
        "name": "bad",
        "elements": 4,
        "changed": 0,
        "nonfinite": 0,
        "l2": 0.0,
        "relative": 0.0,
        "max_abs": 0.0,
        "key": {"role": "trainable", "group": None, "parameter": "bad", "momentum": None},
    }
    code, out = cli(capsys, "diff", flagged, flagged)
    assert code == OK and "changes" not in out


def test_an_s3_checkpoint_object_and_the_cli_on_it(capsys, s3_url, aws_environment, flagged):
    url = f"{s3_url}/a.ckpt"
    state = CheckpointState.load_checkpoint(flagged)
    CheckpointState.save_checkpoint(state, url, include_optimizer_state=True)
    assert tensor_stats(url) == tensor_stats(flagged)
    code, out = cli(capsys, "inspect", "--stats", "--json", url)
    assert code == OK and json.loads(out)["totals"]["flagged"] == 1
    code, out = cli(capsys, "diff", "--json", url, flagged)
    assert code == OK and len(json.loads(out)["changes"]) == 4


FLOAT8_MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    import ml_dtypes
    import numpy as np
    import ortckpt

    def status(key):
        return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

    a = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    b = a.copy()
    b[::7] = np.float32(0.5).astype(ml_dtypes.float8_e4m3fn)
    state_a = ortckpt.CheckpointState.from_arrays({"w": a})
    state_b = ortckpt.CheckpointState.from_arrays({"w": b})
    before = status("VmRSS")
    stats = ortckpt.tensor_stats(state_a)["w"]
    changes = ortckpt.tensor_changes(state_a, state_b)
    print(json.dumps({"grew": status("VmHWM") - before, "nan": stats.nan, "changed": changes["w"].changed}))
    """
)


def test_float8_statistics_and_changes_run_in_the_kernels_with_flat_memory():
    """A 32 MiB float8 tensor: its figures come from the kernels (NumPy widened it to float64,
    +800 MiB for the statistics and +1.4 GiB for the changes)."""
    done = subprocess.run(
        [sys.executable, "-c", FLOAT8_MEMORY_CHILD], capture_output=True, text=True, timeout=300, check=True
    )
    found = json.loads(done.stdout)
    assert found["nan"] > 0 and found["changed"] > 0
    assert found["grew"] < 48 << 20, found


PACKED_MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import ortckpt
    from ortckpt import dtypes
    from ortckpt.dtypes import PackedBits

    def status(key):
        return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

    found = {}
    for code in (dtypes.INT4, dtypes.FLOAT4E2M1):  # 32 MiB each: 64 Mi elements, an odd count
        raw = np.random.default_rng(code).integers(0, 256, 32 << 20, dtype=np.uint8)
        changed = raw.copy()
        changed[::7] ^= 0x10  # the high nibble of every 7th byte
        n = 2 * raw.size - 1
        raw[-1] &= 0x0F  # (the padding nibble: zero, as packing writes it)
        changed[-1] &= 0x0F
        a, b = PackedBits.of(raw, (n,), code), PackedBits.of(changed, (n,), code)
        state_a = ortckpt.CheckpointState.from_arrays({"w": a})
        state_b = ortckpt.CheckpointState.from_arrays({"w": b})
        before = status("VmRSS")
        stats = ortckpt.tensor_stats(state_a)["w"]
        changes = ortckpt.tensor_changes(state_a, state_b)["w"]
        counts, _ = ortckpt.statistics.histogram(a, 16)
        found[dtypes.name_of(code)] = {
            "grew": status("VmHWM") - before,
            "elements": stats.elements,
            "finite": stats.finite,
            "counted": int(counts.sum()),
            "changed": changes.changed,
            "flipped": int(np.count_nonzero((raw[::7] ^ changed[::7]) != 0)),
        }
        # (freed before the next tensor's arrays are made: its VmHWM then bounds its own work,
        # not this tensor's arrays and the next one's side by side)
        del raw, changed, a, b, state_a, state_b, stats, changes, counts
    print(json.dumps(found))
    """
)


def test_packed_4bit_statistics_changes_and_histograms_run_in_the_kernels_with_flat_memory():
    """A 32 MiB INT4 and a 32 MiB FLOAT4E2M1 tensor (64 Mi elements each): the NumPy fallback
    unpacked them to int8/float32 and widened them to float64, +0.8-1.4 GiB; the kernels unpack
    two nibbles a byte as they read, a piece at a time. The first tensor's peak is measured in a
    fresh process; the second's after it (VmHWM only grows: a bound on both)."""
    done = subprocess.run(
        [sys.executable, "-c", PACKED_MEMORY_CHILD], capture_output=True, text=True, timeout=300, check=True
    )
    for name, found in json.loads(done.stdout).items():
        n = 2 * (32 << 20) - 1
        assert (found["elements"], found["finite"], found["counted"]) == (n, n, n), name
        assert found["changed"] == found["flipped"] > 0, name
        assert found["grew"] < 48 << 20, (name, found)


def test_many_small_tensors_in_one_call_give_each_tensors_own_figures_exactly(tmp_path):
    """A checkpoint's tensors cross to the core in one call and come back as columns: each
    tensor's figures are exactly those of a call for it alone, in the checkpoint's order."""
    mixed = [np.float32, np.float16, ml_dtypes.bfloat16, np.int64, ml_dtypes.float8_e5m2]
    arrays = {f"t{i:03d}": values(mixed[i % len(mixed)], 1 + i * 37 % 900, seed=i) for i in range(300)}
    arrays |= {f"p{i}": PackedBits.pack(sub_byte(PACKED_DTYPES[i % 5], 1 + i * 7, seed=i)) for i in range(20)}
    arrays["words"] = np.array(["a", "b"], dtype=object)
    state = CheckpointState.from_arrays(arrays)
    path = tmp_path / "many.ckpt"
    CheckpointState.save_checkpoint(state, path)
    alone = {key: st.stats_of(key.label, key.role, value) for key, value in state.tensors()}
    for found in (tensor_stats(state), tensor_stats(path)):
        assert list(found) == list(alone)
        for key, want in alone.items():
            assert found[key] == want and found[key].key == key


def test_the_garbage_collector_is_paused_for_a_pass_and_left_as_it_was(tmp_path):
    import gc

    state = CheckpointState.from_arrays({"w": np.ones(1 << 20, np.float32)})
    seen: list[bool] = []
    assert gc.isenabled()
    tensor_stats(state, on_bytes=lambda n: seen.append(gc.isenabled()))
    assert seen and not any(seen) and gc.isenabled()

    def boom(n: int) -> None:
        raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt):
        tensor_stats(state, on_bytes=boom)
    assert gc.isenabled()  # again after an error
    gc.disable()
    try:
        tensor_stats(state)
        assert not gc.isenabled()  # a collector the caller paused stays paused
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_a_complex_tensors_figures_are_those_of_its_two_parts_nan_in_either_counts(dtype, monkeypatch):
    """A NaN or infinity in the imaginary part is counted (NumPy's cast to float64 dropped that
    part, with a warning, and said "no NaN"), the L2 norm is the tensor's, in the kernels."""
    x = (np.arange(1000) - 500j).astype(dtype)
    x[3] = complex(1.0, np.nan)
    x[4] = complex(np.inf, 2.0)
    y = x.copy()
    y[9] = complex(x[9].real, 7.0)

    def widened(*args, **kwargs):
        raise AssertionError("the NumPy fallback")

    for fallback in ("_stats_numpy", "_change_numpy", "_histogram_numpy"):
        monkeypatch.setattr(st, fallback, widened)
    found = tensor_stats(CheckpointState.from_arrays({"c": x}))["c"]
    finite = np.stack([x.real, x.imag], axis=-1).reshape(-1)
    finite = finite[np.isfinite(finite)].astype(np.float64)
    assert (found.dtype, found.elements, found.nan, found.posinf) == (np.dtype(dtype).name, 1000, 1, 1)
    assert (found.min, found.max) == (finite.min(), finite.max())
    assert found.l2 == pytest.approx(float(np.sqrt(np.sum(finite**2))), rel=1e-12)
    change = tensor_changes(CheckpointState.from_arrays({"c": x}), CheckpointState.from_arrays({"c": y}))["c"]
    assert change.changed == 1 and change.max_abs == pytest.approx(abs(7.0 - x[9].imag))
    assert st.histogram(x, 4)[0].sum() == finite.size
