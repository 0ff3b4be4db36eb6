"""Tensors are keyed by TensorKey, never by a flat string (issue 40, finding 2): a parameter literally
named ``group0/w/momentum0`` and the first momentum of ``w`` in ``group0`` are two tensors in the
statistics, the report, ``inspect --stats``, ``diff`` (text and --json), ``tensor_changes`` and the
arithmetic; NaN in either is reported and a difference in either is one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ortckpt import CheckpointState, OptimizerGroup, TensorKey, average, render_report, tensor_changes, tensor_stats
from ortckpt.cli import DIFFERENT, OK, run

LABEL = "group0/w/momentum0"
PARAMETER = TensorKey.of_parameter(LABEL)
MOMENTUM = TensorKey.of_momentum("group0", "w", "momentum0")


def twins(parameter: float = 1.0, momentum: float = 1.0) -> CheckpointState:
    """A state whose parameter named LABEL and momentum labelled LABEL hold the given values."""
    state = CheckpointState.from_arrays(
        {"w": np.zeros(3, np.float32), LABEL: np.full(3, parameter, np.float32)},
    )
    state.optimizer_groups["group0"] = OptimizerGroup(
        1, 0.1, {"w": {"momentum0": np.full(3, momentum, np.float32)}, LABEL: {"momentum0": np.zeros(3, np.float32)}}
    )
    return state


def saved(tmp_path, name: str, state: CheckpointState) -> str:
    path = tmp_path / name
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    return str(path)


def cli(capsys, *args) -> tuple[int, str]:
    code = run([str(a) for a in args])
    return code, capsys.readouterr().out


def test_keys_of_a_parameter_and_a_momentum_with_one_label_differ():
    assert PARAMETER.label == MOMENTUM.label == str(PARAMETER) == LABEL
    assert PARAMETER != MOMENTUM and len({PARAMETER, MOMENTUM}) == 2
    assert PARAMETER != LABEL  # a key is no string
    # Roles: trainable and frozen name the same tensor (diff reports the role that differs).
    assert TensorKey.of_parameter("x", requires_grad=False) == TensorKey.of_parameter("x")
    assert sorted([MOMENTUM, PARAMETER, TensorKey.of_parameter("a")]) == [
        TensorKey.of_parameter("a"),
        PARAMETER,
        MOMENTUM,
    ]
    assert MOMENTUM.to_json() == {"role": "momentum", "group": "group0", "parameter": "w", "momentum": "momentum0"}
    with pytest.raises(ValueError):
        TensorKey("momentum", "w")


def test_state_tensors_yield_both_and_momentums_only_with_the_optimizer_state():
    state = twins()
    keys = [key for key, _value in state.tensors()]
    assert keys.count(PARAMETER) == keys.count(MOMENTUM) == 1 and len(keys) == 4
    assert [k for k, _ in state.tensors(include_optimizer_state=False)] == [PARAMETER, TensorKey.of_parameter("w")]


@pytest.mark.parametrize("nan_in", ["parameter", "momentum"])
def test_statistics_and_the_report_show_nan_in_either(tmp_path, nan_in):
    state = twins(**{nan_in: np.nan})
    for source in (state, saved(tmp_path, "c", state)):
        stats = tensor_stats(source)
        assert len(stats) == 4
        flagged = [key for key, s in stats.items() if s.flagged]
        assert flagged == [PARAMETER if nan_in == "parameter" else MOMENTUM]
        assert stats[PARAMETER].role == "trainable" and stats[MOMENTUM].role == "momentum"
        assert stats[PARAMETER].name == stats[MOMENTUM].name == LABEL
        with pytest.raises(KeyError, match="2 tensors"):
            stats[LABEL]  # a label two tensors have finds neither
        assert LABEL in stats and stats["w"] is stats[TensorKey.of_parameter("w")]
    page = render_report(state)
    assert "No tensor holds NaN or Inf" not in page and "1 of 4 tensors hold NaN or Inf" in page


@pytest.mark.parametrize("nan_in", ["parameter", "momentum"])
def test_inspect_stats_flags_nan_in_either(capsys, tmp_path, nan_in):
    path = saved(tmp_path, "c", twins(**{nan_in: np.nan}))
    code, out = cli(capsys, "inspect", "--stats", "--json", path)
    info = json.loads(out)
    assert code == OK and info["totals"]["flagged"] == 1
    roles = {t["role"]: t["stats"] for t in info["tensors"] if t["stats"]["name"] == LABEL}
    assert roles.keys() == {"trainable", "momentum"}
    assert roles["trainable" if nan_in == "parameter" else "momentum"]["nan"] == 3
    assert roles["momentum" if nan_in == "parameter" else "trainable"]["nan"] == 0
    assert roles["momentum"]["key"] == MOMENTUM.to_json()
    code, out = cli(capsys, "inspect", "--stats", path)
    assert code == OK and "! 1 tensor holds NaN or Inf" in out


@pytest.mark.parametrize("changed", ["parameter", "momentum"])
def test_diff_of_files_differing_in_one_of_the_two_differs(capsys, tmp_path, changed):
    a = saved(tmp_path, "a", twins())
    b = saved(tmp_path, "b", twins(**{changed: 2.0}))
    code, out = cli(capsys, "diff", a, b)
    assert code == DIFFERENT, out
    assert (
        f"{LABEL}: values: 3 of 3 elements differ" in out
        and out.splitlines()[-1] == "4 tensors compared: differ in 1 tensor"
    )
    code, out = cli(capsys, "diff", "--json", a, b)
    report = json.loads(out)
    key = (PARAMETER if changed == "parameter" else MOMENTUM).to_json()
    assert code == DIFFERENT and not report["identical"] and report["compared"] == 4
    assert [t["key"] for t in report["tensors"]] == [key]
    assert [c["key"] for c in report["changes"] if c["changed"]] == [key]
    code, out = cli(capsys, "diff", a, a)
    assert code == OK and out.splitlines()[-1] == "4 tensors compared: identical"


def test_diff_names_a_tensor_only_one_side_has_by_its_key(capsys, tmp_path):
    """a has the parameter named LABEL, b the momentum labelled LABEL instead: neither is matched
    with the other."""
    a = CheckpointState.from_arrays({"w": np.zeros(3, np.float32), LABEL: np.ones(3, np.float32)})
    b = CheckpointState.from_arrays({"w": np.zeros(3, np.float32)})
    b.optimizer_groups["group0"] = OptimizerGroup(1, 0.1, {"w": {"momentum0": np.ones(3, np.float32)}})
    code, out = cli(capsys, "diff", "--json", saved(tmp_path, "a", a), saved(tmp_path, "b", b))
    report = json.loads(out)
    assert code == DIFFERENT and report["compared"] == 1
    assert (report["only_in_a"], report["only_in_b"]) == ([LABEL], [LABEL])
    assert (report["only_in_a_keys"], report["only_in_b_keys"]) == ([PARAMETER.to_json()], [MOMENTUM.to_json()])


@pytest.mark.parametrize("changed", ["parameter", "momentum"])
def test_tensor_changes_keep_both(tmp_path, changed):
    changes = tensor_changes(saved(tmp_path, "a", twins()), twins(**{changed: 3.0}))
    assert len(changes) == 4
    moved = PARAMETER if changed == "parameter" else MOMENTUM
    still = MOMENTUM if changed == "parameter" else PARAMETER
    assert changes[moved].changed == 3 and changes[moved].key == moved
    assert changes[still].changed == 0
    assert next(iter(changes)) == moved  # largest change first


def test_arithmetic_keeps_both_apart(tmp_path):
    a, b = saved(tmp_path, "a", twins(1.0, 10.0)), saved(tmp_path, "b", twins(3.0, 30.0))
    out = tmp_path / "avg"
    average([a, b], include_optimizer_state=True, out=out)
    result = CheckpointState.load_checkpoint(out)
    np.testing.assert_array_equal(result.parameters[LABEL].data, np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(result.optimizer_groups["group0"].momentums["w"]["momentum0"], np.full(3, 20.0))
