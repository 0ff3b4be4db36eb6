"""ortckpt.flower.FedAvg's aggregation: Flower's results (to a float64 reference), from the
replies' bytes, with bad replies dropped and reported, never the round."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import error_reply, out_message, reply
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg as FlowersFedAvg
from ortckpt.flower import FedAvg


def client_arrays(model, count, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            k: (v + rng.standard_normal(v.shape) * (i + 1)).astype(v.dtype) if v.dtype.kind == "f" else v
            for k, v in model.items()
        }
        for i in range(count)
    ]


def float64_reference(arrays, weights, key):
    stacked = np.stack([a[key].astype(np.float64) for a in arrays])
    return np.average(stacked, axis=0, weights=np.asarray(weights, np.float64))


def test_the_average_equals_flowers_fedavg_and_a_float64_reference(model):
    floats = {k: v for k, v in model.items() if v.dtype.kind == "f"}  # (Flower averages integers too, into floats)
    arrays = client_arrays(floats, 5)
    weights = [10, 3, 7, 1, 25]
    replies = [reply(node, a, w, loss=float(node)) for node, (a, w) in enumerate(zip(arrays, weights, strict=True))]
    mine, metrics = FedAvg().aggregate_train(1, replies)
    flowers, flower_metrics = FlowersFedAvg().aggregate_train(1, replies)
    assert list(mine.keys()) == list(flowers.keys()) == list(floats)
    for key in floats:
        got, theirs = mine[key].numpy(), flowers[key].numpy()
        assert got.dtype == floats[key].dtype and got.shape == floats[key].shape
        exact = float64_reference(arrays, weights, key)
        # float64 accumulation, rounded once: the reference rounded to the tensor's type
        assert got.tobytes() == exact.astype(got.dtype).tobytes(), key
        np.testing.assert_allclose(theirs, exact, rtol=1e-5)
        np.testing.assert_allclose(got, theirs, rtol=1e-5)
    assert dict(metrics) == pytest.approx(dict(flower_metrics))


def test_each_average_is_bytes_of_its_own_that_later_rounds_leave_alone(model):
    """The kernel writes each result into a new bytes object (made in place, not copied)."""
    floats = {k: v for k, v in model.items() if v.dtype.kind == "f"}
    first, _ = FedAvg().aggregate_train(1, [reply(n, a, 1) for n, a in enumerate(client_arrays(floats, 3, seed=1))])
    kept = {key: bytes(array.data) for key, array in first.items()}  # (a copy, to compare with)
    second, _ = FedAvg().aggregate_train(2, [reply(n, a, 1) for n, a in enumerate(client_arrays(floats, 3, seed=2))])
    for key in floats:
        assert type(first[key].data) is bytes and first[key].data is not second[key].data
        assert first[key].data == kept[key] != second[key].data, key
        assert hash(first[key].data) == hash(kept[key])  # (an ordinary bytes object: hashes as its copy)
        np.testing.assert_array_equal(
            first[key].numpy(),
            np.frombuffer(kept[key][-floats[key].nbytes :], floats[key].dtype).reshape(floats[key].shape),
        )


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn], ids=str)
def test_narrow_floats_are_averaged_in_float32_and_rounded_once(dtype):
    rng = np.random.default_rng(3)
    arrays = [{"w": rng.standard_normal((7, 5)).astype(dtype)} for _ in range(4)]
    weights = [1, 2, 3, 4]
    replies = [reply(n, a, w) for n, (a, w) in enumerate(zip(arrays, weights, strict=True))]
    got = FedAvg().aggregate_train(1, replies)[0]["w"]
    assert got.dtype == np.dtype(dtype).name
    values = np.frombuffer(got.data[-35 * np.dtype(dtype).itemsize :], dtype).reshape(7, 5)
    exact = float64_reference(arrays, weights, "w")
    np.testing.assert_allclose(values.astype(np.float64), exact, rtol=2e-2 if dtype != np.float16 else 2e-3, atol=0.07)


FLOAT8 = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz]


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("weights", [(1, 1), (3, 5), (7, 2), (1, 1000)], ids=str)
def test_float8_averages_are_the_float32_rule_bit_for_bit(dtype, weights):
    """Every pair of finite float8 values (ties, subnormals, signed zeros, the largest), averaged
    by the core's kernel: ``x_0*w_0 + x_1*w_1`` in float32, divided by the total, rounded once
    to the type as ml_dtypes rounds (here: the weights' scaling by a power of two as FedAvg's)."""
    every = np.arange(256, dtype=np.uint8).view(dtype)
    finite = every[np.isfinite(every.astype(np.float32))]
    a, b = np.repeat(finite, finite.size), np.tile(finite, finite.size)
    got = FedAvg().aggregate_train(1, [reply(0, {"w": a}, weights[0]), reply(1, {"w": b}, weights[1])])[0]["w"]
    values = np.frombuffer(got.data[-a.size :], np.uint8)
    w = np.asarray(weights, np.float64)
    w = np.ldexp(w, -np.frexp(w.max())[1])
    acc = a.astype(np.float32) * np.float32(w[0])
    acc += b.astype(np.float32) * np.float32(w[1])
    expected = (acc / np.float32(w.sum())).astype(dtype).view(np.uint8)
    differ = np.flatnonzero(values != expected)
    assert differ.size == 0, f"{differ.size} differ, first: {a[differ[0]]}, {b[differ[0]]}"


def test_integer_tensors_are_taken_from_the_first_accepted_reply(model):
    arrays = client_arrays(model, 3)
    arrays[1]["steps"] = np.array([9, 9], np.int64)
    got = FedAvg().aggregate_train(1, [reply(n, a, 1) for n, a in enumerate(arrays)])[0]
    assert got["steps"].numpy().tolist() == [3, 4]


def sent(strategy, model):
    """The strategy configured as in a round: the global model's layout known."""

    class Grid:
        def get_node_ids(self):
            return [0, 1, 2, 3, 4, 5, 6]

    record = ArrayRecord({k: Array(v) for k, v in model.items()})
    list(strategy.configure_train(1, record, __import__("flwr.app").app.ConfigRecord(), Grid()))
    return record


def bad_replies(model):
    good = client_arrays(model, 1, seed=9)[0]
    nan = {**good, "fc.weight": good["fc.weight"].copy()}
    nan["fc.weight"][1, 2] = np.nan
    inf = {**good, "emb": good["emb"].copy()}
    inf["emb"][0, 0] = -np.inf
    wrong_shape = {**good, "fc.bias": np.zeros(5, np.float32)}
    wrong_dtype = {**good, "fc.bias": good["fc.bias"].astype(np.float64)}
    missing = {k: v for k, v in good.items() if k != "emb"}
    extra = {**good, "other": np.zeros(1, np.float32)}
    two_records = RecordDict(
        {
            "a": ArrayRecord({k: Array(v) for k, v in good.items()}),
            "b": ArrayRecord({k: Array(v) for k, v in good.items()}),
            "metrics": MetricRecord({"num-examples": 1}),
        }
    )
    from flwr.app import Message

    return {
        "nan": (reply(11, nan, 5), "fc.weight: 1 NaN"),
        "inf": (reply(12, inf, 5), "emb: 0 NaN, 0 +inf, 1 -inf"),
        "wrong shape": (reply(13, wrong_shape, 5), "fc.bias: float32 (5,), the global model's is float32 (4,)"),
        "wrong dtype": (reply(14, wrong_dtype, 5), "fc.bias: float64 (4,), the global model's is float32 (4,)"),
        "missing tensor": (reply(15, missing, 5), "missing ['emb']"),
        "extra tensor": (reply(16, extra, 5), "unexpected ['other']"),
        "no weight": (reply(17, good, None), "no number under 'num-examples'"),
        "negative weight": (reply(18, good, -1), "'num-examples' is -1"),
        "nan weight": (reply(19, good, float("nan")), "'num-examples' is nan"),
        "error": (error_reply(20, "client crashed"), "error reply: client crashed"),
        "two arrayrecords": (Message(two_records, reply_to=out_message(ArrayRecord(), 21)), "2 ArrayRecords"),
    }


CASES = ["nan", "inf", "wrong shape", "wrong dtype", "missing tensor", "extra tensor", "no weight", "negative weight"]
CASES += ["nan weight", "error", "two arrayrecords"]


def test_the_cases_are_all_the_bad_replies(model):
    assert set(bad_replies(model)) == set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_a_bad_reply_is_dropped_and_reported_and_the_round_goes_on(model, case):
    strategy = FedAvg()
    sent(strategy, model)
    good = client_arrays(model, 2)
    bad, reason = bad_replies(model)[case]
    replies = [reply(0, good[0], 3), bad, reply(1, good[1], 1)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    (failure,) = strategy.failures[1]
    assert failure.node_id == bad.metadata.src_node_id and reason in failure.reason
    expected, _ = FedAvg().aggregate_train(1, [reply(0, good[0], 3), reply(1, good[1], 1)])
    for key in model:
        assert arrays[key].data == expected[key].data, key
        assert np.isfinite(arrays[key].numpy()).all()
    assert metrics is not None


def test_a_round_with_no_good_reply_keeps_the_global_model(model):
    strategy = FedAvg()
    sent(strategy, model)
    bad = bad_replies(model)
    assert strategy.aggregate_train(2, [bad["nan"][0], bad["error"][0]]) == (None, None)
    assert len(strategy.failures[2]) == 2
    assert strategy.aggregate_train(3, [reply(0, client_arrays(model, 1)[0], 0)]) == (None, None)


def test_the_replies_bytes_are_read_in_place(model, monkeypatch):
    """The kernel is handed views of each reply's Array.data, past the .npy header: no copy."""
    from ortckpt import _boundary

    seen = []
    real = _boundary.combine

    def spy(operation, coefficients, jobs, progress):
        seen.extend(inputs for _, inputs, _, _ in jobs)
        return real(operation, coefficients, jobs, progress)

    monkeypatch.setattr(_boundary, "combine", spy)
    arrays = client_arrays(model, 3)
    replies = [reply(n, a, 1) for n, a in enumerate(arrays)]
    FedAvg().aggregate_train(1, replies)
    assert len(seen) == 3  # the three float tensors, each one job
    datas = [next(iter(r.content.array_records.values())) for r in replies]
    for inputs in seen:
        for view, record in zip(inputs, datas, strict=True):
            assert any(np.shares_memory(view, np.frombuffer(record[k].data, np.uint8)) for k in record)


def test_the_same_replies_in_any_order_give_the_same_bits(model):
    arrays = client_arrays(model, 6, seed=5)
    replies = [reply(node, a, node + 1) for node, a in enumerate(arrays)]
    first = FedAvg().aggregate_train(1, replies)[0]
    shuffled = [replies[i] for i in (4, 1, 5, 0, 3, 2)]
    again = FedAvg().aggregate_train(1, shuffled)[0]
    assert {k: v.data for k, v in first.items()} == {k: v.data for k, v in again.items()}


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn]
)
def test_every_reply_with_nan_or_inf_is_dropped_whatever_its_weight(dtype):
    rng = np.random.default_rng(4)
    arrays = [{"a": rng.standard_normal(50).astype(dtype), "b": rng.standard_normal(8).astype(dtype)} for _ in range(5)]
    arrays[1]["a"][7] = np.nan
    arrays[3]["b"][0] = np.inf
    arrays[4]["a"][0] = -np.inf
    weights = [2, 0, 3, 1, 5]  # (the NaN reply weighs 0: 0 * NaN is still NaN)
    strategy = FedAvg()
    got = strategy.aggregate_train(1, [reply(n, a, w) for n, (a, w) in enumerate(zip(arrays, weights, strict=True))])[0]
    assert sorted(f.node_id for f in strategy.failures[1]) == [1, 3, 4]
    expected = FedAvg().aggregate_train(1, [reply(0, arrays[0], 2), reply(2, arrays[2], 3)])[0]
    assert {k: v.data for k, v in got.items()} == {k: v.data for k, v in expected.items()}
