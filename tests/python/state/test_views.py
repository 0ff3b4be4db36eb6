"""Views in bulk (issue 30): a pass over a loaded state's parameters makes every NumPy view in one
core call (``_core.views``). These views are what ``parameters[name].data`` made one at a time
before: zero-copy over the mapping, writable copy-on-write (read-only over a read-only buffer), the
same dtype, shape, flags and values for every type, keeping the mapping alive, and current after
the state is changed."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest
from ortckpt import CheckpointState, OptimizerGroup, _boundary, _core
from ortckpt import dtypes as dt
from ortckpt.dtypes import PackedBits

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python


def _values() -> dict[str, object]:
    rng = np.random.default_rng(7)
    values: dict[str, object] = {}
    for dtype in (
        np.float32,
        np.float64,
        np.float16,
        np.int8,
        np.uint8,
        np.int16,
        np.uint16,
        np.int32,
        np.uint32,
        np.int64,
        np.uint64,
        np.bool_,
        np.complex64,
        np.complex128,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float8_e8m0fnu,
    ):
        raw = rng.integers(0, 256, size=3 * 5 * np.dtype(dtype).itemsize, dtype=np.uint8)
        if dtype is np.bool_:
            raw = raw & 1
        values[f"t.{np.dtype(dtype).name}"] = raw.view(dtype).reshape(3, 5)
    values["shape.scalar"] = np.array(2.5, np.float32)
    values["shape.empty"] = np.zeros((0, 4), np.float32)
    values["shape.4d"] = np.arange(2 * 3 * 1 * 2, dtype=np.int64).reshape(2, 3, 1, 2)
    values["odd.bytes"] = np.arange(7, dtype=np.int8)  # so the next tensors may start off alignment
    values["packed.int4"] = np.array([-8, -1, 0, 7, 3], ml_dtypes.int4)
    values["packed.uint2"] = np.array([[0, 1, 2], [3, 2, 1]], ml_dtypes.uint2)
    values["text"] = np.array([["a", "ü"], ["", "long text"]], dtype=object)
    return values


def _same(got: object, want: object) -> None:
    if isinstance(want, PackedBits) or (
        isinstance(want, np.ndarray) and want.dtype in (ml_dtypes.int4, ml_dtypes.uint2)
    ):
        assert isinstance(got, PackedBits)
        want_values = want.unpack() if isinstance(want, PackedBits) else want
        np.testing.assert_array_equal(got.unpack().view(np.uint8), np.asarray(want_values).view(np.uint8))
        return
    assert isinstance(got, np.ndarray) and isinstance(want, np.ndarray)
    assert got.shape == want.shape
    if want.dtype == object:
        assert got.tolist() == want.tolist()
        return
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()  # bit for bit (NaNs of the float8 types included)


@pytest.fixture
def saved(tmp_path):
    values = _values()
    path = tmp_path / "views.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(values, {"frozen.w": np.ones(6, np.float32)}), path)
    values["frozen.w"] = np.ones(6, np.float32)
    return path, values


def _mapped_file(array: np.ndarray) -> object:
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def _inside(array: np.ndarray, mapped: object) -> bool:
    start = np.frombuffer(memoryview(mapped), np.uint8).__array_interface__["data"][0]
    at = array.__array_interface__["data"][0]
    return start <= at and at + array.nbytes <= start + len(mapped)


def test_a_pass_gives_every_type_bit_for_bit_as_one_at_a_time_does(saved):
    path, values = saved
    bulk = {name: p.data for name, p in CheckpointState.load_checkpoint(path).parameters}
    single = CheckpointState.load_checkpoint(path)
    assert sorted(bulk) == sorted(values)
    for name, want in values.items():
        _same(bulk[name], want)
        one = single.parameters[name].data  # (made by the Python path: np.frombuffer)
        _same(one, want)
        if isinstance(want, np.ndarray) and want.dtype != object and not isinstance(one, PackedBits):
            for flag in ("WRITEABLE", "ALIGNED", "C_CONTIGUOUS", "OWNDATA"):
                assert bulk[name].flags[flag] == one.flags[flag], (name, flag)


def test_views_are_zero_copy_over_the_mapping_and_writes_stay_in_the_process(saved, tmp_path):
    path, _ = saved
    before = path.read_bytes()
    state = CheckpointState.load_checkpoint(path)
    arrays = {name: p.data for name, p in state.parameters}
    mapped = _mapped_file(arrays["t.float32"])
    assert isinstance(mapped, _core.MappedFile)
    for name, array in arrays.items():
        if isinstance(array, np.ndarray) and array.dtype != object and array.size:
            assert _mapped_file(array) is mapped and _inside(array, mapped), name
            assert array.flags.writeable  # copy-on-write, as before
    arrays["t.float32"][0, 0] = 123.0
    assert state.parameters["t.float32"].data[0, 0] == 123.0  # the state's own values
    assert path.read_bytes() == before  # never the file
    again = tmp_path / "again.ckpt"
    CheckpointState.save_checkpoint(state, again)
    assert CheckpointState.load_checkpoint(again).parameters["t.float32"].data[0, 0] == 123.0


def test_views_keep_the_mapping_alive_after_the_state_is_gone(saved):
    path, values = saved
    state = CheckpointState.load_checkpoint(path)
    arrays = {name: p.data for name, p in state.parameters}
    del state
    gc.collect()
    path.unlink()  # (the mapping holds the file's pages)
    gc.collect()
    for name, want in values.items():
        _same(arrays[name], want)


def test_a_state_is_no_reference_cycle_and_its_mapping_goes_with_its_last_reference(saved):
    """A state (loaded, used through its views, or a snapshot of one) is freed by its last reference,
    not at the next collection of cycles: a manager's async snapshot maps a whole checkpoint (ONNX
    Runtime's save into memfds), which stayed mapped until the collector ran (kept views of itself)."""
    import weakref

    path, _ = saved
    gc.collect()
    gc.disable()
    try:
        for snapshot in (False, True):
            state = CheckpointState.load_checkpoint(path)
            if snapshot:
                state = state.snapshot(include_optimizer_state=True)
            assert len(state.parameters) and "x" not in state.properties  # (its views used)
            gone = weakref.ref(state)
            backing = weakref.ref(state._backing)
            del state
            assert gone() is None and backing() is None
    finally:
        gc.enable()


def test_views_over_a_read_only_buffer_are_read_only_and_over_a_bytearray_write_it(saved):
    path, values = saved
    data = path.read_bytes()
    arrays = {name: p.data for name, p in CheckpointState.from_bytes(data).parameters}
    assert not arrays["t.float32"].flags.writeable
    assert np.shares_memory(arrays["t.float32"], np.frombuffer(data, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        arrays["t.float32"][0, 0] = 1.0
    buffer = bytearray(data)
    state = CheckpointState.from_bytes(buffer)
    arrays = {name: p.data for name, p in state.parameters}
    assert arrays["t.int64"].flags.writeable
    arrays["t.int64"][...] = 5
    assert CheckpointState.from_bytes(bytes(buffer)).parameters["t.int64"].data.tolist() == [[5] * 5] * 3
    with pytest.raises(BufferError):
        buffer.extend(b"x")  # (the views hold the buffer: it cannot move under them)
    for name, want in values.items():
        if name != "t.int64":
            _same(arrays[name], want)


def test_setting_a_parameter_after_a_pass_shows_in_the_next_pass_and_in_parameters_already_given(saved):
    path, _ = saved
    state = CheckpointState.from_bytes(path.read_bytes())  # read-only views: setting replaces them
    held = state.parameters["t.float32"]
    first = {name: p.data for name, p in state.parameters}
    new = np.full((3, 5), 9.0, np.float32)
    state.parameters["t.float32"] = new
    assert np.array_equal(held.data, new)
    assert np.array_equal(dict(state.parameters)["t.float32"].data, new)
    assert np.array_equal(state.tensor_value("t.float32"), new)
    assert not np.array_equal(first["t.float32"], new)  # (the old view is the buffer's, unchanged)
    writable = CheckpointState.load_checkpoint(path)  # writable views: setting copies into them
    view = dict(writable.parameters)["t.int32"].data
    writable.parameters["t.int32"] = np.zeros((3, 5), np.int32)
    assert not view.any() and writable.parameters["t.int32"].data is view


def test_opening_makes_no_view_and_one_pass_makes_them_all_in_one_call(saved, monkeypatch):
    path, values = saved
    calls = []
    real = _boundary.parameter_views

    def counting(loaded):
        calls.append(len(loaded.parameters))
        return real(loaded)

    monkeypatch.setattr(_boundary, "parameter_views", counting)
    state = CheckpointState.load_checkpoint(path)
    assert calls == []
    _same(state.parameters["t.float64"].data, values["t.float64"])  # one tensor: no bulk call
    assert calls == []
    for _ in range(3):
        arrays = {name: p.data for name, p in state.parameters}
    assert calls == [len(values)]
    for name, want in values.items():
        _same(arrays[name], want)


def test_the_loaded_entries_are_not_left_for_the_garbage_collector(saved):
    path, _ = saved
    loaded = _boundary.load(path)
    assert loaded.trainable and not any(gc.is_tracked(entry) for entry in loaded.trainable if entry[0] != "text")
    assert not any(gc.is_tracked(entry[2]) or gc.is_tracked(entry[3]) for entry in loaded.frozen)
    assert gc.is_tracked(next(e for e in loaded.trainable if e[0] == "text"))  # (holds a list)


def test_opening_makes_no_python_objects_per_parameter_but_its_name_and_position(tmp_path):
    # The parameters stay in the core's index until used (issue 41): opening makes a name and
    # a position a parameter (two blocks), no longer its (name, code, dims, stored) tuple and
    # what that holds (five).
    import sys

    path = tmp_path / "many.ckpt"
    arrays = {f"w{i}": np.full(3, i, np.float32) for i in range(2000)}
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)
    CheckpointState.load_checkpoint(path)  # (anything made once per process, made here)
    gc.collect()
    paused = gc.isenabled()
    gc.disable()
    try:
        before = sys.getallocatedblocks()
        state = CheckpointState.load_checkpoint(path)
        made = sys.getallocatedblocks() - before
    finally:
        if paused:
            gc.enable()
    assert made < 2.5 * len(arrays)
    values = {name: p.data for name, p in state.parameters}
    assert all(np.array_equal(values[name], want) for name, want in arrays.items())


def test_momentums_and_external_data_are_cut_in_bulk_too(tmp_path):
    rng = np.random.default_rng(3)
    weights = {f"w{i}": rng.standard_normal((4, 3)).astype(np.float32) for i in range(5)}
    state = CheckpointState.from_arrays(weights)
    moments = {
        name: {"momentum0": w * 2, "momentum1": (w * 3).astype(ml_dtypes.bfloat16)} for name, w in weights.items()
    }
    state.optimizer_groups = {"group0": OptimizerGroup(3, 0.1, moments)}
    path = tmp_path / "external.ckpt"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True, external_data_threshold=0)
    assert (tmp_path / "external.ckpt.data").exists()
    loaded = CheckpointState.load_checkpoint(path)
    arrays = {name: p.data for name, p in loaded.parameters}
    for name, w in weights.items():
        _same(arrays[name], w)
        assert isinstance(_mapped_file(arrays[name]), _core.MappedFile)
    external = _mapped_file(arrays["w0"])
    assert all(_inside(a, external) for a in arrays.values())
    group = loaded.optimizer_groups["group0"]
    for name in weights:
        for m, want in moments[name].items():
            _same(group.momentums[name][m], want)


def test_views_refuses_what_it_does_not_cut_and_leaves_it_to_python():
    data = memoryview(bytes(range(64)))
    dtypes = _boundary._VIEW_DTYPES
    entries = [
        ("ok", dt.FLOAT, (2, 3), (8, 24, False)),
        ("unaligned", dt.DOUBLE, (2,), (1, 16, False)),
        ("short", dt.FLOAT, (2, 3), (8, 20, False)),
        ("past the end", dt.FLOAT, (4,), (56, 16, False)),
        ("offset overflows", dt.FLOAT, (1,), (2**64 - 1, 4, False)),
        ("negative dim", dt.FLOAT, (-1,), (0, 4, False)),
        ("dims overflow", dt.UINT8, (2**62, 2**62, 16), (0, 16, False)),
        ("no bytes", dt.FLOAT, (0,), (0, 0, False)),
        ("external, none given", dt.FLOAT, (1,), (0, 4, True)),
        ("string", dt.STRING, (1,), ["a"]),
        ("nominal", dt.FLOAT, (1,), None),
        ("packed", dt.INT4, (2,), (0, 1, False)),
        ("unknown code", 99, (1,), (0, 4, False)),
        ("negative code", -1, (1,), (0, 4, False)),
        ("too many dims", dt.UINT8, (1,) * 65, (0, 1, False)),
        ("not a tuple", dt.FLOAT, [1], (0, 4, False)),
        ["a list", dt.FLOAT, (1,), (0, 4, False)],
        ("short tuple", dt.FLOAT, (1,)),
        None,
    ]
    views = _core.views(entries, (data, None), dtypes)
    assert len(views) == len(entries)
    ok, unaligned, *rest = views
    assert ok.tolist() == np.frombuffer(data, np.float32, 6, 8).reshape(2, 3).tolist()
    assert not ok.flags.writeable and ok.base is data
    reference = np.frombuffer(data, np.float64, 2, 1)
    assert unaligned.tobytes() == reference.tobytes() and unaligned.flags.aligned == reference.flags.aligned
    assert rest == [None] * len(rest)


def test_a_hostile_dims_product_cannot_make_a_view_past_its_bytes(tmp_path):
    # Dims whose product wraps around to the byte count must not pass (they are checked
    # with overflow, not multiplied blindly).
    data = memoryview(bytearray(64))
    wraps = ("w", dt.UINT8, (2**32, 2**32 + 16), (0, 16, False))
    assert _core.views([wraps], (data, None), _boundary._VIEW_DTYPES) == [None]


def test_release_pages_finds_the_mapping_under_a_bulk_view(tmp_path):
    values = np.arange(3 * 4096, dtype=np.float32)  # several pages
    path = tmp_path / "pages.ckpt"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays({"w": values}), path)
    state = CheckpointState.load_checkpoint(path)
    (view,) = (p.data for _, p in state.parameters)
    assert isinstance(_mapped_file(view), _core.MappedFile)
    _boundary.release_pages(view)  # (MADV_DONTNEED: the pages come back from the file)
    assert view.tobytes() == values.tobytes()
