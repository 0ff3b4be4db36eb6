"""Values that go in and come back (issue 29): non-finite floats of a run's config and metadata
come back as floats after a restart, distinct from the strings "inf" and "nan"; keys that are one
once written and text that is not Unicode are refused at save() with a typed error naming the key
and the file, never a bare UnicodeEncodeError or one value silently kept; every argument of a
CheckpointManager is checked when it is created, naming it, before anything is written."""

from __future__ import annotations

import datetime
import inspect
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ortckpt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortckpt import (
    CheckpointManager,
    CheckpointState,
    CheckpointStateError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    OptimizerGroup,
    documents,
)
from ortckpt.distributed.comm import SingleProcess
from ortckpt.manager import metadata as manager_metadata
from surrogates import PLACES, SURROGATE, no_bare_unicode_error, surrogate_in

# Run on every interpreter of PYTHONS (the rest of the suite runs on the first): the API, buffers
# crossing the boundary, imports, the program's entry point.
pytestmark = pytest.mark.every_python

INF, NAN = math.inf, math.nan


def state() -> CheckpointState:
    return CheckpointState.from_arrays({"w": np.arange(4, dtype=np.float32)})


def same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN and a float never equal to a str (nor a bool to an int)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def strict_json(path: Path) -> Any:
    return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {path}"))


# --- non-finite floats round-trip ---------------------------------------------------------------------


CONFIG = {"max_grad_norm": INF, "schedule": {"floor": -INF, "steps": [1.0, NAN, "inf"]}, "name": "inf", "lr": 0.1}
METADATA = {"best_val": -INF, "worst": NAN, "label": "-inf", "also": "nan", 3: np.float32(INF), "n": np.float64(2.5)}


@pytest.mark.parametrize("read_only", [False, True])
def test_non_finite_config_and_metadata_come_back_as_floats_after_a_restart(tmp_path, read_only):
    with CheckpointManager(tmp_path, config=CONFIG) as manager:
        manager.save(state(), 1, metadata=METADATA, metrics={"loss": INF})
    restarted = CheckpointManager(tmp_path, read_only=read_only)
    meta = restarted.latest().metadata
    assert same(meta["config"], CONFIG)
    user = meta["user"]
    assert user["best_val"] == -INF and type(user["best_val"]) is float
    assert math.isnan(user["worst"]) and user["3"] == INF and user["n"] == 2.5
    assert user["label"] == "-inf" and user["also"] == "nan"  # the strings stay strings
    assert meta["config"]["name"] == "inf" and meta["config"]["schedule"]["steps"][2] == "inf"
    assert restarted.latest().metrics["loss"] == INF
    assert documents.NON_FINITE_KEY not in meta  # decoded, not shown
    strict_json(tmp_path / "step_00000001" / "metadata.json")  # still JSON any reader parses
    restarted.close()


def test_a_compressed_step_keeps_its_non_finite_floats(tmp_path):
    """compress_kept rewrites a kept step's metadata.json from what was read back: the floats
    stay floats through the second writing."""
    with CheckpointManager(tmp_path, config=CONFIG, keep_every=2, max_to_keep=1, compress_kept=True) as manager:
        for step in (2, 3):
            manager.save(state(), step, metadata={"best": -INF, "s": "inf"})
        assert manager.all()[0].compressed
    again = CheckpointManager(tmp_path, read_only=True).all()[0]
    assert again.compressed and same(again.metadata["config"], CONFIG)
    assert same(again.metadata["user"], {"best": -INF, "s": "inf"})


def test_metadata_written_without_the_list_loads_as_it_was(tmp_path):
    """metadata.json of an earlier ortckpt (non-finite floats as bare strings, no list): the
    strings stay strings, metrics decode as they always did."""
    with CheckpointManager(tmp_path) as manager:
        manager.save(state(), 1, metadata={"best": -INF}, metrics={"loss": NAN})
    path = tmp_path / "step_00000001" / "metadata.json"
    document = strict_json(path)
    assert document.pop(documents.NON_FINITE_KEY) == [["user", "best"]]
    path.write_text(json.dumps(document))
    meta = CheckpointManager(tmp_path, read_only=True).latest().metadata
    assert meta["user"] == {"best": "-inf"} and math.isnan(meta["metrics"]["loss"])


@pytest.mark.parametrize(
    ("places", "problem"),
    [
        ([["user", "missing"]], "the place of a value"),
        ([["user", "n"]], '"nan", "inf" or "-inf"'),
        ([["step"]], '"nan", "inf" or "-inf"'),
        ([["run_id"]], "run_id"),
        ([["user", "best"], ["user", "best"]], '"nan", "inf" or "-inf"'),
        ([[]], "the place of a value"),
        ("user", "expected a list"),
        ([["user", 0]], "the place of a value"),
    ],
)
def test_a_non_finite_list_that_names_no_such_string_is_damage(tmp_path, places, problem):
    with CheckpointManager(tmp_path) as manager:
        manager.save(state(), 1, metadata={"best": -INF, "n": 1})
    path = tmp_path / "step_00000001" / "metadata.json"
    document = strict_json(path)
    if places == [["run_id"]]:
        document["run_id"] = "inf"  # a run id that becomes a float is no run id
    document[documents.NON_FINITE_KEY] = places
    path.write_text(json.dumps(document))
    with pytest.warns(RuntimeWarning, match="step 1 skipped") as caught:
        assert CheckpointManager(tmp_path, read_only=True).all_steps() == []
    assert problem in str(caught[0].message)


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["inf", "-inf", "nan", "Infinity", "NaN", ""]),
    st.text(st.characters(codec="utf-8"), max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


json_objects = st.dictionaries(st.text(st.characters(codec="utf-8"), max_size=6), json_values, max_size=4)


@pytest.mark.once  # 300 random documents through the manager's JSON (pure Python): one interpreter
@settings(max_examples=300, deadline=None)
@given(config=json_objects, user=json_objects)
def test_any_json_value_with_any_float_reads_back_as_it_was_given(config, user):
    meta = {
        "format": manager_metadata.FORMAT,
        "step": 1,
        "config": config,
        "user": user,
        "metrics": {"m": INF},
        "files": {},
    }
    data = manager_metadata.encode(meta)
    json.loads(data, parse_constant=lambda c: pytest.fail(f"{c} written"))
    back = documents.parse(documents.METADATA, data, "metadata.json")
    assert same(back["config"], config) and same(back["user"], user)


# --- keys and text ------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize(
    ("argument", "value", "key"),
    [
        ("metadata", {1: "a", "1": "b"}, "metadata"),
        ("metadata", {"1": "b", np.int64(1): "a"}, "metadata"),
        ("metadata", {"outer": [{"x": 1}, {2: 1, "2": 2}]}, "metadata['outer'][1]"),
        ("metrics", {7: 0.5, "7": 0.7}, "metrics"),
        ("rng_state", {"seed": {0: 1, "0": 2}}, "rng_state['seed']"),
    ],
)
def test_keys_that_are_one_once_written_are_refused_at_save(tmp_path, async_save, argument, value, key):
    with CheckpointManager(tmp_path, async_save=async_save) as manager:
        with pytest.raises(InvalidArgumentError, match="once written") as caught:
            manager.save(state(), 1, **{argument: value})
        assert caught.value.key == key and caught.value.argument == argument
        assert str(tmp_path / "step_00000001" / "metadata.json") in str(caught.value)
        manager.wait()
        assert manager.all_steps() == []
    assert not list(tmp_path.glob("step_*"))


@pytest.mark.parametrize("key", [(1, 2), None, 1.5, True, np.bool_(False), b"k", frozenset()])
def test_keys_other_than_str_and_int_are_refused(tmp_path, key):
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(InvalidArgumentTypeError, match="keys are str or int"):
            manager.save(state(), 1, metadata={"ok": {key: 1}})
        with pytest.raises(TypeError, match=r"metadata\['ok'\] .*JSON-serialisable"):
            manager.save(state(), 1, metadata={"ok": {1, 2}})
        assert manager.all_steps() == []


@pytest.mark.parametrize(
    ("save", "kind", "argument"),
    [
        ({"metrics": [("loss", 1.0)]}, TypeError, "metrics"),
        ({"metadata": "notes"}, TypeError, "metadata"),
        ({"metadata": [("a", 1)]}, TypeError, "metadata"),
        ({"rng_state": 5}, TypeError, "rng_state"),
        ({"include_optimizer_state": "no"}, TypeError, "include_optimizer_state"),
        ({"dataset_fingerprint": 5}, TypeError, "dataset_fingerprint"),
        ({"metrics": {"loss": "0.5"}}, TypeError, "metrics"),
        ({"metrics": {"loss": 10**400}}, ValueError, "metrics"),  # ranked as a float: it would fail after the commit
        ({"metadata": {"x": 10**5000}}, ValueError, "metadata"),  # Python could not read it back
    ],
)
def test_save_arguments_that_metadata_json_cannot_hold_are_refused_naming_them(tmp_path, save, kind, argument):
    with CheckpointManager(tmp_path, keep_best=("loss", "min", 1)) as manager:
        with pytest.raises(kind) as caught:
            manager.save(state(), 1, **save)
        assert isinstance(caught.value, InvalidArgumentError) and caught.value.argument == argument
        assert manager.all_steps() == []


def test_int_keys_are_written_as_their_digits(tmp_path):
    with CheckpointManager(tmp_path, config={np.int64(3): "layers", 10**30: "big"}) as manager:
        manager.save(state(), 1, metadata={1: "one", -2: "minus two"})
    meta = CheckpointManager(tmp_path, read_only=True).latest().metadata
    assert meta["user"] == {"1": "one", "-2": "minus two"}
    assert meta["config"] == {"3": "layers", str(10**30): "big"}


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize(
    ("save", "key"),
    [
        ({"metadata": {SURROGATE: 1}}, "metadata"),
        ({"metadata": {"k": [SURROGATE]}}, "metadata['k'][0]"),
        ({"metrics": {SURROGATE: 1.0}}, "metrics"),
        ({"dataset_fingerprint": SURROGATE}, "dataset_fingerprint"),
        ({"rng_state": {"k": SURROGATE}}, "rng_state['k']"),
    ],
)
def test_a_lone_surrogate_in_metadata_is_refused_at_save_naming_the_key_and_file(tmp_path, async_save, save, key):
    with CheckpointManager(tmp_path, async_save=async_save) as manager:
        with pytest.raises(InvalidArgumentError, match="lone surrogate") as caught:
            manager.save(state(), 1, **save)
        no_bare_unicode_error(caught.value)
        assert caught.value.key == key
        assert str(caught.value).startswith(f"{tmp_path / 'step_00000001' / 'metadata.json'}: {key} ")
        manager.wait()
        assert manager.all_steps() == []


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("where", PLACES)
def test_a_lone_surrogate_in_a_state_is_refused_by_the_manager_in_the_callers_thread(tmp_path, where, async_save):
    with CheckpointManager(tmp_path, async_save=async_save) as manager:
        with pytest.raises(CheckpointStateError, match="lone surrogate") as caught:
            manager.save(surrogate_in(where), 1)
        no_bare_unicode_error(caught.value)
        assert str(caught.value).startswith(str(tmp_path / "step_00000001"))
        if where == "string element":
            assert caught.value.tensor == "vocab"
        manager.wait()
        assert manager.all_steps() == []


# --- properties ---------------------------------------------------------------------------------------


def test_a_sharded_step_keeps_non_finite_properties_and_learning_rates(tmp_path):
    """index.json is JSON: NaN and infinities are written as strings and listed, as in
    metadata.json (a sharded save used to fail at its commit, after writing every shard)."""
    s = CheckpointState.from_arrays({"w": np.ones(4, np.float32)}, properties={"a": INF, "b": NAN, "c": "inf"})
    s.optimizer_groups = {"group0": OptimizerGroup(3, -INF, {"w": {"momentum0": np.zeros(4, np.float32)}})}
    with CheckpointManager(tmp_path, comm=SingleProcess()) as manager:
        manager.save(s, 1, include_optimizer_state=True)
    strict_json(tmp_path / "step_00000001" / "index.json")
    back = CheckpointManager(tmp_path, read_only=True).restore()
    assert back.properties["a"] == INF and math.isnan(back.properties["b"]) and back.properties["c"] == "inf"
    assert back.optimizer_groups["group0"].initial_learning_rate == -INF


# --- the manager's arguments --------------------------------------------------------------------------


REFUSED = [
    ("max_to_keep", 1.5, TypeError),
    ("max_to_keep", True, TypeError),
    ("max_to_keep", "3", TypeError),
    ("max_to_keep", 0, ValueError),
    ("max_to_keep", np.float64(2), TypeError),
    ("keep_every", 0.5, TypeError),
    ("keep_every", np.bool_(True), TypeError),
    ("keep_every", -2, ValueError),
    ("keep_best", ("loss", "min", 1.5), TypeError),
    ("keep_best", ("loss", "min", True), TypeError),
    ("keep_best", ("loss", "min", 0), ValueError),
    ("keep_best", ("loss", "avg", 1), ValueError),
    ("keep_best", ("loss", "min"), TypeError),
    ("keep_best", "loss", TypeError),
    ("keep_best", {"loss", "min", 1}, TypeError),
    ("keep_best", ("", "min", 1), ValueError),
    ("keep_best", (1, "min", 1), TypeError),
    ("save_every", 0.5, TypeError),
    ("save_every", 0, ValueError),
    ("save_every", -3, ValueError),
    ("save_every", True, TypeError),
    ("save_every", "5", TypeError),
    ("save_every", datetime.timedelta(seconds=-1), ValueError),
    ("external_data_threshold", -1, ValueError),
    ("external_data_threshold", 1.5, TypeError),
    ("external_data_threshold", True, TypeError),
    ("external_data_threshold", "0", TypeError),
    ("external_data_threshold", 2**64, ValueError),
    ("async_save", "False", TypeError),
    ("durable", "yes", TypeError),
    ("durable", 1, TypeError),
    ("compress_kept", None, TypeError),
    ("progress", "no", TypeError),
    ("read_only", 0, TypeError),
    ("verify_after_save", "yes", TypeError),
    ("verify_after_save", 1, TypeError),
    ("run_id", 5, TypeError),
    ("run_id", "", ValueError),
    ("run_id", SURROGATE, ValueError),
    ("config", [("a", 1)], TypeError),
    ("config", "lr=0.1", TypeError),
    ("config", {"optimizer": object()}, TypeError),
    ("config", {"a": {1: 1, "1": 2}}, ValueError),
    ("config", {SURROGATE: 1}, ValueError),
    ("storage_options", [1], TypeError),
    ("track", "nope", ValueError),
    ("track", 5, TypeError),
    ("validate", 5, TypeError),
]


@pytest.mark.parametrize(("argument", "value", "kind"), REFUSED)
def test_every_argument_is_checked_at_construction_naming_it(tmp_path, argument, value, kind):
    directory = tmp_path / "run"
    with pytest.raises(kind) as caught:
        CheckpointManager(directory, **{argument: value})
    assert isinstance(caught.value, InvalidArgumentError), repr(caught.value)
    assert caught.value.argument == argument and argument in str(caught.value)
    assert not directory.exists()  # refused before anything is created


def test_a_config_nested_past_what_metadata_json_holds_is_refused_at_construction(tmp_path):
    deep: Any = 1
    for _ in range(70):
        deep = [deep]
    with pytest.raises(InvalidArgumentTypeError, match="config is nested deeper"):
        CheckpointManager(tmp_path / "run", config={"deep": deep})
    assert not (tmp_path / "run").exists()


def test_max_to_keep_of_a_float_no_longer_commits_then_fails(tmp_path):
    """It used to commit step 1 and then raise TypeError from the retention."""
    with pytest.raises(TypeError, match=r"max_to_keep is an int, got 1\.5"):
        CheckpointManager(tmp_path, max_to_keep=1.5)
    assert list(tmp_path.iterdir()) == []


def test_numpy_integers_and_bools_are_accepted_as_plain_values(tmp_path):
    big = CheckpointState.from_arrays({"w": np.arange(64, dtype=np.float32)})
    with CheckpointManager(
        tmp_path,
        max_to_keep=np.int64(2),
        keep_every=np.int32(10),
        keep_best=["loss", "min", np.uint8(1)],
        save_every=np.int16(2),
        external_data_threshold=np.int64(0),
        durable=np.bool_(False),
        async_save=np.bool_(True),
    ) as manager:
        assert manager.policy.max_to_keep == 2 and type(manager.policy.max_to_keep) is int
        assert manager.policy.keep_best == ("loss", "min", 1) and type(manager.policy.keep_best[2]) is int
        assert manager.save_every == 2 and manager.durable is False and manager.async_save is True
        for step in range(1, 6):
            if manager.should_save(step):
                manager.save(big, step, metrics={"loss": float(step)})
    assert CheckpointManager(tmp_path, read_only=True).all_steps() == [2, 4]
    assert (tmp_path / "step_00000004" / "checkpoint.data").exists()  # threshold 0: external data


def test_a_zero_timedelta_is_still_every_step(tmp_path):
    assert CheckpointManager(tmp_path, save_every=datetime.timedelta(0)).should_save(1)


odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=3),
    st.sampled_from([np.int64(3), np.float32(2.0), np.bool_(True), np.uint64(2**64 - 1), np.int8(-1)]),
)


@settings(max_examples=150, deadline=None)
@given(argument=st.sampled_from(["max_to_keep", "keep_every", "save_every"]), value=odd_values)
def test_a_count_is_accepted_exactly_when_it_is_a_positive_integer(argument, value):
    is_count = (
        isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and int(value) >= 1
    ) or value is None
    with tempfile.TemporaryDirectory() as directory:
        if not is_count:
            with pytest.raises(InvalidArgumentError, match=argument):
                CheckpointManager(Path(directory) / "run", **{argument: value})
            assert not (Path(directory) / "run").exists()
            return
        with CheckpointManager(Path(directory) / "run", durable=False, **{argument: value}) as manager:
            manager.save(state(), 10**6)  # a step every rule keeps or lets go without an error
            assert manager.all_steps() == [10**6]


@settings(max_examples=100, deadline=None)
@given(value=odd_values)
def test_a_flag_is_accepted_exactly_when_it_is_a_bool(value):
    with tempfile.TemporaryDirectory() as directory:
        if isinstance(value, (bool, np.bool_)):
            with CheckpointManager(Path(directory) / "run", durable=value) as manager:
                assert manager.durable is bool(value)
        else:
            with pytest.raises(InvalidArgumentTypeError, match="durable is True or False"):
                CheckpointManager(Path(directory) / "run", durable=value)


def test_the_signature_shows_every_option():
    """IDEs and help() show each option, its default and its documentation (no **options)."""
    parameters = inspect.signature(ortckpt.CheckpointManager).parameters
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert {
        "directory",
        "save_every",
        "max_to_keep",
        "keep_best",
        "keep_every",
        "async_save",
        "durable",
        "verify_after_save",
        "validate",
        "compress_kept",
        "track",
        "run_id",
        "config",
        "progress",
        "external_data_threshold",
        "comm",
        "read_only",
        "storage_options",
    } <= set(parameters)
    assert parameters["max_to_keep"].default is None and parameters["durable"].default is True
    documented = inspect.getdoc(ortckpt.CheckpointManager) or ""  # (3.13 dedents docstrings itself)
    assert [name for name in parameters if f"\n    {name}: " not in documented] == []
