"""Property-based round trips: whatever state goes in comes back out, byte for byte."""

from __future__ import annotations

import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from ortckpt import CheckpointState, OptimizerGroup

DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    np.complex64,
    np.complex128,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=300)
shapes = hnp.array_shapes(min_dims=0, max_dims=8, min_side=0, max_side=4)


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(shapes)
    count = int(np.prod(shape))
    raw = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
    array = np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape)
    if dtype == np.bool_:
        array = array.view(np.uint8) % 2 == 1  # only 0/1 are valid bools
    return array


property_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(width=32, allow_nan=False),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=200),
)


@st.composite
def states(draw):
    all_names = draw(st.lists(names, max_size=8, unique=True))
    split = draw(st.integers(0, len(all_names)))
    trainable = {n: draw(arrays()) for n in all_names[:split]}
    frozen = {n: draw(arrays()) for n in all_names[split:]}
    properties = draw(st.dictionaries(names, property_values, max_size=6))
    with_state = draw(st.lists(st.sampled_from(all_names), unique=True)) if all_names else []
    momentum_names = st.lists(st.sampled_from(["momentum0", "momentum1"]), unique=True)
    momentums = {n: {m: draw(arrays()) for m in draw(momentum_names)} for n in with_state}
    group = OptimizerGroup(
        step=draw(st.integers(0, 2**63 - 1)),
        initial_learning_rate=draw(st.floats(width=32, allow_nan=False)),
        momentums=momentums,
    )
    return trainable, frozen, properties, group


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
def test_any_state_round_trips(case):
    trainable, frozen, properties, group = case
    state = CheckpointState.from_arrays(trainable, frozen, properties)
    state.optimizer_groups["group0"] = group
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c"
        CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
        loaded = CheckpointState.load_checkpoint(path)
        assert sorted(n for n, _ in loaded.parameters) == sorted({**trainable, **frozen})
        for requires_grad, arrays_ in ((True, trainable), (False, frozen)):
            for name, array in arrays_.items():
                param = loaded.parameters[name]
                assert param.requires_grad is requires_grad
                assert param.data.dtype == array.dtype and param.data.shape == array.shape
                assert param.data.tobytes() == array.tobytes()
        expected_props = {k: (float(np.float32(v)) if isinstance(v, float) else v) for k, v in properties.items()}
        assert dict(loaded.properties) == expected_props
        got = loaded.optimizer_groups["group0"]
        assert got.step == group.step
        assert got.initial_learning_rate == float(np.float32(group.initial_learning_rate))
        assert sorted(got.momentums) == sorted(group.momentums)
        for param, moms in group.momentums.items():
            assert sorted(got.momentums[param]) == sorted(moms)
            for m, value in moms.items():
                assert got.momentums[param][m].tobytes() == value.tobytes()
                assert got.momentums[param][m].shape == value.shape
