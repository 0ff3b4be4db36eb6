"""The Rust boundary: no panic reaches Python as a crash, and threads share the
library safely (what is and is not safe to share is documented in the README)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from ortckpt import CheckpointState, _boundary, _core

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python


def test_the_test_hooks_are_in_the_development_build_and_never_in_the_wheel():
    """The panic hook's own test is tests/devbuild/test_panics.py, run on the development build."""
    installed = "site-packages" in _core.__file__
    assert hasattr(_core, "_panic_for_test") != installed


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{seed}.{i}": rng.standard_normal(1000 + 37 * i).astype(np.float32) for i in range(20)}


def test_threads_loading_reading_and_saving_different_checkpoints_at_once(tmp_path):
    def work(seed: int) -> None:
        arrays = _arrays(seed)
        path = tmp_path / f"c{seed}"
        for round_ in range(10):
            threshold = 0 if (seed + round_) % 2 else 1 << 40
            CheckpointState.save_checkpoint(
                CheckpointState.from_arrays(arrays), path, external_data_threshold=threshold
            )
            loaded = CheckpointState.load_checkpoint(path)
            for name, expected in arrays.items():
                assert np.array_equal(loaded.parameters[name].data, expected)
            arrays = {k: v + 1 for k, v in arrays.items()}

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(work, seed) for seed in range(16)]:
            future.result()


def test_threads_reading_one_loaded_state_see_the_same_values(tmp_path):
    arrays = _arrays(7)
    path = tmp_path / "shared"
    CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)
    state = CheckpointState.load_checkpoint(path)

    def read_all(_: int) -> dict[str, float]:
        return {name: float(state.parameters[name].data.sum()) for name in state.parameters.names()}

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(read_all, range(32)))
    assert all(r == results[0] for r in results)
    assert results[0] == pytest.approx({k: float(v.sum()) for k, v in arrays.items()})


def test_threads_saving_to_the_same_path_leave_one_complete_checkpoint(tmp_path):
    path = tmp_path / "contested"
    candidates = [_arrays(seed) for seed in range(6)]

    def save(arrays):
        for _ in range(5):
            CheckpointState.save_checkpoint(CheckpointState.from_arrays(arrays), path)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(save, candidates))
    loaded = CheckpointState.load_checkpoint(path)
    names = sorted(loaded.parameters.names())
    winner = next(a for a in candidates if sorted(a) == names)
    assert all(np.array_equal(loaded.parameters[n].data, winner[n]) for n in names)
    assert [p.name for p in tmp_path.iterdir()] == ["contested"]


def test_the_writers_take_typed_records_read_by_name_and_values_cross_uncopied(tmp_path):
    """The core's writers take two records (issue 42), a checkpoint (``_boundary.CoreState``) and
    write options (``_boundary.WriteOptions``), read by attribute name: a look-alike of another
    class writes the same checkpoint, a record without a field is refused naming it, and the
    positional lists of before are refused. The tensors' buffers are handed back, not copied."""
    w, m = np.arange(6000, dtype=np.float32), np.full(6000, 0.25, np.float32)  # past EXTERNAL_MIN_BYTES
    w_bytes, m_bytes = _boundary.as_bytes(w), _boundary.as_bytes(m)
    state = _boundary.CoreState(
        [("w", 1, (2, 3000), w_bytes)],
        [("names", 8, (2,), ["a", "b"])],
        [("g", 3, 0.5, [("w", [("w.m", 1, (2, 3000), m_bytes)])])],
        {"epoch": 2, "lr": 0.5, "tag": "x"},
    )
    fields = ("trainable", "frozen", "groups", "ints", "floats", "strings", "nominal", "keep_order")
    look_alike = SimpleNamespace(**{field: getattr(state, field) for field in fields})
    options = SimpleNamespace(durable=False, external_data_threshold=0, progress=None, lock_timeout=None, holes=[])
    _core.save(str(tmp_path / "record"), state, _boundary.WriteOptions(external_data_threshold=0))
    _core.save(str(tmp_path / "look-alike"), look_alike, options)
    for name in ("record", "look-alike"):
        loaded = CheckpointState.load_checkpoint(tmp_path / name)
        assert (tmp_path / f"{name}.data").exists()  # the options were read: threshold 0
        np.testing.assert_array_equal(loaded.parameters["w"].data, w.reshape(2, 3000))
        assert {key: loaded.properties[key] for key in ("epoch", "lr", "tag")} == {"epoch": 2, "lr": 0.5, "tag": "x"}
        assert loaded.optimizer_groups["g"].step == 3
    del look_alike.keep_order
    with pytest.raises(AttributeError, match="keep_order"):
        _core.save(str(tmp_path / "incomplete"), look_alike, options)
    with pytest.raises(TypeError):
        _core.save(str(tmp_path / "positional"), [("w", 1, [6], w_bytes)], [], [], [], [], [])  # type: ignore[call-arg]
    assert not (tmp_path / "incomplete").exists() and not (tmp_path / "positional").exists()
    main, external = _core.encode_segments(state, external_data_threshold=0)
    assert external is not None and {id(w_bytes), id(m_bytes)} <= {id(segment) for _, segment in external[1]}
    main, external = _core.encode_segments(state)
    assert external is None and {id(w_bytes), id(m_bytes)} <= {id(segment) for segment in main}
