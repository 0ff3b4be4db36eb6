"""Checkpoint arithmetic on values at the edges of their types (issue 29): a result is finite
where its inputs are, or a ValueOverflowError names the tensor, the element and the checkpoints
(and nothing is written); arguments are refused before any checkpoint is read; num_samples is
checked and summed within what a property holds. Non-finite inputs are the user's: they pass
through as they are."""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import ortckpt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortckpt import (
    CheckpointState,
    CheckpointStateError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    ValueOverflowError,
)

F64_MAX = float(np.finfo(np.float64).max)
F16_MAX = float(np.finfo(np.float16).max)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def saved(tmp_path: Path, name: str, values, dtype, properties=None) -> Path:
    path = tmp_path / name
    state = CheckpointState.from_arrays({"w": np.array(values, dtype)}, {"f": np.ones(2, np.float32)}, properties)
    CheckpointState.save_checkpoint(state, path)
    return path


def w(state: CheckpointState) -> np.ndarray:
    return state.parameters["w"].data


@pytest.fixture(params=[False, True], ids=["in memory", "streamed"])
def out(request, tmp_path):
    """Where a result goes: returned in memory, or written with out= (the streaming path)."""
    return tmp_path / "result.ckpt" if request.param else None


# --- averages of finite values are finite -------------------------------------------------------------


def test_weights_near_the_largest_float_give_the_equal_mean(tmp_path, out):
    a, b = saved(tmp_path, "a", [1.0, 2.0], np.float32), saved(tmp_path, "b", [3.0, 4.0], np.float32)
    mean = ortckpt.average([a, b], [1e308, 1e308], out=out)
    assert np.array_equal(w(mean), [2.0, 3.0])
    skewed = ortckpt.average([a, b], [F64_MAX, F64_MAX / 3], out=out)
    np.testing.assert_allclose(w(skewed), [1.5, 2.5], rtol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (np.float16, 60000.0),
        (np.float16, F16_MAX),
        (ml_dtypes.bfloat16, BF16_MAX),
        (ml_dtypes.float8_e4m3fn, 400.0),  # stored as 384, its nearest
        (ml_dtypes.float8_e4m3fn, E4M3_MAX),
        (ml_dtypes.float8_e5m2, 57344.0),
        (np.float32, float(np.finfo(np.float32).max)),
        (np.float64, F64_MAX),
    ],
)
def test_the_mean_of_a_value_with_itself_is_that_value_at_the_top_of_every_type(tmp_path, out, dtype, value):
    stored = np.array([value, -value], dtype)
    a = saved(tmp_path, "a", stored, dtype)
    for weights in (None, [1, 1], [1e308, 1e308], [3, 1], [2.0**-1074, 2.0**-1074]):
        result = w(ortckpt.average([a, a, a], None if weights is None else [*weights, 1], out=out))
        assert result.dtype == np.dtype(dtype) and np.all(np.isfinite(result)), (weights, result)
        if dtype == np.float64:  # summed in float64 itself, from shares where the sum overflows: an ulp off
            np.testing.assert_allclose(result, stored, rtol=4 * np.finfo(np.float64).eps)
        else:  # (in a wider type, rounded once: exact)
            assert np.array_equal(result, stored), (weights, result)


def test_a_mean_of_float64_values_whose_sum_overflows_is_computed_from_shares(tmp_path, out):
    """The weighted sum of [max, 0.9 max, max] overflows float64; the mean does not."""
    xs = [saved(tmp_path, f"x{i}", [v, 1.0], np.float64) for i, v in enumerate((F64_MAX, 0.9 * F64_MAX, F64_MAX))]
    result = w(ortckpt.average(xs, [1, 2, 3], out=out))
    assert np.all(np.isfinite(result))
    np.testing.assert_allclose(result, [(1 + 1.8 + 3) / 6 * F64_MAX, 1.0], rtol=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    # (values far from the subnormals: a product that underflows is rounded where it lands)
    values=st.lists(st.floats(-1e6, 1e6).filter(lambda v: v == 0 or abs(v) > 1e-250), min_size=2, max_size=4),
    weights=st.lists(st.floats(1e-6, 1e6), min_size=4, max_size=4),
    power=st.integers(-1000, 1000),
)
def test_averages_are_numpys_weighted_mean_bit_for_bit_at_any_scale_of_the_weights(values, weights, power):
    """Weights scaled by a power of two give the same bits (scaling them is exact), and those of
    np.average where its products neither overflow nor underflow (np.average of the weights times
    2**1000 is all infinities and NaN)."""
    states = [CheckpointState.from_arrays({"w": np.array([v, -v / 3], np.float64)}) for v in values]
    weights = weights[: len(values)]
    expected = np.average(np.stack([w(s) for s in states]), axis=0, weights=weights)
    assert np.array_equal(w(ortckpt.average(states, [x * 2.0**power for x in weights])), expected)


# --- results that do not fit ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "dtype", "a", "b", "what"),
    [
        ("apply", np.float16, 60000.0, 60000.0, "float16"),
        ("apply", ml_dtypes.float8_e4m3fn, E4M3_MAX, E4M3_MAX, "float8_e4m3fn"),  # NaN before: no infinity
        ("apply", ml_dtypes.bfloat16, BF16_MAX, BF16_MAX, "bfloat16"),
        ("delta", np.float64, F64_MAX, -F64_MAX, "float64"),
        ("delta", np.float16, 60000.0, -60000.0, "float16"),
        ("interpolate", np.float16, 60000.0, -60000.0, "float16"),
    ],
)
def test_a_result_past_its_type_is_a_typed_error_naming_tensor_and_checkpoints(tmp_path, operation, dtype, a, b, what):
    pa, pb = saved(tmp_path, "a.ckpt", [1.0, a], dtype), saved(tmp_path, "b.ckpt", [1.0, b], dtype)
    target = tmp_path / "out.ckpt"
    call = {
        "apply": lambda **kw: ortckpt.apply(pa, pb, 2.0, **kw),
        "delta": lambda **kw: ortckpt.delta(pa, pb, **kw),
        "interpolate": lambda **kw: ortckpt.interpolate(pa, pb, 3.0, **kw),
    }[operation]
    for kwargs in ({}, {"out": target}):
        with pytest.raises(ValueOverflowError, match=rf"{operation}: tensor w: element 1 .* does not fit {what}") as e:
            call(**kwargs)
        assert isinstance(e.value, OverflowError) and e.value.tensor == "w"
        assert str(pa) in str(e.value) and str(pb) in str(e.value)
    assert e.value.filename == str(target) and f"nothing was written to {target}" in str(e.value)
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "b.ckpt"]


def test_a_result_that_fits_after_rounding_is_no_error(tmp_path, out):
    a, d = saved(tmp_path, "a", [65000.0], np.float16), saved(tmp_path, "d", [500.0], np.float16)
    assert w(ortckpt.apply(a, d, 1.0, out=out))[0] == F16_MAX  # 65500 rounds to 65504


def test_non_finite_inputs_pass_through_as_they_are(tmp_path, out):
    a = saved(tmp_path, "a", [np.inf, -np.inf, np.nan, 1.0], np.float16)
    b = saved(tmp_path, "b", [1.0, 1.0, 1.0, 3.0], np.float16)
    mean = w(ortckpt.average([a, b], out=out))
    assert mean[0] == np.inf and mean[1] == -np.inf and np.isnan(mean[2]) and mean[3] == 2.0
    difference = w(ortckpt.delta(a, a, out=out))
    assert np.isnan(difference[:3]).all() and difference[3] == 0.0  # inf - inf: NaN, as the user's values say
    assert np.isnan(w(ortckpt.apply(a, b, 1.0, out=out))[2])


# --- arguments, before any work ------------------------------------------------------------------------


MISSING = "/nonexistent/ortckpt/never.ckpt"  # read first, it would be a FileNotFoundError


@pytest.mark.parametrize(
    ("call", "kind", "argument"),
    [
        (lambda: ortckpt.apply(MISSING, MISSING, float("inf")), InvalidArgumentError, "scale"),
        (lambda: ortckpt.apply(MISSING, MISSING, float("nan")), InvalidArgumentError, "scale"),
        (lambda: ortckpt.apply(MISSING, MISSING, 10**400), InvalidArgumentError, "scale"),
        (lambda: ortckpt.apply(MISSING, MISSING, "0.5"), InvalidArgumentTypeError, "scale"),
        (lambda: ortckpt.apply(MISSING, MISSING, True), InvalidArgumentTypeError, "scale"),
        (lambda: ortckpt.apply(MISSING, MISSING, None), InvalidArgumentTypeError, "scale"),
        (lambda: ortckpt.interpolate(MISSING, MISSING, -math.inf), InvalidArgumentError, "t"),
        (lambda: ortckpt.average([MISSING, MISSING], [1, math.inf]), InvalidArgumentError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], [1, math.nan]), InvalidArgumentError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], [1, 2**2000]), InvalidArgumentError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], [1, "2"]), InvalidArgumentTypeError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], [1, None]), InvalidArgumentTypeError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], [True, 1]), InvalidArgumentTypeError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], "12"), InvalidArgumentTypeError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], [1, 2, 3]), InvalidArgumentError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], [1, -1]), InvalidArgumentError, "weights"),
        (lambda: ortckpt.average([MISSING, MISSING], [0, 0]), InvalidArgumentError, "weights"),
        (lambda: ortckpt.average([]), InvalidArgumentError, "sources"),
        (lambda: ortckpt.average(MISSING), InvalidArgumentTypeError, "sources"),
        (lambda: ortckpt.average([MISSING, 3]), InvalidArgumentTypeError, "sources"),
        (lambda: ortckpt.average([MISSING], frozen="last"), InvalidArgumentError, "frozen"),
        (lambda: ortckpt.average([MISSING], include_optimizer_state="yes"), InvalidArgumentTypeError, None),
        (lambda: ortckpt.average([MISSING], out=3), InvalidArgumentTypeError, "out"),
        (lambda: ortckpt.average([MISSING], out="x", durable="no"), InvalidArgumentTypeError, "durable"),
        (lambda: ortckpt.average([MISSING], out="x", external_data_threshold=-1), InvalidArgumentError, None),
        (lambda: ortckpt.average([MISSING], out="x", compression=1), InvalidArgumentTypeError, "compression"),
        (lambda: ortckpt.average([MISSING], external_data_threshold=0), InvalidArgumentTypeError, None),
        (lambda: ortckpt.delta(MISSING, MISSING, out="x", storage_options={}), InvalidArgumentTypeError, None),
    ],
)
def test_arguments_are_refused_before_any_checkpoint_is_read(call, kind, argument):
    with pytest.raises(kind) as caught:
        call()
    assert isinstance(caught.value, (ValueError, TypeError)) and not isinstance(caught.value, FileNotFoundError)
    if argument is not None:
        assert caught.value.argument == argument and argument in str(caught.value)


def test_numpy_and_fraction_weights_and_scales_are_numbers(tmp_path):
    from fractions import Fraction

    a, b = saved(tmp_path, "a", [1.0], np.float32), saved(tmp_path, "b", [4.0], np.float32)
    assert w(ortckpt.average([a, b], np.array([1, 2], np.int64)))[0] == 3.0
    assert w(ortckpt.average([a, b], [np.float32(1), Fraction(2)]))[0] == 3.0
    assert w(ortckpt.apply(a, b, np.float16(0.5)))[0] == 3.0


# --- num_samples ---------------------------------------------------------------------------------------


def test_num_samples_that_overflow_when_summed_are_a_typed_error_naming_the_files(tmp_path, out):
    a = saved(tmp_path, "a.ckpt", [1.0], np.float32, {"num_samples": 2**62})
    b = saved(tmp_path, "b.ckpt", [3.0], np.float32, {"num_samples": 2**62})
    with pytest.raises(ValueOverflowError, match="num_samples") as caught:
        ortckpt.average([a, b], out=out)
    assert str(a) in str(caught.value) and str(b) in str(caught.value)
    assert out is None or not out.exists()
    fits = ortckpt.average([a, saved(tmp_path, "c.ckpt", [3.0], np.float32, {"num_samples": 2**62 - 1})], out=out)
    assert fits.properties["num_samples"] == 2**63 - 1 and w(fits)[0] == 2.0


@pytest.mark.parametrize("bad", ["many", -5, math.inf, math.nan])
def test_a_num_samples_that_is_no_number_of_samples_is_named_with_its_file(tmp_path, bad):
    a = saved(tmp_path, "a.ckpt", [1.0], np.float32, {"num_samples": 10})
    b = saved(tmp_path, "b.ckpt", [3.0], np.float32, {"num_samples": bad})
    for weights in (None, [1, 1]):  # (given weights: the result's num_samples would still be their sum)
        with pytest.raises(CheckpointStateError, match=r"checkpoint #1 \(.*b\.ckpt\): property num_samples is") as e:
            ortckpt.average([a, b], weights)
        assert e.value.filename == str(b) and not isinstance(e.value, TypeError)


def test_num_samples_weigh_the_mean_and_are_left_out_unless_every_source_has_one(tmp_path, out):
    a = saved(tmp_path, "a", [0.0], np.float32, {"num_samples": 1, "round": 7})
    b = saved(tmp_path, "b", [4.0], np.float32, {"num_samples": 3.0})
    weighted = ortckpt.average([a, b], out=out)
    assert w(weighted)[0] == 3.0 and weighted.properties["num_samples"] == 4.0
    assert weighted.properties["round"] == 7
    c = saved(tmp_path, "c", [4.0], np.float32, {"round": 7})
    equal = ortckpt.average([a, c], out=out)
    assert w(equal)[0] == 2.0 and "num_samples" not in equal.properties  # not the first source's 1
    zeros = [saved(tmp_path, f"z{i}", [1.0], np.float32, {"num_samples": 0}) for i in range(2)]
    with pytest.raises(InvalidArgumentError, match=r"num_samples must be .* not all 0"):
        ortckpt.average(zeros)


@pytest.mark.parametrize(
    "dtype",
    [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz],
    ids=str,
)
@pytest.mark.parametrize("to_file", [False, True], ids=["memory", "file"])
def test_float8_averages_in_the_kernel_are_numpys_float32_rule_bit_for_bit(dtype, to_file, tmp_path):
    """Every pair of finite values of a float8 type, averaged with weights 3 and 5 by the core's
    kernel: NumPy's ``x_0*w_0 + x_1*w_1`` in float32, ``/ total``, then ml_dtypes' rounding."""
    every = np.arange(256, dtype=np.uint8).view(dtype)
    finite = every[np.isfinite(every.astype(np.float32))]
    a, b = np.repeat(finite, finite.size), np.tile(finite, finite.size)
    states = [CheckpointState.from_arrays({"w": x}) for x in (a, b)]
    out = tmp_path / "mean.ckpt" if to_file else None
    got = ortckpt.average(states, [3, 5], out=out).parameters["w"].data
    w = np.ldexp(np.array([3.0, 5.0]), -3)  # (scaled: the largest in [0.5, 1))
    acc = a.astype(np.float32) * np.float32(w[0])
    acc += b.astype(np.float32) * np.float32(w[1])
    expected = (acc / np.float32(w.sum())).astype(dtype)
    assert np.asarray(got).view(np.uint8).tobytes() == expected.view(np.uint8).tobytes()
