"""The core's arithmetic kernels (issue 30): average, delta, apply and interpolate of float16,
bfloat16, float32 and float64 tensors give exactly the float64 (float32 for the narrow types)
NumPy reference rounded once, across chunk boundaries and with many sources, in memory and
streamed into a file; the same as NumPy's own path (the one big-endian arrays take); peak
memory does not grow with the number of sources; an overflow is refused, typed, with nothing
written."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import ortckpt
import pytest
from ortckpt import CheckpointState, ValueOverflowError

# The kernels' chunk (src/compute/mod.rs CHUNK) and sizes around its boundaries.
CHUNK = 1 << 16
SIZES = [1, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 3]
DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64)]


def work(dtype: np.dtype) -> type:
    """The type arithmetic runs in: float64 for float32/float64, float32 for the narrow ones."""
    return np.float64 if dtype.itemsize >= 4 else np.float32


def values(rng: np.random.Generator, size: int, dtype: np.dtype) -> np.ndarray:
    """Random values of every sign and many magnitudes, well inside the type (no overflow)."""
    top = 8 if dtype.itemsize == 2 else 30
    v = rng.standard_normal(size) * np.exp2(rng.integers(-top, top, size))
    return v.astype(dtype)


def states(count: int, size: int, dtype: np.dtype, seed: int = 0) -> list[CheckpointState]:
    rng = np.random.default_rng(seed)
    return [
        CheckpointState.from_arrays(
            {"w": values(rng, size, dtype), "v": values(rng, 7, dtype)}, {"frozen": np.arange(3, dtype=np.int64)}
        )
        for _ in range(count)
    ]


def saved(tmp_path: Path, sources: list[CheckpointState], **options) -> list[Path]:
    paths = []
    for i, state in enumerate(sources):
        paths.append(tmp_path / f"s{i}.ckpt")
        CheckpointState.save_checkpoint(state, paths[-1], **options)
    return paths


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(f"u{array.dtype.itemsize}")


def reference(what: str, arrays: list[np.ndarray], coefficients: list[float]) -> np.ndarray:
    """The documented arithmetic written out in NumPy, in the work type, rounded once."""
    dtype = arrays[0].dtype
    t = work(dtype)
    x = [a.astype(t) for a in arrays]
    with np.errstate(over="ignore", invalid="ignore"):
        if what == "average":
            w = np.asarray(coefficients, np.float64)
            w = np.ldexp(w, -np.frexp(w.max())[1])
            acc = x[0] * t(w[0])
            for xi, wi in zip(x[1:], w[1:], strict=True):
                acc = acc + xi * t(wi)
            result = acc / t(w.sum())
        elif what == "delta":
            result = x[0] - x[1]
        elif what == "apply":
            result = x[0] + x[1] * t(coefficients[0])
        else:
            tt = coefficients[0]
            result = x[0] * t(1 - tt) + x[1] * t(tt)
        return result.astype(dtype)


def run(what: str, sources: list, coefficients: list[float], out) -> CheckpointState:
    if what == "average":
        return ortckpt.average(sources, coefficients, out=out)
    if what == "delta":
        return ortckpt.delta(*sources, out=out)
    if what == "apply":
        return ortckpt.apply(*sources, coefficients[0], out=out)
    return ortckpt.interpolate(*sources, coefficients[0], out=out)


CASES = [
    ("average", 9, [3.0, 1.0, 0.5, 7.25, 2.0, 1e-3, 4.0, 1.0, 0.125]),
    ("delta", 2, []),
    ("apply", 2, [0.3]),
    ("interpolate", 2, [0.7]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("what", "count", "coefficients"), CASES, ids=[c[0] for c in CASES])
def test_every_function_and_type_is_the_reference_bit_for_bit(tmp_path, what, count, coefficients, dtype):
    sources = states(count, 2 * CHUNK + 3, dtype)
    expected = {n: reference(what, [s.parameters[n].data for s in sources], coefficients) for n in ("w", "v")}
    in_memory = run(what, sources, coefficients, None)
    streamed = run(what, saved(tmp_path, sources), coefficients, tmp_path / "out.ckpt")
    for result in (in_memory, streamed):
        for name, value in expected.items():
            got = result.parameters[name].data
            assert got.dtype == dtype
            assert np.array_equal(bits(got), bits(value)), f"{what} {dtype} {name}"
        assert np.array_equal(result.parameters["frozen"].data, np.arange(3))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("threshold", [0, None], ids=["external data", "inline"])
def test_sizes_around_the_chunk_in_the_data_file_and_inline(tmp_path, size, threshold):
    sources = states(5, size, np.dtype(np.float32), seed=size)
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    options = {} if threshold is None else {"external_data_threshold": threshold}
    paths = saved(tmp_path, sources, **options)
    result = ortckpt.average(paths, weights, out=tmp_path / "out.ckpt", **options)
    expected = reference("average", [s.parameters["w"].data for s in sources], weights)
    assert np.array_equal(bits(result.parameters["w"].data), bits(expected))
    assert Path(f"{tmp_path / 'out.ckpt'}.data").exists() == (threshold == 0)


@pytest.mark.parametrize("dtype", DTYPES[2:], ids=str)
def test_the_kernel_and_numpys_path_agree(dtype):
    """Big-endian arrays are combined by NumPy's path: the same values little-endian go through
    the kernel, and every result is the same, bit for bit. (float32 and float64: NumPy's path
    computes big-endian float16 in float64, not float32; bfloat16 has no big-endian form.)"""
    sources = states(9, CHUNK + 5, dtype, seed=3)
    swapped = [
        CheckpointState.from_arrays({n: s.parameters[n].data.astype(dtype.newbyteorder(">")) for n in ("w", "v")})
        for s in sources
    ]
    for what, count, coefficients in CASES:
        kernel = run(what, sources[:count], coefficients, None)
        numpy = run(what, swapped[:count], coefficients, None)
        for name in ("w", "v"):
            assert np.array_equal(bits(kernel.parameters[name].data), bits(numpy.parameters[name].data.astype(dtype)))


def test_an_overflow_past_the_first_chunk_is_refused_typed_with_nothing_written(tmp_path):
    big = np.ones(2 * CHUNK + 9, np.float16)
    big[CHUNK + 17] = 60000.0
    big[2 * CHUNK + 1] = 60000.0
    a, b = (CheckpointState.from_arrays({"w": big}) for _ in range(2))
    paths = saved(tmp_path, [a, b], external_data_threshold=0)
    out = tmp_path / "out.ckpt"
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueOverflowError, match=rf"tensor w: element {CHUNK + 17} of the result \(120000\)") as e:
        ortckpt.apply(*paths, 1.0, out=out)
    assert e.value.tensor == "w" and e.value.filename == str(out)
    assert str(paths[0]) in str(e.value) and str(paths[1]) in str(e.value)
    assert sorted(tmp_path.iterdir()) == before  # no result, no staged file left
    ortckpt.save_checkpoint(a, out)  # a previous result stays as it was
    with pytest.raises(ValueOverflowError):
        ortckpt.apply(*paths, 1.0, out=out)
    assert np.array_equal(CheckpointState.load_checkpoint(out).parameters["w"].data, big)
    with pytest.raises(ValueOverflowError, match=rf"element {CHUNK + 17} "):
        ortckpt.apply(a, b, 1.0)


def test_non_finite_inputs_pass_through_the_kernel_as_numpy_makes_them():
    x = np.array([np.inf, -np.inf, np.nan, 1.0, np.inf], np.float32)
    y = np.array([1.0, np.inf, 2.0, np.nan, np.inf], np.float32)
    a, b = CheckpointState.from_arrays({"w": x}), CheckpointState.from_arrays({"w": y})
    with np.errstate(invalid="ignore"):
        expected = (x.astype(np.float64) - y.astype(np.float64)).astype(np.float32)
    got = ortckpt.delta(a, b).parameters["w"].data
    assert np.array_equal(got, expected, equal_nan=True)


MEMORY_CHILD = textwrap.dedent(
    """
    import json, sys
    import ortckpt

    def status(key):
        return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

    paths, out = json.loads(sys.argv[1]), sys.argv[2]
    before = status("VmRSS")
    ortckpt.average(paths, out=out)
    print(status("VmHWM") - before)
    """
)


def test_peak_memory_does_not_grow_with_the_number_of_sources(tmp_path):
    """10 and 80 sources of 2 MiB (8 tensors each): the peak grows by a few chunks, not by the
    70 sources' 140 MiB (nor by the pages the kernel maps around what it reads)."""
    rng = np.random.default_rng(0)
    template = tmp_path / "template.ckpt"
    arrays = {f"t{i}": rng.standard_normal(1 << 16).astype(np.float32) for i in range(8)}
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), template)
    paths = [template]
    for i in range(1, 80):
        paths.append(tmp_path / f"copy{i}.ckpt")
        paths[-1].write_bytes(template.read_bytes())
    grown = {}
    for count in (10, 80):
        done = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, json.dumps([str(p) for p in paths[:count]]), str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        grown[count] = int(done.stdout.split()[-1])
    extra = grown[80] - grown[10]
    assert extra < 8 << 20, f"80 sources peak {extra >> 20} MiB above 10 sources' ({grown})"
